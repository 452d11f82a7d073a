"""The familiar front door: transformers / TRL argument classes and trainers on hfnative's engine."""

from importlib import import_module

from .arguments import SFTConfig, TrainingArguments
from .sft_trainer import SFTTrainer
from .trainer import Trainer

# the other algorithms' trainers, imported on first use: name -> module under hfnative.trainers
_LAZY = {
    "DPOConfig": "dpo_config",
    "DPOTrainer": "dpo_trainer",
    "DistillationConfig": "distillation_config",
    "DistillationTrainer": "distillation_trainer",
    "GKDConfig": "distillation_config",
    "GKDTrainer": "gkd_trainer",
    "GRPOConfig": "grpo_trainer",
    "GRPOTrainer": "grpo_trainer",
    "KTOConfig": "kto_config",
    "KTOTrainer": "kto_trainer",
    "ORPOConfig": "reference_free_config",
    "ORPOTrainer": "orpo_trainer",
    "CPOConfig": "reference_free_config",
    "CPOTrainer": "cpo_trainer",
    "OnlineDPOConfig": "online_dpo_config",
    "OnlineDPOTrainer": "online_dpo_trainer",
    "PPOConfig": "ppo_config",
    "PPOTrainer": "ppo_trainer",
    "RewardConfig": "reward_config",
    "RewardTrainer": "reward_trainer",
    "RLOOConfig": "rloo_config",
    "RLOOTrainer": "rloo_trainer",
    "AsyncGRPOConfig": "async_grpo_config",
    "AsyncGRPOTrainer": "async_grpo",
}

__all__ = ["SFTConfig", "SFTTrainer", "Trainer", "TrainingArguments", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hfnative.trainers' has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
