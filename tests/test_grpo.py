"""GRPO: the policy-loss functions, the trainer and its CLI, against TRL 1.16's GRPOTrainer run beside us.

TRL's own ``_compute_loss`` is called on the same per-token log-probs (through a stand-in object holding
the attributes it reads), so every loss type, the KL, delta, the sequence-level ratio and every clip
statistic are compared with TRL's code, not a copy of it.
"""

from __future__ import annotations

import json
import math
import sys
import types
from collections import defaultdict

import pytest
import torch

from hfnative.losses.policy import (
    clipped_policy_loss,
    entropy_bonus,
    off_policy_sequence_mask,
    group_advantages,
    leave_one_out_advantages,
    nanstd,
    weighted_rewards,
)

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


VESPO = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)


def _trl_compute_loss(loss_type, logps, old, ref, entropy, mask, advantages, *, beta, delta, epsilon_high, level,
                      accumulation, steps_per_generation, num_items_in_batch, off_policy_mask_threshold=None,
                      entropy_coef=0.0):
    """TRL's GRPOTrainer._compute_loss with the model's log-probs replaced by the given ones; (loss, metrics)."""
    from trl import GRPOTrainer

    metrics = {"train": defaultdict(list)}
    args = types.SimpleNamespace(use_bias_correction_kl=True, delta=delta, sapo_temperature_pos=1.0,
                                 sapo_temperature_neg=1.05, steps_per_generation=steps_per_generation, **VESPO)
    accelerator = types.SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t,
                                        sync_gradients=False)
    stand_in = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=off_policy_mask_threshold, importance_sampling_level=level,
        beta=beta, args=args, loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation, max_completion_length=16, accelerator=accelerator,
        _entropy_bonus_enabled=entropy_coef != 0.0, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        aux_loss_enabled=False, _metrics=metrics,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights,
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
        ("vespo", 0.04, None, None, "token"),
        ("vespo", 0.0, None, None, "token"),
    ],
)
@pytest.mark.parametrize("extra", [{}, {"off_policy_mask_threshold": 0.02}, {"entropy_coef": 0.05}],
                         ids=["plain", "off-policy mask", "entropy bonus"])
def test_clipped_policy_loss_equals_trl(loss_type, beta, delta, epsilon_high, level, extra):
    accumulation, steps_per_generation = 2, 4
    logps, old, ref, entropy, mask, advantages = _random_completions(seed=len(loss_type) + int(beta * 100))
    num_items = mask.sum().float() * 3  # the generation batch's tokens
    theirs, their_metrics = _trl_compute_loss(
        loss_type, logps, old, ref, entropy, mask, advantages, beta=beta, delta=delta,
        epsilon_high=0.2 if epsilon_high is None else epsilon_high, level=level, accumulation=accumulation,
        steps_per_generation=steps_per_generation, num_items_in_batch=num_items, **extra,
    )
    (their_grad,) = torch.autograd.grad(theirs, logps)
    vespo = {name.removeprefix("vespo_"): value for name, value in VESPO.items()}
    out = clipped_policy_loss(
        logps, old, advantages, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=epsilon_high, delta=delta,
        beta=beta, ref_logprobs_BT=ref, importance_sampling_level=level, max_completion_length=16,
        num_items=num_items * accumulation / steps_per_generation, entropy_BT=entropy,
        off_policy_mask_threshold=extra.get("off_policy_mask_threshold"), vespo=vespo if loss_type == "vespo" else None,
    )
    if "off_policy_mask_threshold" in extra:  # the mask drops something here, so the comparison means something
        dropped = off_policy_sequence_mask(advantages[:, None], logps, old, mask.float(), 0.02)
        assert 0 < dropped.sum() < len(dropped)
    ours = out.loss if loss_type in ("dapo", "cispo", "vespo") else out.loss / accumulation
    if "entropy_coef" in extra:  # the objective's bonus: a micro-batch mean, divided by the accumulation as TRL
        out.metrics["policy_loss"] = out.loss.detach()
        ours = ours + entropy_bonus(entropy, mask, extra["entropy_coef"]) / accumulation
    (our_grad,) = torch.autograd.grad(ours, logps)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    torch.testing.assert_close(our_grad, their_grad, atol=1e-7, rtol=1e-6)
    assert set(out.metrics) == set(their_metrics)
    for name, value in their_metrics.items():
        assert _value(out.metrics[name]) == pytest.approx(value, abs=1e-6, nan_ok=True), name


def test_trl_static_helpers_have_trl_signatures_and_numbers():
    """GRPOTrainer.get_off_policy_mask, get_gamma_weights and get_high_entropy_mask, called as a TRL user's code
    calls them, equal TRL's on the same tensors."""
    import hfnative
    import trl

    logps, old, ref, entropy, mask, advantages = _random_completions(seed=5)
    mask = mask.float()
    ours = hfnative.GRPOTrainer.get_off_policy_mask(advantages[:, None], logps, old, mask, 0.02)
    theirs = trl.GRPOTrainer.get_off_policy_mask(advantages[:, None], logps, old, mask, 0.02)
    assert torch.equal(ours, theirs) and 0 < ours.sum() < len(ours)
    log_ratio, weights = logps.detach() - old, torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    for ratio in (None, weights):
        torch.testing.assert_close(
            hfnative.GRPOTrainer.get_gamma_weights(advantages[:, None], log_ratio, mask, ratio, 2.5, 3.0, 3.5, 2.0),
            trl.GRPOTrainer.get_gamma_weights(advantages[:, None], log_ratio, mask, ratio, 2.5, 3.0, 3.5, 2.0))
    for threshold in (0.2, 0.5, 0.9):  # on the stand-in TRL's own tests build: only an accelerator
        assert torch.equal(hfnative.GRPOTrainer.get_high_entropy_mask(_trl_stand_in(hfnative.GRPOTrainer), entropy, mask, threshold),
                           trl.GRPOTrainer.get_high_entropy_mask(_trl_stand_in(trl.GRPOTrainer), entropy, mask, threshold))


