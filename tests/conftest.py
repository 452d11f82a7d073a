"""The suite's torch threads, and fixtures shared by test modules that ask for them."""

import os

import pytest
import torch

# One intra-op thread for the whole suite's in-process runs, as every launched rank has (OMP_NUM_THREADS=1): the
# models here are tiny, so a second thread mostly waits at each op's barrier (see one_torch_thread). Set
# HFNATIVE_TEST_THREADS to another count to run with it. The vLLM backend's tests (their own run, their own venv)
# keep torch's default.
SUITE_THREADS = int(os.environ.get("HFNATIVE_TEST_THREADS", "1"))


def pytest_configure(config):
    if not any("vllm_backend" in str(arg) for arg in config.args):
        torch.set_num_threads(SUITE_THREADS)


@pytest.fixture(scope="module")
def one_torch_thread():
    """A module's one-process runs train with one intra-op thread, as each launched rank does (OMP_NUM_THREADS=1):
    on tiny models a second thread only waits at every op's barrier, and on 2 busy cores that wait measured ~10x a
    one-process run's time (22 s against 2 s). Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
