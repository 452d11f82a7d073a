"""Every engine option, alone and together, trains to the plain path's losses (fp32, CPU).

The plain path: materialized logits + F.cross_entropy, a regular optimizer step after backward,
no activation checkpointing, no compile.
"""

import json
from pathlib import Path

import pytest
from datasets import Dataset

from hfnative import SFTConfig, SFTTrainer

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
PLAIN = dict(fused_loss=False, optimizer_in_backward=False, activation_checkpointing=False, torch_compile=False, optim="adamw_torch")


def _losses(tmp_path, **options):
    rows = [json.loads(line) for line in open(ROOT / "examples" / "data" / "sft_messages.jsonl")][:32]
    args = SFTConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        max_steps=4, logging_steps=1, save_strategy="no", per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=1,
        max_grad_norm=0.0, **{**PLAIN, **options},
    )
    trainer = SFTTrainer(model=MODEL, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    return [(e["loss"], e["grad_norm"], e["learning_rate"]) for e in trainer.state.log_history if "loss" in e]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("plain"))


OPTIONS = {
    "fused_loss": dict(fused_loss=True),
    "optimizer_in_backward": dict(optimizer_in_backward=True),
    "activation_checkpointing_full": dict(activation_checkpointing=True),
    "activation_checkpointing_selective": dict(activation_checkpointing=True, activation_checkpointing_mode="selective"),
    # TRL's key: checkpointed blocks keep the attention's output
    "gradient_checkpointing_selective": dict(activation_checkpointing=True,
                                             gradient_checkpointing_kwargs={"selective": True}),
    "use_liger_kernel": dict(use_liger_kernel=True),
    "compile": dict(torch_compile=True),
    # transformers' DataLoader worker fields: rows read and collated in two forked processes give the same batches
    "dataloader_workers": dict(dataloader_num_workers=2, dataloader_persistent_workers=True,
                               dataloader_prefetch_factor=3, dataloader_multiprocessing_context="fork"),
    "all_together": dict(fused_loss=True, optimizer_in_backward=True, activation_checkpointing=True, torch_compile=True),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_reproduces_the_plain_losses(name, plain, tmp_path):
    got = _losses(tmp_path, **OPTIONS[name])
    assert len(got) == len(plain) == 4
    for (loss, grad_norm, lr), (plain_loss, plain_grad_norm, plain_lr) in zip(got, plain):
        assert loss == pytest.approx(plain_loss, rel=1e-5)
        assert grad_norm == pytest.approx(plain_grad_norm, rel=1e-4)
        assert lr == plain_lr


COUNTED_GRAPHS = []


def _counting_backend(graph_module, example_inputs):
    """A torch.compile backend that counts the graphs it is handed and runs them as traced."""
    COUNTED_GRAPHS.append(graph_module)
    return graph_module.forward


def test_compile_backend_and_mode_reach_torch_compile(plain, tmp_path, monkeypatch):
    """torch_compile_backend (which sets torch_compile, as in transformers): the blocks compile with that backend (one
    registered here counts its graphs) and the run reproduces the plain losses; torch_compile_mode reaches
    torch.compile with the backend's mode (spied: inductor's autotuning would take minutes on a CPU); an unknown
    backend or mode is refused by name before anything loads."""
    import torch._dynamo

    if "hfnative_test_counting" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_counting_backend, name="hfnative_test_counting")
    COUNTED_GRAPHS.clear()
    got = _losses(tmp_path / "backend", torch_compile=False, torch_compile_backend="hfnative_test_counting")
    assert COUNTED_GRAPHS  # the blocks went through the named backend
    for (loss, grad_norm, _), (plain_loss, plain_grad_norm, _) in zip(got, plain, strict=True):
        assert loss == pytest.approx(plain_loss, rel=1e-5) and grad_norm == pytest.approx(plain_grad_norm, rel=1e-4)

    calls, compile_ = [], torch.compile

    def spy(fn, **kwargs):
        calls.append(kwargs)
        return compile_(fn, backend="hfnative_test_counting", dynamic=kwargs.get("dynamic"))

    monkeypatch.setattr(torch, "compile", spy)
    _losses(tmp_path / "mode", torch_compile=False, torch_compile_mode="max-autotune-no-cudagraphs")
    assert calls and all(call["mode"] == "max-autotune-no-cudagraphs" for call in calls)
    monkeypatch.undo()

    for field, value, said in (("torch_compile_backend", "no_such_backend", "torch.compile has no such backend"),
                               ("torch_compile_mode", "fastest", "torch.compile's modes are")):
        with pytest.raises(ValueError, match=f"{field}='{value}': {said}"):
            SFTTrainer(model=str(tmp_path / "never-loaded"), train_dataset=[{"text": "a row"}],
                       args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value}))


