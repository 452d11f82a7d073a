"""``TrainingArguments(deepspeed=...)`` read without DeepSpeed: the ZeRO config a TRL or transformers user passes (a
JSON file, a dict, or accelerate's base64-encoded JSON) becomes its FSDP2 layout (``parallel_plan.py``), and DeepSpeed
is never imported.

As transformers' ``HfTrainerDeepSpeedConfig`` does, the config's ``"auto"`` values are filled from the training
arguments (the micro-batch, gradient accumulation, the global batch, gradient clipping, fp16 / bf16, an AdamW
section's hyperparameters), and a value given that differs from them is refused, all such values listed in one
message. An ``optimizer`` section is read when it is the training arguments' AdamW (DeepSpeed's ``Adam`` and ``AdamW``
decouple the weight decay by default); what else the config would change beyond the layout (another optimizer, a
``scheduler`` section, NVMe offload) is refused by ``parallel_plan._deepspeed_layout`` or here.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class DeepSpeedConfig:
    """A ZeRO config as ``parallel_plan`` reads it (the attributes it reads of accelerate's ``DeepSpeedPlugin``)."""

    deepspeed_config: dict
    optimizer_is_arguments: bool = False  # an optimizer section checked equal to the training arguments' AdamW

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
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) is not None and not harmless(node[leaf]):
            raise ValueError(f"deepspeed: {key}={node[leaf]!r} is not supported by hfnative: {why}")
    mismatches: list[str] = []
    batch_must_match = not getattr(args, "auto_find_batch_size", False)

    def fill_match(key: str, value, name: str, must_match: bool = True) -> None:
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node.get(parent)
            if not isinstance(node, dict):
                return
        if node.get(leaf) == "auto":
            node[leaf] = value
        elif must_match and node.get(leaf) is not None and node[leaf] != value:
            mismatches.append(f"- ds {key}={node[leaf]} vs hf {name}={value}")

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
    fill_match("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    fill_match("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    if mismatches:
        raise ValueError(
            "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
            + "\n".join(mismatches) + "\nThe easiest method is to set these DeepSpeed config values to 'auto'.")
    return DeepSpeedConfig(config, optimizer_is_arguments=optimizer is not None)


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


__all__ = ["DeepSpeedConfig", "deepspeed_config", "read_deepspeed_config"]
