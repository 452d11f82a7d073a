"""Checkpoints of the generating and distilling trainers resume to the uninterrupted run's steps: on-policy GKD
(lmbda=1: the student samples every batch), on-policy distillation and RLOO (sampled completions, a reference
model), each trained 4 steps saving at step 2, then resumed from checkpoint-2 in a new trainer. The resumed steps'
loss, grad norm and learning rate equal the uninterrupted run's (1e-6 relative): the same rows and the same samples
were drawn (the data order and the RNG state are restored; the generation calls, which key each row's sampling
stream, and the on-policy coin are in the checkpoint's distillation_state.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

import hfnative

ROOT = Path(__file__).resolve().parents[1]
STUDENT = str(ROOT / "examples" / "tiny-qwen3")
TEACHER = str(ROOT / "examples" / "tiny-qwen3-teacher")
STEPS, SAVED = 4, 2


def _rows(name: str, n: int) -> list[dict]:
    with open(ROOT / "examples" / "data" / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _common(output_dir) -> dict:
    return dict(output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                logging_steps=1, save_strategy="steps", save_steps=SAVED, max_steps=STEPS, learning_rate=3e-3,
                lr_scheduler_type="cosine", warmup_steps=1, seed=5)


def _gkd(output_dir):
    args = hfnative.GKDConfig(**_common(output_dir), per_device_train_batch_size=2, lmbda=1.0, beta=0.5,
                              max_new_tokens=6, max_length=64)
    return hfnative.GKDTrainer(model=STUDENT, teacher_model=TEACHER, args=args,
                               train_dataset=Dataset.from_list(_rows("sft_messages.jsonl", 16)),
                               processing_class=AutoTokenizer.from_pretrained(STUDENT))


def _distillation(output_dir):
    args = hfnative.DistillationConfig(**_common(output_dir), per_device_train_batch_size=2,
                                       gradient_accumulation_steps=2, max_completion_length=6)
    return hfnative.DistillationTrainer(model=STUDENT, teacher_model=TEACHER, args=args,
                                        train_dataset=Dataset.from_list(_rows("sft_prompt_completion.jsonl", 16)),
                                        processing_class=AutoTokenizer.from_pretrained(STUDENT))


def _even_ids(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _rloo(output_dir):
    args = hfnative.RLOOConfig(**_common(output_dir), per_device_train_batch_size=8, num_generations=4,
                               max_completion_length=8, beta=0.05)
    prompts = [{"prompt": f"Tell me about the number {i}"} for i in range(16)]
    return hfnative.RLOOTrainer(model=STUDENT, reward_funcs=_even_ids, args=args, train_dataset=Dataset.from_list(prompts))


def _sft_cloned_template_lora(output_dir):
    """SFT with LoRA, a cloned chat template adding a token: the new rows train (trainable_token_indices); the
    checkpoint's adapter holds them and the resized embedding whole."""
    from peft import LoraConfig
    from test_clone_chat_template import _source

    source = output_dir.parent / "template"
    if not source.exists():
        _source(source, new_token=True)
    args = hfnative.SFTConfig(**_common(output_dir), per_device_train_batch_size=2, max_length=64,
                              chat_template_path=str(source))
    return hfnative.SFTTrainer(model=STUDENT, args=args, train_dataset=Dataset.from_list(_rows("sft_messages.jsonl", 16)),
                               processing_class=AutoTokenizer.from_pretrained(STUDENT),
                               peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def _steps(trainer, first: int = 1) -> dict[int, dict]:
    return {e["step"]: e for e in trainer.state.log_history if "loss" in e and e["step"] >= first}


@pytest.mark.parametrize("make", [_gkd, _distillation, _rloo, _sft_cloned_template_lora],
                         ids=["gkd-on-policy", "distillation", "rloo", "sft-lora-cloned-template"])
def test_checkpoint_resumes_to_the_uninterrupted_steps(tmp_path, make):
    whole = make(tmp_path / "run")
    whole.train()
    expected = _steps(whole)
    assert sorted(expected) == list(range(1, STEPS + 1))
    resumed = make(tmp_path / "run")  # the same output_dir: checkpoint-2 is there
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{SAVED}"))
    got = _steps(resumed, SAVED + 1)
    assert sorted(got) == list(range(SAVED + 1, STEPS + 1))
    # RLOO's on-policy loss is a float32 sum of O(1) terms that cancels to ~1e-8, so it is compared absolutely, to a few
    # float32 ulps of its terms (with one intra-op thread its resumed step 4 measured 1.04e-7 off); its resumed step 4's
    # grad norm measured 1.7e-6 off (a few float32 ulps; the same rewards were drawn): 1e-5 for RLOO, 1e-6 for the others
    rel, loss_abs = (1e-5, 5e-7) if make is _rloo else (1e-6, 1e-7)
    for step, entry in got.items():
        for key in ("loss", "grad_norm", "learning_rate"):
            assert entry[key] == pytest.approx(expected[step][key], rel=rel, abs=loss_abs if key == "loss" else 0), \
                (step, key, entry[key], expected[step][key])
        if "reward" in entry:
            assert entry["reward"] == expected[step]["reward"], step
