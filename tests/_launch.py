"""``torchrun``: one multi-process launch of a test worker script, as the layout tests start them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def torchrun(script: str, args: list[str], processes: int, timeout: float, **env: str) -> None:
    """Run ``tests/<script>`` with ``args`` on ``processes`` gloo ranks (torch.distributed.run --standalone), one
    intra-op thread each and tests/ on the import path (plus ``env``); fail with the end of its stderr unless it
    exits 0."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE), **env)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(HERE / script), *args]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-6000:]


# logged values that are differences of sequence log-probs (policy minus reference): each term carries float32
# rounding of ~1e-7 of a log-prob's size that a layout's other reduction order changes, and the difference keeps it
LOGP_DIFFERENCES = ("rewards/", "kl", "objective/non_score_reward", "objective/rlhf_reward")


def assert_logged_close(mine: dict, theirs: dict, where, rel: float = 1e-5, abs: float = 1e-6) -> None:
    """Every float ``theirs`` logged (perf/* and epoch aside) is in ``mine`` and equal within ``rel`` / ``abs``; a
    difference of log-probs within ``abs`` or 5e-7 of the largest ``logps/*`` that step logged, whichever is larger."""
    import pytest

    for key, value in theirs.items():
        if key.startswith("perf/") or key == "epoch" or not isinstance(value, float):
            continue
        assert key in mine, (where, key)
        assert mine[key] == pytest.approx(value, rel=rel, abs=logged_abs_tolerance(key, theirs, abs)), (where, key)


def logged_abs_tolerance(key: str, entry: dict, abs: float = 1e-6) -> float:
    """``abs``, or for a difference of log-probs 5e-7 of the largest ``logps/*`` in the logged ``entry`` if larger."""
    if not any(part in key for part in LOGP_DIFFERENCES):
        return abs
    logps = [value for name, value in entry.items() if name.startswith("logps/")]
    return max(abs, 5e-7 * max((v if v >= 0 else -v for v in logps), default=0.0))
