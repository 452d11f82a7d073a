"""RLOOConfig: TRL 1.16's RLOO arguments, names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from .grpo_config import OnlineRLConfig


@dataclass(repr=False)
class RLOOConfig(OnlineRLConfig):
    """TRL 1.16's RLOOConfig: GRPO's generation and clipping fields (no loss_type, scale_rewards, delta) plus
    ``normalize_advantages`` and ``reward_clip_range``; num_generations 2 and beta 0.05 by default."""

    num_generations: int | None = field(default=2, metadata={"help": "Completions sampled per prompt."})
    beta: float = field(default=0.05, metadata={"help": "KL coefficient in the reward (> 0 loads a reference model)."})
    normalize_advantages: bool = field(
        default=False, metadata={"help": "Standardize the advantages over each generation batch."}
    )
    reward_clip_range: tuple[float, float] | None = field(
        default=None, metadata={"help": "Clip the rewards to (min, max) before the baseline."}
    )


__all__ = ["RLOOConfig"]
