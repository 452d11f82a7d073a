"""The GPU policy's Triton kernels (``hfnative.models.triton_kernels``: RMSNorm, the rotated q/k norm and the
SiLU-gated unit, forward and backward), run on CPU by Triton's interpreter in a process of its own, and compiled for
sm_90 by Triton's compiler in another (tests/_triton_kernels_worker.py, whose docstrings say what each check compares
and within what).

Triton is not a dependency of the CPU install, and transformers behaves differently when it can import it, so the
worker gets Triton from a folder of its own: ``.triton-cpu`` in the checkout, installed from the package registry at
the first run (about 290 MB), or the test environment's own Triton where it has one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRITON_DIR = ROOT / ".triton-cpu"
TRITON_REQUIREMENT = "triton==3.6.0"  # the GPU image's; its interpreter runs the kernels on CPU tensors
INTERPRETED = ["rms_norm", "rms_norm_fanned_out", "residual_rms_norm", "norm_rope", "rope", "cross_entropy",
               "cross_entropy_replaced_rows", "silu_gated", "models", "decoding_bf16_weights", "decode_qkv",
               "decode_attention", "dequantize", "dequantize_rollouts", "bf16_autocast", "compiled_blocks_leave_them_to_the_compiler", "bf16_as_close_to_exact_as_torch"]
# Triton's compiler and launcher, without the interpreter: a cubin for sm_90, the variants launches compile; no GPU
COMPILED = ["compiles_for_sm90", "one_variant_for_any_token_count"]


def _triton_path() -> str | None:
    """A PYTHONPATH entry that makes Triton importable ("" when this environment has it), or None."""
    if importlib.util.find_spec("triton") is not None:
        return ""
    if not (TRITON_DIR / "triton" / "__init__.py").exists():
        staging = Path(tempfile.mkdtemp(prefix=".triton-cpu-", dir=ROOT))
        try:
            install = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(staging),
                 TRITON_REQUIREMENT], capture_output=True, text=True, timeout=900,
            )
            if install.returncode != 0:
                return None
            if not TRITON_DIR.exists():
                staging.rename(TRITON_DIR)  # whole or not at all
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(TRITON_DIR)


def _run_worker(path: str, checks: list[str], interpret: bool) -> dict:
    env = dict(os.environ)
    env.pop("HFNATIVE_DEVICE_POLICY", None)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, str(ROOT / "tests"), env.get("PYTHONPATH", "")) if p)
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "_triton_kernels_worker.py"), *checks],
                         capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0 and lines, f"the worker failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def results():
    path = _triton_path()
    if path is None:
        pytest.skip(f"Triton could not be installed into {TRITON_DIR} ({TRITON_REQUIREMENT}: no package registry?)")
    return {**_run_worker(path, INTERPRETED, interpret=True), **_run_worker(path, COMPILED, interpret=False)}


@pytest.mark.parametrize("check", INTERPRETED + COMPILED)
def test_triton_kernels(results, check):
    assert check in results, f"the worker did not run {check}"
    assert results[check] is None, results[check]
