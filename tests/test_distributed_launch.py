"""Launching as TRL users do: ``accelerate launch --config_file`` with TRL's shipped fsdp2 and multi_gpu
configs, hfnative-train's own ``--num_processes`` / ``--accelerate_config``, and two torchrun launchers
forming one job over loopback (multi-node). Each runs the unchanged TRL-style script examples/sft.py on 2 CPU
processes and must log the losses of the same script on one process over the same global batches."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS, PER_DEVICE = 3, 2
TRL_CONFIGS = Path(pytest.importorskip("trl").__file__).parent / "accelerate_configs"


def _script_arguments(output_dir: Path, per_device: int) -> list[str]:
    return ["--config", str(ROOT / "examples" / "sft_full.yaml"), "--output_dir", str(output_dir),
            "--max_steps", str(STEPS), "--per_device_train_batch_size", str(per_device), "--logging_steps", "1",
            "--save_steps", str(STEPS), "--save_total_limit", "1", "--seed", "11"]


def _run(command: list[str], cwd: Path = ROOT) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]


def _logged(output_dir: Path) -> list[dict]:
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("one")
    _run([sys.executable, str(ROOT / "examples" / "sft.py"), *_script_arguments(out, 2 * PER_DEVICE)])
    return _logged(out)


def _assert_same_training(logged: list[dict], reference: list[dict]) -> None:
    assert len(logged) == len(reference) == STEPS
    for mine, theirs in zip(logged, reference):
        for key in ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "num_tokens"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (theirs["step"], key)


@pytest.mark.parametrize("config", ["fsdp2", "multi_gpu"])
def test_accelerate_launch_with_trl_config(config, one_process, tmp_path):
    out = tmp_path / config
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(TRL_CONFIGS / f"{config}.yaml"),
          "--num_processes", "2", "--mixed_precision", "no", str(ROOT / "examples" / "sft.py"),
          *_script_arguments(out, PER_DEVICE)])
    _assert_same_training(_logged(out), one_process)
    assert (out / "model.safetensors").is_file() and (out / f"checkpoint-{STEPS}" / "training_state").is_dir()


def test_cli_launches_its_processes(one_process, tmp_path):
    out = tmp_path / "cli"
    _run([sys.executable, "-m", "hfnative.trainers.running.cli", "sft", *_script_arguments(out, PER_DEVICE),
          "--num_processes", "2", "--accelerate_config", "fsdp2", "--mixed_precision", "no"])
    _assert_same_training(_logged(out), one_process)


def test_tensor_parallel_from_the_command_line(one_process, tmp_path):
    """TP2 on 2 torchrun processes (both ranks read the same rows), set with --parallelism_config."""
    out = tmp_path / "tp2"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          str(ROOT / "examples" / "sft.py"), *_script_arguments(out, 2 * PER_DEVICE),
          "--parallelism_config", '{"dp_shard_size": 1, "tp_size": 2}'])
    _assert_same_training(_logged(out), one_process)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_launchers_train_as_one_job(one_process, tmp_path):
    """--nnodes 2: one launcher per "node" on loopback, rendezvous over TCP, FSDP over both."""
    out, port = tmp_path / "nodes", _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
             "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(ROOT / "examples" / "sft.py"), *_script_arguments(out, PER_DEVICE), "--fsdp", "full_shard"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    for launcher in launchers:
        _, stderr = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, stderr[-6000:]
    _assert_same_training(_logged(out), one_process)