def test_the_high_entropy_mask_never_waits_for_the_device():
    """top_entropy_quantile's mask, as the loss takes it every micro-batch: no op whose result the host must read
    (a boolean index's size, an item), TRL's mask on the same tensors, and nothing kept where no token is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import trl
    from hfnative.losses.policy import high_entropy_mask

    aten = torch.ops.aten

    class HostReads(TorchDispatchMode):
        found: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            boolean_index = func in (aten.index.Tensor, aten.index_put.default) and any(
                i is not None and i.dtype == torch.bool for i in args[1])
            if boolean_index or func in (aten._local_scalar_dense.default, aten.nonzero.default,
                                         aten.masked_select.default):
                self.found.append(str(func))
            return func(*args, **(kwargs or {}))

    _, _, _, entropy, mask, _ = _random_completions(seed=6)
    with HostReads() as reads:
        kept = high_entropy_mask(entropy, mask, 0.7)
    assert reads.found == []
    their = trl.GRPOTrainer.get_high_entropy_mask(_trl_stand_in(trl.GRPOTrainer), entropy, mask.float(), 0.7)
    assert torch.equal(kept, their) and 0 < kept.sum() < mask.sum()
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), 0.7).any()
    assert high_entropy_mask(entropy[:0], mask[:0], 0.7).shape == (0, mask.shape[1])  # no row on any rank

    from hfnative.losses.policy import _quantile_of_numbers

    generator = torch.Generator().manual_seed(7)
    for n, missing in ((1, 0.0), (2, 0.5), (11, 0.3), (500, 0.9)):
        values = torch.randn(n, generator=generator)
        values[torch.rand(n, generator=generator) < missing] = float("nan")
        for quantile in (0.0, 0.37, 0.5, 1.0):  # torch's nanquantile, to the bit (it refuses 2**24 values or more)
            torch.testing.assert_close(_quantile_of_numbers(values, quantile), torch.nanquantile(values, quantile),
                                       rtol=0, atol=0, equal_nan=True)


def _trl_stand_in(trainer_class):
    """TRL's tests' trainer for get_high_entropy_mask: Mock(spec=GRPOTrainer) with only an accelerator's gather and
    pad_across_processes."""
    from unittest.mock import Mock

    trainer = Mock(spec=trainer_class)
    trainer.accelerator = Mock()
    trainer.accelerator.num_processes = 1
    trainer.accelerator.gather = lambda x: x
    trainer.accelerator.pad_across_processes = lambda x, dim, pad_index: x
    return trainer


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
    settings = dict(
        output_dir=str(tmp_path / name), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=8, gradient_accumulation_steps=2,
        num_generations=G, max_completion_length=10, learning_rate=1e-2, seed=0, gradient_checkpointing=False,
        reward_weights=[1.0, 0.5],
    )
    return {**settings, **extra}


def save_reward_model(folder) -> str:
    """A random sequence-classification Qwen3 (one label) with tiny-qwen3's tokenizer, saved to ``folder``."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    config = Qwen3Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=0)
    torch.manual_seed(1)
    Qwen3ForSequenceClassification(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(MODEL) / name, Path(folder) / name)
    return str(folder)


def _reward_funcs(tmp_path, extra: dict) -> list:
    funcs = [even_fraction, near_target_length]
    if extra.get("reward_weights") and len(extra["reward_weights"]) == 3:
        folder = tmp_path / "reward-model"
        funcs.append(str(folder) if folder.exists() else save_reward_model(folder))
    return funcs


def _train_prompts(stream: bool, n: int = 12):
    from datasets import Dataset

    rows = Dataset.from_list(_prompts(n))
    return rows.to_iterable_dataset() if stream else rows


def _run_trl(tmp_path, monkeypatch, evaluate=False, model=MODEL, stream=False, eval_stream=False, **extra):
    import trl
    import trl.trainer.grpo_trainer as trl_grpo
    from datasets import Dataset

    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    max_length = extra.get("max_completion_length", 10)

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [fixed_completion(list(p), i, max_length) for i, p in enumerate(prompt_ids)], None

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", generate)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=_reward_funcs(tmp_path, extra),
                              args=trl.GRPOConfig(**_settings(tmp_path, "trl", **extra)),
                              train_dataset=_train_prompts(stream),
                              eval_dataset=_train_prompts(eval_stream, 2) if evaluate else None)
    trainer.train()
    if evaluate:
        return trainer.evaluate()
    return trainer.state.log_history[:-1]


def _run_ours(tmp_path, evaluate=False, model=MODEL, stream=False, eval_stream=False, **extra):
    import hfnative
    from datasets import Dataset
    from hfnative.generation import Rollouts

    trainer = hfnative.GRPOTrainer(model=model, reward_funcs=_reward_funcs(tmp_path, extra),
                                   args=hfnative.GRPOConfig(**_settings(tmp_path, "ours", **extra)),
                                   train_dataset=_train_prompts(stream),
                                   eval_dataset=_train_prompts(eval_stream, 2) if evaluate else None)
    objective = trainer.objective
    max_length = trainer.args.max_completion_length

    def generate(prompts, sampling):
        completions = [fixed_completion(list(p), i, max_length) for i, p in enumerate(prompts)]
        return Rollouts(completions, [[0.0] * len(c) for c in completions], ["stop"] * len(completions))

    objective.engine.generate = generate
    objective.shuffled_order = torch.arange
    objective.old_logprobs_source = "forward"  # TRL recomputes them with a forward; the engine's equal it to ~1e-6
    trainer.train()
    if evaluate:
        return trainer.evaluate()
    return trainer.state.log_history[:-1]


