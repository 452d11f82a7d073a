"""Training-state persistence: atomic checkpoint folders, RNG state, code-free loading."""

from .atomic import atomic_directory, atomic_files
from .rng import load_rng_state, save_rng_state
from .safe_load import RefusedCheckpointFile, safe_torch_load

__all__ = ["RefusedCheckpointFile", "atomic_directory", "atomic_files", "load_rng_state", "safe_torch_load", "save_rng_state"]
