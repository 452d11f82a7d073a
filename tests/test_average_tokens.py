"""average_tokens_across_devices against TRL's SFTTrainer on the same 2-process launch (gloo, CPU): with False each
rank divides its loss by its own label tokens and the ranks' gradients are averaged; with True (the default) the
step's loss is over all its tokens. Each setting's per-step losses and gradient norms equal TRL's, and the two
settings differ (the ranks hold different numbers of label tokens)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _launch(out: Path, runner: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "_average_tokens_worker.py"), str(out), runner]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]


def test_per_rank_token_means_equal_trls(tmp_path):
    pytest.importorskip("trl")
    for runner in ("trl", "hfnative"):
        _launch(tmp_path, runner)
    logs = {name: json.loads((tmp_path / f"{name}.json").read_text())
            for name in ("trl-false", "trl-true", "hfnative-false", "hfnative-true")}
    for average in ("false", "true"):
        ours, theirs = logs[f"hfnative-{average}"], logs[f"trl-{average}"]
        assert len(ours) == len(theirs) == 4
        for mine, reference in zip(ours, theirs):
            for key in ("loss", "grad_norm"):
                assert mine[key] == pytest.approx(reference[key], rel=1e-5), (average, mine["step"], key)
    # the setting matters here, far beyond the tolerance (measured: loss 5.5e-4, grad norm 1.7% apart at step 1)
    first_false, first_true = logs["trl-false"][0], logs["trl-true"][0]
    assert abs(first_false["loss"] - first_true["loss"]) > 1e-4 * first_true["loss"]
    assert abs(first_false["grad_norm"] - first_true["grad_norm"]) > 1e-2 * first_true["grad_norm"]


def test_context_parallelism_refuses_per_rank_means(tmp_path):
    from hfnative.trainers.loop.trainer import Trainer

    class Run:  # what _context_parallel_conflicts reads of a context-parallel layout
        class dims:
            cp_enabled, cp = True, 2

    from hfnative.trainers.algorithms.distillation import OnPolicyDistillationObjective
    from hfnative.trainers.loop.objective import LanguageModelingObjective

    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(distributed=Run(), compute_loss_func=None, compute_metrics=None,
                            args=type("Args", (), {"average_tokens_across_devices": False})(),
                            objective=LanguageModelingObjective.__new__(LanguageModelingObjective))
    conflicts = trainer._context_parallel_conflicts(evaluating=False)
    assert len(conflicts) == 1 and "average_tokens_across_devices=False with context parallelism" in conflicts[0]
    # TRL's DistillationTrainer normalizes over every rank's tokens whatever the flag says: nothing to refuse
    trainer.objective = OnPolicyDistillationObjective.__new__(OnPolicyDistillationObjective)
    assert trainer._context_parallel_conflicts(evaluating=False) == []