def test_dataloader_worker_fields_reach_the_loaders(tmp_path):
    """dataloader_num_workers, _persistent_workers, _prefetch_factor, _multiprocessing_context and _in_order are the
    train and eval DataLoaders' own arguments, as transformers passes them; persistent workers without workers are
    refused by name."""
    rows = Dataset.from_list([{"text": f"row {i} of the data"} for i in range(8)])
    fields = dict(dataloader_num_workers=2, dataloader_persistent_workers=True, dataloader_prefetch_factor=3,
                  dataloader_multiprocessing_context="fork", dataloader_in_order=False)
    trainer = SFTTrainer(model=MODEL, train_dataset=rows, eval_dataset=rows,
                         args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **fields))
    for loader in (trainer.get_train_dataloader(), trainer.get_eval_dataloader()):
        assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor, loader.in_order) == (2, True, 3, False)
        assert loader.multiprocessing_context.get_start_method() == "fork"
    assert trainer.get_eval_dataloader() is trainer.get_eval_dataloader()  # its workers kept, as transformers keeps them
    with pytest.raises(ValueError, match="dataloader_persistent_workers=True .* dataloader_num_workers=0"):
        SFTTrainer(model=str(tmp_path / "never-loaded"), train_dataset=rows,
                   args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, dataloader_persistent_workers=True))


def test_low_bit_adamw_stays_close_to_adamw(plain, tmp_path):
    pytest.importorskip("torchao")
    for options in (dict(optim="adamw_torch_8bit"), dict(optim="adamw_torch_8bit", optimizer_in_backward=True)):
        got = _losses(tmp_path, **options)
        for (loss, _, _), (plain_loss, _, _) in zip(got, plain):
            assert loss == pytest.approx(plain_loss, rel=1e-3)  # 8-bit moments: documented 0.1% tolerance over 4 steps


def test_optimizer_in_backward_refuses_clipping(tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, optimizer_in_backward=True)  # max_grad_norm 1.0
    with pytest.raises(ValueError, match="max_grad_norm=0"):
        SFTTrainer(model=MODEL, args=args, train_dataset=[{"text": "hello"}])


_ALLOCATOR_PROBE = """
import json
import torch
from hfnative.allocator import heap_stats, keep_freed_cpu_memory

def free_in_heap():  # bytes of the heap arenas not handed out
    stats = heap_stats()
    return stats.heap - (stats.in_use - stats.mapped)

first = keep_freed_cpu_memory()
tensor = torch.ones(64 * 2**20 // 4)  # 64 MiB: above glibc's largest default mmap threshold
mapped = heap_stats().mapped
free_while_held = free_in_heap()
del tensor
# kept: the freed block is free memory of the heap now, not unmapped or trimmed away. (Heap growth is no
# measure: the block may take free space the top of the heap already had before it was allocated.)
print(json.dumps({"first": first, "again": keep_freed_cpu_memory(), "mapped": mapped >= 64 * 2**20,
                  "kept": free_in_heap() - free_while_held >= 64 * 2**20}))
"""


@pytest.mark.parametrize("switch,expected", [(None, True), ("0", False)])
def test_cpu_allocator_setting_is_applied_once_and_can_be_switched_off(switch, expected):
    import os
    import platform
    import subprocess
    import sys

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("the setting exists only on glibc")
    env = {k: v for k, v in os.environ.items() if k != "HFNATIVE_KEEP_FREED_CPU_MEMORY"}
    if switch is not None:
        env["HFNATIVE_KEEP_FREED_CPU_MEMORY"] = switch
    done = subprocess.run([sys.executable, "-c", _ALLOCATOR_PROBE], env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # on: the block comes from the heap and stays there once freed; off: glibc maps it and unmaps it on free
    assert result == {"first": expected, "again": expected, "mapped": not expected, "kept": expected}
