"""Rollouts: one interface (``RolloutEngine``: ``generate``, ``load_weights``) and its native KV-cache
backend; ``generate`` for a one-off call on any model the trainers accept."""

from .api import generate, native_model
from .native import NativeRolloutEngine
from .rollouts import RolloutEngine, Rollouts
from .sampling import SamplingParams, sampling_distribution

__all__ = [
    "NativeRolloutEngine",
    "RolloutEngine",
    "Rollouts",
    "SamplingParams",
    "generate",
    "native_model",
    "sampling_distribution",
]
