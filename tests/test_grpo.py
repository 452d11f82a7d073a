"""GRPO: the policy-loss functions, the trainer and its CLI, against TRL 1.16's GRPOTrainer run beside us.

TRL's own ``_compute_loss`` is called on the same per-token log-probs (through a stand-in object holding
the attributes it reads), so every loss type, the KL, delta, the sequence-level ratio and every clip
statistic are compared with TRL's code, not a copy of it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from collections import defaultdict

import pytest
import torch

from hfnative.losses.policy import (
    clipped_policy_loss,
    group_advantages,
    leave_one_out_advantages,
    nanstd,
    weighted_rewards,
)

# tests/vllm (a folder of tests, importable as a namespace package from here) is not vLLM: keep TRL from taking it for one
_vllm = importlib.util.find_spec("vllm")
if _vllm is not None and _vllm.origin is None:
    sys.modules["vllm"] = None

# --- the loss functions against TRL's _compute_loss ----------------------------------------------------------


def _random_completions(seed: int, B: int = 6, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = logps.detach() + torch.randn(B, T, generator=g) * 0.3
    ref = logps.detach() + torch.randn(B, T, generator=g) * 0.3
    entropy = torch.rand(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[2] = 0  # a completion with no counted token
    advantages = torch.randn(B, generator=g)
    return logps, old, ref, entropy, mask, advantages


def _trl_compute_loss(loss_type, logps, old, ref, entropy, mask, advantages, *, beta, delta, epsilon_high, level,
                      accumulation, steps_per_generation, num_items_in_batch):
    """TRL's GRPOTrainer._compute_loss with the model's log-probs replaced by the given ones; (loss, metrics)."""
    from trl import GRPOTrainer

    metrics = {"train": defaultdict(list)}
    args = types.SimpleNamespace(use_bias_correction_kl=True, delta=delta, sapo_temperature_pos=1.0,
                                 sapo_temperature_neg=1.05, steps_per_generation=steps_per_generation)
    accelerator = types.SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t)
    stand_in = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta, args=args,
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation, max_completion_length=16, accelerator=accelerator,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=metrics,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None),
    )
    B, T = mask.shape
    inputs = dict(
        prompt_ids=torch.zeros(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
        completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask, advantages=advantages,
        old_per_token_logps=old, ref_per_token_logps=ref, num_items_in_batch=num_items_in_batch,
    )
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    return loss, {name: values[0] for name, values in metrics["train"].items()}


def _value(metric) -> float:
    if isinstance(metric, tuple):
        return float(metric[0] / metric[1].clamp(min=1))
    return float(metric)


@pytest.mark.parametrize(
    "loss_type,beta,delta,epsilon_high,level",
    [
        ("grpo", 0.04, None, 0.28, "token"),
        ("bnpo", 0.04, None, None, "token"),
        ("dr_grpo", 0.0, None, 0.28, "token"),
        ("dapo", 0.04, 1.5, 0.28, "token"),
        ("dapo", 0.0, None, None, "token"),
        ("luspo", 0.1, None, None, "sequence"),
        ("grpo", 0.0, None, None, "sequence"),
        ("cispo", 0.04, None, 5.0, "token"),
        ("sapo", 0.04, None, None, "token"),
    ],
)
def test_clipped_policy_loss_equals_trl(loss_type, beta, delta, epsilon_high, level):
    accumulation, steps_per_generation = 2, 4
    logps, old, ref, entropy, mask, advantages = _random_completions(seed=len(loss_type) + int(beta * 100))
    num_items = mask.sum().float() * 3  # the generation batch's tokens
    theirs, their_metrics = _trl_compute_loss(
        loss_type, logps, old, ref, entropy, mask, advantages, beta=beta, delta=delta,
        epsilon_high=0.2 if epsilon_high is None else epsilon_high, level=level, accumulation=accumulation,
        steps_per_generation=steps_per_generation, num_items_in_batch=num_items,
    )
    (their_grad,) = torch.autograd.grad(theirs, logps)
    out = clipped_policy_loss(
        logps, old, advantages, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=epsilon_high, delta=delta,
        beta=beta, ref_logprobs_BT=ref, importance_sampling_level=level, max_completion_length=16,
        num_items=num_items * accumulation / steps_per_generation, entropy_BT=entropy,
    )
    ours = out.loss if loss_type in ("dapo", "cispo") else out.loss / accumulation
    (our_grad,) = torch.autograd.grad(ours, logps)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    torch.testing.assert_close(our_grad, their_grad, atol=1e-7, rtol=1e-6)
    assert set(out.metrics) == set(their_metrics)
    for name, value in their_metrics.items():
        assert _value(out.metrics[name]) == pytest.approx(value, abs=1e-6, nan_ok=True), name


def test_advantages_follow_the_formulas():
    rewards = torch.tensor([1.0, 0.0, 0.5, float("nan"), 2.0, 2.0, 2.0, 2.0, 0.3, float("nan"), float("nan"), float("nan")])
    groups = rewards.view(-1, 4)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, 4, scale).advantages_N
        for p, group in enumerate(groups):
            scored = group[~group.isnan()]
            std = scored.std() if scale == "group" else rewards[~rewards.isnan()].std()
            for i in range(4):
                expected = 0.0 if group[i].isnan() else float(group[i] - scored.mean())
                if scale != "none" and not group[i].isnan():
                    expected /= float(std if len(scored) > 1 or scale == "batch" else float("nan")) + 1e-4
                expected = 0.0 if math.isnan(expected) else expected
                assert float(adv[4 * p + i]) == pytest.approx(expected, abs=1e-6), (scale, p, i)
    loo = leave_one_out_advantages(rewards, 4)
    assert float(loo.advantages_N[0]) == pytest.approx(1.0 - (0.0 + 0.5) / 2)
    assert float(loo.advantages_N[3]) == 0.0 and float(loo.advantages_N[4]) == 0.0
    assert float(loo.advantages_N[8]) == 0.0  # the only scorable completion of its group
    assert loo.is_std_zero_N.tolist()[4:8] == [True] * 4
    assert float(nanstd(torch.tensor([1.0, float("nan"), 3.0]))) == pytest.approx(math.sqrt(2.0))
    both = weighted_rewards(torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")]]), torch.tensor([2.0, 3.0]))
    assert float(both[0]) == 2.0 and math.isnan(float(both[1]))


# --- the trainer against TRL's GRPOTrainer on fixed rollouts ---------------------------------------------------

from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
EOS = 2  # tiny-qwen3's <|im_end|>
G = 4


def fixed_completion(prompt_ids: list[int], index: int, max_length: int) -> list[int]:
    """A completion that depends only on the prompt and its place in the group: some stop with EOS, some are
    cut at max_length."""
    j, seed = index % G, sum(prompt_ids)
    length = 2 + (seed + 5 * j) % (max_length - 1)
    tokens = [10 + (seed * 7 + 13 * j + 31 * k) % 300 for k in range(length)]
    return tokens + [EOS] if (seed + j) % 3 and length < max_length else tokens[:max_length]


def even_fraction(completion_ids, log_metric, **kwargs):
    """Fraction of even token ids; None (no opinion) when the first token is a multiple of 5."""
    rewards = [None if ids[0] % 5 == 0 else sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]
    log_metric("custom/first_token", float(sum(ids[0] for ids in completion_ids)) / len(completion_ids))
    return rewards


async def near_target_length(completions, target, **kwargs):
    """Async, reads the dataset's `target` column: 1 / (1 + |characters - target|)."""
    return [1.0 / (1.0 + abs(len(c) - t)) for c, t in zip(completions, target)]


