"""Starting the processes of a run, as ``trl`` does: ``--num_processes N``, ``--accelerate_config NAME|PATH`` (TRL's
shipped configs or an accelerate config file) and any other ``accelerate launch`` flag given to ``hfnative-train``
start it through accelerate's launcher with the same command (minus those flags) in every process. An accelerate
DeepSpeed config (TRL's zero1 / zero2 / zero3) with deepspeed not installed starts torchrun processes instead, each
given the config's ZeRO settings as ``--deepspeed`` (run as their FSDP2 equivalent: ``deepspeed_config.py``). Also the
usage error every part of the command line raises.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import subprocess
import tempfile
from collections.abc import Iterable

class UsageError(Exception):
    """A mistake on the command line or in the config file: reported in one line, exit status 2."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""



# set for the processes hfnative-train starts: the launch settings in their --config file were applied already
LAUNCHED_BY_CLI = "HFNATIVE_LAUNCHED_BY_CLI"
ACCELERATE_CONFIG = "--accelerate_config"
LAUNCH_HELP = (
    "Launching: --num_processes N, --accelerate_config NAME|PATH (TRL's configs fsdp2, fsdp1, multi_gpu, single_gpu, "
    "zero1, zero2, zero3, or an accelerate config file) and any other `accelerate launch` flag (--mixed_precision, "
    "--main_process_port, --num_machines, ...), here or in the --config file, start the run through accelerate launch, "
    "with this command in every process. Under torchrun or accelerate launch, leave them out."
)


@functools.cache
def _launch_options() -> dict[str, int | str | None]:
    """accelerate launch's flags (and TRL's --accelerate_config) -> how many values each takes (argparse nargs)."""
    from accelerate.commands.launch import launch_command_parser

    options = {option: action.nargs for option, action in launch_command_parser()._option_string_actions.items()}
    for ours in ("-h", "--help"):
        options.pop(ours, None)
    return {**options, ACCELERATE_CONFIG: None, "--accelerate-config": None}


def _value_count(nargs, following: list[str]) -> int:
    if nargs == 0:
        return 0
    if nargs is None:
        return min(1, len(following))
    if nargs == "?":
        return int(bool(following) and not following[0].startswith("-"))
    if isinstance(nargs, int):
        return nargs
    return next((i for i, arg in enumerate(following) if arg.startswith("-")), len(following))


def split_launch_flags(args: list[str], training_options) -> tuple[list[str], list[str]]:
    """(accelerate launch's flags in ``args`` with their values, the other arguments), each in its order.
    ``training_options``: the training parser's flags, which keep theirs."""
    launch, rest, index = [], [], 0
    while index < len(args):
        flag = args[index].split("=", 1)[0]
        if flag in training_options or flag not in _launch_options():
            rest.append(args[index])
            index += 1
            continue
        count = 0 if "=" in args[index] else _value_count(_launch_options()[flag], args[index + 1:])
        launch += args[index:index + 1 + count]
        index += 1 + count
    return launch, rest


def _launch_flags_from_config(values: dict, training_options) -> list[str]:
    """The launch settings of a ``--config`` mapping (``num_processes: 2``, ``accelerate_config: fsdp2``) as flags."""
    flags = []
    for key, value in values.items():
        flag = f"--{key}"
        if flag in training_options or flag not in _launch_options():
            continue
        if _launch_options()[flag] == 0:  # an on/off switch
            flags += [flag] if value is True or str(value).lower() == "true" else []
        else:
            flags += [flag, str(value)]
    return flags


def _launched_note() -> str:
    world = os.environ.get("WORLD_SIZE") or os.environ.get("LOCAL_RANK")
    return f", not in a process a launcher started (WORLD_SIZE={world})" if world is not None else ""


def _accelerate_config_path(launch_args: list[str]) -> list[str]:
    """``--accelerate_config NAME|PATH`` as accelerate's ``--config_file PATH`` (a NAME is one of TRL's shipped
    configs, trl/accelerate_configs/NAME.yaml); the other launch flags unchanged."""
    result, name = [], None
    index = 0
    while index < len(launch_args):
        flag, _, value = launch_args[index].partition("=")
        if flag in (ACCELERATE_CONFIG, "--accelerate-config"):
            if not value:
                index += 1
                if index == len(launch_args):
                    raise UsageError(f"{ACCELERATE_CONFIG} needs a value: fsdp2, fsdp1, multi_gpu, single_gpu, zero1, "
                                     "zero2, zero3 or an accelerate config file")
                value = launch_args[index]
            name = value
        else:
            result.append(launch_args[index])
        index += 1
    if name is None:
        return result
    if any(arg.split("=")[0] in ("--config_file", "--config-file") for arg in result):
        raise UsageError(f"{ACCELERATE_CONFIG} and --config_file both name an accelerate config; keep one")
    return ["--config_file", _shipped_config(name), *result]


