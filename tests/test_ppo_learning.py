"""PPO learns: on a toy reward (a random one-label Qwen3 classifier whose score head is scaled up, so its score ranges
over several units), the tiny-qwen3 policy's mean score rises clearly over 160 updates of 8 sampled rollouts."""

from __future__ import annotations

import pytest
import torch

from _ppo_worker import ppo_trainer, save_classifier

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_mean_score_rises(tmp_path):
    from transformers import AutoModelForSequenceClassification

    save_classifier(tmp_path / "models" / "value", 2)
    reward = AutoModelForSequenceClassification.from_pretrained(save_classifier(tmp_path / "models" / "reward", 1))
    with torch.no_grad():
        reward.score.weight.mul_(100.0)
    reward.save_pretrained(tmp_path / "models" / "reward")
    trainer = ppo_trainer(tmp_path / "run", tmp_path / "models", per_device_train_batch_size=8,
                          gradient_accumulation_steps=1, total_episodes=8 * 160, learning_rate=1e-3,
                          lr_scheduler_type="constant", warmup_steps=0, save_strategy="no", num_ppo_epochs=4,
                          response_length=4, kl_coef=0.01, temperature=1.0)
    trainer.train()
    scores = [row["objective/scores"] for row in trainer.state.log_history if "objective/scores" in row]
    assert len(scores) == 160
    first, last = sum(scores[:32]) / 32, sum(scores[-32:]) / 32
    assert last > first + 5.0, (first, last)
