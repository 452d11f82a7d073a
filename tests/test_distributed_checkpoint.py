"""Distributed training state (hfnative.checkpoint.save_training_state / load_training_state): saved under FSDP2 on 2
ranks after 3 AdamW steps, resumed under FSDP2 on 2 ranks, TP2 on 2 ranks, FSDP2 x TP2 on 4 ranks (one 4-process gloo
launch, tests/_dcp_worker.py) and on 1 plain process (here), each then training the last 2 of 5 steps; the FSDP2 x TP2
resume saves again, and HSDP 2x2 resumes from that.

Oracles: the state right after loading equals the saving run's state at the save exactly (every weight, exp_avg,
exp_avg_sq and step); the 2 resumed steps' losses match the uninterrupted 5-step runs, single-process and FSDP2,
within 1e-5 relative (measured <= ~2e-7); final weights match them within 1e-5 of each tensor's largest weight
(measured <= ~1.5e-6: the layouts sum gradients in other orders), and exactly for the resume in the saving layout.
The folder holds only safetensors and JSON; a save that dies before its rename leaves the previous state in place.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _dcp_worker import EXTRA, SAVED_AT, Run, max_difference
from _parallel_worker import PADDING_ID, VOCAB, global_batches
from hf_configs import CONFIGS
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from hfnative.checkpoint import TrainingStateError, load_training_state, save_training_state
from hfnative.converters.loading import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_dcp_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
LOSS_TOLERANCE = WEIGHT_TOLERANCE = 1e-5
RESUMES = {  # result name -> the ranks that ran it
    "resumed under FSDP2 x TP2 on 4 ranks": (0, 1, 2, 3),
    "resumed under HSDP 2x2 on 4 ranks, saved again under FSDP2 x TP2": (0, 1, 2, 3),
    "resumed under FSDP2 on ranks 0, 1": (0, 1),
    "resumed under TP2 on ranks 2, 3": (2, 3),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, list[dict]]:
    """(the launch's output folder, each rank's results) from one 4-process launch."""
    base = tmp_path_factory.mktemp("dcp")
    # tied head, q/k/v/o biases, a vocabulary (95 rows) that splits unevenly over the ranks
    config = CONFIGS["qwen3-mha-tied-bias"]()
    config.vocab_size, config.pad_token_id = VOCAB, PADDING_ID
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(base / "model"))
    started = time.perf_counter()
    launch = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(WORKER), str(base),
         str(base / "model")],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert launch.returncode == 0, f"the 4-process launch failed:\n{launch.stdout[-6000:]}"
    print(f"\ndistributed checkpoint launch: {time.perf_counter() - started:.1f} s")
    return base, [json.loads((base / f"rank{rank}.json").read_text()) for rank in range(4)]


def check_resume(result: dict, same_layout: bool) -> None:
    assert "error" not in result, result.get("error")
    assert result["loaded_state_max_difference"] == 0.0, result["loaded_state_worst"]
    assert result["step_dtypes"] == ["torch.float32"]
    assert result["extra_matches"], result["extra"]
    assert result["scheduler_last_epoch"] == 5 and result["learning_rate"] == 0.0  # the schedule ran on to its end
    for reference in ("single", "fsdp"):
        assert result[f"loss_vs_{reference}"] <= LOSS_TOLERANCE, (reference, result)
        assert result[f"weights_vs_{reference}"] <= WEIGHT_TOLERANCE, (reference, result)
    if same_layout:
        assert result["loss_vs_fsdp"] == 0.0 and result["weights_vs_fsdp"] == 0.0


@pytest.mark.parametrize("name", RESUMES)
def test_resume_in_another_layout(launched, name):
    _, per_rank = launched
    for rank in RESUMES[name]:
        check_resume(per_rank[rank][name], same_layout=name.endswith("FSDP2 on ranks 0, 1"))


def test_random_generators_restored_for_the_same_number_of_ranks(launched):
    _, per_rank = launched
    saved = [per_rank[rank]["saved under FSDP2 on ranks 0, 1"]["random_draws_after_save"] for rank in (0, 1)]
    for rank in (0, 1):
        assert per_rank[rank]["resumed under FSDP2 on ranks 0, 1"]["random_draws"] == saved[rank]
    for rank in (2, 3):  # ranks 0 and 1 of their pair
        assert per_rank[rank]["resumed under TP2 on ranks 2, 3"]["random_draws"] == saved[rank - 2]


def test_resume_on_one_plain_process(launched):
    base, _ = launched
    uninterrupted = json.loads((base / "uninterrupted.json").read_text())
    references = {"single": (uninterrupted["single_losses"], load_file(str(base / "single_weights.safetensors"))),
                  "fsdp": (uninterrupted["fsdp_losses"], load_file(str(base / "fsdp_weights.safetensors")))}
    run = Run(load_pretrained(base / "model").model)
    with pytest.warns(UserWarning, match="saved by 2 ranks and is loaded by 1"):
        extra = load_training_state(base / "saved", run.model, run.optimizer, lr_scheduler=run.scheduler)
    assert extra == EXTRA
    difference, worst = max_difference(run.full_state(), load_file(str(base / "at_save.safetensors")))
    assert difference == 0.0, worst
    losses = [run.step(batch) for batch in global_batches()[SAVED_AT:]]
    weights = {name: value for name, value in run.full_state().items() if name.startswith("model.")}
    for name, (reference_losses, reference_weights) in references.items():
        loss_difference = max(abs(a - b) / abs(b) for a, b in zip(losses, reference_losses[SAVED_AT:]))
        assert loss_difference <= LOSS_TOLERANCE, (name, losses, reference_losses)
        assert max_difference(weights, reference_weights)[0] <= WEIGHT_TOLERANCE, name


def assert_no_pickle(folder: Path) -> None:
    """Every file is JSON, or safetensors with nothing beyond its JSON header and the tensors' bytes."""
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    assert files
    for path in files:
        data = path.read_bytes()
        assert not data.startswith((b"\x80", b"PK\x03\x04")), f"{path.name}: a pickle or torch.save file"
        if path.suffix == ".json":
            json.loads(data.decode("utf-8"))
            continue
        assert path.suffix == ".safetensors", f"{path.name}: neither JSON nor safetensors"
        (header_size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_size])
        for value in header.pop("__metadata__", {}).values():
            assert isinstance(value, str)
        end = max(entry["data_offsets"][1] for entry in header.values())
        assert len(data) == 8 + header_size + end, f"{path.name}: bytes beyond the header and the tensors"


