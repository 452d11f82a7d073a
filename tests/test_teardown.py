"""Ending a distributed run: ``hfnative.parallel.end_process_group`` waits, the GIL released, until gloo's
worker threads have let go of their last collectives, so no rank aborts in interpreter finalization
("terminate called without an active exception", exit -6) after its work is done."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hfnative.parallel import teardown

HERE = Path(__file__).resolve().parent
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are inspected through /proc")


class _Thread:
    """A thread running ``body(stop)`` and its /proc/self/task path."""

    def __init__(self, body):
        self.stop = threading.Event()
        self.tid = None
        started = threading.Event()

        def run():
            self.tid = threading.get_native_id()
            started.set()
            body(self.stop)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait()
        time.sleep(0.05)  # into its wait

    @property
    def task(self) -> str:
        return f"/proc/self/task/{self.tid}"

    def end(self):
        self.stop.set()
        self.thread.join()


def _becomes_idle(task: str, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not teardown._is_idle(task):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@needs_proc
def test_a_thread_on_an_untimed_wait_is_idle_a_timed_wait_or_a_runnable_thread_is_busy():
    def timed_waits(stop):  # like a thread waiting for the GIL
        while not stop.wait(0.5):
            pass

    def spin(stop):
        while not stop.is_set():
            sum(range(1000))

    untimed = _Thread(lambda stop: stop.wait())  # like a gloo worker waiting on its work queue
    timed = _Thread(timed_waits)
    spinning = _Thread(spin)
    try:
        assert _becomes_idle(untimed.task)  # at once, unless a loaded machine has not yet run it into its wait
        assert not teardown._is_idle(timed.task)
        # a spinning Python thread is running, runnable, or (between GIL hand-offs) in the GIL's timed wait
        assert not any(teardown._is_idle(spinning.task) for _ in range(5))
    finally:
        for thread in (untimed, timed, spinning):
            thread.end()
    assert teardown._is_idle(untimed.task)  # a thread that has ended counts as idle


def test_with_no_gloo_group_it_returns_at_once():
    start = time.monotonic()
    assert teardown.end_process_group() is True
    assert time.monotonic() - start < 1.0


@needs_proc
def test_ranks_ending_right_after_a_barrier_exit_cleanly(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               str(HERE / "_exit_race_worker.py"), str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "terminate called" not in result.stderr
    for rank in range(4):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["gloo_workers"] >= 2 and seen["idle"] is True, (rank, seen)
