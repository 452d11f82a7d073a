"""PPO's checkpoints hold the value model beside the policy (``value_model/``, also in the output folder) and resume
to the uninterrupted run: a run resumed from checkpoint-2 in a new trainer, and one SIGKILLed as update 3 began,
log updates 3 and 4 as the uninterrupted run does (1e-6 relative): the same prompts, the same samples (each update
keys its sampling streams and its mini-batch shuffles), the value model's and the policy's weights, the optimizer
over both, the schedule and TRL's accumulation counter (ppo_state.json) restored."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _ppo_worker import SAVED, STEPS, ppo_trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMPARED = ("loss", "grad_norm", "learning_rate", "objective/kl", "objective/scores", "loss/policy_avg",
            "loss/value_avg", "policy/entropy_avg", "val/ratio", "episode")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo-resume")
    trainer = ppo_trainer(root / "run", root / "models")
    trainer.train()
    return root, trainer


def _by_step(log_history):
    return {row["step"]: row for row in log_history if "objective/kl" in row}


def _assert_resumed_equal(resumed_logs, uninterrupted_logs):
    mine, reference = _by_step(resumed_logs), _by_step(uninterrupted_logs)
    for step in range(SAVED + 1, STEPS + 1):
        for key in COMPARED:
            assert mine[step][key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_value_model_is_saved_beside_the_policy(uninterrupted):
    import hfnative
    from transformers import AutoModelForSequenceClassification

    root, trainer = uninterrupted
    checkpoint = root / "run" / f"checkpoint-{SAVED}"
    assert (checkpoint / "value_model" / "config.json").exists() and (checkpoint / "optimizer.pt").exists()
    trainer.save_model()
    saved = AutoModelForSequenceClassification.from_pretrained(root / "run" / "value_model")
    loaded = hfnative.load_pretrained(str(root / "run" / "value_model"), num_labels=1).model
    theirs = dict(saved.named_parameters())
    assert theirs["score.weight"].shape == (1, 32)
    import torch

    torch.testing.assert_close(trainer.value_model.output.weight.detach(), theirs["score.weight"].detach())
    torch.testing.assert_close(loaded.output.weight, theirs["score.weight"].detach())


def test_resumed_run_equals_the_uninterrupted_one(uninterrupted, tmp_path):
    import shutil

    root, trainer = uninterrupted
    shutil.copytree(root / "run" / f"checkpoint-{SAVED}", tmp_path / "run" / f"checkpoint-{SAVED}")
    resumed = ppo_trainer(tmp_path / "run", root / "models")
    resumed.train(resume_from_checkpoint=True)
    _assert_resumed_equal(resumed.state.log_history, trainer.state.log_history)


def test_sigkilled_run_resumes_exactly(uninterrupted, tmp_path):
    root, trainer = uninterrupted
    worker = Path(__file__).with_name("_ppo_worker.py")
    done = subprocess.run([sys.executable, str(worker), str(tmp_path / "run"), str(root / "models"), str(SAVED + 1)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == -9, done.stderr[-2000:]
    assert (tmp_path / "run" / f"checkpoint-{SAVED}").is_dir()
    resumed = ppo_trainer(tmp_path / "run", root / "models")
    resumed.train(resume_from_checkpoint=True)
    _assert_resumed_equal(resumed.state.log_history, trainer.state.log_history)


def test_cli_trains_ppo_and_saves_the_value_model(uninterrupted, tmp_path):
    """``hfnative-train ppo``: a dataset's text prompts tokenized, the reward and value models from
    reward_model_path, the policy and value_model/ saved."""
    import json

    from hfnative.trainers.running import cli

    root, _ = uninterrupted
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}"}) + "\n" for i in range(8)))
    out = tmp_path / "out"
    from _ppo_worker import MODEL

    assert cli.main(["ppo", "--model_name_or_path", MODEL, "--dataset_name", str(data), "--reward_model_path",
                     str(root / "models" / "reward"), "--output_dir", str(out), "--use_cpu", "--no_bf16",
                     "--per_device_train_batch_size", "4", "--num_ppo_epochs", "1", "--response_length", "4",
                     "--total_episodes", "8", "--report_to", "none", "--save_strategy", "no",
                     "--disable_tqdm", "true"]) == 0
    assert (out / "model.safetensors").exists() and (out / "value_model" / "model.safetensors").exists()
    state = json.loads((out / "value_model" / "config.json").read_text())
    assert state["architectures"] == ["Qwen3ForSequenceClassification"]
