"""PPOTrainer under DDP and FSDP2 on 2 processes (torchrun, gloo), each equal to one process on the same global batch,
and an FSDP2 run resumed from its distributed checkpoint equal to the uninterrupted one.

Nothing is stood in for: each rank samples its rows from the native engine (each row's own sampling stream, keyed by
the seed, the update and the row's place in the whole batch, so the samples do not depend on the layout), stopping at
EOS, so rows keep different numbers of tokens; the reward model scores, the value model values and the reference
model reads every rank's own rows, and every rank then holds the whole rollout batch: the rewards, the advantages
(whitened over the whole batch) and the shuffles of the PPO epochs are one process's. The micro-batches are cut over
the ranks and each rank's loss is its share of the whole micro-batch's token means.

Checked per update (3 updates, 2 PPO epochs of 2 accumulation steps): the scores, the KL and the response tokens
equal (the same responses were sampled and read), and the loss and the statistics of the PPO epochs (policy and value
loss, clip fractions, approximate KL, entropy, ratio) within 1e-5 relative of one process's: the well-conditioned
checks that each micro-batch's gradient was its share of one process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _ppo_layouts_worker import SAVED, UPDATES, save_stopping_policy, train
from _ppo_worker import save_classifier

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

HERE = Path(__file__).resolve().parent
RUNS = ["ddp", "fsdp2", "fsdp2-resume"]
REFUSED = ["tp2"]
SAME = ("objective/scores", "val/num_eos_tokens", "episode")
CLOSE = ("loss", "objective/kl", "objective/non_score_reward", "objective/entropy", "loss/policy_avg", "loss/value_avg",
         "policy/approxkl_avg", "policy/clipfrac_avg", "val/clipfrac_avg", "policy/entropy_avg", "val/ratio")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The reward and value models (random one-label classifiers), written before any rank reads them."""
    folder = tmp_path_factory.mktemp("ppo-layout-models")
    for seed, name in enumerate(("reward", "value"), start=1):
        save_classifier(folder / name, seed)
    save_stopping_policy(folder / "policy")
    return folder


@pytest.fixture(scope="module")
def launched(tmp_path_factory, models) -> Path:
    out = tmp_path_factory.mktemp("ppo-layouts")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "_ppo_layouts_worker.py"), str(out), str(models), *RUNS, *REFUSED]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-8000:]
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, models) -> list[dict]:
    return train(str(tmp_path_factory.mktemp("ppo-one-process") / "run"), str(models), 1)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("run", RUNS)
def test_layout_equals_one_process(launched, one_process, run):
    expected = [row for row in one_process if "objective/kl" in row]
    assert len(expected) == UPDATES
    first = SAVED + 1 if run.endswith("-resume") else 1
    for rank in range(2):
        logs = {row["step"]: row for row in json.loads((launched / f"{run}-rank{rank}.json").read_text())
                if "objective/kl" in row}
        assert sorted(logs) == list(range(1, UPDATES + 1)), (run, rank, sorted(logs))
        for want in expected[first - 1 :]:
            got, where = logs[want["step"]], (run, rank, want["step"])
            for key in SAME:
                assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-9), (where, key, got[key], want[key])
            for key in CLOSE:
                assert _relative(got[key], want[key]) <= 1e-5 or abs(got[key] - want[key]) <= 1e-7, \
                    (where, key, got[key], want[key])
    # the updates trained something, and some rows stopped early (the per-token means were over unequal rows)
    assert expected[-1]["objective/kl"] != 0
    assert any(row["val/num_eos_tokens"] > 0 for row in expected)


def test_tensor_parallelism_is_refused_in_one_message(launched):
    for rank in range(2):
        error = json.loads((launched / f"tp2-rank{rank}.json").read_text())["error"]
        assert error.startswith("UnsupportedLayoutError: PPOTrainer does not support tensor parallelism (tp_size > 1): "
                                "set tp_size=1"), error
