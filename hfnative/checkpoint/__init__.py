"""Training-state persistence: atomic checkpoint folders, RNG state, code-free loading, and the training state of
distributed runs (``save_training_state`` / ``load_training_state``: torch.distributed.checkpoint into safetensors
and JSON).

The distributed pieces load on first use (PEP 562), so single-process callers do not import
torch.distributed.checkpoint."""

from importlib import import_module

from .atomic import atomic_directory, atomic_files
from .rng import load_rng_state, save_rng_state
from .safe_load import RefusedCheckpointFile, safe_torch_load

_LAZY = {
    "TrainingStateError": "distributed",
    "load_training_state": "distributed",
    "save_training_state": "distributed",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(f"hfnative.checkpoint.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hfnative.checkpoint' has no attribute {name!r}")


__all__ = [
    "RefusedCheckpointFile",
    "atomic_directory",
    "atomic_files",
    "load_rng_state",
    "safe_torch_load",
    "save_rng_state",
    *_LAZY,
]
