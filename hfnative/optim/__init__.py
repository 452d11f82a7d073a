"""Optimizers and learning-rate schedules, named and configured as in transformers' Trainer."""

from hfnative.optim.factory import (
    SUPPORTED_OPTIMIZERS,
    Adafactor,
    build_optimizer,
    decay_parameter_names,
    optimizer_class_and_kwargs,
    parse_optim_args,
    split_decay_groups,
    with_fused_kernel,
)
from hfnative.optim.schedules import SUPPORTED_SCHEDULERS, build_lr_scheduler, lr_lambda_for, resolve_warmup_steps

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "Adafactor",
    "build_lr_scheduler",
    "build_optimizer",
    "decay_parameter_names",
    "lr_lambda_for",
    "optimizer_class_and_kwargs",
    "parse_optim_args",
    "resolve_warmup_steps",
    "split_decay_groups",
    "with_fused_kernel",
]
