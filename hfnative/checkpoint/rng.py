"""RNG state in transformers' ``rng_state.pth`` layout: python, numpy, cpu (and cuda) generators."""

from __future__ import annotations

import random

import numpy as np
import torch

from .safe_load import safe_torch_load

_numpy_core = np._core if hasattr(np, "_core") else np.core  # renamed in numpy 2
# what numpy's generator state (a uint32 array) needs to be rebuilt; nothing else is allowed
_NUMPY_STATE_GLOBALS = (_numpy_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)))


def save_rng_state(path) -> None:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    torch.save(state, path)


def load_rng_state(path) -> None:
    """Restore the generators from ``path``; RefusedCheckpointFile if it holds anything but their states."""
    state = safe_torch_load(path, allowed_globals=_NUMPY_STATE_GLOBALS)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])
