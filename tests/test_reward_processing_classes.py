"""GRPO's reward_processing_classes and unscored rows as TRL 1.16 treats them: one tokenizer is taken only with one
reward function (else TRL's error, raised by both trainers), a reward model's tokenizer without a pad token pads with
its EOS and the model scores at that token (its rewards equal transformers' classifier given the same pad id), and a
row every reward function returned None for is named in TRL's warning."""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import hfnative
from hfnative.trainers.rollout.rewards import RewardFunctions
from test_grpo import MODEL, save_reward_model


def _length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _never(completions, **kwargs):
    return [None] * len(completions)


def _args(tmp_path, name):
    return dict(output_dir=str(tmp_path / name), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                per_device_train_batch_size=4, num_generations=2, max_completion_length=4, save_strategy="no")


def test_one_tokenizer_for_several_functions_is_trl_s_error(tmp_path):
    import trl

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    message = r"The number of reward processing classes \(1\) must match the number of reward functions \(2\)\."
    rows = Dataset.from_list([{"prompt": "Say hi"}] * 4)
    with pytest.raises(ValueError, match=message):
        trl.GRPOTrainer(model=MODEL, reward_funcs=[_length, _never], reward_processing_classes=tokenizer,
                        args=trl.GRPOConfig(**_args(tmp_path, "trl")), train_dataset=rows)
    with pytest.raises(ValueError, match=message):
        hfnative.GRPOTrainer(model=MODEL, reward_funcs=[_length, _never], reward_processing_classes=tokenizer,
                             args=hfnative.GRPOConfig(**_args(tmp_path, "ours")), train_dataset=rows)
    # one tokenizer with one function is that function's
    assert RewardFunctions([_length], reward_processing_classes=tokenizer).tokenizers == [tokenizer]


def test_a_reward_tokenizer_without_pad_pads_with_eos_and_scores_there(tmp_path):
    folder = save_reward_model(tmp_path / "reward")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = None
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    rewards = RewardFunctions([model], reward_processing_classes=[tokenizer])
    assert tokenizer.pad_token == tokenizer.eos_token and model.config.pad_token_id == tokenizer.eos_token_id
    prompts, completions = ["Rate this: ", "Rate that one please: "], ["good", "a much longer answer"]
    got = rewards.score(prompts, completions, [[1], [1]], [{"prompt": p} for p in prompts])[:, 0]
    reference = AutoModelForSequenceClassification.from_pretrained(folder)
    reference.config.pad_token_id = tokenizer.eos_token_id
    with torch.no_grad():
        for index, (prompt, completion) in enumerate(zip(prompts, completions)):
            alone = tokenizer(prompt + completion, return_tensors="pt", add_special_tokens=False)
            assert float(got[index]) == pytest.approx(float(reference(**alone).logits[0, 0]), abs=1e-5)


def test_a_row_no_function_scored_gets_trl_s_warning(caplog):
    rewards = RewardFunctions([_never])
    with caplog.at_level(logging.WARNING, logger="hfnative.trainers.rollout.rewards"):
        scored = rewards.score(["p0", "p1"], ["c0", "c1"], [[1], [2]], [{"prompt": "p0", "topic": "a"},
                                                                          {"prompt": "p1", "topic": "b"}])
    assert torch.isnan(scored).all()
    warning = [r.getMessage() for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    assert len(warning) == 1 and "'topic': 'a'" in warning[0] and "'prompt': 'p0'" in warning[0]
    assert "Please ensure that at least one reward function returns a valid reward." in warning[0]
