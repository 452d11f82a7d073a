"""No device->host synchronisation inside a training step, for every teacher-forced trainer, under the GPU's device
policy (``hfnative.device_policy``, forced here on CPU): the loss, the metric sums and the token counts stay on the
device and are read once per logging step.

A ``TorchDispatchMode`` sees every aten op from the moment a step's batches move to the device until its optimizer step
returns, and counts the ones that make a CUDA device wait for the host to read a value: ``_local_scalar_dense`` (what
``.item()``, ``int(t)``, ``bool(t)`` and ``if t:`` become), ``is_nonzero``, ``equal``, and the ops whose output shape
depends on the values (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` with a tensor of repeats,
indexing or ``index_put`` with a boolean mask). The batch's host-side preparation (collation, the attention plan, the
normalizer's count) runs before the batches move and is not counted: on a GPU it reads host memory. On CPU the device
is the host, so the CPU's own policy keeps its host reads (they skip work there); a run under it shows the counter
does find them. Each trainer runs 4 optimizer steps (logging every second) on the shipped tiny model, in fp32 (its
logged losses and grad norms equal the CPU policy's run, 1e-5) and, for three of them, under bf16 autocast. ``masked_scatter``
is counted too (the CPU path's compact log-probs scatter back with it); the GPU policy's paths use none.
"""

from __future__ import annotations

import collections
import json
import traceback
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoTokenizer

import hfnative as h
from hfnative.device_policy import use_device_policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
TEACHER = str(ROOT / "examples" / "tiny-qwen3-teacher")
aten = torch.ops.aten

# ops that read a device value on the host, or whose output size depends on device values
SYNCING = {
    aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default,
    aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
    aten.unique_dim.default, aten.repeat_interleave.Tensor, aten.masked_scatter.default,
}
# indexing ops that sync when an index is boolean (a mask: the output size is its count)
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class SyncCounter(TorchDispatchMode):
    """Counts syncing ops by (op, the innermost hfnative / trainer frames that called it)."""

    def __init__(self):
        super().__init__()
        self.found = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        syncs = func in SYNCING or (
            func in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1])
        )
        if syncs:
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:][::-1])
            self.found[f"{func} at {where}"] += 1
        return func(*args, **(kwargs or {}))


def count_step_syncs(trainer) -> collections.Counter:
    """Train, counting syncing ops from the end of each step's host-side preparation (its normalizer, the last part,
    counted on the host batches) until its optimizer step returns."""
    counter = SyncCounter()
    normalizer, optimizer_step = trainer._step_normalizer, trainer._optimizer_step
    active = []

    def step_normalizer(*args):
        result = normalizer(*args)
        counter.__enter__()  # the batches move to the device next: the step's device work starts
        active.append(True)
        return result

    def step():
        try:
            return optimizer_step()
        finally:
            if active:
                active.pop()
                counter.__exit__(None, None, None)

    trainer._step_normalizer, trainer._optimizer_step = step_normalizer, step
    trainer.train()
    assert not active
    return counter.found


def _rows(name: str, n: int) -> list[dict]:
    with open(ROOT / "examples" / "data" / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _unpaired(n: int) -> list[dict]:
    return [{"prompt": pair["prompt"], "completion": pair["chosen"] if i % 2 else pair["rejected"], "label": bool(i % 2)}
            for i, pair in enumerate(_rows("preference.jsonl", n))]


def _trainer(name: str, output_dir: Path, bf16: bool):
    common = dict(output_dir=str(output_dir), use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=2,
                  save_strategy="no", max_steps=4, learning_rate=1e-3, seed=0, bf16=bf16, max_length=64,
                  per_device_train_batch_size=2, gradient_accumulation_steps=2)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    preference = Dataset.from_list(_rows("preference.jsonl", 16))
    if name in ("SFT", "SFT-packed"):
        return h.SFTTrainer(model=MODEL, args=h.SFTConfig(**common, packing=name == "SFT-packed"),
                            train_dataset=Dataset.from_list(_rows("sft_messages.jsonl", 16)), processing_class=tokenizer)
    if name == "KTO":
        return h.KTOTrainer(model=MODEL, args=h.KTOConfig(**common), train_dataset=Dataset.from_list(_unpaired(16)),
                            processing_class=tokenizer)
    if name == "GKD-off-policy":
        config = h.GKDConfig(**common, lmbda=0.0)
        return h.GKDTrainer(model=MODEL, teacher_model=TEACHER, args=config, processing_class=tokenizer,
                            train_dataset=Dataset.from_list(_rows("sft_messages.jsonl", 16)))
    classes = {"DPO": (h.DPOTrainer, h.DPOConfig), "ORPO": (h.ORPOTrainer, h.ORPOConfig),
               "CPO": (h.CPOTrainer, h.CPOConfig), "reward": (h.RewardTrainer, h.RewardConfig)}
    trainer_class, config_class = classes[name]
    return trainer_class(model=MODEL, args=config_class(**common), train_dataset=preference, processing_class=tokenizer)


TRAINERS = ["SFT", "SFT-packed", "DPO", "KTO", "ORPO", "CPO", "reward", "GKD-off-policy"]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", TRAINERS)
def test_training_step_makes_no_host_sync_under_the_gpu_policy(name, bf16, tmp_path):
    if bf16 and name not in ("SFT", "DPO", "KTO"):
        pytest.skip("bf16 autocast runs the same host-side code; three trainers cover it")
    with use_device_policy("gpu"):
        trainer = _trainer(name, tmp_path, bf16)
        found = count_step_syncs(trainer)
    assert not found, f"{name}: the step read the device on the host:\n" + "\n".join(
        f"  {count} x {where}" for where, count in found.most_common())
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs), logs
    if not bf16:  # the same run under the CPU's policy (which the trainers' TRL tests hold to TRL's numbers)
        with use_device_policy("cpu"):
            cpu_trainer = _trainer(name, tmp_path / "cpu", bf16)
            cpu_trainer.train()
        cpu_logs = [entry for entry in cpu_trainer.state.log_history if "loss" in entry]
        for entry, cpu_entry in zip(logs, cpu_logs):
            for key in ("loss", "grad_norm"):
                assert entry[key] == pytest.approx(cpu_entry[key], rel=1e-5, abs=1e-7), (name, key, entry, cpu_entry)


def test_the_counter_finds_the_cpu_policys_host_reads(tmp_path):
    """The CPU's policy drops ignored positions with a boolean index and checks top-1 ties on the host: the
    counter sees both, so a sync that creeps into a step under the GPU policy would be seen too."""
    with use_device_policy("cpu"):
        found = count_step_syncs(_trainer("SFT", tmp_path, bf16=False))
    assert any("aten.index.Tensor" in where and "cross_entropy.py" in where for where in found), found
    assert any("_local_scalar_dense" in where and "_chunks.py" in where for where in found), found
