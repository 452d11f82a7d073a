"""Fixtures shared by test modules that ask for them (none is applied to the whole suite)."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """A module's one-process runs train with one intra-op thread, as each launched rank does (OMP_NUM_THREADS=1):
    on tiny models a second thread only waits at every op's barrier, and on 2 busy cores that wait measured ~10x a
    one-process run's time (22 s against 2 s). Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
