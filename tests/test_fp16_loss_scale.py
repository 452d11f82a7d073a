"""fp16 loss scaling (hfnative/optim/loss_scale.py) against torch.amp.GradScaler, the scaler accelerate gives
transformers' Trainer under fp16=True on a GPU; and the trainer's use of it, with the scaling forced on for a CPU
(where accelerate, and so hfnative, trains fp16 unscaled)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hfnative.optim.loss_scale import LossScale

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")


def _toy(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def test_loss_scale_steps_skips_and_moves_the_scale_as_gradscaler():
    """Six steps under fp16 autocast, two of them with an inf gradient: the same parameters after every step, the same
    steps skipped, the same scale (backed off after an overflow, grown after ``growth_interval`` clean steps)."""
    ours_model, ours_optimizer = _toy()
    theirs_model, theirs_optimizer = _toy()
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    scale = LossScale(growth_interval=2)
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator)
        for model in (ours_model, theirs_model):
            model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            ours_loss = torch.nn.functional.mse_loss(ours_model(x).float(), y)
            theirs_loss = torch.nn.functional.mse_loss(theirs_model(x).float(), y)
        scale.scaled(ours_loss).backward()
        scaler.scale(theirs_loss).backward()
        if step in (1, 4):  # an overflow
            ours_model[0].weight.grad[0, 0] = float("inf")
            theirs_model[0].weight.grad[0, 0] = float("inf")
        scale.unscale_(list(ours_model.parameters()))
        norm = torch.nn.utils.clip_grad_norm_(ours_model.parameters(), 1.0)
        if scale.update(norm):
            ours_optimizer.step()
        scaler.unscale_(theirs_optimizer)
        torch.nn.utils.clip_grad_norm_(theirs_model.parameters(), 1.0)
        scaler.step(theirs_optimizer)
        scaler.update()
        assert scale.scale == scaler.get_scale(), step
        for ours, theirs in zip(ours_model.parameters(), theirs_model.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert scale.scale != 2.0**16  # it moved


def _config(output_dir, **extra):
    import hfnative

    settings = dict(output_dir=str(output_dir), use_cpu=True, bf16=False, fp16=True, report_to="none",
                    disable_tqdm=True, max_steps=3, logging_steps=1, save_strategy="no", per_device_train_batch_size=4,
                    learning_rate=1e-3, max_length=64, seed=0)
    return hfnative.SFTConfig(**{**settings, **extra})


def _trainer(config):
    import hfnative
    from datasets import Dataset

    rows = [json.loads(line) for line in open(ROOT / "examples" / "data" / "sft_messages.jsonl")][:16]
    return hfnative.SFTTrainer(model=MODEL, args=config, train_dataset=Dataset.from_list(rows))


def _logged(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.fixture
def scaling_on_cpu(monkeypatch):
    from hfnative.trainers.loop import optimization

    monkeypatch.setattr(optimization, "scales_loss", lambda device: True)


def test_the_trainer_scales_the_loss_and_unscales_the_gradients(tmp_path, monkeypatch):
    """The logged loss and gradient norm are those of the unscaled run (backward ran from the loss times 2^16, the
    gradients were divided back before clipping); the checkpoint keeps the scale, and a resumed run goes on with it."""
    unscaled = _trainer(_config(tmp_path / "unscaled"))
    unscaled.train()
    from hfnative.trainers.loop import optimization

    monkeypatch.setattr(optimization, "scales_loss", lambda device: True)
    scaled = _trainer(_config(tmp_path / "scaled", save_strategy="steps", save_steps=2))
    scaled.train()
    assert _logged(scaled)[0]["loss"] == _logged(unscaled)[0]["loss"]  # the same forward
    for ours, theirs in zip(_logged(scaled), _logged(unscaled), strict=True):
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2e-2)
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=2e-2)
    assert scaled._loss_scale.state_dict()["growth_tracker"] == 3
    checkpoint = tmp_path / "scaled" / "checkpoint-2"
    saved = json.loads((checkpoint / "loss_scale.json").read_text())
    assert saved["scale"] == 2.0**16 and saved["growth_tracker"] == 2

    saved["scale"] = 2.0**10  # as a run whose scale had backed off
    (checkpoint / "loss_scale.json").write_text(json.dumps(saved))
    resumed = _trainer(_config(tmp_path / "scaled"))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed._loss_scale.scale == 2.0**10 and resumed._loss_scale.growth_tracker == 3


def test_an_overflowed_step_is_skipped_with_the_schedule(tmp_path, scaling_on_cpu):
    """A step whose gradients overflowed changes no parameter and leaves the learning-rate schedule where it was (as
    transformers does when accelerate's scaler skipped a step); the scale halves."""
    trainer = _trainer(_config(tmp_path, max_steps=2, lr_scheduler_type="linear"))
    clip, before, unchanged = trainer._clip_gradients, {}, []

    def overflow_first(params):
        if not before:  # the first step: an inf gradient
            before.update({id(p): p.detach().clone() for p in params})
            params[0].grad.view(-1)[0] = float("inf")
        elif not unchanged:  # the second step, before it steps: what the first left
            unchanged.append(all(torch.equal(p, before[id(p)]) for p in params))
        return clip(params)

    trainer._clip_gradients = overflow_first
    trainer.train()
    logs = _logged(trainer)
    assert unchanged == [True]
    assert not torch.isfinite(torch.tensor(logs[0]["grad_norm"]))
    assert logs[0]["learning_rate"] == logs[1]["learning_rate"]  # the schedule did not move past the skipped step
    assert trainer._loss_scale.scale == 2.0**15 and trainer._loss_scale.growth_tracker == 1


def test_fp16_loss_scaling_refuses_the_optimizer_in_backward(tmp_path, scaling_on_cpu):
    """Refused when the trainer is made, before anything is written."""
    with pytest.raises(ValueError, match="fp16=True with optimizer_in_backward=True"):
        _trainer(_config(tmp_path / "run", optimizer_in_backward=True, max_grad_norm=0.0))
    assert not (tmp_path / "run").exists()
