"""The familiar front door: transformers / TRL argument classes and trainers on hfnative's engine."""

from .arguments import SFTConfig, TrainingArguments
from .sft_trainer import SFTTrainer
from .trainer import Trainer

__all__ = ["SFTConfig", "SFTTrainer", "Trainer", "TrainingArguments"]