def _prompts(n: int = 12) -> list[dict]:
    words = ["sky", "fox", "robot", "count", "blue", "grass", "tree", "sun", "moon", "lake", "road", "bird"]
    return [{"prompt": f"Tell me about the {words[i % len(words)]} number {i}", "target": 5 + 3 * i} for i in range(n)]


def _settings(tmp_path, name, **extra):
    return dict(
        output_dir=str(tmp_path / name), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=8, gradient_accumulation_steps=2,
        num_generations=G, max_completion_length=10, learning_rate=1e-2, seed=0, gradient_checkpointing=False,
        reward_weights=[1.0, 0.5], **extra,
    )


def _run_trl(tmp_path, monkeypatch, **extra):
    import trl
    import trl.trainer.grpo_trainer as trl_grpo
    from datasets import Dataset

    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    max_length = extra.get("max_completion_length", 10)

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [fixed_completion(list(p), i, max_length) for i, p in enumerate(prompt_ids)], None

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", generate)
    trainer = trl.GRPOTrainer(model=MODEL, reward_funcs=[even_fraction, near_target_length],
                              args=trl.GRPOConfig(**_settings(tmp_path, "trl", **extra)),
                              train_dataset=Dataset.from_list(_prompts()))
    trainer.train()
    return trainer.state.log_history[:-1]


def _run_ours(tmp_path, **extra):
    import hfnative
    from datasets import Dataset
    from hfnative.generation import Rollouts

    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=[even_fraction, near_target_length],
                                   args=hfnative.GRPOConfig(**_settings(tmp_path, "ours", **extra)),
                                   train_dataset=Dataset.from_list(_prompts()))
    objective = trainer.objective
    max_length = trainer.args.max_completion_length

    def generate(prompts, sampling):
        completions = [fixed_completion(list(p), i, max_length) for i, p in enumerate(prompts)]
        return Rollouts(completions, [[0.0] * len(c) for c in completions], ["stop"] * len(completions))

    objective.engine.generate = generate
    objective.shuffled_order = torch.arange
    objective.old_logprobs_source = "forward"  # TRL recomputes them with a forward; the engine's equal it to ~1e-6
    trainer.train()
    return trainer.state.log_history[:-1]


@pytest.mark.parametrize(
    "extra",
    [
        dict(loss_type="dapo", scale_rewards="group", beta=0.04),
        dict(loss_type="grpo", scale_rewards="batch", epsilon_high=0.28, delta=1.5),
        dict(loss_type="bnpo", scale_rewards="none", mask_truncated_completions=True),
        dict(loss_type="dr_grpo", scale_rewards="group", beta=0.1, num_iterations=2),
    ],
    ids=lambda extra: "-".join(f"{k}={v}" for k, v in extra.items()),
)
def test_trainer_logs_equal_trl_on_fixed_rollouts(tmp_path, monkeypatch, extra):
    theirs = _run_trl(tmp_path, monkeypatch, **extra)
    ours = _run_ours(tmp_path, **extra)
    assert len(ours) == len(theirs) == 2
    for step, (mine, reference) in enumerate(zip(ours, theirs), start=1):
        names = set(reference) - {"step_time"}
        assert names <= set(mine), f"step {step}: missing {sorted(names - set(mine))}"
        for name in sorted(names):
            tolerance = 1e-6
            if name == "grad_norm":
                assert mine[name] == pytest.approx(reference[name], rel=1e-4), (step, name)
            else:
                assert mine[name] == pytest.approx(reference[name], abs=tolerance, rel=tolerance), (step, name)
