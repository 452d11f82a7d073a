"""Asynchronous RL on Ray: generation and reward scoring as actors, joined to the trainer by a queue,
with bounded staleness (see rollout_queue.py). Ray is imported only when a rollout queue starts."""

from .actors import RewardScorer, RolloutGenerator
from .rollout_queue import RolloutActorError, RolloutQueue, RolloutStalledError
from .policy_copy import PolicyCopy, load_policy_copy, policy_copy
from .staleness import StalenessFilter

__all__ = [
    "PolicyCopy",
    "RewardScorer",
    "RolloutActorError",
    "RolloutGenerator",
    "RolloutQueue",
    "RolloutStalledError",
    "StalenessFilter",
    "load_policy_copy",
    "policy_copy",
]
