"""hfnative-train: TRL's ``trl sft ...`` command line, on hfnative's trainers.

    hfnative-train [sft] --model_name_or_path M --dataset_name D [--config cfg.yaml] [--<any SFTConfig field> ...]

The flags are generated from the argument dataclasses (ScriptArguments, ModelArguments and the
command's config class) by transformers' HfArgumentParser, so names, types, bare ``--flag`` (True)
and ``--no_flag`` (False) behave as in TRL. ``--config`` YAML values replace the defaults and flags
on the command line override them; a YAML ``env:`` mapping sets environment variables, as in TRL.
Usage mistakes (an unknown flag or command, a bad config file or value, a missing, empty or malformed
dataset, an unusable model folder, an output_dir that cannot be written or that another run is using,
no checkpoint to resume, nothing left to train on) print one line on stderr and exit with status 2;
README.md's bad-input table lists them.

Launching processes, as ``trl`` does: ``--num_processes N``, ``--accelerate_config NAME|PATH`` (TRL's
shipped configs fsdp2, fsdp1, multi_gpu, single_gpu, zero1-3, or an accelerate config file) and any other
``accelerate launch`` flag, on the command line or in the ``--config`` YAML, start the run through accelerate's
launcher with this command (minus those flags) in every process; the exit status is the run's. Inside a
process torchrun or accelerate launch started, they are refused (trainers/running/launch.py). ``trainers/running/parallel_plan.py`` turns the
launch's settings into the layout.

A command is registered in ``COMMANDS`` with its config class, trainer class, script-arguments
class and the function that runs it; ``sft`` is the default when none is named. The other algorithms'
commands are named there as ``"module:function"`` and imported only when run: ``function()`` returns the
module's ``Command``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from copy import copy
from dataclasses import dataclass, fields
from importlib import import_module
from typing import get_type_hints

import torch
import yaml
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from hfnative.checkpoint import RefusedCheckpointFile

from ..loop.arguments import SFTConfig
from ..loop.checkpoints import resolve_checkpoint
from .launch import (  # noqa: F401  (LAUNCHED_BY_CLI, split_launch_flags: part of this module's interface)
    LAUNCH_HELP,
    LAUNCHED_BY_CLI,
    UsageError,
    _did_you_mean,
    _launch_flags_from_config,
    _launch_options,
    _launched_note,
    _one_line,
    launch_processes,
    split_launch_flags,
)
from .parallel_plan import parallelism_config_from
from ..loop.run_guard import RunError, output_dir_claimed
from .script_arguments import (
    ModelArguments,
    ScriptArguments,
    model_init_kwargs_from,
    peft_config_from,
    train_and_eval_datasets,
)
from ..algorithms.sft import SFTTrainer

PROG = "hfnative-train"


class TrainingArgumentParser(HfArgumentParser):
    """HfArgumentParser with a titled help group per dataclass, ``--config``, bare ``--flag`` / ``--no_flag``
    for booleans whose default is None too, and usage errors raised as ``UsageError``.

    ``dataclass_types``: the argument classes, in the order ``parse`` returns their instances;
    ``titles``: the help group of each (defaults to the class name).
    """

    def __init__(self, dataclass_types, titles: Iterable[str] | None = None, **kwargs):
        dataclass_types = list(dataclass_types)
        self._titles = dict(zip(dataclass_types, titles or [t.__name__ for t in dataclass_types]))
        kwargs.setdefault("allow_abbrev", False)  # a misspelt flag is an error, never a guess
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(dataclass_types, **kwargs)
        self.add_argument("--config", metavar="YAML", help="a YAML file of argument values; command-line flags override it")
        for action in self._actions:
            if action.dest == "parallelism_config":  # accelerate's ParallelismConfig, written as a JSON object
                action.type, action.metavar = _parallelism_config_value, "JSON"
            _tidy_for_help(action)
        # short groups first in --help, so data and model flags are not buried under 150 training flags
        self._action_groups.sort(key=lambda g: len(g._group_actions) if g.title in self._titles.values() else -1)

    def _add_dataclass_arguments(self, dtype) -> None:
        group = self.add_argument_group(self._titles[dtype])
        hints = get_type_hints(dtype)
        for dataclass_field in fields(dtype):
            if not dataclass_field.init:
                continue
            dataclass_field = copy(dataclass_field)  # HfArgumentParser rewrites .type; keep the class's own intact
            dataclass_field.type = hints[dataclass_field.name]
            self._parse_dataclass_field(group, dataclass_field)
            if dataclass_field.default is None and hints[dataclass_field.name] == bool | None:
                self._add_bare_and_no_flag(group, dataclass_field.name)

    def _add_bare_and_no_flag(self, group, name: str) -> None:
        """``bf16: bool | None = None`` (TRL's "decide later") also takes a bare ``--bf16`` and ``--no_bf16``."""
        action = next(a for a in group._group_actions if a.dest == name and a.type is string_to_bool)
        action.nargs, action.const = "?", True
        group.add_argument(f"--no_{name}", f"--no-{name.replace('_', '-')}", action="store_false", dest=name,
                           default=None, help=argparse.SUPPRESS)

    def error(self, message: str):
        raise UsageError(message)

    def parse(self, args: list[str]) -> tuple:
        """The dataclass instances for ``args`` (after ``--config``'s values); raises UsageError."""
        namespace, named = self.parse_namespace(args)
        outputs = []
        for dtype in self.dataclass_types:
            values = {f.name: getattr(namespace, f.name) for f in fields(dtype) if f.init}
            try:
                with warnings.catch_warnings():
                    if "gradient_checkpointing" not in named:  # TRL's default for the old name, not the user's choice
                        warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
                    outputs.append(dtype(**values))
            except (ValueError, TypeError) as err:
                raise UsageError(_explain_invalid_arguments(err)) from err
        return tuple(outputs)

    def parse_namespace(self, args: list[str]) -> tuple[argparse.Namespace, set[str]]:
        """The flags' values (``--config``'s first) and the names the user set, before the dataclasses check them;
        raises UsageError."""
        config_path = _config_path(args)
        from_config = self._config_values(config_path) if config_path is not None else argparse.Namespace()
        named = set(vars(from_config)) | {self._option_string_actions[a.split("=")[0]].dest  # what the user set
                                          for a in args if a.split("=")[0] in self._option_string_actions}
        namespace, unknown = self.parse_known_args(args, namespace=from_config)  # flags overwrite config values
        if unknown:
            flag = unknown[0].split("=")[0]
            if flag in _launch_options():
                raise UsageError(f"{flag} is a flag of accelerate launch, which starts the processes: pass it to "
                                 "hfnative-train, or to accelerate launch before the script's name")
            known = [o for a in self._actions for o in a.option_strings]
            hint = _did_you_mean(flag, known) if unknown[0].startswith("-") else ""
            raise UsageError(f"unknown argument {unknown[0]!r}{hint}; see {self.prog} --help")
        return namespace, named

    def launch_arguments(self, args: list[str]) -> tuple[list[str], list[str]]:
        """(accelerate launch's flags, from the ``--config`` YAML and then the command line; the other arguments).
        A flag both have (--debug, --gradient_accumulation_steps) is a training argument, as in TRL."""
        launch, rest = split_launch_flags(args, self._option_string_actions)
        config_path = _config_path(rest)
        if config_path is not None and os.environ.get(LAUNCHED_BY_CLI) is None:  # else applied by the parent already
            values = _read_config(config_path)
            launch = [*_launch_flags_from_config(values, self._option_string_actions), *launch]
        return launch, rest

    def parse_args_and_config(self, args: list[str] | None = None) -> tuple:
        """TrlParser's name: ``parse`` on ``sys.argv``, a usage error printed in one line (exit status 2)."""
        try:
            return self.parse(list(sys.argv[1:] if args is None else args))
        except UsageError as err:
            _exit_with_usage_error(self.prog, err)

    def _config_values(self, path: str) -> argparse.Namespace:
        """The YAML file's values, typed by their flags (``learning_rate: 1e-3`` is a string to YAML)."""
        values = _read_config(path)
        env = values.pop("env", None) or {}
        if not isinstance(env, dict):
            raise UsageError(f"--config {path}: 'env' must be a mapping of variable names to values")
        actions = {}
        for action in self._actions:  # a flag's own action, not its --no_ complement
            if action.option_strings and action.dest not in ("help", "config"):
                actions.setdefault(action.dest, action)
        launch = [key for key in values if key not in actions and f"--{key}" in _launch_options()]
        if launch and os.environ.get(LAUNCHED_BY_CLI) is None:
            raise UsageError(f"--config {path}: {launch[0]} is an accelerate launch setting, which hfnative-train applies "
                             f"when it starts the processes itself{_launched_note()}; remove it from the file")
        for key in launch:  # hfnative-train read them when it started this process
            del values[key]
        unknown = [key for key in values if key not in actions]
        if unknown:
            raise UsageError(f"--config {path}: unknown argument {unknown[0]!r}{_did_you_mean(unknown[0], actions)}")
        for name, value in env.items():
            os.environ[str(name)] = str(value)
        namespace = argparse.Namespace()
        for name, value in values.items():
            if isinstance(value, str) or (isinstance(value, dict) and actions[name].type is _parallelism_config_value):
                try:
                    value = self._get_value(actions[name], value)  # as argparse types a string default
                    if actions[name].choices is not None:
                        self._check_value(actions[name], value)
                except argparse.ArgumentError as err:
                    raise UsageError(f"--config {path}: {name}: {err.message}") from err
            setattr(namespace, name, value)
        return namespace


def _read_config(path: str) -> dict:
    """The ``--config`` YAML file as a mapping; UsageError when it cannot be read or is not one."""
    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except OSError as err:
        raise UsageError(f"--config {path}: cannot read it ({err.strerror})") from err
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise UsageError(f"--config {path}: not valid YAML{line}: {_one_line(getattr(err, 'problem', err))}") from err
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise UsageError(f"--config {path}: expected a mapping of argument names to values, got a {type(values).__name__}")
    return values


def _parallelism_config_value(value):
    try:
        return parallelism_config_from(value)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"invalid parallelism_config {value!r}: {_one_line(err)}") from err