def assert_two_steps_equal(ours: list[dict], theirs: list[dict]) -> None:
    """Every key TRL logged over two optimizer steps, ours equal to it. Step 1 runs on the same weights: 1e-6.
    Step 2 runs after an AdamW step whose update magnifies the round-off between the two gradient computations
    where gradients are near zero (it depends on the thread count): 1e-4 relative, as per-step training
    comparisons elsewhere; grad_norm 1e-4 relative at both."""
    assert len(ours) == len(theirs) == 2
    for step, (mine, reference) in enumerate(zip(ours, theirs), start=1):
        names = set(reference) - {"step_time"}
        assert names <= set(mine), f"step {step}: missing {sorted(names - set(mine))}"
        tolerance = 1e-6 if step == 1 else 1e-4
        for name in sorted(names):
            if reference[name] is None:  # TRL's log of a metric with no value this step (a reward that scored nothing)
                assert mine[name] is None, (step, name)
            elif name == "grad_norm":
                assert mine[name] == pytest.approx(reference[name], rel=1e-4), (step, name)
            else:
                assert mine[name] == pytest.approx(reference[name], abs=1e-6, rel=tolerance), (step, name)


@pytest.mark.parametrize(
    "extra",
    [
        dict(loss_type="dapo", scale_rewards="group", beta=0.04, reward_weights=[1.0, 0.5, 2.0]),
        dict(loss_type="grpo", scale_rewards="batch", epsilon_high=0.28, delta=1.5),
        dict(loss_type="bnpo", scale_rewards="none", mask_truncated_completions=True),
        dict(loss_type="dr_grpo", scale_rewards="group", beta=0.1, num_iterations=2),
        dict(loss_type="dapo", steps_per_generation=4, top_entropy_quantile=0.5),  # one generation, two steps
    ],
    ids=lambda extra: "-".join(f"{k}={v}" for k, v in extra.items()),
)
def test_trainer_logs_equal_trl_on_fixed_rollouts(tmp_path, monkeypatch, extra):
    theirs = _run_trl(tmp_path, monkeypatch, **extra)
    ours = _run_ours(tmp_path, **extra)
    assert_two_steps_equal(ours, theirs)


