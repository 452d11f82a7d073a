"""Rollouts: one interface (``RolloutEngine``: ``generate``, ``load_weights``) and its native KV-cache
backend; ``generate`` for a one-off call on a native model. The vLLM backend is in ``vllm_backend``."""

from .api import generate
from .native import NativeRolloutEngine
from .rollouts import RolloutEngine, Rollouts
from .sampling import SamplingParams, sampling_distribution

__all__ = [
    "NativeRolloutEngine",
    "RolloutEngine",
    "Rollouts",
    "SamplingParams",
    "generate",
    "sampling_distribution",
]
