"""Optimizers named and configured as in transformers' Trainer (the LR schedule is transformers'
get_scheduler, built in trainers/)."""

from hfnative.optim.bf16_updates import BF16_WEIGHT_UPDATES, KahanAdamW
from hfnative.optim.factory import (
    SUPPORTED_OPTIMIZERS,
    OptimizerSettings,
    allocate_adam_state,
    build_optimizer,
    decay_parameter_names,
    optimizer_class_and_kwargs,
    optimizer_parts,
    parse_optim_args,
    split_decay_groups,
    with_fused_kernel,
)

__all__ = [
    "BF16_WEIGHT_UPDATES",
    "KahanAdamW",
    "SUPPORTED_OPTIMIZERS",
    "OptimizerSettings",
    "allocate_adam_state",
    "build_optimizer",
    "decay_parameter_names",
    "optimizer_class_and_kwargs",
    "optimizer_parts",
    "parse_optim_args",
    "split_decay_groups",
    "with_fused_kernel",
]
