"""Applying parallelism and memory/speed transforms to a native model (activation checkpointing,
compile), in the order: TP -> activation checkpointing -> compile -> FSDP2."""

from hfnative.parallel.activation_checkpoint import AC_MODES, apply_activation_checkpointing
from hfnative.parallel.compile import apply_compile

__all__ = ["AC_MODES", "apply_activation_checkpointing", "apply_compile"]
