"""Asynchronous RL on Ray: generation and reward scoring as actors, joined to the trainer by a queue,
with bounded staleness (see pipeline.py). Ray is imported only when a pipeline starts."""

from .actors import RewardScorer, RolloutGenerator
from .pipeline import RolloutActorError, RolloutPipeline, RolloutStalledError
from .policy_copy import PolicyCopy, load_policy_copy, policy_copy
from .staleness import StalenessFilter

__all__ = [
    "PolicyCopy",
    "RewardScorer",
    "RolloutActorError",
    "RolloutGenerator",
    "RolloutPipeline",
    "RolloutStalledError",
    "StalenessFilter",
    "load_policy_copy",
    "policy_copy",
]