def test_a_reward_model_loads_quantized_with_the_policys_8bit_request(tmp_path):
    """TRL loads reward models with the policy's model_init_kwargs: with load_in_8bit the native reward model's
    linears are int8 rows, and its scores are transformers' classifier's over bitsandbytes' 8-bit weights (to its
    int8 activations)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig

    from hfnative.peft import Int8Weight
    from hfnative.trainers.rollout.rewards import load_reward_model

    folder = save_reward_model(tmp_path / "reward-model")
    ours = load_reward_model(folder, {"load_in_8bit": True})
    assert sum(isinstance(p, Int8Weight) for p in ours.parameters()) == 7  # one layer's projections
    theirs = AutoModelForSequenceClassification.from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(load_in_8bit=True), dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(folder)(["Tell me about the sky", "A fox"], return_tensors="pt", padding=True)
    with torch.no_grad():
        mine, reference = ours(**ids).logits, theirs(**ids).logits
    torch.testing.assert_close(mine, reference, rtol=2e-2, atol=2e-3)


def test_a_reward_models_base_is_quantized_on_the_trainers_device(tmp_path, monkeypatch):
    """The reward model loads on the host; its linears are quantized on the trainer's device, each weight moved there
    first (on a GPU the host never quantizes a whole model)."""
    from hfnative.peft import quantize
    from hfnative.trainers.rollout.rewards import RewardFunctions

    seen, real = [], quantize.quantize_base
    monkeypatch.setattr(quantize, "quantize_base",
                        lambda model, settings, names, device=None: seen.append(device) or real(model, settings, names,
                                                                                                device))
    RewardFunctions([str(save_reward_model(tmp_path / "reward-model"))], device="cpu",
                    model_init_kwargs={"load_in_8bit": True})
    assert seen == [torch.device("cpu")]


def test_log_completions_writes_trls_tables(tmp_path, monkeypatch):
    """log_completions=True: at each log (the run's last one included, where the last step logs nothing of its own)
    the completions table (step, prompt, completion, each reward, advantage) is written to
    output_dir/completions/completions_{step:05d}.parquet, file for file and value for value TRL's on the same
    rollouts; the table reaches the callbacks' loggers after the log's metrics, as TRL's."""
    import pandas as pd
    from transformers import TrainerCallback

    import hfnative.trainers.algorithms.grpo as grpo

    order = []

    class Metrics(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            order.append("metrics")

    publish = grpo.publish_completions
    monkeypatch.setattr(grpo, "publish_completions", lambda *a, **k: order.append("table") or publish(*a, **k))
    extra = dict(log_completions=True, max_steps=3, logging_steps=2)
    _run_trl(tmp_path, monkeypatch, **extra)
    monkeypatch.setattr(grpo.GRPOTrainer, "__init__", _with_callback(grpo.GRPOTrainer.__init__, Metrics()))
    _run_ours(tmp_path, **extra)
    assert order == ["metrics", "table"] * 2  # step 2's log, then the last (train_runtime) one at step 3
    files = {name: sorted(p.name for p in (tmp_path / name / "completions").iterdir()) for name in ("trl", "ours")}
    assert files["ours"] == files["trl"] == ["completions_00002.parquet", "completions_00003.parquet"]
    for name in files["trl"]:
        mine, theirs = (pd.read_parquet(tmp_path / run / "completions" / name) for run in ("ours", "trl"))
        assert list(mine.columns) == list(theirs.columns) == ["step", "prompt", "completion", "even_fraction",
                                                               "near_target_length", "advantage"]
        assert len(mine) == len(theirs) == 16  # the generation batch
        pd.testing.assert_frame_equal(mine, theirs, check_exact=False, rtol=1e-5, atol=1e-6)


def _with_callback(init, callback):
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(callback)
    return wrapped


def test_completions_table_reaches_wandb_and_trackio(tmp_path, monkeypatch):
    """With report_to naming W&B (a run started) or trackio, the table is logged to each as ``completions``, one row
    per prompt under log_unique_prompts, as TRL logs it."""
    import sys
    import types

    from hfnative.trainers.rollout.completion_log import publish_completions

    received = {}

    def backend(name, run=True):
        module = types.ModuleType(name)
        module.run = object() if run else None
        module.Table = lambda dataframe: dataframe
        module.log = lambda data: received.setdefault(name, []).append(data["completions"])
        return module

    monkeypatch.setitem(sys.modules, "wandb", backend("wandb"))
    monkeypatch.setitem(sys.modules, "trackio", backend("trackio"))
    logged = {"prompt": ["a", "a", "b"], "completion": ["x", "y", "z"], "rewards": {"f": [1.0, 0.0, 0.5]},
              "extra": {"note": ["n"]}, "advantages": [0.5, -0.5, 0.0]}
    args = types.SimpleNamespace(report_to=["wandb", "trackio"], output_dir=str(tmp_path), num_completions_to_print=1,
                                 log_unique_prompts=True)
    publish_completions(logged, 3, args)
    for name in ("wandb", "trackio"):
        (table,) = received[name]
        assert table.drop(columns="note").to_dict("list") == {"step": [3, 3], "prompt": ["a", "b"], "completion": ["x", "z"],
                                                              "f": [1.0, 0.5], "advantage": [0.5, 0.0]}
        assert table["note"].isna().tolist() == [True, False] and table["note"].iloc[1] == "n"  # logged from row 3 on
    assert len(__import__("pandas").read_parquet(tmp_path / "completions" / "completions_00003.parquet")) == 3
    logged["extra"]["mixed"] = [2, "two", None]  # parquet holds one type a column: this one is written as text
    publish_completions(logged, 5, types.SimpleNamespace(report_to=[], output_dir=str(tmp_path), num_completions_to_print=0))
    written = __import__("pandas").read_parquet(tmp_path / "completions" / "completions_00005.parquet")
    assert written["mixed"].tolist()[:2] == ["2", "two"] and written["mixed"].isna().tolist() == [False, False, True]
    assert written["f"].tolist() == [1.0, 0.0, 0.5]
    monkeypatch.setitem(sys.modules, "wandb", backend("wandb", run=False))  # report_to wandb, no run: nothing logged
    received.clear()
    args.report_to = ["wandb"]
    publish_completions(logged, 4, args, write_file=False)
    assert not received and not (tmp_path / "completions" / "completions_00004.parquet").exists()


@pytest.mark.parametrize("extra", [dict(loss_type="dapo", steps_per_generation=4), dict(loss_type="grpo", shuffle_dataset=False)],
                         ids=["shuffled-one-generation-two-steps", "in-order"])
def test_streaming_dataset_equals_trl_on_fixed_rollouts(tmp_path, monkeypatch, extra):
    """An IterableDataset of prompts (max_steps set): TRL's buffered shuffle with the run's seed, its generation
    batches in stream order, each read for its steps; every logged metric equal."""
    theirs = _run_trl(tmp_path, monkeypatch, stream=True, **extra)
    ours = _run_ours(tmp_path, stream=True, **extra)
    assert_two_steps_equal(ours, theirs)


def save_moe_model(folder) -> str:
    """A random Qwen3-MoE (4 experts, top 2) with tiny-qwen3's tokenizer and a large router_aux_loss_coef (0.5),
    so the load-balancing term moves the loss and the gradients visibly."""
    import shutil

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.5,
                            max_position_embeddings=256, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(MODEL) / name, Path(folder) / name)
    return str(folder)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return save_moe_model(tmp_path_factory.mktemp("qwen3-moe"))


@pytest.mark.parametrize("extra", [dict(loss_type="dapo", beta=0.04), dict(loss_type="grpo", router_aux_loss_coef=0.0)],
                         ids=["dapo-beta-config-coef", "coef-off"])
def test_moe_router_loss_equals_trl_on_fixed_rollouts(tmp_path, monkeypatch, moe_model, extra):
    """A MoE policy: the router's load-balancing loss joins the loss as TRL adds it (the config's coefficient over
    the step's micro-batches, the reference's and old log-probs' forwards without it) and aux_loss is logged; a
    coefficient of 0 turns it off in both."""
    theirs = _run_trl(tmp_path, monkeypatch, model=moe_model, **extra)
    ours = _run_ours(tmp_path, model=moe_model, **extra)
    assert_two_steps_equal(ours, theirs)
    if extra.get("router_aux_loss_coef") == 0.0:
        assert not any("aux_loss" in entry for entry in ours + theirs)
    else:
        assert all(entry["aux_loss"] > 0 for entry in theirs)


def _rollout_func(prompts, trainer):
    """A user's rollout (TRL's contract): the prompts tokenized by the trainer's tokenizer, fixed completions, the
    last two tokens of every completion longer than three written by an "environment" (env_mask 0), and an extra
    field for the reward functions."""
    prompt_ids = [list(ids) for ids in trainer.processing_class(text=prompts)["input_ids"]]
    completion_ids = [fixed_completion(ids, i, 10) for i, ids in enumerate(prompt_ids)]
    env_mask = [[1] * (len(c) - 2) + [0, 0] if len(c) > 3 else [1] * len(c) for c in completion_ids]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[-1.0] * len(c) for c in completion_ids], "env_mask": env_mask,
            "turns": [1 + i % 3 for i in range(len(prompts))]}


