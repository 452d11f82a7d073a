"""Learning-rate schedules by transformers' `lr_scheduler_type` name, as pure functions of the step.

`lr_lambda_for` is the single source of truth: it returns `step -> multiplier of the base learning rate`,
so one schedule can drive a `LambdaLR` or many per-parameter optimizers (optimizer-in-backward).
Every formula, default and `lr_scheduler_kwargs` name follows transformers 5.24 `get_scheduler`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch


def resolve_warmup_steps(warmup_steps: float, num_training_steps: int) -> int:
    """TrainingArguments.warmup_steps -> a step count.

    A value >= 1 is a count (truncated: 2.7 -> 2); a value < 1 is a ratio of `num_training_steps`,
    rounded up from the float product (so 0.07 of 100 steps is 8, since 100 * 0.07 = 7.000000000000001).
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps}: expected a step count >= 0 or a ratio in [0, 1)")
    if warmup_steps >= 1:
        return int(warmup_steps)
    return math.ceil(num_training_steps * warmup_steps)


def _linear_warmup(step: int, num_warmup_steps: int) -> float:
    return float(step) / float(max(1, num_warmup_steps))


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return _linear_warmup(step, num_warmup_steps)
    return 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _linear_warmup(step, num_warmup_steps)
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float, min_lr_rate: float) -> float:
    """Half-cosine (num_cycles=0.5) from 1 down to min_lr_rate; `cosine` is this with min_lr_rate=0."""
    if step < num_warmup_steps:
        return _linear_warmup(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: int) -> float:
    if step < num_warmup_steps:
        return _linear_warmup(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _cosine_warmup_with_min_lr(
    step: int,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float,
    min_lr_rate: float,
    warmup_lr_rate: float | None,
) -> float:
    """Like `_cosine` with min_lr_rate, but warmup starts above 0 and the decay is shifted one step earlier."""
    step, num_warmup_steps, num_training_steps = float(step), float(num_warmup_steps), float(num_training_steps)
    if step < num_warmup_steps:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, num_warmup_steps)
        warmup_lr_rate = float(warmup_lr_rate)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, num_warmup_steps - 1)
    progress = (step - num_warmup_steps + 1.0) / max(1.0, num_training_steps - num_warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)


