"""The CPU tensor pool (hfnative/allocator.py, hfnative/_cpu_pool.cpp): each probe runs in a fresh process, since the
pool, once installed, is torch's CPU allocator for the rest of the process."""

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or (shutil.which("g++") is None and shutil.which("c++") is None),
    reason="the pool is built with the system's C++ compiler on Linux",
)

MIB = 2**20

_PROBE = """
import json, os, random
import torch
from hfnative.allocator import _pool_stats, heap_stats, pool_cpu_tensors

MIB = 2**20
out = {"installed": pool_cpu_tensors(), "again": pool_cpu_tensors()}
base, _, free_before = _pool_stats()

# best fit, split and coalesced: a freed middle block takes a smaller request at its own address
a, b, c = (torch.empty(4 * MIB, dtype=torch.uint8) for _ in range(3))
out["in_use"] = _pool_stats()[0] - base
b_address = b.data_ptr()
del b
d = torch.empty(2 * MIB, dtype=torch.uint8)
out["reused"] = d.data_ptr() == b_address
before = _pool_stats()[0]
small = torch.empty(1000)
out["small_outside"] = _pool_stats()[0] == before  # from malloc
del small
del a, c, d
out["freed"] = _pool_stats()[0] - base
out["new_free_blocks"] = _pool_stats()[2] - free_before

# no two live tensors share memory: random sizes, frees in random order, each filled with its own value
rng = random.Random(0)
live = {}
for step in range(400):
    if live and rng.random() < 0.45:
        key = rng.choice(list(live))
        tensor, value = live.pop(key)
        assert bool((tensor == value).all()), "a tensor was overwritten"
    else:
        numel = rng.choice([1, 100, 2**18, 2**18 + 3, 2**19, 3 * 2**19, 2**20 + 17, 5 * 2**20]) // 4 or 1
        live[step] = (torch.full((numel,), float(step)), float(step))
out["intact"] = all(bool((tensor == value).all()) for tensor, value in live.values())
live.clear()
tensor = None  # the last one popped
out["all_back"] = _pool_stats()[0] - base

NUMBERS

# heap_stats counts the pool
held = torch.empty(8 * MIB, dtype=torch.uint8)
out["heap_counts_pool"] = heap_stats().in_use >= _pool_stats()[0] >= 8 * MIB
del held

# a fork (as a DataLoader worker, one thread: OpenMP does not survive a fork) allocates and frees from the pool's copy
pid = os.fork()
if pid == 0:
    try:
        torch.set_num_threads(1)
        t = torch.ones(3 * MIB)
        os._exit(0 if float(t.sum()) == 3 * MIB else 1)
    except BaseException:
        os._exit(2)
out["fork"] = os.waitpid(pid, 0)[1] == 0

# the profiler still sees the CPU memory of tensors from the pool
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    kept = torch.empty(6 * MIB, dtype=torch.uint8)
out["profiled"] = max(event.cpu_memory_usage for event in prof.key_averages()) >= 6 * MIB
print(json.dumps(out))
"""


def _probe(env_overrides: dict, code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HFNATIVE_CPU_TENSOR_POOL", "CXX")}
    env.update(env_overrides)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# a matmul chain with its gradients, compared by the test with the numbers torch's own CPU allocator gives
_NUMBERS = """
torch.manual_seed(0)
x = torch.randn(512, 768, requires_grad=True)
w = torch.randn(768, 2048, requires_grad=True)
loss = torch.tanh(x @ w).square().mean()
loss.backward()
out["numbers"] = [loss.item(), x.grad.double().sum().item(), w.grad.double().abs().sum().item()]
"""


def test_pool_places_frees_and_reuses_blocks_without_changing_numbers():
    got = _probe({}, _PROBE.replace("NUMBERS", _NUMBERS))
    assert got["installed"] and got["again"]
    assert got["in_use"] == 3 * 4 * MIB  # three whole blocks
    assert got["reused"] and got["small_outside"]
    assert got["freed"] == 0 and got["new_free_blocks"] == 0  # coalesced back into the range's end
    assert got["intact"] and got["all_back"] == 0
    assert got["heap_counts_pool"] and got["fork"] and got["profiled"]
    # the same numbers as torch's own CPU allocator
    plain = _probe({"HFNATIVE_CPU_TENSOR_POOL": "0"},
                   "import json, torch\nfrom hfnative.allocator import pool_cpu_tensors\n"
                   "out = {'installed': pool_cpu_tensors()}\n" + _NUMBERS + "print(json.dumps(out))")
    assert plain["installed"] is False
    assert got["numbers"] == plain["numbers"]


def test_pool_switched_off_or_unbuildable_leaves_torch_allocator(tmp_path):
    code = ("import json, torch\nfrom hfnative.allocator import _pool_stats, pool_cpu_tensors\n"
            "ok = pool_cpu_tensors()\nt = torch.ones(4 * 2**20)\n"
            "print(json.dumps({'installed': ok, 'stats': _pool_stats(), 'sum': float(t.sum())}))")
    off = _probe({"HFNATIVE_CPU_TENSOR_POOL": "0"}, code)
    assert off == {"installed": False, "stats": None, "sum": 4.0 * MIB}
    no_compiler = _probe({"CXX": str(tmp_path / "no-such-compiler"), "HFNATIVE_CACHE_DIR": str(tmp_path / "cache")}, code)
    assert no_compiler == {"installed": False, "stats": None, "sum": 4.0 * MIB}
    assert not any((tmp_path / "cache").glob("*.so"))  # nothing half-built left behind


_TRAINER = """
import json, sys
from datasets import Dataset
from hfnative import SFTConfig, SFTTrainer
from hfnative.allocator import _pool_stats

rows = [json.loads(line) for line in open(sys.argv[1])][:8]
args = SFTConfig(output_dir=sys.argv[2], use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=1,
                 per_device_train_batch_size=2, save_strategy="no", max_length=64)
SFTTrainer(model=sys.argv[3], args=args, train_dataset=Dataset.from_list(rows)).train()
print(json.dumps({"installed": _pool_stats() is not None}))
"""


@pytest.mark.parametrize("switch,installed", [(None, False), ("1", True), ("0", False)])
def test_the_trainer_installs_the_pool_only_when_asked(tmp_path, switch, installed):
    """Opt-in: a training run on CPU leaves torch's allocator alone unless HFNATIVE_CPU_TENSOR_POOL=1."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "HFNATIVE_CPU_TENSOR_POOL"}
    if switch is not None:
        env["HFNATIVE_CPU_TENSOR_POOL"] = switch
    command = [sys.executable, "-c", _TRAINER, os.path.join(root, "examples/data/sft_messages.jsonl"),
               str(tmp_path / "run"), os.path.join(root, "examples/tiny-qwen3")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"installed": installed}