def test_saved_folder_holds_no_pickle(launched):
    base, _ = launched
    saved = base / "saved"
    names = sorted(path.name for path in saved.iterdir())
    assert names == ["rng_state_0.json", "rng_state_1.json", "shard-00001-model-00001-of-00001.safetensors",
                     "shard-00002-model-00001-of-00001.safetensors", "training_state.json"]
    assert_no_pickle(saved)
    saved_again = sorted(path.name for path in (base / "saved_again").iterdir())
    assert saved_again == [f"rng_state_{rank}.json" for rank in range(4)] + [
        f"shard-0000{rank}-model-00001-of-00001.safetensors" for rank in range(1, 5)] + ["training_state.json"]
    assert_no_pickle(base / "saved_again")
    assert not list(base.glob(".tmp-*")), "the staging folders were renamed into place"


def small_run(model_dir: Path) -> Run:
    run = Run(load_pretrained(model_dir).model)
    run.step(global_batches()[0])
    return run


class Killed(BaseException):
    """The process dying: nothing after it runs, not even clean-up."""


def test_save_killed_before_its_rename_leaves_the_previous_state(launched, tmp_path, monkeypatch):
    base, _ = launched
    run = small_run(base / "model")
    previous = run.full_state()
    target = tmp_path / "checkpoint-1"
    save_training_state(target, run.model, run.optimizer, lr_scheduler=run.scheduler, extra={"global_step": 1})
    run.step(global_batches()[1])

    def killed(*args, **kwargs):
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", killed)
        patched.setattr("shutil.rmtree", lambda *args, **kwargs: None)
        for name in ("checkpoint-1", "checkpoint-2"):  # replacing a checkpoint, and writing a new one
            with pytest.raises(Killed):
                save_training_state(tmp_path / name, run.model, run.optimizer, extra={"global_step": 2})
    for name in ("checkpoint-1", "checkpoint-2"):  # written in full, but aside
        assert (tmp_path / f".tmp-{name}" / "training_state.json").is_file()
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    with pytest.raises(TrainingStateError, match="does not exist"):
        load_training_state(tmp_path / "checkpoint-2", run.model, run.optimizer)

    fresh = Run(load_pretrained(base / "model").model)
    assert load_training_state(target, fresh.model, fresh.optimizer, lr_scheduler=fresh.scheduler) == {"global_step": 1}
    assert max_difference(fresh.full_state(), previous)[0] == 0.0
    assert fresh.scheduler.last_epoch == 1

    save_training_state(tmp_path / "checkpoint-2", run.model, run.optimizer)  # replaces what the killed save left
    assert sorted(path.name for path in tmp_path.iterdir()) == [".tmp-checkpoint-1", "checkpoint-1", "checkpoint-2"]
    assert_no_pickle(tmp_path / "checkpoint-2")


class TiedModel(nn.Module):
    """A head that holds the embedding's parameter under its own name (as transformers' tied models do)."""

    def __init__(self, vocab: int = 11):
        super().__init__()
        self.embedding = nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids):
        return self.head(self.embedding(ids))


