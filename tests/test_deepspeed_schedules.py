"""A DeepSpeed config's scheduler section (``TrainingArguments(deepspeed=...)``, read without DeepSpeed:
trainers/running/deepspeed_config.py) replaces the arguments' schedule, as under transformers' Trainer with DeepSpeed.
The oracle is DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py) written out here step by step: the schedule is
made before the first step, which runs at its start, and stepped after every optimizer step; "auto" takes the run's
steps, ``max(1, warmup steps)`` and the learning rate, as transformers fills them."""

import math

import pytest
from datasets import Dataset

from hfnative import SFTConfig, SFTTrainer
from hfnative.trainers.running.deepspeed_config import deepspeed_scheduler

TINY = "examples/tiny-qwen3"
STEPS, LR = 7, 2e-3


def _trained_rates(tmp_path, scheduler: dict, **settings) -> list[float]:
    """The learning rate each of the run's optimizer steps used (logged per step), with this scheduler section."""
    args = SFTConfig(str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                     max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=2,
                     learning_rate=LR, max_length=32, seed=0, lr_scheduler_type="cosine",
                     deepspeed={"zero_optimization": {"stage": 0}, "scheduler": scheduler}, **settings)
    rows = [{"prompt": "a b c", "completion": " d e f"}] * 32
    trainer = SFTTrainer(model=TINY, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    return [entry["learning_rate"] for entry in trainer.state.log_history if "loss" in entry]


def test_warmup_decay_lr_from_auto_values(tmp_path):
    """WarmupDecayLR with every value "auto" and warmup_steps=3: log warm-up from 0 (its first two steps at 0, as
    DeepSpeed runs them), then linear decay to 0 at the run's last step; the arguments' cosine schedule unused."""
    rates = _trained_rates(tmp_path, {"type": "WarmupDecayLR", "params": dict.fromkeys(
        ["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"], "auto")}, warmup_steps=3)
    warmup = 3
    expected = [0.0]  # before the first step: warmup_min_lr
    for iteration in range(STEPS - 1):
        if iteration < warmup:
            gamma = math.log(iteration + 1) / math.log(warmup)
        else:
            gamma = max(0.0, (STEPS - iteration) / (STEPS - warmup))
        expected.append(LR * gamma)
    assert rates == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert rates[0] == rates[1] == 0.0 and max(rates) == pytest.approx(LR)


def test_warmup_lr_linear_with_its_own_values(tmp_path):
    """WarmupLR, linear warm-up from warmup_min_lr over 4 steps, then constant at the learning rate."""
    rates = _trained_rates(tmp_path, {"type": "WarmupLR", "params": {
        "warmup_min_lr": 1e-4, "warmup_max_lr": LR, "warmup_num_steps": 4, "warmup_type": "linear"}}, warmup_steps=4)
    expected = [1e-4] + [1e-4 + (LR - 1e-4) * min(iteration / 4, 1.0) for iteration in range(STEPS - 1)]
    assert rates == pytest.approx(expected, rel=1e-6)


def test_warmup_cosine_lr(tmp_path):
    """WarmupCosineLR: ratios of the learning rate, a log warm-up from warmup_min_ratio, then a cosine to
    cos_min_ratio (its first step at 0 in the first parameter group, the one logged)."""
    rates = _trained_rates(tmp_path, {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}},
        warmup_steps=2)
    warmup, expected = 2, [0.0]
    for iteration in range(STEPS - 1):
        if iteration < warmup:
            ratio = 0.1 + math.log(iteration + 1) / math.log(warmup) * 0.9
        else:
            ratio = 0.05 + 0.95 * (1 + math.cos(math.pi * (iteration - warmup + 1) / (STEPS - warmup))) / 2
        expected.append(LR * ratio)
    assert rates == pytest.approx(expected, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_every_parameter_group_and_a_resume(kind, tmp_path):
    """DeepSpeed's per-group rates: WarmupLR and WarmupDecayLR set the same absolute rate on every group (one whose
    own rate is 0 included), WarmupCosineLR scales each group's own (the first group alone at 0 before the first step,
    as DeepSpeed sets it); and a schedule rebuilt from its state_dict (JSON, as checkpoints keep it) goes on alike."""
    import json

    import torch

    params = dict(warmup_num_steps=3, total_num_steps=10, warmup_type="linear")
    if kind != "WarmupCosineLR":
        params.update(warmup_min_lr=1e-5, warmup_max_lr=LR)
    if kind == "WarmupLR":
        del params["total_num_steps"]
    args = SFTConfig(str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", learning_rate=LR,
                     warmup_steps=3, deepspeed={"scheduler": {"type": kind, "params": params}})

    def optimizer():
        return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": LR},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.0},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": LR / 2}])

    def expected(iteration: int) -> list[float]:
        own = [LR, 0.0, LR / 2]
        if kind == "WarmupCosineLR":
            if iteration < 0:
                return [0.0, *own[1:]]
            ratio = iteration / 3 if iteration < 3 else (1 + math.cos(math.pi * (iteration - 2) / 7)) / 2 * 0.9999 + 1e-4
            return [lr * ratio for lr in own]
        gamma = -1.0 if iteration < 0 else min(iteration / 3, 1.0)
        if kind == "WarmupDecayLR" and iteration >= 3:
            gamma = (10 - iteration) / 7
        return [1e-5 if gamma < 0 else 1e-5 + (LR - 1e-5) * gamma] * 3

    first = optimizer()
    schedule = deepspeed_scheduler(args, first, 10)
    for iteration in range(-1, 5):
        if iteration >= 0:
            schedule.step()
        assert [group["lr"] for group in first.param_groups] == pytest.approx(expected(iteration), rel=1e-9, abs=1e-15)
    state = json.loads(json.dumps(schedule.state_dict()))
    again = optimizer()
    again.load_state_dict(first.state_dict())
    resumed = deepspeed_scheduler(args, again, 10)
    resumed.load_state_dict(state)
    for iteration in range(5, 9):
        schedule.step()
        resumed.step()
        assert [g["lr"] for g in again.param_groups] == [g["lr"] for g in first.param_groups]
        assert [g["lr"] for g in first.param_groups] == pytest.approx(expected(iteration), rel=1e-9, abs=1e-15)


def test_a_schedule_value_that_differs_from_the_run_is_refused(tmp_path):
    """Given (not "auto"), total_num_steps and warmup_num_steps must be the run's, as transformers checks them."""
    import torch

    args = SFTConfig(str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", learning_rate=LR,
                     warmup_steps=2, deepspeed={"scheduler": {"type": "WarmupDecayLR", "params": {
                         "total_num_steps": 100, "warmup_num_steps": 5}}})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    with pytest.raises(ValueError) as error:
        deepspeed_scheduler(args, optimizer, STEPS)
    assert str(error.value) == (
        "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
        f"- ds scheduler.params.total_num_steps=100 vs hf num_training_steps (calculated)={STEPS}\n"
        "- ds scheduler.params.warmup_num_steps=5 vs hf warmup_steps=2\n"
        "The easiest method is to set these DeepSpeed config values to 'auto'.")