def _shipped_config(name: str) -> str:
    if os.path.isfile(name):
        return name
    from importlib import resources

    try:
        shipped = resources.files("trl.accelerate_configs")
    except ModuleNotFoundError:
        raise UsageError(f"{ACCELERATE_CONFIG} {name}: no such file, and TRL's named configs need trl installed "
                         "(pip install trl); or pass the path of an accelerate config file") from None
    names = sorted(f.name.removesuffix(".yaml") for f in shipped.iterdir() if f.name.endswith(".yaml"))
    if name not in names:
        raise UsageError(f"{ACCELERATE_CONFIG} {name}: no such file, and not one of TRL's configs ({', '.join(names)})"
                         f"{_did_you_mean(name, names)}")
    return str(shipped.joinpath(f"{name}.yaml"))


def _launch_config(launch: argparse.Namespace):
    """(the config file accelerate launch reads: the given one, else `accelerate config`'s default, not with --cpu;
    its ClusterConfig), or (None, None)."""
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file

    path = launch.config_file or (default_config_file if os.path.isfile(default_config_file) and not launch.cpu else None)
    try:
        return path, (load_config_from_file(path) if path else None)
    except (OSError, ValueError, TypeError) as err:
        raise UsageError(f"accelerate config {path}: {_one_line(err)}") from err


# accelerate launch's DeepSpeed flags, which take priority over its config's deepspeed_config
_DEEPSPEED_FLAGS = ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps",
                    "gradient_clipping", "deepspeed_config_file", "zero3_init_flag", "zero3_save_16bit_model",
                    "deepspeed_hostfile", "deepspeed_multinode_launcher", "deepspeed_exclusion_filter",
                    "deepspeed_inclusion_filter")


def _deepspeed_as_torchrun(launch: argparse.Namespace, args: list[str], folder: str,
                           parser) -> tuple[str, list[str]] | None:
    """For an accelerate DeepSpeed config with deepspeed not installed (accelerate's launcher would stop with an
    ImportError): (the same config with torchrun's distributed type, or one process's, written in ``folder``; ``args``
    with ``--deepspeed`` holding the config's ZeRO settings, accelerate's DeepSpeed flags over them, or its
    deepspeed_config_file). None for any other launch, and where the launch flags choose another launcher
    (--use_deepspeed, --multi_gpu, --use_fsdp: ``_check_launch`` says what then)."""
    from accelerate.utils import DistributedType, is_deepspeed_available

    path, config = _launch_config(launch)
    if (config is None or config.distributed_type != DistributedType.DEEPSPEED or is_deepspeed_available()
            or launch.use_deepspeed or launch.multi_gpu or launch.use_fsdp):
        return None
    plugin = dict(config.deepspeed_config or {})
    plugin.update({key: getattr(launch, key) for key in _DEEPSPEED_FLAGS if getattr(launch, key, None) is not None})
    machines = launch.num_machines or config.num_machines or 1
    if machines > 1 and plugin.get("deepspeed_multinode_launcher", "pdsh") != "standard":
        raise UsageError(
            f"accelerate config {path}: {machines} machines with deepspeed_multinode_launcher "
            f"{plugin.get('deepspeed_multinode_launcher', 'pdsh')!r} start every node from this one through DeepSpeed, "
            "which is not installed; set deepspeed_multinode_launcher: standard and run the command on every node "
            "(with its machine_rank), or pip install deepspeed")
    if parser.parse_namespace(args)[0].deepspeed:
        raise UsageError(f"accelerate config {path} runs DeepSpeed and --deepspeed names a DeepSpeed config too; keep one")
    if plugin.get("deepspeed_config_file"):
        zero = plugin["deepspeed_config_file"]
    else:  # accelerate's DeepSpeedPlugin defaults: ZeRO-2, nothing offloaded
        settings = {"zero_optimization": {
            "stage": plugin.get("zero_stage", 2),
            "offload_optimizer": {"device": plugin.get("offload_optimizer_device", "none")},
            "offload_param": {"device": plugin.get("offload_param_device", "none")}}}
        for key in ("gradient_accumulation_steps", "gradient_clipping"):
            if plugin.get(key) not in (None, "auto"):
                settings[key] = plugin[key]
        zero = json.dumps(settings)
    as_torchrun = {key: value for key, value in config.to_dict().items() if key != "deepspeed_config"}
    one_process = machines == 1 and (launch.num_processes or config.num_processes or 1) == 1
    as_torchrun["distributed_type"] = (DistributedType.NO if one_process else DistributedType.MULTI_GPU).value
    converted = os.path.join(folder, "accelerate_config.json")
    with open(converted, "w") as file:
        json.dump(as_torchrun, file)
    print(f"accelerate config {path} runs DeepSpeed, which is not installed: hfnative starts the processes with torchrun "
          f"and runs the config's ZeRO settings as their FSDP2 equivalent (--deepspeed {zero})", flush=True)
    return converted, [*args, "--deepspeed", zero]