def _polynomial(
    step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float, base_lr: float
) -> float:
    if step < num_warmup_steps:
        return _linear_warmup(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / base_lr
    # transformers divides by zero here when warmup == training steps; max(1, .) avoids the crash
    decay_steps = max(1, num_training_steps - num_warmup_steps)
    pct_remaining = 1 - (step - num_warmup_steps) / decay_steps
    return ((base_lr - lr_end) * pct_remaining**power + lr_end) / base_lr


def _inverse_sqrt(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _linear_warmup(step, num_warmup_steps)
    shift = timescale - num_warmup_steps
    return 1.0 / math.sqrt((step + shift) / timescale)


_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


def _warmup_stable_decay(
    step: int,
    *,
    num_warmup_steps: int,
    num_stable_steps: int,
    num_decay_steps: int,
    warmup_type: str,
    decay_type: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> float:
    if step < num_warmup_steps:
        progress = float(step) / float(max(1, num_warmup_steps))
        if warmup_type == "linear":
            factor = progress
        elif warmup_type == "cosine":
            factor = 0.5 * (1.0 - math.cos(math.pi * progress))
        else:  # "1-sqrt"
            factor = 1.0 - math.sqrt(1.0 - progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = float(step - num_warmup_steps - num_stable_steps) / float(max(1, num_decay_steps))
        if decay_type == "linear":
            factor = 1.0 - progress
        elif decay_type == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        else:  # "1-sqrt"
            factor = 1.0 - math.sqrt(progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


# name -> the lr_scheduler_kwargs it accepts, with transformers' defaults (None = required or optional, see below)
_SCHEDULER_KWARGS: dict[str, dict[str, object]] = {
    "linear": {},
    "cosine": {"num_cycles": 0.5},
    "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {"timescale": None},
    "cosine_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None},
    "cosine_warmup_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None, "warmup_lr_rate": None},
    "warmup_stable_decay": {
        "num_decay_steps": None,
        "num_stable_steps": None,
        "warmup_type": "linear",
        "decay_type": "cosine",
        "min_lr_ratio": 0.0,
        "num_cycles": 0.5,
    },
}
SUPPORTED_SCHEDULERS = tuple(_SCHEDULER_KWARGS)


def _min_lr_rate(name: str, min_lr: float | None, min_lr_rate: float | None, base_lr: float | None) -> float:
    if min_lr is not None and min_lr_rate is not None:
        raise ValueError(f"lr_scheduler_type={name!r}: set only one of min_lr or min_lr_rate in lr_scheduler_kwargs")
    if min_lr_rate is not None:
        return min_lr_rate
    if min_lr is None:
        raise ValueError(
            f"lr_scheduler_type={name!r} needs lr_scheduler_kwargs={{'min_lr': ...}} or {{'min_lr_rate': ...}}"
        )
    if base_lr is None:
        raise ValueError(f"lr_scheduler_type={name!r} with min_lr needs base_lr (the optimizer's learning rate)")
    return min_lr / base_lr


def lr_lambda_for(
    name: str,
    num_warmup_steps: int,
    num_training_steps: int | None,
    *,
    base_lr: float | None = None,
    **scheduler_kwargs,
) -> Callable[[int], float]:
    """The schedule `name` as `step -> multiplier of the base learning rate`.

    name: a transformers `lr_scheduler_type` (see SUPPORTED_SCHEDULERS).
    num_warmup_steps: already resolved to a count (see `resolve_warmup_steps`).
    base_lr: the optimizer's learning rate; needed only by polynomial (lr_end is absolute) and by
        cosine_with_min_lr / cosine_warmup_with_min_lr when given min_lr.
    scheduler_kwargs: TrainingArguments.lr_scheduler_kwargs, with transformers' names and defaults.
    """
    name = str(getattr(name, "value", name))  # accepts transformers' SchedulerType enum too
    if name not in _SCHEDULER_KWARGS:
        raise ValueError(f"lr_scheduler_type={name!r} is not supported; choose one of {', '.join(SUPPORTED_SCHEDULERS)}")
    accepted = _SCHEDULER_KWARGS[name]
    # transformers never passes lr_scheduler_kwargs to these two, so it silently ignores them
    if name in ("constant", "constant_with_warmup"):
        scheduler_kwargs = {}
    unknown = sorted(set(scheduler_kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"lr_scheduler_kwargs {unknown} are not accepted by lr_scheduler_type={name!r}; "
            f"it accepts {sorted(accepted) or 'none'}"
        )
    kw = {**accepted, **scheduler_kwargs}
    needs_total = name not in ("constant", "constant_with_warmup", "inverse_sqrt", "warmup_stable_decay")
    if needs_total and num_training_steps is None:
        raise ValueError(f"lr_scheduler_type={name!r} needs num_training_steps")

    if name == "constant":
        return _constant
    if name == "constant_with_warmup":
        return partial(_constant_with_warmup, num_warmup_steps=num_warmup_steps)
    if name == "linear":
        return partial(_linear, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps)
    if name == "cosine":
        return partial(
            _cosine,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            num_cycles=kw["num_cycles"],
            min_lr_rate=0.0,
        )
    if name == "cosine_with_restarts":
        return partial(
            _cosine_with_restarts,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            num_cycles=kw["num_cycles"],
        )
    if name == "polynomial":
        if base_lr is None:
            raise ValueError("lr_scheduler_type='polynomial' needs base_lr (the optimizer's learning rate)")
        if not base_lr > kw["lr_end"]:
            raise ValueError(f"lr_end ({kw['lr_end']}) must be smaller than the initial learning rate ({base_lr})")
        return partial(
            _polynomial,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            lr_end=kw["lr_end"],
            power=kw["power"],
            base_lr=base_lr,
        )
    if name == "inverse_sqrt":
        timescale = kw["timescale"] if kw["timescale"] is not None else (num_warmup_steps or 10_000)
        return partial(_inverse_sqrt, num_warmup_steps=num_warmup_steps, timescale=timescale)
    if name == "cosine_with_min_lr":
        return partial(
            _cosine,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            num_cycles=kw["num_cycles"],
            min_lr_rate=_min_lr_rate(name, kw["min_lr"], kw["min_lr_rate"], base_lr),
        )
    if name == "cosine_warmup_with_min_lr":
        return partial(
            _cosine_warmup_with_min_lr,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            num_cycles=kw["num_cycles"],
            min_lr_rate=_min_lr_rate(name, kw["min_lr"], kw["min_lr_rate"], base_lr),
            warmup_lr_rate=kw["warmup_lr_rate"],
        )
    # warmup_stable_decay
    if kw["num_decay_steps"] is None:
        raise ValueError("lr_scheduler_type='warmup_stable_decay' needs lr_scheduler_kwargs={'num_decay_steps': N}")
    for key in ("warmup_type", "decay_type"):
        if kw[key] not in _WSD_SHAPES:
            raise ValueError(f"lr_scheduler_kwargs {key}={kw[key]!r}: expected one of {', '.join(_WSD_SHAPES)}")
    num_stable_steps = kw["num_stable_steps"]  # wins over num_training_steps when both are given
    if num_stable_steps is None:
        if num_training_steps is None:
            raise ValueError("lr_scheduler_type='warmup_stable_decay' needs num_training_steps or num_stable_steps")
        num_stable_steps = num_training_steps - num_warmup_steps - kw["num_decay_steps"]
    return partial(
        _warmup_stable_decay,
        num_warmup_steps=num_warmup_steps,
        num_stable_steps=num_stable_steps,
        num_decay_steps=kw["num_decay_steps"],
        warmup_type=kw["warmup_type"],
        decay_type=kw["decay_type"],
        min_lr_ratio=kw["min_lr_ratio"],
        num_cycles=kw["num_cycles"],
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    name: str,
    num_warmup_steps: int,
    num_training_steps: int | None,
    scheduler_kwargs: dict | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `optimizer` following `lr_lambda_for`; base_lr is optimizer.defaults["lr"] as in transformers."""
    lr_lambda = lr_lambda_for(
        name, num_warmup_steps, num_training_steps, base_lr=optimizer.defaults["lr"], **(scheduler_kwargs or {})
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
