"""RLOO against TRL 1.16's RLOOTrainer run beside us: the sequence loss on the same log-probs through TRL's own
``_compute_loss``, and every logged metric over two optimizer steps on fixed rollouts (the leave-one-out
baseline, the KL in the reward, reward clipping, normalized advantages)."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from hfnative.losses.policy import sequence_policy_loss
from test_grpo import G, LEARN_SETTINGS, assert_two_steps_equal, MODEL, save_moe_model, _prompts, even_fraction, fixed_completion, letter_e, near_target_length


def test_sequence_policy_loss_equals_trl():
    from trl import RLOOTrainer

    g = torch.Generator().manual_seed(3)
    B, T = 6, 5
    logps = (-torch.rand(B, T, generator=g) * 2).requires_grad_()
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    old_logps = (logps.detach() * mask).sum(1) + torch.randn(B, generator=g) * 0.4
    advantages = torch.randn(B, generator=g)
    entropy = torch.rand(B, T, generator=g)
    metrics = {"train": defaultdict(list)}
    accelerator = types.SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t)
    stand_in = types.SimpleNamespace(
        epsilon_low=0.2, epsilon_high=0.3, aux_loss_enabled=False, accelerator=accelerator, _metrics=metrics,
        model=types.SimpleNamespace(training=True), _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None),
    )
    inputs = dict(prompt_ids=torch.zeros(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask, old_logps=old_logps,
                  advantages=advantages)
    theirs = RLOOTrainer._compute_loss(stand_in, None, inputs)
    (their_grad,) = torch.autograd.grad(theirs, logps)
    out = sequence_policy_loss(logps, old_logps, advantages, mask, epsilon=0.2, epsilon_high=0.3, entropy_BT=entropy)
    (our_grad,) = torch.autograd.grad(out.loss, logps)
    assert float(out.loss) == pytest.approx(float(theirs), abs=1e-6)
    torch.testing.assert_close(our_grad, their_grad, atol=1e-7, rtol=1e-6)
    assert set(out.metrics) == set(metrics["train"])
    for name, values in metrics["train"].items():
        mine = out.metrics[name]
        mine = float(mine[0] / mine[1]) if isinstance(mine, tuple) else float(mine)
        assert mine == pytest.approx(values[0], abs=1e-6), name


def _settings(tmp_path, name, **extra):
    return dict(
        output_dir=str(tmp_path / name), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=8, gradient_accumulation_steps=2,
        num_generations=G, max_completion_length=10, learning_rate=1e-2, seed=0, gradient_checkpointing=False,
        reward_weights=[1.0, 0.5], **extra,
    )


def _run_trl(tmp_path, monkeypatch, model=MODEL, **extra):
    import trl
    import trl.trainer.rloo_trainer as trl_rloo
    from datasets import Dataset

    monkeypatch.setattr(trl_rloo, "shuffle_sequence_dict", lambda batch: batch)

    def generate(self, prompt_ids, images, multimodal_fields):
        return [fixed_completion(list(p), i, self.max_completion_length) for i, p in enumerate(prompt_ids)]

    monkeypatch.setattr(trl.RLOOTrainer, "_generate_single_turn", generate)
    trainer = trl.RLOOTrainer(model=model, reward_funcs=[even_fraction, near_target_length],
                              args=trl.RLOOConfig(**_settings(tmp_path, "trl", **extra)),
                              train_dataset=Dataset.from_list(_prompts()))
    trainer.train()
    return trainer.state.log_history[:-1]


def _run_ours(tmp_path, model=MODEL, **extra):
    import hfnative
    from datasets import Dataset
    from hfnative.generation import Rollouts

    trainer = hfnative.RLOOTrainer(model=model, reward_funcs=[even_fraction, near_target_length],
                                   args=hfnative.RLOOConfig(**_settings(tmp_path, "ours", **extra)),
                                   train_dataset=Dataset.from_list(_prompts()))
    objective = trainer.objective
    max_length = trainer.args.max_completion_length

    def generate(prompts, sampling):
        completions = [fixed_completion(list(p), i, max_length) for i, p in enumerate(prompts)]
        return Rollouts(completions, [[0.0] * len(c) for c in completions], ["stop"] * len(completions))

    objective.engine.generate = generate
    objective.shuffled_order = torch.arange
    objective.old_logprobs_source = "forward"  # TRL's; the engine's sampling log-probs equal it to ~1e-6
    trainer.train()
    return trainer.state.log_history[:-1]


@pytest.mark.parametrize(
    "extra",
    [
        dict(),  # TRL's defaults: beta 0.05 (a reference model), no normalization
        dict(beta=0.0, normalize_advantages=True, epsilon_high=0.28, mask_truncated_completions=True),
        dict(beta=0.1, reward_clip_range=(0.2, 0.6), num_iterations=2),
    ],
    ids=["defaults", "normalized-no-kl", "clipped-rewards-kl-2-iterations"],
)
def test_trainer_logs_equal_trl_on_fixed_rollouts(tmp_path, monkeypatch, extra):
    theirs = _run_trl(tmp_path, monkeypatch, **extra)
    ours = _run_ours(tmp_path, **extra)
    assert_two_steps_equal(ours, theirs)


def test_moe_router_loss_equals_trl_on_fixed_rollouts(tmp_path, monkeypatch):
    """A MoE policy at TRL's defaults (beta 0.05): the router's load-balancing loss added as TRL adds it."""
    model = save_moe_model(tmp_path / "qwen3-moe")
    theirs = _run_trl(tmp_path, monkeypatch, model=model)
    ours = _run_ours(tmp_path, model=model)
    assert_two_steps_equal(ours, theirs)
    assert all(entry["aux_loss"] > 0 for entry in theirs)


def test_rloo_learns_from_the_reward(tmp_path):
    """RLOO loads a reference model by default (beta 0.05); without the KL it raises the toy reward clearly."""
    import hfnative
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": f"Write note {i}:"} for i in range(32)])
    args = hfnative.RLOOConfig(output_dir=str(tmp_path / "rloo"), max_steps=30, learning_rate=1e-2, **LEARN_SETTINGS)
    trainer = hfnative.RLOOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows)
    assert args.beta == 0.05 and isinstance(trainer.ref_model, torch.nn.Module)
    # on this toy task the KL in the reward (0.05 x a 16-token log-ratio sum) soon outweighs the letter reward
    args = hfnative.RLOOConfig(output_dir=str(tmp_path / "rloo"), max_steps=30, learning_rate=1e-2, beta=0.0, **LEARN_SETTINGS)
    trainer = hfnative.RLOOTrainer(model=MODEL, reward_funcs=letter_e, args=args, train_dataset=rows)
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert sum(rewards[-5:]) / 5 > 2 * sum(rewards[:5]) / 5, rewards