def fewer_turns(completions, turns, **kwargs):
    """Reads the rollout's extra field."""
    return [1.0 / t for t in turns]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_rollout_func_equals_trl(tmp_path, monkeypatch, loss_type):
    """GRPOTrainer(rollout_func=...): the user's function makes the completions (it gets each prompt num_generations
    times and the trainer); its extra fields reach the reward functions, its env_mask keeps the environment's tokens
    out of the loss and the length metrics. Every metric TRL logs over two steps equal, beside TRL's trainer with the
    same function. Its errors are TRL's."""
    import hfnative
    import trl
    import trl.trainer.grpo_trainer as trl_grpo
    from datasets import Dataset

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    funcs = [even_fraction, fewer_turns]
    extra = dict(loss_type=loss_type, beta=0.04)
    theirs = trl.GRPOTrainer(model=MODEL, reward_funcs=funcs, args=trl.GRPOConfig(**_settings(tmp_path, "trl", **extra)),
                             train_dataset=Dataset.from_list(_prompts()), rollout_func=_rollout_func)
    theirs.train()
    ours = hfnative.GRPOTrainer(model=MODEL, reward_funcs=funcs, args=hfnative.GRPOConfig(**_settings(tmp_path, "ours", **extra)),
                                train_dataset=Dataset.from_list(_prompts()), rollout_func=_rollout_func)
    assert ours.rollout_func is _rollout_func
    ours.objective.shuffled_order = torch.arange
    ours.train()
    assert_two_steps_equal(ours.state.log_history[:-1], theirs.state.log_history[:-1])

    def missing_logprobs(prompts, trainer):
        return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[2]] * len(prompts)}

    bad = hfnative.GRPOTrainer(model=MODEL, reward_funcs=funcs, args=hfnative.GRPOConfig(**_settings(tmp_path, "bad")),
                               train_dataset=Dataset.from_list(_prompts()), rollout_func=missing_logprobs)
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\] in its output dict"):
        bad.train()


@pytest.mark.parametrize("extra", [dict(loss_type="dapo", beta=0.04), dict(loss_type="grpo", num_generations_eval=2),
                                   dict(loss_type="dapo", eval_stream=True)],
                         ids=["dapo-beta", "grpo-G_eval=2", "eval-stream"])
