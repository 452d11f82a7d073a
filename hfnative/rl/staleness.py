"""How far behind the policy a rollout may be, and the numbers logged about it.

A sample generated with policy version v (the number of optimizer steps its weights had taken) is
trained on at step t only if t - v <= max_staleness; older samples are dropped and counted.
"""

from __future__ import annotations


class StalenessFilter:
    """Keeps or drops rollouts by their policy lag; ``pop_metrics`` gives TRL's keys for the logging window:
    sample/staleness_mean and sample/staleness_max over the kept samples, sample/dropped_stale_total (samples
    dropped in the window), and the kept samples' policy versions (sample/model_version_min / _max)."""

    def __init__(self, max_staleness: int):
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness!r}: expected an int >= 0 (0 trains on-policy only)")
        self.max_staleness = max_staleness
        self.dropped_total = 0  # over the whole run
        self._lags: list[int] = []
        self._versions: list[int] = []
        self._dropped = 0

    def keep(self, step: int, version: int, num_samples: int) -> bool:
        """Whether ``num_samples`` samples generated with policy ``version`` may be trained on at ``step``."""
        lag = step - version
        if lag < 0:
            raise ValueError(f"a rollout of policy version {version} reached step {step}: versions run ahead of steps")
        if lag > self.max_staleness:
            self._dropped += num_samples
            self.dropped_total += num_samples
            return False
        self._lags += [lag] * num_samples
        self._versions += [version] * num_samples
        return True

    def pop_metrics(self) -> dict[str, float]:
        metrics = {"sample/dropped_stale_total": float(self._dropped)}
        if self._lags:
            metrics["sample/staleness_mean"] = sum(self._lags) / len(self._lags)
            metrics["sample/staleness_max"] = float(max(self._lags))
            metrics["sample/model_version_min"] = float(min(self._versions))
            metrics["sample/model_version_max"] = float(max(self._versions))
        self._lags, self._versions, self._dropped = [], [], 0
        return metrics
