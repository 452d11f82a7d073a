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