def test_evaluation_equals_trl_on_fixed_rollouts(tmp_path, monkeypatch, extra):
    """evaluate() after two steps: the eval prompts completed (num_generations_eval each) and scored; every eval_*
    metric TRL logs (loss, rewards, completion lengths, kl, entropy, clip ratios) equal on the same completions."""
    extra = dict(extra, per_device_eval_batch_size=8 if "num_generations_eval" not in extra else 4)
    theirs = _run_trl(tmp_path, monkeypatch, evaluate=True, **extra)
    ours = _run_ours(tmp_path, evaluate=True, **extra)
    names = set(theirs) - {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"}
    assert "eval_loss" in names and "eval_reward" in names
    assert names <= set(ours), sorted(names - set(ours))
    for name in sorted(names):
        assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name


# --- learning from the reward alone, beside TRL --------------------------------------------------------------


def letter_e(completions, **kwargs):
    """The toy task: the fraction of the letter "e" in the completion's text."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [t.count("e") / max(len(t), 1) for t in texts]


LEARN_STEPS = 25
LEARN_SETTINGS = dict(use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, logging_steps=1, save_strategy="no",
                      per_device_train_batch_size=16, num_generations=8, max_completion_length=16,
                      lr_scheduler_type="constant", seed=0)


def _learn(module, tmp_path):
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": f"Write note {i} about the sea."}]} for i in range(64)]
    args = module.GRPOConfig(
        output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        max_steps=LEARN_STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=16, num_generations=8,
        max_completion_length=16, learning_rate=1e-2, lr_scheduler_type="constant", seed=0,
    )
    trainer = module.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    return trainer, [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]


def test_tiny_model_learns_from_the_reward_like_trl(tmp_path):
    """Conversational prompts through the chat template, sampled by the native engine (activation checkpointing
    on, GRPOConfig's default). The reward rises clearly, which a wrong gradient sign or advantage would undo,
    and ends at least at 80% of TRL's GRPOTrainer's on the same task, seed and settings."""
    import trl

    trainer, ours = _learn(__import__("hfnative"), tmp_path)
    _, theirs = _learn(trl, tmp_path)
    assert len(ours) == len(theirs) == LEARN_STEPS
    start, end = sum(ours[:5]) / 5, sum(ours[-5:]) / 5
    assert end > 2.5 * start and end - start > 0.2, ours
    assert end >= 0.8 * sum(theirs[-5:]) / 5, (ours, theirs)

    # the engine's sampling log-probs (the default old log-probs) are a forward pass's
    objective = trainer.objective
    micro_batches = objective.generate_and_score([{"prompt": [{"role": "user", "content": "Write about the sea."}]}] * 2)
    for micro_batch in micro_batches:
        forward = objective.rollout.completion_logprobs(trainer.model, micro_batch, len(micro_batch["prompt_ids"]))
        mask = micro_batch["completion_mask"].bool()
        torch.testing.assert_close(micro_batch["sampling_logprobs"][mask], forward[mask], atol=2e-5, rtol=1e-5)


def test_bf16_rollouts_come_from_the_updated_policy(tmp_path):
    """bf16=True (autocast over fp32 weights): the engine decodes a bf16 copy of the policy's matmul weights. After
    optimizer steps (torch's fused AdamW, the default, which moves no weight's version counter) its sampling log-probs
    are the updated policy's forward under autocast, to bf16 rounding (a copy left at the first weights is off by
    whole nats)."""
    import hfnative
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": f"Write note {i}:"} for i in range(32)])
    settings = dict(LEARN_SETTINGS, bf16=True, per_device_train_batch_size=8, num_generations=4)
    args = hfnative.GRPOConfig(output_dir=str(tmp_path / "bf16"), max_steps=2, learning_rate=5e-2, **settings)
    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows)
    trainer.train()
    _assert_rollouts_are_the_policys(trainer)


def _assert_rollouts_are_the_policys(trainer) -> None:
    """Under bf16 autocast, the sampling log-probs of fresh rollouts equal the trained policy's forward on them (within
    bf16)."""
    objective = trainer.objective
    with torch.autocast("cpu", dtype=torch.bfloat16):
        micro_batches = objective.generate_and_score([{"prompt": "Write about the sea."}] * 2)
        for micro_batch in micro_batches:
            forward = objective.rollout.completion_logprobs(trainer.model, micro_batch, len(micro_batch["prompt_ids"]))
            mask = micro_batch["completion_mask"].bool()
            torch.testing.assert_close(micro_batch["sampling_logprobs"][mask], forward[mask], atol=0.1, rtol=0)


def test_lora_reference_is_the_base(tmp_path):
    """beta > 0 with LoRA: the reference is the base with adapters disabled (KL 0 before the first update, > 0
    after)."""
    import hfnative
    from datasets import Dataset
    from peft import LoraConfig

    rows = Dataset.from_list([{"prompt": f"Write note {i}:"} for i in range(32)])
    args = hfnative.GRPOConfig(output_dir=str(tmp_path / "lora"), max_steps=2, learning_rate=5e-2, beta=0.1, **LEARN_SETTINGS)
    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows,
                                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert trainer.ref_model is None and not trainer.objective.auxiliary_models
    trainer.train()
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[1] > 1e-6



def test_lora_policy_rollouts_from_folded_weights(tmp_path, monkeypatch):
    """A LoRA policy with bf16=True decoded as on a GPU (the engine folds the adapters, ``fold_adapters``): the
    replica's layers are folded, the reference is still the base (KL 0 at the first step), and after two steps the
    rollouts' log-probs are the trained policy's own (its forward through the unfolded LoRA layers, within bf16)."""
    import hfnative
    from datasets import Dataset
    from peft import LoraConfig

    from hfnative.generation import NativeRolloutEngine

    monkeypatch.setattr(NativeRolloutEngine, "_fold", lambda self, dtype: True)  # CUDA's default
    rows = Dataset.from_list([{"prompt": f"Write note {i}:"} for i in range(32)])
    settings = dict(LEARN_SETTINGS, bf16=True, per_device_train_batch_size=8, num_generations=4)
    args = hfnative.GRPOConfig(output_dir=str(tmp_path / "fold"), max_steps=2, learning_rate=5e-2, beta=0.1, **settings)
    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows,
                                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    trainer.train()
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[1] > 1e-6
    assert len(trainer.objective.rollout.engine._weights.folds) == 7 * len(trainer.native_model.layers)
    _assert_rollouts_are_the_policys(trainer)


def test_trained_token_rows_in_grpo(tmp_path):
    """LoRA with trainable_token_indices, the tied head given rows of its own: rollouts from the native engine on the
    model itself, the reference the base with the rows off (KL 0 before the first update, > 0 after). A plain copy of
    such a model cannot exist: rollouts that decode one (vLLM here) are refused when the trainer is made."""
    import hfnative
    from datasets import Dataset
    from peft import LoraConfig

    rows = Dataset.from_list([{"prompt": f"Write note {i}:"} for i in range(32)])
    args = hfnative.GRPOConfig(output_dir=str(tmp_path / "rows"), max_steps=2, learning_rate=5e-2, beta=0.1, **LEARN_SETTINGS)
    lora = LoraConfig(r=4, target_modules=["q_proj"],
                      trainable_token_indices={"embed_tokens": list(range(100, 300)), "lm_head": list(range(0, 1024, 3))})
    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows, peft_config=lora)
    head_rows = trainer.native_model.output.token_rows.values.detach().clone()
    trainer.train()
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[1] > 1e-6
    assert not torch.equal(trainer.native_model.output.token_rows.values, head_rows)
    trainer.args.use_vllm = True
    with pytest.raises(ValueError, match="decode a plain copy"):
        trainer._check_supported()


def test_adaptive_entropy_bonus_off_policy_mask_and_vespo_in_the_trainer(tmp_path):
    """TRL's adaptive entropy controller in a real run: the coefficient starts applied at 0 (no step's entropy yet),
    then rises by entropy_coef_delta each step while the step's entropy is at most entropy_target; each step's loss
    is its policy_loss minus the coefficient applied times its entropy. VESPO with the off-policy mask trains and
    logs vespo/phi_seq_mean."""
    import hfnative
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": f"Write note {i}:"} for i in range(32)])
    args = hfnative.GRPOConfig(output_dir=str(tmp_path / "adaptive"), max_steps=3, learning_rate=5e-2,
                               use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.005,
                               entropy_target=100.0, **LEARN_SETTINGS)
    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [round(entry["entropy_coef"], 6) for entry in logs] == [0.015, 0.02, 0.025]
    applied = [0.0, 0.015, 0.02]
    for entry, coef in zip(logs, applied):
        assert entry["loss"] == pytest.approx(entry["policy_loss"] - coef * entry["entropy"], abs=1e-6)

    # the controller's state is saved with each checkpoint (TRL's entropy_ctrl_state.json) and resumed from it: a run
    # resumed at step 2 applies 0.02 at step 3 and ends at 0.025, where a fresh controller would apply 0 and end at 0.015
    args = hfnative.GRPOConfig(output_dir=str(tmp_path / "adaptive-resumed"), max_steps=3, learning_rate=5e-2,
                               use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.005,
                               entropy_target=100.0, save_steps=2, **{**LEARN_SETTINGS, "save_strategy": "steps"})
    hfnative.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows).train()
    saved = json.loads((tmp_path / "adaptive-resumed" / "checkpoint-2" / "entropy_ctrl_state.json").read_text())
    assert saved["entropy_coef"] == pytest.approx(0.02) and math.isfinite(saved["last_world_entropy"])
    resumed = hfnative.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows)
    resumed.train(resume_from_checkpoint=str(tmp_path / "adaptive-resumed" / "checkpoint-2"))
    last = [entry for entry in resumed.state.log_history if "loss" in entry][-1]
    assert last["step"] == 3 and last["entropy_coef"] == pytest.approx(0.025)
    assert last["loss"] == pytest.approx(last["policy_loss"] - 0.02 * last["entropy"], abs=1e-6)

    args = hfnative.GRPOConfig(output_dir=str(tmp_path / "vespo"), max_steps=2, learning_rate=5e-2, loss_type="vespo",
                               off_policy_mask_threshold=0.5, **LEARN_SETTINGS)
    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) and 0 < entry["vespo/phi_seq_mean"] for entry in logs)
    assert "clip_ratio/region_mean" not in logs[0]


@pytest.mark.parametrize("trainer_name", ["GRPO", "RLOO"])
def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path, trainer_name):
    """sync_ref_model (TR-DPO, as TRL's SyncRefModelCallback): at every ref_model_sync_steps-th step the reference
    becomes alpha * policy + (1 - alpha) * reference, checked with TRL's own mixing applied to the policy and
    reference as they were after each step; left alone at the other steps. TRL's refusals without a reference."""
    import hfnative
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl.trainer.callbacks import SyncRefModelCallback

    def snapshot(model):
        return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}

    class Snapshots(TrainerCallback):
        def __init__(self):
            self.policy, self.reference = [], []

        def on_step_end(self, args, state, control, **kwargs):
            self.policy.append(snapshot(trainer.model))
            self.reference.append(snapshot(trainer.ref_model))

    config_class = getattr(hfnative, f"{trainer_name}Config")
    trainer_class = getattr(hfnative, f"{trainer_name}Trainer")
    rows = Dataset.from_list([{"prompt": f"Write note {i}:"} for i in range(32)])
    args = config_class(output_dir=str(tmp_path / "sync"), max_steps=3, learning_rate=5e-2, beta=0.1,
                        sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.3, **LEARN_SETTINGS)
    trainer = trainer_class(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows)
    start = snapshot(trainer.ref_model)
    snapshots = Snapshots()
    trainer.add_callback(snapshots)
    trainer.train()
    expected = {name: tensor.clone() for name, tensor in start.items()}
    for step, (policy, reference) in enumerate(zip(snapshots.policy, snapshots.reference), start=1):
        if step % 2 == 0:
            target, source = torch.nn.ParameterList(expected.values()), torch.nn.ParameterList(policy.values())
            SyncRefModelCallback._sync_target_model(source, target, 0.3)
            expected = dict(zip(expected, target))
        for name in expected:
            torch.testing.assert_close(reference[name], expected[name], rtol=1e-6, atol=1e-7, msg=f"{step} {name}")
    assert not torch.equal(snapshots.reference[-1]["tok_embeddings.weight"], start["tok_embeddings.weight"])

    zero_beta = config_class(output_dir=str(tmp_path / "zero"), max_steps=1, beta=0.0, sync_ref_model=True,
                             **LEARN_SETTINGS)
    with pytest.raises(ValueError, match=f"sync_ref_model=True` while `beta=0.0`.*{trainer_name}Trainer does not create"):
        trainer_class(model=MODEL, reward_funcs=letter_e, args=zero_beta, train_dataset=rows)
    with pytest.raises(ValueError, match="while using a PEFT model"):
        trainer_class(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows,
                      peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


# --- reward functions, CLI and example -----------------------------------------------------------------------


def test_reward_functions_calling_convention():
    import asyncio

    from hfnative.trainers.rollout.rewards import BUILTIN_REWARDS, RewardFunctions

    seen = {}

    def plain(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, answer, **kwargs):
        seen.update(prompts=prompts, answer=answer, state=trainer_state, kwargs=kwargs)
        log_extra("note", ["x"] * len(prompts))
        return [None if a is None else 1.0 for a in answer]

    other_started = []

    async def slow(completions, **kwargs):  # finishes only once `slower` has started: they run concurrently
        for _ in range(500):
            if other_started:
                return [0.5] * len(completions)
            await asyncio.sleep(0.01)
        raise AssertionError("the async reward functions ran one after the other")

    async def slower(completions, **kwargs):
        other_started.append(True)
        await asyncio.sleep(0.01)
        return [0.25] * len(completions)

    rewards = RewardFunctions([plain, slow, slower, "exact_match", "hfnative.trainers.rollout.rewards.completion_length"],
                              reward_weights=[1, 1, 1, 1, 1])
    assert rewards.names == ["plain", "slow", "slower", "exact_match", "completion_length"]
    extra = []
    scores = rewards.score(["p1", "p2"], [" 4", "five"], [[5, 6], [7]], [{"prompt": "p1", "answer": "4", "id": 0},
                           {"prompt": "p2", "answer": None, "id": 1}], trainer_state="state",
                           log_extra=lambda column, values: extra.append(column), log_metric=None)
    assert seen["answer"] == ["4", None] and seen["kwargs"]["id"] == [0, 1] and seen["state"] == "state"
    assert extra == ["note"]
    expected = [[1.0, 0.5, 0.25, 1.0, 0.02], [float("nan"), 0.5, 0.25, float("nan"), 0.01]]
    torch.testing.assert_close(scores, torch.tensor(expected), equal_nan=True)
    assert BUILTIN_REWARDS["think_format_reward"](["<think>a</think>b", "b<think>a</think>"]) == [1.0, 0.0]
    penalty = BUILTIN_REWARDS["get_soft_overlong_punishment"](completion_ids=[[0] * 1000, [0] * 1152, [0] * 1300])
    assert penalty == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="returned 1 rewards, but 2"):
        RewardFunctions(lambda completions, **k: [1.0]).score(["a", "b"], ["x", "y"], [[1], [2]], [{"prompt": "a"}] * 2)
    with pytest.raises(ValueError, match="Could not load reward function"):
        RewardFunctions("no_such_module.reward")