def trained_tied(seed: int):
    torch.manual_seed(seed)
    model = TiedModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.arange(6)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def test_tied_weight_is_saved_once(tmp_path):
    model, optimizer = trained_tied(0)
    save_training_state(tmp_path / "tied", model, optimizer, extra={"note": "tied"})
    state = json.loads((tmp_path / "tied" / "training_state.json").read_text())
    assert state["model_aliases"] == {"model.head.weight": "model.embedding.weight"}
    (shard,) = (tmp_path / "tied").glob("*.safetensors")
    with safe_open(str(shard), "pt") as saved:
        assert sorted(saved.keys()) == [
            "model.embedding.weight", "optimizer.state.embedding.weight.exp_avg",
            "optimizer.state.embedding.weight.exp_avg_sq", "optimizer.state.embedding.weight.step",
        ]
    other, other_optimizer = trained_tied(1)
    assert load_training_state(tmp_path / "tied", other, other_optimizer) == {"note": "tied"}
    assert other.head.weight is other.embedding.weight
    assert torch.equal(other.embedding.weight, model.embedding.weight)
    for field, value in optimizer.state[model.embedding.weight].items():
        assert torch.equal(other_optimizer.state[other.embedding.weight][field], value), field


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_base_is_left_out_of_the_training_state(tmp_path, bits):
    """A frozen quantized base weight (int8 rows, NF4) is not written (it never changes; a resumed run loads it with
    the model), and loading the state into a model with the same base restores the rest and leaves the base as is."""
    from hfnative.peft.quantize import QuantizedLinear, dequantize, quantized_parameter
    from hfnative.peft.settings import Int8Settings, NF4Settings

    if bits == 4:
        pytest.importorskip("torchao")
    settings = Int8Settings() if bits == 8 else NF4Settings()

    def trained(seed: int):
        torch.manual_seed(0)
        base = nn.Linear(64, 64)
        model = nn.Sequential(QuantizedLinear(base, quantized_parameter(settings, base.weight)), nn.Linear(64, 3))
        torch.manual_seed(seed)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model(torch.randn(5, 64)).square().mean().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = trained(0)
    save_training_state(tmp_path / "state", model, optimizer)
    (shard,) = (tmp_path / "state").glob("*.safetensors")
    with safe_open(str(shard), "pt") as saved:
        assert "model.0.weight" not in saved.keys() and "model.1.weight" in saved.keys()
    other, other_optimizer = trained(1)
    load_training_state(tmp_path / "state", other, other_optimizer)
    assert torch.equal(other[1].weight, model[1].weight) and torch.equal(other[0].bias, model[0].bias)
    assert torch.equal(dequantize(other[0].weight), dequantize(model[0].weight))
    assert type(other[0].weight) is type(model[0].weight)


def test_mismatches_and_unsaveable_values_are_named(tmp_path):
    model, optimizer = trained_tied(0)
    with pytest.raises(TrainingStateError, match=r"extra\['sampler'\] is a object"):
        save_training_state(tmp_path / "bad", model, optimizer, extra={"sampler": object()})
    assert not (tmp_path / "bad").exists() and not list(tmp_path.iterdir())
    save_training_state(tmp_path / "tied", model, optimizer)
    larger = TiedModel(vocab=12)
    shapes = r"model.embedding.weight was saved with shape \(11, 4\), the model's is \(12, 4\)"
    with pytest.raises(TrainingStateError, match=shapes):
        load_training_state(tmp_path / "tied", larger, torch.optim.AdamW(larger.parameters()))
    other = nn.Linear(4, 3)
    with pytest.raises(TrainingStateError, match=r"missing \['model.bias', 'model.weight'"):
        load_training_state(tmp_path / "tied", other, torch.optim.AdamW(other.parameters()))
    (tmp_path / "tied" / "training_state.json").unlink()
    with pytest.raises(TrainingStateError, match="training_state.json is missing"):
        load_training_state(tmp_path / "tied", model, optimizer)


@pytest.mark.parametrize("visible, current, saved, expected", [
    (4, 2, 2, "all"),  # the same devices: every generator restored
    (1, 0, 3, 3),  # now one GPU a process: the current one from the device the saving process drew from
    (1, 0, None, 0),  # a save that did not say which: the current device's index
    (1, 0, 7, None),  # nothing saved for it: it starts afresh
])
def test_cuda_generators_restore_under_another_number_of_visible_gpus(monkeypatch, caplog, visible, current, saved,
                                                                      expected):
    """A resume that sees another number of GPUs than the save (8 then 1 a process, say) restores what it can and says
    so, where setting every saved generator failed on the devices it cannot see. CUDA stood in for (a CPU here)."""
    from hfnative.checkpoint import rng

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state_all", lambda states: calls.append(("all", len(states))))
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", lambda state: calls.append(("one", state)))
    states = [f"state {index}" for index in range(4)]
    rng.set_cuda_rng_states(states, saved)
    if expected == "all":
        assert calls == [("all", 4)]
    else:
        assert calls == ([] if expected is None else [("one", f"state {expected}")])
        assert "this process sees 1" in caplog.text
