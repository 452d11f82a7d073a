"""``TrainingArguments(deepspeed=...)`` read without DeepSpeed: the ZeRO config a TRL or transformers user passes (a
JSON file, a dict, or accelerate's base64-encoded JSON) becomes its FSDP2 layout (``parallel_plan.py``), and DeepSpeed
is never imported.

As transformers' ``HfTrainerDeepSpeedConfig`` does, the config's ``"auto"`` values are filled from the training
arguments (the micro-batch, gradient accumulation, the global batch, gradient clipping, fp16 / bf16, an AdamW
section's hyperparameters), and a value given that differs from them is refused, all such values listed in one
message. An ``optimizer`` section is read when it is the training arguments' AdamW (DeepSpeed's ``Adam`` and ``AdamW``
decouple the weight decay by default). A ``scheduler`` section (DeepSpeed's WarmupLR, WarmupDecayLR or WarmupCosineLR)
replaces the arguments' schedule, as under transformers' Trainer with DeepSpeed: ``deepspeed_scheduler`` computes
DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py) in a torch scheduler. What else the config would change beyond the
layout (another optimizer or schedule, NVMe offload) is refused by ``parallel_plan._deepspeed_layout`` or here.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass
class DeepSpeedConfig:
    """A ZeRO config as ``parallel_plan`` reads it (the attributes it reads of accelerate's ``DeepSpeedPlugin``)."""

    deepspeed_config: dict
    # the sections hfnative reads (checked here): an optimizer equal to the arguments' AdamW, a DeepSpeed schedule
    sections_read: frozenset = frozenset()

    @property
    def zero_stage(self):
        return self._zero().get("stage", 0)  # DeepSpeed's default: no partitioning

    @property
    def offload_param_device(self) -> str:
        return (self._zero().get("offload_param") or {}).get("device", "none")

    @property
    def offload_optimizer_device(self) -> str:
        return (self._zero().get("offload_optimizer") or {}).get("device", "none")

    def _zero(self) -> dict:
        return self.deepspeed_config.get("zero_optimization") or {}


def read_deepspeed_config(value) -> dict:
    """The config ``deepspeed=`` names: a mapping, a path to a JSON file, or base64-encoded JSON (as accelerate takes
    it); a ValueError naming the value otherwise."""
    if isinstance(value, Mapping):
        config = copy.deepcopy(dict(value))
    elif isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as file:
                    config = json.load(file)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ValueError(f"deepspeed={path!r}: not a readable JSON file ({error})") from error
        else:
            try:
                config = json.loads(base64.urlsafe_b64decode(path.encode("ascii")).decode("utf-8"))
            except (UnicodeError, binascii.Error, json.JSONDecodeError, ValueError):
                raise ValueError(
                    f"deepspeed={path!r}: no such file; pass the path of a DeepSpeed JSON config, a dict, or "
                    "base64-encoded JSON") from None
    else:
        raise ValueError(f"deepspeed={value!r}: expected the path of a DeepSpeed JSON config or a dict")
    if not isinstance(config, dict):
        raise ValueError(f"deepspeed={value!r}: the config is a JSON {type(config).__name__}, not an object")
    return config


def deepspeed_config(args, data_parallel_size: int) -> DeepSpeedConfig:
    """``args.deepspeed`` read, its "auto" values filled from ``args`` and the rest checked against them (transformers'
    ``trainer_config_process`` rules, in its order); the global batch counted over ``data_parallel_size`` ranks (the
    world size, less what tensor / context / pipeline parallelism take)."""
    config = read_deepspeed_config(args.deepspeed)
    for key, (harmless, why) in _REFUSED_KEYS.items():
        node, leaf = _node(config, key)
        if node is not None and node.get(leaf) is not None and not harmless(node[leaf]):
            raise ValueError(f"deepspeed: {key}={node[leaf]!r} is not supported by hfnative: {why}")
    filled = _AutoValues(config)
    fill_match = filled.fill_match
    batch_must_match = not getattr(args, "auto_find_batch_size", False)
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill_match("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", batch_must_match)
    fill_match("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    fill_match("train_batch_size", data_parallel_size * micro * accumulation, "train_batch_size (calculated)",
               batch_must_match)
    fill_match("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    optimizer = config.get("optimizer")
    if optimizer is not None:
        _check_adamw(optimizer, args)
        fill_match("optimizer.params.lr", args.learning_rate, "learning_rate")
        fill_match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
        fill_match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
        fill_match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    scheduler = config.get("scheduler")
    if scheduler is not None:
        _check_schedule(scheduler)
        fill_match("scheduler.params.warmup_min_lr", 0, "", must_match=False)  # not a training argument
        fill_match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fill_match("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    fill_match("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    filled.check()
    read = {name for name, section in (("optimizer", optimizer), ("scheduler", scheduler)) if section is not None}
    return DeepSpeedConfig(config, frozenset(read))


def _node(config: dict, key: str) -> tuple[dict | None, str]:
    """(the dict holding a dotted ``key``'s last part, or None where a part is missing; that last part)."""
    *parents, leaf = key.split(".")
    node = config
    for parent in parents:
        node = node.get(parent) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


class _AutoValues:
    """transformers' ``fill_match`` over a config: an "auto" value takes the training arguments', another value must
    equal it (``check`` raises, listing every mismatch in transformers' words)."""

    def __init__(self, config: dict):
        self.config, self.mismatches = config, []

    def fill_match(self, key: str, value, name: str, must_match: bool = True) -> None:
        node, leaf = _node(self.config, key)
        if node is None:
            return
        if node.get(leaf) == "auto":
            node[leaf] = value
        elif must_match and node.get(leaf) is not None and node[leaf] != value:
            self.mismatches.append(f"- ds {key}={node[leaf]} vs hf {name}={value}")

    def check(self) -> None:
        if self.mismatches:
            raise ValueError(
                "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
                + "\n".join(self.mismatches) + "\nThe easiest method is to set these DeepSpeed config values to 'auto'.")


# DeepSpeed's schedules and the parameters each takes (deepspeed/runtime/lr_schedules.py)
_SCHEDULES = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
    "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"},
    "WarmupCosineLR": {"warmup_min_ratio", "warmup_num_steps", "warmup_type", "cos_min_ratio", "total_num_steps"},
}
_AUTO_SCHEDULE_PARAMS = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"}  # transformers fills


def _check_schedule(scheduler) -> None:
    """A scheduler section hfnative runs, or a ValueError saying what in it is not."""
    kind = scheduler.get("type") if isinstance(scheduler, dict) else None
    params = (scheduler.get("params") or {}) if isinstance(scheduler, dict) else {}
    problems = []
    if kind not in _SCHEDULES:
        problems.append(f"type {kind!r}")
    else:
        extra = sorted(set(params) - _SCHEDULES[kind])
        if extra:
            problems.append(f"it sets {extra}")
        if kind != "WarmupLR" and "total_num_steps" not in params:
            problems.append("it leaves out total_num_steps (\"auto\": the run's steps)")
    if params.get("warmup_type", "log") not in ("log", "linear"):
        problems.append(f"warmup_type={params['warmup_type']!r}")
    for key, value in params.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key != "warmup_type" and not number and not (value == "auto" and key in _AUTO_SCHEDULE_PARAMS):
            wanted = 'a number, or "auto"' if key in _AUTO_SCHEDULE_PARAMS else "a number"
            problems.append(f"{key}={value!r} ({wanted})")
    if problems:
        raise ValueError(
            f"deepspeed: the config's scheduler section ({scheduler!r}) is not one hfnative runs: {'; '.join(problems)}. "
            f"It runs DeepSpeed's {', '.join(_SCHEDULES)} with their own parameters and warmup_type 'log' or "
            "'linear'; or remove the section and set lr_scheduler_type and warmup_steps")


class DeepSpeedSchedule(torch.optim.lr_scheduler.LRScheduler):
    """A DeepSpeed schedule: each parameter group's learning rate set to ``rate(iteration, group)`` (DeepSpeed's
    absolute rates, whatever the group's own), the scheduler's step e being DeepSpeed's iteration e - 1 (its
    constructor's rate is DeepSpeed's before any step). Its state is the step count."""

    def __init__(self, optimizer: torch.optim.Optimizer, rate):
        self._rate = rate
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self._rate(self.last_epoch - 1, group) for group in range(len(self.optimizer.param_groups))]

    def state_dict(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key not in ("optimizer", "_rate")}