def _check_launch(launch: argparse.Namespace) -> None:
    """Refuse a launch that would not start what it asks for: DeepSpeed launcher flags without deepspeed
    (accelerate's launcher would stop with an ImportError; a DeepSpeed config file is run as torchrun processes:
    ``_deepspeed_as_torchrun``), several processes where accelerate would start one. On a machine with fewer GPUs
    than processes and no accelerate config, accelerate's multi-process launcher (torchrun) is chosen, as it is on a
    multi-GPU machine: the processes then use gloo on the CPU."""
    from accelerate.utils import DistributedType, is_deepspeed_available

    path, config = _launch_config(launch)
    distributed = config.distributed_type if config is not None else None
    if (launch.use_deepspeed or distributed == DistributedType.DEEPSPEED) and not is_deepspeed_available():
        what = "--use_deepspeed" if launch.use_deepspeed else f"accelerate config {path} with --multi_gpu / --use_fsdp"
        raise UsageError(f"{what} asks for DeepSpeed's own launcher, and deepspeed is not installed: pip install "
                         "deepspeed, or give the ZeRO settings without those flags: --accelerate_config zero3 (or an "
                         "accelerate config file with distributed_type DEEPSPEED), or --deepspeed ds_config.json, run as "
                         "their FSDP2 equivalent")
    processes = launch.num_processes
    if processes is None or processes <= 1 or launch.mpirun_hostfile:
        return
    if launch.cpu:
        raise UsageError(f"--cpu with --num_processes {processes}: accelerate starts several CPU processes only through "
                         "MPI (--mpirun_hostfile); drop --cpu (without a GPU the processes run on the CPU with gloo; "
                         "--use_cpu keeps them on the CPU beside a GPU)")
    if launch.multi_gpu or launch.use_fsdp or launch.use_deepspeed or launch.use_megatron_lm or launch.tpu:
        return
    if distributed is None:
        launch.multi_gpu = True  # accelerate would start a single process where it finds fewer than two GPUs
    elif distributed == DistributedType.NO:
        raise UsageError(f"--num_processes {processes} with accelerate config {path}, whose distributed_type is NO "
                         "(one process): use --accelerate_config multi_gpu or fsdp2")


def launch_processes(command_name: str, launch_args: list[str], args: list[str], parser) -> int:
    """Start the run through accelerate launch (``launch_args``: its flags), ``hfnative-train command_name args`` in
    every process, as ``trl`` does; wait for it; the run's exit status (a process's, when one failed). ``parser``: the
    command's TrainingArgumentParser, which checks ``args`` once here before the processes start."""
    if os.environ.get("WORLD_SIZE") or os.environ.get("LOCAL_RANK"):
        raise UsageError(f"{launch_args[0].split('=')[0]} asks hfnative-train to start the processes{_launched_note()}: "
                         "leave out the launch flags under torchrun or accelerate launch")
    own = [arg for arg in launch_args if arg.split("=")[0] in ("-m", "--module", "--no_python", "--no-python")]
    if own:
        raise UsageError(f"{own[0]} is not for hfnative-train, which starts its own module in every process")
    from accelerate.commands.launch import launch_command_parser

    launch_parser = launch_command_parser()
    launch_parser.error = _accelerate_usage_error
    launch_args = _accelerate_config_path(launch_args)
    module = ["--module", "hfnative.trainers.running.cli", command_name]
    launch = launch_parser.parse_args([*launch_args, *module, *args])
    with tempfile.TemporaryDirectory(prefix="hfnative-launch-") as folder:
        converted = _deepspeed_as_torchrun(launch, args, folder, parser)
        if converted is not None:
            config, args = converted
            launch = launch_parser.parse_args([*_without_config_file(launch_args), "--config_file", config, *module, *args])
        return _launch(launch, args, parser)


def _without_config_file(launch_args: list[str]) -> list[str]:
    """``launch_args`` less any ``--config_file PATH``."""
    kept, skip = [], False
    for arg in launch_args:
        if skip:
            skip = False
        elif arg.split("=")[0] in ("--config_file", "--config-file"):
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


def _launch(launch: argparse.Namespace, args: list[str], parser) -> int:
    """``launch`` checked and run; the run's exit status."""
    from accelerate.commands.launch import launch_command
    from accelerate.utils import patch_environment
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _check_launch(launch)
    with patch_environment(**{LAUNCHED_BY_CLI: "1"}):
        parser.parse_namespace(args)  # a usage mistake is reported once, here, rather than by every process
        try:
            launch_command(launch)
        except subprocess.CalledProcessError as err:  # the single-process launcher
            return err.returncode
        except ChildFailedError as err:  # torchrun's: the first process that failed
            _, failure = err.get_first_failure()
            code = failure.exitcode
            return 128 - code if code < 0 else code or 1  # killed by signal n: 128 + n, as a shell reports it
        except (ValueError, FileNotFoundError) as err:  # accelerate's checks of its flags and config
            raise UsageError(f"accelerate launch: {_one_line(err)}") from err
    return 0


def _accelerate_usage_error(message: str):
    raise UsageError(f"accelerate launch: {message}")
