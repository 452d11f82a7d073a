"""A frozen model's linear weights kept in the autocast dtype (``hfnative.models.compute_dtype``): the reference
model of DPO and the other preference / RL trainers and the distillation teacher, under ``bf16=True``.

Autocast casts a float32 linear weight to bf16 at every use, so a frozen model whose linear weights already are those
bf16 values computes exactly what it computed before (the oracle: the same model with float32 weights under
autocast), with half those weights' memory; called outside autocast it runs under autocast to that dtype itself.
"""

from __future__ import annotations

import copy
import math
import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from datasets import load_dataset

import hfnative as h
from hf_configs import make_hf_model
from hfnative.converters.loading import load_pretrained
from hfnative.generation import generate
from hfnative.generation.compute_weights import DecodingWeights
from hfnative.models.compute_dtype import keep_linear_weights_in, linear_weights
from hfnative.models.head import TokenCrossEntropy

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny-qwen3")


def _native(name: str):
    with tempfile.TemporaryDirectory() as directory:
        make_hf_model(name).save_pretrained(directory)
        model = load_pretrained(directory).model
    return model.requires_grad_(False).eval()


@pytest.mark.parametrize("name", ["qwen3-gqa", "gemma3-softcap-linear-untied"])
def test_frozen_model_in_the_autocast_dtype_computes_what_autocast_computed(name):
    model = _native(name)
    kept = copy.deepcopy(model)
    linear_numel = sum(p.numel() for p in linear_weights(kept))
    freed = keep_linear_weights_in(kept, torch.bfloat16)
    assert freed == 2 * linear_numel
    assert all(p.dtype == torch.bfloat16 for p in linear_weights(kept))
    others = {n: p for n, p in kept.named_parameters() if all(p is not w for w in linear_weights(kept))}
    assert others and all(p.dtype == torch.float32 for p in others.values()), "norms, embedding and head stay fp32"
    assert kept.output.weight.dtype == torch.float32 if not kept.output.is_tied else True

    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(ids, head_loss=TokenCrossEntropy(targets))
        got = kept(ids, head_loss=TokenCrossEntropy(targets))
        assert torch.equal(got.logits, want.logits)
    assert torch.equal(got.head_output.loss_sum, want.head_output.loss_sum)
    # called outside autocast, the model runs its forward (the loss through the head included) under autocast to its
    # weights' dtype itself
    outside = kept(ids, head_loss=TokenCrossEntropy(targets))
    assert torch.equal(outside.hidden_states, want.hidden_states)
    assert torch.equal(outside.head_output.loss_sum, want.head_output.loss_sum)
    assert torch.equal(outside.logits, want.logits)  # made on access, under the same autocast
    # and generates what the float32 model generates under autocast
    prompts = [[1, 2, 3], [4, 5]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_rollouts = generate(model, prompts, max_new_tokens=4, do_sample=False)
    rollouts = generate(kept, prompts, max_new_tokens=4, do_sample=False)
    assert rollouts.completion_ids == want_rollouts.completion_ids


def test_a_frozen_scorer_in_the_autocast_dtype_scores_what_autocast_scored():
    """A sequence classifier (PPO's reward model) kept so: the same scores under autocast, and called outside it."""
    with tempfile.TemporaryDirectory() as directory:
        make_hf_model("qwen3-gqa").save_pretrained(directory)  # a causal LM's body, scored by a fresh 1-label head
        from hfnative.models.classifier import SequenceClassifier

        base = load_pretrained(directory).model
        scorer = SequenceClassifier(dataclasses.replace(base.args, num_labels=1, pad_token_id=0))
    scorer.load_state_dict({k: v for k, v in base.state_dict().items() if not k.startswith("output.")}, strict=False)
    torch.nn.init.normal_(scorer.output.weight, std=0.3)
    scorer.requires_grad_(False).eval()
    kept = copy.deepcopy(scorer)
    keep_linear_weights_in(kept, torch.bfloat16)
    assert kept.output.weight.dtype == torch.float32
    ids = torch.randint(1, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = scorer(ids).logits
        assert torch.equal(kept(ids).logits, want)
    assert torch.equal(kept(ids).logits, want)


def test_decoding_shares_the_weights_already_in_the_autocast_dtype():
    kept = _native("qwen3-gqa")
    keep_linear_weights_in(kept, torch.bfloat16)
    replica = DecodingWeights().model_for(kept, torch.bfloat16)
    assert replica is not kept  # the tied head still gets a bf16 copy of its own
    shared = {p.data_ptr() for p in linear_weights(kept)}
    assert {p.data_ptr() for p in linear_weights(replica)} == shared, "no second copy of the kept linear weights"
    assert replica.output.weight.dtype == torch.bfloat16


def test_a_trainable_model_is_refused():
    model = _native("qwen3-gqa").requires_grad_(True)
    with pytest.raises(ValueError, match="require gradients"):
        keep_linear_weights_in(model, torch.bfloat16)


def _dpo(tmp_path: Path, **extra):
    data = load_dataset("json", data_files=str(ROOT / "examples" / "data" / "preference.jsonl"), split="train")
    config = h.DPOConfig(output_dir=str(tmp_path), max_steps=1, logging_steps=1, learning_rate=1e-3, report_to="none",
                         disable_tqdm=True, save_strategy="no", seed=0, use_cpu=True, bf16=True,
                         per_device_train_batch_size=4, max_length=48, **extra)
    return h.DPOTrainer(model=TINY, args=config, train_dataset=data.select(range(8)))


def test_dpo_reference_kept_in_bf16_gives_the_policys_log_probs_at_the_first_step(tmp_path):
    trainer = _dpo(tmp_path / "dpo")
    trainer.train()
    ref = trainer.ref_model
    assert all(p.dtype == torch.bfloat16 for p in linear_weights(ref))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters()), "the policy keeps fp32 master weights"
    first = next(entry for entry in trainer.state.log_history if "loss" in entry)
    # before its first update the policy is the reference: the rewards beta * (log pi - log ref) are exactly zero
    # when the bf16-weight reference computes what the policy computes under autocast
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0, first


def test_a_users_own_native_reference_is_left_as_given(tmp_path):
    given = h.load_pretrained(TINY).model
    before = {name: p.detach().clone() for name, p in given.named_parameters()}
    data = load_dataset("json", data_files=str(ROOT / "examples" / "data" / "preference.jsonl"), split="train")
    config = h.DPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", disable_tqdm=True,
                         save_strategy="no", use_cpu=True, bf16=True, per_device_train_batch_size=4, max_length=48)
    trainer = h.DPOTrainer(model=TINY, ref_model=given, args=config, train_dataset=data.select(range(8)))
    trainer.train()
    assert trainer.ref_model is given
    for name, p in given.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name