def deepspeed_scheduler(args, optimizer: torch.optim.Optimizer, num_training_steps: int) -> DeepSpeedSchedule | None:
    """The schedule of ``args.deepspeed``'s scheduler section over ``optimizer`` (None without one), as DeepSpeed's
    engine runs it under transformers' Trainer: made before the first step (which then runs at the schedule's start,
    ``warmup_min_lr``) and stepped after every optimizer step. ``total_num_steps`` and ``warmup_num_steps`` "auto"
    are the run's steps and ``max(1, args.get_warmup_steps(...))``, as transformers fills them; a value given must
    equal them."""
    config = read_deepspeed_config(args.deepspeed) if args.deepspeed else {}
    scheduler = config.get("scheduler")
    if scheduler is None:
        return None
    _check_schedule(scheduler)
    filled = _AutoValues(config)  # transformers' trainer_config_finalize, and warmup_*_lr as at the config's reading
    filled.fill_match("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    filled.fill_match("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
                      "warmup_steps")
    filled.fill_match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    filled.fill_match("scheduler.params.warmup_min_lr", 0, "", must_match=False)
    filled.check()
    kind, params = scheduler["type"], scheduler.get("params") or {}
    original = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]  # the cosine's ratios' base
    return DeepSpeedSchedule(optimizer, _deepspeed_rates(kind, params, original))


