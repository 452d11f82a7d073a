"""The objectives' metrics between logging steps: kept on the device, reduced over the data-parallel ranks and read
with one host sync when logged (TRL's per-micro-batch means, ratios of sums over the ranks, running totals)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, 0.0 over nothing (TRL's entropy and mean_token_accuracy)."""
    return numerator / denominator if denominator > 0 else 0.0


def ratio_if_any(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, no value over nothing (TRL's KTO rewards and logits, left out when a batch has none)."""
    return numerator / denominator if denominator > 0 else None


@dataclass(frozen=True)
class RankSums:
    """A micro-batch's metric made from sums over every data-parallel rank: ``combine(*parts summed over the ranks)``
    is its value, or None for none (the micro-batch is left out of the mean; a metric with no value is not logged)."""

    parts: tuple
    combine: Callable[..., float | None] = ratio


class MetricAverages:
    """Metrics kept on the device between logging steps and read with one host sync when logged.

    ``add``: one value per micro-batch, logged as their mean (as TRL averages its per-micro-batch values);
    ``add_ratio``: one (numerator, denominator) per micro-batch, logged as the mean of the ratios, each
    ratio taken over every data-parallel rank's sums (TRL's entropy and mean_token_accuracy: gathered sums
    divided); ``add_rank_sums``: the same for any ``RankSums``; ``set``: logged as the last value set (running
    totals such as num_tokens, summed over ranks).
    """

    def __init__(self):
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._latest: dict[str, torch.Tensor] = {}
        self._combined: dict[str, list[RankSums]] = {}
        self._missing: set[str] = set()

    def add(self, name: str, value) -> None:
        value = torch.as_tensor(value).detach().double()
        self._sums[name] = self._sums[name] + value.to(self._sums[name].device) if name in self._sums else value
        self._counts[name] = self._counts.get(name, 0) + 1

    def add_value(self, name: str, value) -> None:
        """One value (a float or a 0-d tensor, read now) to the mean; NaN (a reward function that scored nothing) is
        left out of it, and the metric logged as None when no value comes before the next pop (TRL's)."""
        value = float(value)
        if value == value:
            self.add(name, torch.tensor(value))
        else:
            self.mark_missing(name)

    def add_ratio(self, name: str, numerator, denominator) -> None:
        self.add_rank_sums(name, RankSums((numerator, denominator)))

    def add_rank_sums(self, name: str, metric: RankSums) -> None:
        parts = tuple(torch.as_tensor(part).detach().double() for part in metric.parts)
        self._combined.setdefault(name, []).append(RankSums(parts, metric.combine))

    def set(self, name: str, value) -> None:
        self._latest[name] = torch.as_tensor(value).detach().double()

    def mark_missing(self, name: str) -> None:
        """A metric that had no value this time (a reward function that scored nothing): logged as None when no
        value of it is added before the next pop (TRL logs such a metric as None)."""
        self._missing.add(name)

    def record(self, metrics: dict) -> None:
        """An objective's metrics dict: (numerator, denominator) tuples are ratios, ``RankSums`` combined sums,
        num_tokens a running total."""
        for name, value in metrics.items():
            if isinstance(value, RankSums):
                self.add_rank_sums(name, value)
            elif isinstance(value, tuple):
                self.add_ratio(name, *value)
            elif name == "num_tokens":
                self.set(name, value)
            else:
                self.add(name, value)

    def pop(self, reduce=None) -> dict[str, float]:
        """The values since the last pop (cleared), as floats. ``reduce(values, summed)``: combines the stacked
        values over data-parallel ranks (``summed[i]``: summed over ranks; else averaged)."""
        names = list(self._sums) + list(self._latest)
        values = [self._sums[n] / self._counts[n] for n in self._sums] + list(self._latest.values())
        summed = [False] * len(self._sums) + [True] * len(self._latest)
        entries = [(name, metric) for name, metrics in self._combined.items() for metric in metrics]
        for _, metric in entries:
            values += [part.reshape(()) for part in metric.parts]
            summed += [True] * len(metric.parts)
        missing = {name: None for name in self._missing if name not in self._sums and name not in self._latest}
        self._sums.clear()
        self._counts.clear()
        self._latest.clear()
        self._combined.clear()
        self._missing.clear()
        if not values:
            return missing
        stacked = torch.stack([v.to(values[0].device) for v in values])
        if reduce is not None:
            stacked = reduce(stacked, summed)
        flat = stacked.tolist()
        result = dict(zip(names, flat[: len(names)]))
        combined: dict[str, list[float]] = {}
        offset = len(names)
        for name, metric in entries:
            value = metric.combine(*flat[offset : offset + len(metric.parts)])
            offset += len(metric.parts)
            if value is not None:
                combined.setdefault(name, []).append(value)
        result.update({name: sum(v) / len(v) for name, v in combined.items()})
        return {**missing, **result}


__all__ = ["MetricAverages", "RankSums", "ratio", "ratio_if_any"]