def test_cli_grpo_and_example_run(tmp_path):
    import json
    import subprocess

    from hfnative.trainers.running import cli

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Question {i}:", "answer": str(i)}) for i in range(16)))
    common = ["--model_name_or_path", MODEL, "--dataset_name", str(data), "--use_cpu", "--no_bf16", "--max_steps", "2",
              "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
              "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no"]
    for command in ("grpo", "rloo"):
        out = tmp_path / command
        flags = ["--reward_funcs", "exact_match", "hfnative.trainers.rollout.rewards.completion_length"]
        assert cli.main([command, *common, "--output_dir", str(out), *flags]) in (0, None)
        state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text()) if (out / "checkpoint-2").exists() else None
        assert (out / "model.safetensors").exists()
        assert state is None or state["global_step"] == 2
    with pytest.raises(SystemExit) as refused:
        cli.main(["grpo", *common, "--output_dir", str(tmp_path / "none")])
    assert refused.value.code == 2  # no reward function: a usage error

    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo.py"), *common, "--output_dir", str(tmp_path / "example"),
         "--reward_funcs", "examples.grpo.letter_e", "think_format_reward"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "example" / "model.safetensors").exists()


def test_sampler_importance_weights_and_an_engine_that_copies_weights(tmp_path, capsys):
    """TRL's vLLM correction: the four modes against their formulas; in training (an engine that does not read
    the live weights, its log-probs 0.01 below the model's) the weights reach the loss, TRL's sampling/* keys
    are logged, and the engine receives the Hub-named weights before each generation."""
    import hfnative
    from datasets import Dataset
    from hfnative.generation import NativeRolloutEngine, Rollouts
    from hfnative.losses.policy import sampler_importance_weights

    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -3.0]])
    sampled = logprobs - torch.tensor([[0.5, -0.2, 0.1], [2.0, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    gap = torch.tensor([[0.5, -0.2, 0.0], [2.0, 0.0, 0.0]])
    torch.testing.assert_close(sampler_importance_weights(logprobs, sampled, mask, "token_truncate", None, 3.0),
                               gap.exp().clamp(max=3.0))
    torch.testing.assert_close(sampler_importance_weights(logprobs, sampled, mask, "token_mask", 0.9, 3.0),
                               torch.where((gap.exp() < 0.9) | (gap.exp() > 3.0), 0.0, gap.exp()))
    sequence = gap.sum(-1, keepdim=True).exp()
    torch.testing.assert_close(sampler_importance_weights(logprobs, sampled, mask, "sequence_truncate", 1.5, 3.0),
                               sequence.clamp(1.5, 3.0))
    torch.testing.assert_close(sampler_importance_weights(logprobs, sampled, mask, "sequence_mask", None, 3.0),
                               torch.where(sequence > 3.0, 0.0, sequence))

    args = hfnative.GRPOConfig(output_dir=str(tmp_path / "copy"), max_steps=2, learning_rate=1e-2, log_completions=True,
                               num_completions_to_print=3, **LEARN_SETTINGS)
    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=letter_e, args=args,
                                   train_dataset=Dataset.from_list([{"prompt": f"Note {i}:"} for i in range(8)]))
    native, received = trainer.objective.engine, []

    class CopyingEngine(NativeRolloutEngine):
        reads_live_weights = False

        def generate(self, prompts, sampling):
            out = native.generate(prompts, sampling)
            return Rollouts(out.completion_ids, [[lp - 0.01 for lp in row] for row in out.logprobs], out.finish_reason)

        def load_weights(self, named_tensors):
            received.append([name for name, _ in named_tensors])

    trainer.objective.engine = CopyingEngine(trainer.model)
    trainer.objective.sampler_correction = True
    trainer.train()
    assert len(received) == 2 and "model.layers.0.self_attn.q_proj.weight" in received[0]
    first = trainer.state.log_history[0]
    assert first["sampling/sampling_logp_difference/mean"] == pytest.approx(0.01, abs=1e-4)
    expected = math.exp(0.01 * first["completions/mean_length"])  # every completion runs to the limit here
    assert first["sampling/importance_sampling_ratio/mean"] == pytest.approx(expected, rel=1e-3)
    printed = capsys.readouterr().out  # log_completions: a table of prompts, completions, rewards, advantages
    assert "Step 1" in printed and "Step 2" in printed and "letter_e" in printed and "Advantage" in printed
