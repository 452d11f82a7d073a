"""Parallelism and memory/speed transforms for a native model: ``ParallelDims`` builds the named DeviceMesh,
``parallelize`` applies, in this order, the pipeline stage split -> float8 training (``apply_float8_training``) ->
tensor/sequence (and expert) parallel -> activation checkpointing -> compile -> FSDP2; context parallel (``ring_attention``, ``split_batch``) splits each batch along the
sequence; ``Pipeline`` runs a step's micro-batches through the stages.

The distributed pieces load on first use (PEP 562), so single-process callers do not import
torch.distributed's tensor-parallel and FSDP modules."""

from importlib import import_module

from hfnative.parallel.activation_checkpoint import AC_MODES, apply_activation_checkpointing
from hfnative.parallel.compile import CompileSettings, apply_compile

_LAZY = {
    "ParallelDims": "dims",
    "apply_fsdp": "fsdp",
    "mixed_precision_policy": "fsdp",
    "parallelize": "parallelize",
    "apply_tensor_parallel": "tensor_parallel",
    "check_tensor_parallel": "tensor_parallel",
    "ring_attention": "context_parallel",
    "split_batch": "context_parallel",
    "apply_expert_parallel": "expert_parallel",
    "end_process_group": "teardown",
    "Pipeline": "pipeline",
    "split_into_stage": "pipeline",
    "Float8Training": "float8",
    "apply_float8_training": "float8",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(f"hfnative.parallel.{_LAZY[name]}"), name)
        # cached here; this also replaces the submodule "parallelize" that its import bound to the same name
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hfnative.parallel' has no attribute {name!r}")


__all__ = ["AC_MODES", "CompileSettings", "apply_activation_checkpointing", "apply_compile", *_LAZY]
