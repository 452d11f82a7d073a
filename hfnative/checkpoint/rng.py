"""RNG state in transformers' ``rng_state.pth`` layout: python, numpy, cpu (and cuda) generators."""

from __future__ import annotations

import random

import numpy as np
import torch


def save_rng_state(path) -> None:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    torch.save(state, path)


def load_rng_state(path) -> None:
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])
