"""Fixtures shared by test modules that ask for them (none is applied to the whole suite), and how the suite splits
over pytest-xdist workers (``python -m pytest -n 2``, the README's command)."""

import os
from pathlib import PurePosixPath

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the machine's cores: each trains with one intra-op thread, as every launched rank does, and
    # hands that to the processes its tests start. A second thread per worker would oversubscribe the cores, and on
    # tiny models it only waits at every op's barrier (the whole suite ran as fast with one thread as with two).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Test modules that must not run beside each other: each starts a local Ray cluster sized to the whole machine.
_SHARED_GROUPS = {"test_async_grpo.py": "ray", "test_async_grpo_layouts.py": "ray"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """A test module is one unit of work, run by one worker: its module-scoped fixtures (e.g. a launch that every test
    of it reads) are built once. Modules that share a resource form one unit. Units go to whichever worker is free,
    the units with the most tests first (xdist's order; putting the longest-running modules first measured no faster:
    28:30 against 28:07)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _SHARED_GROUPS.get(PurePosixPath(module).name, module)

    return ModuleScheduling(config, log)


@pytest.fixture(scope="module")
def one_torch_thread():
    """A module's one-process runs train with one intra-op thread, as each launched rank does (OMP_NUM_THREADS=1):
    on tiny models a second thread only waits at every op's barrier, and on 2 busy cores that wait measured ~10x a
    one-process run's time (22 s against 2 s). Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
