"""RNG state in transformers' ``rng_state.pth`` layout: python, numpy, cpu (and cuda) generators."""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from .safe_load import safe_torch_load

logger = logging.getLogger(__name__)

_numpy_core = np._core if hasattr(np, "_core") else np.core  # renamed in numpy 2
# what numpy's generator state (a uint32 array) needs to be rebuilt; nothing else is allowed
_NUMPY_STATE_GLOBALS = (_numpy_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)))


def save_rng_state(path) -> None:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
        state["cuda_device"] = torch.cuda.current_device()  # which of them this process drew from
    torch.save(state, path)


def load_rng_state(path) -> None:
    """Restore the generators from ``path``; RefusedCheckpointFile if it holds anything but their states."""
    state = safe_torch_load(path, allowed_globals=_NUMPY_STATE_GLOBALS)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        set_cuda_rng_states(state["cuda"], state.get("cuda_device"))


def set_cuda_rng_states(states: list, saved_device: int | None = None) -> None:
    """The CUDA generators from the states saved of every device the saving process saw (``saved_device``: the one it
    drew from, when the save says). A process that sees as many devices sets them all; one that sees another number (a
    launcher that now gives each process only its own GPU) sets its current device from the state of the device the
    saving process drew from, and says so: the generators of devices it cannot see are not its to set."""
    visible = torch.cuda.device_count()
    if len(states) == visible:
        torch.cuda.random.set_rng_state_all(states)
        return
    current = torch.cuda.current_device()
    source = saved_device if saved_device is not None else current
    if source < len(states):
        torch.cuda.random.set_rng_state(states[source])
    logger.warning("the checkpoint holds the CUDA generators of %d devices and this process sees %d: the current "
                   "device's generator %s", len(states), visible,
                   f"was restored from device {source}'s" if source < len(states) else "starts afresh")
