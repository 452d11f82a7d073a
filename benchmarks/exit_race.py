"""How often a gloo rank aborts at exit ("terminate called without an active exception", exit -6) when it
ends right after a barrier with its group left up (as a trainer's groups are: they outlive
``destroy_process_group``) versus ending with ``hfnative.parallel.end_process_group``.

Launches tests/_exit_race_worker.py with torchrun, alternating the two endings, and prints the launches
that failed for each (hfnative/parallel/teardown.py explains the race). CPU only, gloo.

    python benchmarks/exit_race.py --launches 30 --nproc 4
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_exit_race_worker.py"


def launch(ending: str, nproc: int) -> tuple[int, bool]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests"))
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               str(nproc), str(WORKER), out, ending], env=env, capture_output=True, text=True)
    return done.returncode, "terminate called" in done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=30, help="launches of each ending")
    parser.add_argument("--nproc", type=int, default=4)
    cli = parser.parse_args()
    failed = {"none": [], "end": []}
    start = time.monotonic()
    for i in range(cli.launches):
        for ending in failed:
            code, aborted = launch(ending, cli.nproc)
            if code != 0:
                failed[ending].append((i, code, aborted))
    print(f"{platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()} | "
          f"{cli.launches} launches x {cli.nproc} processes per ending, {time.monotonic() - start:.0f} s")
    for ending, failures in failed.items():
        label = "group left up" if ending == "none" else "end_process_group"
        aborts = sum(aborted for _, _, aborted in failures)
        print(f"  {label:22s} failed launches: {len(failures)}/{cli.launches} (with the abort message: {aborts})")


if __name__ == "__main__":
    main()
