"""Ending a distributed run so that no rank aborts at interpreter exit.

Gloo runs each collective on the process group's worker threads ("pt_gloo_runloop"), and a worker
releases a finished collective a moment *after* the caller's ``wait()`` has returned: the collective's
tensors, and for a barrier every collective still in flight when the barrier was queued. Releasing a
tensor that Python created takes the GIL. If the main thread reaches interpreter finalization first,
CPython 3.11 ends any thread that asks for the GIL with ``pthread_exit``; the unwinding runs into the
work's C++ destructor (``noexcept``) and the process aborts with "terminate called without an active
exception" (exit -6), after all of its work is done. The usual trigger is the barrier after the final
save, followed at once by the end of the script, on a loaded machine where the worker thread is not
scheduled in time.

``destroy_process_group`` only ends threads of groups nothing else refers to; a trained model's groups
outlive it (in a 4-process FSDP2 x TP2 run, 4 of 5 groups' threads were still running after it and a
``gc.collect()``, with no Python container holding a group), so :func:`end_process_group` also lets go of
the GIL until every gloo worker thread is idle, waiting for its next collective, before the interpreter
goes on to finalize.
"""

from __future__ import annotations

import os
import platform
import time

import torch.distributed as dist

_GLOO_WORKER = "pt_gloo_runloop"
_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())  # the futex system call's number


def _gloo_workers() -> list[str]:
    """This process's gloo worker threads, as /proc/self/task/<tid> paths (empty where there is no /proc)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    workers = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == _GLOO_WORKER:
                    workers.append(f"/proc/self/task/{tid}")
        except OSError:  # the thread ended meanwhile
            continue
    return workers


def _is_idle(task: str) -> bool:
    """Whether a gloo worker sleeps on its work queue: blocked (state S) in an untimed futex wait.

    A worker that is runnable, inside a collective (socket I/O), or in a timed wait (how CPython's
    GIL is waited for) is busy. A thread that has ended counts as idle."""
    try:
        with open(f"{task}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state != "S":
            return state in ("Z", "X")
        with open(f"{task}/syscall") as f:
            fields = f.read().split()
    except (OSError, IndexError):
        return True
    if not fields or fields[0] in ("running", "-1"):
        return False
    # futex(uaddr, op, val, timeout, ...): the work queue's condition variable is waited on without a timeout
    if _FUTEX is not None and int(fields[0]) != _FUTEX:
        return False
    return len(fields) > 4 and int(fields[4], 16) == 0


def wait_for_idle_communication_threads(timeout: float = 5.0, poll: float = 0.002) -> bool:
    """Sleep (the GIL released) until every gloo worker thread of this process has finished with its
    last collective; True when they all were idle twice in a row within ``timeout`` seconds.

    Without /proc (not Linux) the threads cannot be inspected: it sleeps ``min(timeout, 0.1)`` once."""
    workers = _gloo_workers()
    if not workers:
        if not os.path.isdir("/proc/self/task"):
            time.sleep(min(timeout, 0.1))
        return True
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(poll)
        quiet = quiet + 1 if all(_is_idle(task) for task in workers) else 0
        if quiet >= 2:
            return True
    return False


def end_process_group() -> bool:
    """Destroy the default process group (and its subgroups) if one is up, then wait for the gloo
    worker threads to let go of their last collectives: call it last, once every rank's work is done.
    Returns whether they were all idle in time (``wait_for_idle_communication_threads``).

    Safe to call more than once, and with no process group."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return wait_for_idle_communication_threads()
