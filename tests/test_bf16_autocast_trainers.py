"""The generating trainers with bf16=True and fp32 master weights (autocast), as on a GPU, here on CPU.

Their rollouts run the native engine under the training step's autocast, so the key/value cache sees the
projections' bf16 outputs; a cache kept in the weights' dtype made the first rollout fail. Each trainer runs two
optimizer steps on the shipped tiny model and data: every logged loss finite, every completion generated to its
length limit (a random model rarely stops), the parameters moved and still fp32 (the distillation teacher's linear
weights in bf16).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from datasets import load_dataset

import hfnative as h
from hfnative.models.compute_dtype import linear_weights

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny-qwen3")
TEACHER = str(ROOT / "examples" / "tiny-qwen3-teacher")
PROMPTS = str(ROOT / "examples" / "data" / "sft_prompt_completion.jsonl")
COMPLETION = 8


def _letter_e(completions, **kwargs) -> list[float]:
    return [text.count("e") / max(len(text), 1) for text in completions]


def _trainer(name: str, output_dir: Path):
    data = load_dataset("json", data_files=PROMPTS, split="train").select(range(16))
    common = dict(output_dir=str(output_dir), max_steps=2, logging_steps=1, learning_rate=1e-3, report_to="none",
                  disable_tqdm=True, save_strategy="no", seed=0, use_cpu=True, bf16=True)
    if name in ("GRPO", "RLOO"):
        config = (h.GRPOConfig if name == "GRPO" else h.RLOOConfig)(
            **common, num_generations=4, max_completion_length=COMPLETION, per_device_train_batch_size=8)
        trainer_class = h.GRPOTrainer if name == "GRPO" else h.RLOOTrainer
        return trainer_class(model=TINY, reward_funcs=_letter_e, args=config, train_dataset=data)
    config = h.DistillationConfig(**common, max_completion_length=COMPLETION, per_device_train_batch_size=4,
                                  teacher_model_name_or_path=TEACHER)
    return h.DistillationTrainer(model=TINY, args=config, train_dataset=data)


@pytest.mark.parametrize("name", ["GRPO", "RLOO", "distillation"])
def test_generating_trainer_trains_under_bf16_autocast(name, tmp_path):
    trainer = _trainer(name, tmp_path)
    before = {key: value.detach().clone() for key, value in trainer.model.named_parameters()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs), logs
    if name != "distillation":  # TRL's GRPO/RLOO completion metrics
        assert all(entry["completions/mean_length"] == COMPLETION for entry in logs), logs
    assert all(entry["perf/generated_tok_s"] > 0 for entry in logs), logs
    after = dict(trainer.model.named_parameters())
    assert all(value.dtype == torch.float32 for value in after.values())
    assert any(not torch.equal(before[key], value) for key, value in after.items())
    if name == "distillation":  # the frozen teacher's linear weights kept in bf16 (hfnative.models.compute_dtype)
        assert all(p.dtype == torch.bfloat16 for p in linear_weights(trainer.teacher_model))
