"""Asynchronous RL on Ray: generation and reward scoring as actors, joined to the trainer by a queue,
with bounded staleness (see pipeline.py). Ray is imported only when a pipeline starts."""

from .actors import RewardScorer, RolloutGenerator
from .pipeline import RolloutActorError, RolloutPipeline, RolloutStalledError, policy_bytes
from .staleness import StalenessFilter

__all__ = [
    "RewardScorer",
    "RolloutActorError",
    "RolloutGenerator",
    "RolloutPipeline",
    "RolloutStalledError",
    "StalenessFilter",
    "policy_bytes",
]