def _deepspeed_rates(kind: str, params: dict, base_lrs: list[float]):
    """``rate(iteration, group)``: the learning rate DeepSpeed's ``kind`` gives a parameter group at an iteration
    (-1: before the first step), with DeepSpeed's defaults for what ``params`` leaves out."""
    warmup = max(2, params.get("warmup_num_steps", 1000))
    linear = params.get("warmup_type", "log") == "linear"

    def warming(iteration: int) -> float:  # 0 -> 1 over the warm-up
        return iteration / warmup if linear else math.log(iteration + 1) / math.log(warmup)

    if kind == "WarmupCosineLR":
        total, min_ratio = params["total_num_steps"], params.get("warmup_min_ratio", 0.0)
        cos_min = params.get("cos_min_ratio", 0.0001)

        def rate(iteration: int, group: int) -> float:
            if iteration < 0:  # DeepSpeed sets the first group's rate to 0 before the first step, the others' not
                return 0.0 if group == 0 else base_lrs[group]
            if iteration < warmup:
                ratio = min_ratio + warming(iteration) * (1.0 - min_ratio)
            else:
                ratio = (1 + math.cos(math.pi * (iteration - warmup + 1) / (total - warmup))) / 2
                ratio = max(0.0, cos_min + (1.0 - cos_min) * ratio)
            return base_lrs[group] * ratio

        return rate
    low, high = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", 0.001)
    total = params.get("total_num_steps")

    def rate(iteration: int, group: int) -> float:
        if iteration < 0:
            return low
        if iteration < warmup:
            gamma = warming(iteration)
        elif kind == "WarmupDecayLR":
            gamma = max(0.0, (total - iteration) / max(1.0, total - warmup))
        else:
            gamma = 1.0
        return low + (high - low) * gamma

    return rate


# what a config may hold that would change the run beyond its layout: (the values that change nothing, why the others
# are refused)
_REFUSED_KEYS = {
    "zero_optimization.cpu_offload": (lambda value: value is False, "it is DeepSpeed's old name for offload_optimizer; "
                                      "use \"offload_optimizer\": {\"device\": \"cpu\"}"),
    "tensor_parallel.autotp_size": (lambda value: type(value) is int and value <= 1,
                                    "tensor parallelism comes from parallelism_config (tp_size)"),
}
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")  # each "auto" or equal to the training arguments'
_ADAMW_PARAMS = {*_HYPERPARAMETERS, "adam_w_mode", "torch_adam"}
_PLAIN_ADAMW = ("adamw_torch", "adamw_torch_fused")  # a 32-bit AdamW, as DeepSpeed's is


def _check_adamw(optimizer, args) -> None:
    """An optimizer section hfnative can honour: DeepSpeed's Adam / AdamW with decoupled weight decay and its four
    hyperparameters given ("auto" or values, checked like the rest: a missing one is DeepSpeed's default, not the
    arguments'), over training arguments whose optimizer is the same plain 32-bit AdamW."""
    kind = str(optimizer.get("type", "")) if isinstance(optimizer, dict) else ""
    params = (optimizer.get("params") or {}) if isinstance(optimizer, dict) else {}
    decoupled = kind.lower() == "adamw" or (kind.lower() == "adam" and params.get("adam_w_mode", True) is True)
    optim = str(getattr(args.optim, "value", args.optim))
    extra, missing = sorted(set(params) - _ADAMW_PARAMS), [key for key in _HYPERPARAMETERS if key not in params]
    if not decoupled or optim not in _PLAIN_ADAMW or extra or missing:
        details = "".join([f"; it sets {extra}" if extra else "",
                           f"; it leaves {missing} to DeepSpeed's defaults" if missing else ""])
        raise ValueError(
            f"deepspeed: the config's optimizer section ({optimizer!r}) is not the training arguments' optimizer "
            f"(optim={optim!r}){details}: hfnative runs the training arguments' optimizer, and reads an optimizer "
            "section only when it is DeepSpeed's Adam / AdamW with decoupled weight decay and lr, betas, eps and "
            f"weight_decay given (\"auto\" takes the arguments'), over optim in {list(_PLAIN_ADAMW)}; remove the "
            "section and set optim, learning_rate, adam_beta1/2, adam_epsilon and weight_decay instead")


__all__ = ["DeepSpeedConfig", "DeepSpeedSchedule", "deepspeed_config", "deepspeed_scheduler", "read_deepspeed_config"]