def test_a_synchronized_reference_keeps_float32_weights(tmp_path):
    trainer = _dpo(tmp_path / "tr-dpo", sync_ref_model=True, ref_model_sync_steps=1)
    trainer.train()
    assert all(p.dtype == torch.float32 for p in trainer.ref_model.parameters())



def test_ppo_reward_model_kept_in_bf16(tmp_path):
    """PPO's reward model scores rollouts under the trainer's autocast: kept in bf16 under bf16=True (the trained value
    model and the policy keep fp32 weights)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    config = Qwen3Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=0)
    folders = {}
    for seed, name in enumerate(("reward", "value")):
        torch.manual_seed(seed)
        Qwen3ForSequenceClassification(config).save_pretrained(tmp_path / name)
        folders[name] = str(tmp_path / name)
    tokenizer = AutoTokenizer.from_pretrained(TINY, padding_side="left")
    rows = [{"input_ids": tokenizer(f"Tell me about the number {i}")["input_ids"]} for i in range(8)]
    from datasets import Dataset

    args = h.PPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=True, num_ppo_epochs=1, response_length=4,
                       stop_token="eos", total_episodes=8, per_device_train_batch_size=4, report_to=[],
                       save_strategy="no", seed=0, num_sample_generations=0, logging_steps=1)
    trainer = h.PPOTrainer(args, tokenizer, TINY, None, folders["reward"], Dataset.from_list(rows), folders["value"])
    trainer.train()
    assert all(p.dtype == torch.bfloat16 for p in linear_weights(trainer.reward_model))
    assert all(p.dtype == torch.float32 for p in trainer.value_model.parameters())
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(math.isfinite(entry["loss/policy_avg"]) for entry in trainer.state.log_history
               if "loss/policy_avg" in entry)
