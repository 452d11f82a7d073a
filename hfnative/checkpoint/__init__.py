"""Training-state persistence: atomic checkpoint folders and RNG state."""

from .atomic import atomic_directory
from .rng import load_rng_state, save_rng_state

__all__ = ["atomic_directory", "load_rng_state", "save_rng_state"]