_METAVARS = {int: "INT", float: "FLOAT", str: "STR", string_to_bool: "BOOL"}


def _tidy_for_help(action: argparse.Action) -> None:
    """Short metavars (INT, FLOAT, {a,b,...}), long choice lists moved into the help, a default shown for every flag."""
    if not action.option_strings or action.help == argparse.SUPPRESS:
        return
    if action.metavar is None and action.choices is not None:
        choices = [str(c) for c in action.choices]
        if len(choices) > 6:
            action.metavar = "{" + ",".join(choices[:3]) + ",...}"
            action.help = f"{action.help or ''} One of: {', '.join(choices)}.".strip()
    elif action.metavar is None:
        action.metavar = _METAVARS.get(action.type, "VALUE")
    if not action.help:
        action.help = "(default: %(default)s)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """One spelling per flag (the underscore one; the hyphen aliases still parse)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=44, width=100)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        first = action.option_strings[0]
        options = ", ".join(o for o in action.option_strings if o == first or o != first.replace("_", "-"))
        if action.nargs == 0:
            return options
        return f"{options} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


def _config_path(args: list[str]) -> str | None:
    for index, arg in enumerate(args):
        if arg == "--config":
            if index + 1 == len(args) or args[index + 1].startswith("--"):
                raise UsageError("--config needs a YAML file path")
            return args[index + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _explain_invalid_arguments(err: Exception) -> str:
    message = _one_line(err)
    if "bf16" in message and not torch.cuda.is_available():
        return ("bf16=True (SFTConfig's default unless fp16) needs a GPU with bfloat16, and none was found: "
                "pass --bf16 false, or --use_cpu to run bf16 on the CPU")
    return f"invalid arguments: {message}"


def _exit_with_usage_error(prog: str, err: Exception):
    print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
    raise SystemExit(2)


# --- commands --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One algorithm: its arguments, its trainer, and the function that runs it
    as ``run(command, script_args, training_args, model_args)``."""

    help: str
    config_class: type
    trainer_class: type
    run: Callable
    script_args_class: type = ScriptArguments
    model_args_class: type = ModelArguments
    # extra keyword arguments of the trainer, from the parsed arguments: (script_args, training_args, model_args) -> dict
    trainer_kwargs: Callable | None = None

    def parser(self, name: str) -> TrainingArgumentParser:
        return TrainingArgumentParser(
            (self.script_args_class, self.config_class, self.model_args_class),
            titles=("script arguments", f"training arguments ({self.config_class.__name__})", "model arguments"),
            prog=f"{PROG} {name}",
            usage="%(prog)s --model_name_or_path MODEL --dataset_name DATASET [--config YAML] [--<argument> VALUE ...]",
            description=f"{self.help}. Commands: {', '.join(COMMANDS)} (default: {DEFAULT_COMMAND}).",
            epilog=LAUNCH_HELP,
        )


def train_model(command: Command, script_args, training_args, model_args) -> None:
    """Load the data and model, train, then save (and push) the result — TRL's sft.py flow. output_dir is
    claimed first, so a second run on it, or an unwritable one, stops before anything is loaded."""
    with ExitStack() as claim:
        try:
            claim.enter_context(output_dir_claimed(training_args.output_dir))
            checkpoint = resolve_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
            train_dataset, eval_dataset = train_and_eval_datasets(script_args, training_args)
            if not model_args.model_name_or_path:
                raise ValueError("model_name_or_path is required: a local model folder or a Hub model id")
            training_args.model_init_kwargs = model_init_kwargs_from(model_args, training_args)
            extra = command.trainer_kwargs(script_args, training_args, model_args) if command.trainer_kwargs else {}
            trainer = command.trainer_class(
                model=model_args.model_name_or_path,
                args=training_args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                peft_config=peft_config_from(model_args),
                **extra,
            )
        except (ValueError, FileNotFoundError) as err:
            raise UsageError(err) from err
        trainer.dataset_name = script_args.dataset_name
        try:
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        except (RunError, RefusedCheckpointFile) as err:  # nothing to train on; a checkpoint holding code
            raise UsageError(err) from err
        if training_args.push_to_hub:
            # push_to_hub saves the model and card into output_dir first (save_model would push a second time)
            commit = trainer.push_to_hub(dataset_name=script_args.dataset_name)
            if trainer.is_world_process_zero():  # one line per run, not per process
                print(f"Model saved to {training_args.output_dir} and pushed to {commit.commit_url}")
        else:
            trainer.save_model(training_args.output_dir)
            if trainer.is_world_process_zero():
                print(f"Model saved to {training_args.output_dir}")


COMMANDS: dict[str, Command | str] = {
    "sft": Command("Supervised fine-tuning (TRL's `trl sft`)", SFTConfig, SFTTrainer, train_model),
    "dpo": "hfnative.trainers.algorithms.dpo:cli_command",
    "distillation": "hfnative.trainers.algorithms.distillation:distillation_cli_command",
    "gkd": "hfnative.trainers.algorithms.gkd:gkd_cli_command",
    "grpo": "hfnative.trainers.algorithms.grpo:cli_command",
    "kto": "hfnative.trainers.algorithms.kto:cli_command",
    "orpo": "hfnative.trainers.algorithms.orpo:cli_command",
    "ppo": "hfnative.trainers.algorithms.ppo:cli_command",
    "cpo": "hfnative.trainers.algorithms.cpo:cli_command",
    "reward": "hfnative.trainers.algorithms.reward:cli_command",
    "rloo": "hfnative.trainers.algorithms.rloo:cli_command",
}
DEFAULT_COMMAND = "sft"


def command_named(name: str) -> Command:
    """The registered command, importing its module when it is registered as ``"module:function"``."""
    entry = COMMANDS[name]
    if isinstance(entry, str):
        module_name, function = entry.split(":")
        entry = COMMANDS[name] = getattr(import_module(module_name), function)()
    return entry


def _pick_command(args: list[str]) -> tuple[str, list[str]]:
    if args and not args[0].startswith("-"):
        if args[0] not in COMMANDS:
            raise UsageError(f"unknown command {args[0]!r}{_did_you_mean(args[0], COMMANDS)}; "
                             f"commands: {', '.join(COMMANDS)} (default: {DEFAULT_COMMAND})")
        return args[0], args[1:]
    return DEFAULT_COMMAND, args


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        name, args = _pick_command(args)
        command = command_named(name)
        parser = command.parser(name)
        launch_args, args = parser.launch_arguments(args)
        if launch_args:
            return launch_processes(name, launch_args, args, parser)
        script_args, training_args, model_args = parser.parse(args)
        command.run(command, script_args, training_args, model_args)
    except UsageError as err:
        _exit_with_usage_error(PROG, err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
