"""float8 training (tensorwise under FSDP2 with float8 all-gather, rowwise under tensor parallel) on 2 gloo processes
equals one float8 process: one launch of tests/_float8_layout_worker.py.

The oracle runs what the ranks run: float8 scales activations and gradients over the micro-batch it sees, so one
process takes the FSDP2 ranks' micro-batches as gradient-accumulation steps (a data-parallel float8 run differs from
one process over the whole global batch by those scales: 1e-2 in gradient norms here), and the tensor-parallel ranks'
one batch as is. The weights' scales are the same everywhere (FSDP2 casts its shards with one all-reduced amax,
tensor parallel takes amaxes over DTensors). What is left is the fp32 order of the sharded reductions; now and then it
moves a value across a float8 rounding boundary, one e4m3 step (2^-4 relative) on one element, which reaches a
gradient norm at ~1e-3 and, through AdamW's normalized update, a weight by a fraction of the learning rate (3e-3).
Measured: losses within 1e-5, gradient norms 8e-4, weights 3.2e-4 (FSDP2); TP2 equal to fp32 round-off.
"""

from __future__ import annotations

import json
from pathlib import Path

import _distributed_train_worker as train_worker
import _float8_layout_worker as worker
import pytest
import torch
from _launch import torchrun
from safetensors.torch import load_file

from hfnative import SFTTrainer


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("float8-layouts")
    torchrun("_float8_layout_worker.py", [str(out), *worker.LAYOUTS], processes=2, timeout=600)
    return out


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_float8_layout_trains_like_one_float8_process(launched, layout, tmp_path):
    sizes, recipe = worker.LAYOUTS[layout]
    ranks = sizes.get("dp_shard_size", 1)  # the FSDP2 ranks' micro-batches, one after the other
    args = train_worker.config(str(tmp_path), train_worker.PER_DEVICE, gradient_accumulation_steps=ranks,
                               float8_recipe=recipe)
    reference = SFTTrainer(model=worker.MODEL, args=args, train_dataset=train_worker.train_dataset({}))
    reference.train()
    reference.save_model()
    logs = [entry for entry in json.loads((launched / layout / "log.json").read_text()) if "loss" in entry]
    reference_logs = [entry for entry in reference.state.log_history if "loss" in entry]
    assert len(logs) == len(reference_logs) == train_worker.STEPS
    for mine, oracle in zip(logs, reference_logs):
        for key, rel in (("loss", 1e-4), ("grad_norm", 3e-3), ("num_tokens", 0)):
            assert mine[key] == pytest.approx(oracle[key], rel=rel), (layout, oracle["step"], key)
    weights, reference_weights = (load_file(str(folder / "model.safetensors")) for folder in (launched / layout, tmp_path))
    assert {k: v.dtype for k, v in weights.items()} == {k: v.dtype for k, v in reference_weights.items()}
    for key, value in reference_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-3, msg=key)
