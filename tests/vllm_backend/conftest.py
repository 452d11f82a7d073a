"""Fixtures for the vLLM backend tests. They run in .venv-vllm (scripts/vllm_env.sh builds it and runs them);
elsewhere every test here is skipped because vllm is not importable."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# set for the vLLM tests only (in the main suite this folder's tests are skipped and nothing is set)
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}  # KV cache GiB: the tiny model needs a few MiB
MODEL_DIR = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-hd32"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.fail(f"{MODEL_DIR} is missing: run examples/make_vllm_model.py")
    return MODEL_DIR


@pytest.fixture(scope="session")
def vllm_server(model_dir, tmp_path_factory):
    """A real `vllm serve` on 127.0.0.1, set up for the files weight transport; its base URL."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    env = {**os.environ, **VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1"}
    command = [
        # `vllm serve`'s own module: vllm-cpu 0.32.0's `vllm` command looks up the version of a package named
        # "vllm", which is installed as "vllm-cpu", and exits before serving
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
        "--max-num-seqs", "16", "--seed", "0", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", "hfnative.generation.vllm_backend.VLLMWorkerExtension",
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        import requests

        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up in 300 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
