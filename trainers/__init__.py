"""The familiar front door: transformers / TRL argument classes and trainers on hfnative's engine."""

from importlib import import_module

from .loop.arguments import SFTConfig, TrainingArguments
from .algorithms.sft import SFTTrainer
from .loop.trainer import Trainer

# the other algorithms' trainers, imported on first use: name -> module under hfnative.trainers
_LAZY = {
    "DPOConfig": "algorithms.dpo_config",
    "DPOTrainer": "algorithms.dpo",
    "DistillationConfig": "algorithms.distillation_config",
    "DistillationTrainer": "algorithms.distillation",
    "GKDConfig": "algorithms.distillation_config",
    "GKDTrainer": "algorithms.gkd",
    "GRPOConfig": "algorithms.grpo",
    "GRPOTrainer": "algorithms.grpo",
    "KTOConfig": "algorithms.kto_config",
    "KTOTrainer": "algorithms.kto",
    "ORPOConfig": "algorithms.reference_free_config",
    "ORPOTrainer": "algorithms.orpo",
    "CPOConfig": "algorithms.reference_free_config",
    "CPOTrainer": "algorithms.cpo",
    "OnlineDPOConfig": "algorithms.online_dpo_config",
    "OnlineDPOTrainer": "algorithms.online_dpo",
    "PPOConfig": "algorithms.ppo_config",
    "PPOTrainer": "algorithms.ppo",
    "RewardConfig": "algorithms.reward_config",
    "RewardTrainer": "algorithms.reward",
    "RLOOConfig": "algorithms.rloo_config",
    "RLOOTrainer": "algorithms.rloo",
    "AsyncGRPOConfig": "algorithms.async_grpo_config",
    "AsyncGRPOTrainer": "algorithms.async_grpo",
}

__all__ = ["SFTConfig", "SFTTrainer", "Trainer", "TrainingArguments", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hfnative.trainers' has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
