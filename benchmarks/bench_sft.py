"""SFT throughput, memory and loss agreement: TRL's SFTTrainer vs transformers' Trainer vs hfnative.

Every runner trains the same saved model on the same token rows, in the same seeded order, with the
same hyperparameters, each in its own child process (so peak RSS is per runner), alternating runners
over several rounds. Printed: tokens/s (trained input tokens, warm-up steps excluded), peak RSS,
final and per-step losses side by side, and MFU against a matmul peak measured on this machine.

    python benchmarks/bench_sft.py --preset smoke --rounds 1
    python benchmarks/bench_sft.py --preset reference --write-results
    python benchmarks/bench_sft.py --device cuda --packing --write-results

FLOPs per trained token (PaLM appendix B convention, causal masking not discounted):
    F = 6 * (N_body + V * D) + 12 * L * H * d_head * S
N_body = parameters of the decoder blocks and final norm (no embedding table); V * D = the output
projection, counted even when tied to the embedding (the lookup is free, the head matmul is not);
L layers, H query heads, d_head head dim, S sequence length (the packed row length with --packing).
MFU = tokens/s * F / peak, peak = 2 n^3 / t of a timed n x n torch.mm loop (fp32 on CPU, bf16 on CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import datasets
import torch
import torch._dynamo
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, TrainerCallback

from hfnative.allocator import heap_stats

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "examples" / "tiny-qwen3"  # a BPE tokenizer (ids < 1024) the runners load
CORPUS = ROOT / "examples" / "data" / "sft_text.jsonl"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BASE_RUNNERS = ("trl", "hf", "ours")
OURS_VARIANTS = ("default", "optimizer_in_backward", "compile")


@dataclasses.dataclass
class Shape:
    """A Qwen3-shaped model and the training batch it sees."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    seq: int
    batch: int
    steps: int
    warmup: int


PRESETS = {
    "smoke": Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1024,
                   seq=64, batch=8, steps=5, warmup=2),
    "reference": Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=1024, vocab=32000,
                       seq=256, batch=8, steps=30, warmup=3),
    "vocab152k": Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=1024, vocab=151936,
                       seq=256, batch=8, steps=30, warmup=3),
    # 24.6M embedding + 12 x 6.29M blocks = 100.1M parameters
    "100m": Shape(hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2048, vocab=32000,
                  seq=256, batch=8, steps=10, warmup=2),
    # Qwen3-0.6B's shape, for --device cuda
    "qwen3_0.6b": Shape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                        seq=2048, batch=8, steps=30, warmup=5),
}


# ------------------------------------------------------------------------------------------------
# measurement helpers (used by parent and children)


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork + exec, so
    a child's ru_maxrss is at least the parent's RSS when it forked."""
    peak = rss_mib("VmHWM")
    return peak if peak == peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class HeapPeak:
    """Peak of the bytes malloc has handed out and not yet taken back (glibc's mallinfo2: in-use heap
    chunks + mmapped chunks), sampled on a thread every ``interval`` seconds while running.

    The CPU counterpart of torch.cuda.max_memory_allocated: the live set, whatever the allocator keeps
    cached and without the ~0.5 GB of library code and interpreter memory that RSS also counts.
    ``peak_mib`` is None where the C library is not glibc >= 2.33.
    """

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak_bytes = interval, 0
        self.available = heap_stats() is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, heap_stats().in_use)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        if self.available:
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.available:
            self._stop.set()
            self._thread.join()
            self._sample()

    @property
    def peak_mib(self) -> float | None:
        return self.peak_bytes / 2**20 if self.available else None


def machine_description(device: str) -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    for name in ("transformers", "trl"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "not installed"
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def measure_matmul_peak(device: str, seconds: float) -> float:
    """GFLOP/s of a timed n x n torch.mm loop: fp32 2048^2 on CPU, bf16 8192^2 on CUDA."""
    n, dtype = (2048, torch.float32) if device == "cpu" else (8192, torch.bfloat16)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):  # warm up the BLAS / kernels
        torch.mm(a, b)
    sync()
    iterations, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(4):
            torch.mm(a, b)
        sync()
        iterations += 4
    elapsed = time.perf_counter() - start
    return 2 * n**3 * iterations / elapsed / 1e9


def flops_per_token(shape: Shape) -> dict:
    d, q_dim, kv_dim = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = d * q_dim + 2 * d * kv_dim + q_dim * d + 2 * shape.head_dim  # q, k, v, o + q/k norms
    mlp = 3 * d * shape.intermediate
    body = shape.layers * (attention + mlp + 2 * d) + d  # + two RMSNorms per block, final norm
    head = shape.vocab * d
    attention_scores = 12 * shape.layers * shape.heads * shape.head_dim * shape.seq
    return {
        "body_params": body,
        "head_params": head,
        "total_params": body + head,  # tied: the embedding table is the head
        "flops_per_token": 6 * (body + head) + attention_scores,
    }


# ------------------------------------------------------------------------------------------------
# parent: model, data, orchestration


def build_model(shape: Shape, folder: Path, seed: int) -> int:
    """Save a randomly initialised Qwen3 (fp32, tied embeddings) and the tiny tokenizer to ``folder``."""
    config = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate, max_position_embeddings=max(shape.seq, 2048),
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, bos_token_id=None, dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)
    return sum(p.numel() for p in model.parameters())


def build_dataset(shape: Shape, folder: Path, packing: bool, seed: int) -> dict:
    """Token rows from examples/data/sft_text.jsonl (each text + EOS, cycled).

    Without packing: rows of exactly ``seq`` tokens cut from the token stream, so no runner pads.
    With packing: one row per document (variable length); the trainers pack them to ``seq``.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    with open(CORPUS) as f:
        texts = [json.loads(line)["text"] for line in f]
    documents = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    if any(tokenizer.pad_token_id in doc for doc in documents):
        raise RuntimeError("the corpus contains the pad token; transformers' collator would mask it")
    needed = int(shape.steps * shape.batch * shape.seq * 1.2) + shape.seq
    rng = random.Random(seed)
    rows, total = [], 0
    while total < needed:  # cycle the corpus, reshuffled each pass
        order = list(range(len(documents)))
        rng.shuffle(order)
        for i in order:
            rows.append(documents[i])
            total += len(documents[i])
    if not packing:
        stream = [t for doc in rows for t in doc]
        rows = [stream[i : i + shape.seq] for i in range(0, len(stream) - shape.seq + 1, shape.seq)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(folder))
    return {"rows": len(rows), "tokens": sum(len(r) for r in rows)}


def run_child(runner: str, spec_path: Path, out_path: Path, timeout: float, script: str = __file__) -> dict:
    """Run ``script --child runner`` in a fresh process; its result JSON, or a failed entry with the stderr tail."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    command = [sys.executable, script, "--child", runner, "--spec", str(spec_path), "--out", str(out_path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"runner": runner, "status": "failed", "note": f"timed out after {timeout:.0f} s"}
    if out_path.exists():
        result = json.loads(out_path.read_text())
        out_path.unlink()
        return result
    tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
    return {"runner": runner, "status": "failed", "note": f"exit {done.returncode}: " + "\n".join(tail)}


# ------------------------------------------------------------------------------------------------
# child: one runner, one training run


def child_main(runner: str, spec_path: Path, out_path: Path, train=None) -> None:
    """Child process: ``train(runner, spec, notes) -> metrics`` (default ``train_once``), written as JSON."""
    spec = json.loads(spec_path.read_text())
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    result = {"runner": runner, "status": "ok", "notes": []}
    try:
        result.update((train or train_once)(runner, spec, result["notes"]))
    except _Unavailable as unavailable:
        result.update(status="unavailable", note=str(unavailable))
    out_path.write_text(json.dumps(result))


class _Unavailable(Exception):
    """A variant the trainer does not offer (yet): reported, never fatal."""


def train_once(runner: str, spec: dict, notes: list[str]) -> dict:
    rss_after_imports = rss_mib()
    device, shape = spec["device"], Shape(**spec["shape"])
    dataset = datasets.load_from_disk(spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    is_cuda = device == "cuda"
    common = training_arguments(runner, spec)
    sft = dict(max_length=shape.seq, packing=spec["packing"])

    base, _, variant = runner.partition(":")
    if base == "trl":
        import trl

        args = trl.SFTConfig(**common, **sft)
        trainer = trl.SFTTrainer(model=spec["model_dir"], args=args, train_dataset=dataset, processing_class=tokenizer)
    elif base == "hf":
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
        args = transformers.TrainingArguments(**common)
        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                                       processing_class=tokenizer)
    elif base == "ours":
        import hfnative

        extra = {}
        if variant == "optimizer_in_backward":
            extra["optimizer_in_backward"] = True
        elif variant == "compile":
            extra["torch_compile"] = True
        try:
            args = hfnative.SFTConfig(**common, **sft, **extra)
            trainer = hfnative.SFTTrainer(model=spec["model_dir"], args=args, train_dataset=dataset,
                                          processing_class=tokenizer)
        except (TypeError, ValueError) as error:
            if variant:
                raise _Unavailable(f"{type(error).__name__}: {error}") from error
            raise
    else:
        raise ValueError(f"unknown runner {runner!r}")

    if variant == "compile":
        torch._dynamo.reset()
    result, clock = train_and_measure(trainer, shape, is_cuda, watch_gradients=variant == "optimizer_in_backward")

    if variant == "compile":
        from torch._dynamo.utils import counters

        if not counters["stats"]["unique_graphs"]:
            notes.append("torch_compile=True was accepted but torch.compile compiled no frame: the option is ignored")
    if variant == "optimizer_in_backward" and clock.gradients_seen_before_step:
        notes.append("optimizer_in_backward=True was accepted but parameters still held a .grad at "
                     "on_pre_optimizer_step (the optimizer did not step inside backward): the option is ignored")
    return {**result, "rss_after_imports_mib": rss_after_imports}


def training_arguments(runner: str, spec: dict) -> dict:
    """The TrainingArguments every runner gets (the SFT-specific ones come on top)."""
    shape, is_cuda = Shape(**spec["shape"]), spec["device"] == "cuda"
    return dict(
        output_dir=str(Path(spec["work_dir"]) / f"out-{runner.replace(':', '-')}"),
        use_cpu=not is_cuda, bf16=is_cuda, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, max_steps=shape.steps, per_device_train_batch_size=shape.batch,
        gradient_accumulation_steps=1, learning_rate=1e-3, optim="adamw_torch", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=spec["max_grad_norm"], seed=spec["seed"],
        dataloader_num_workers=0,
        # both names: transformers 5 resolves gradient_checkpointing into activation_checkpointing
        gradient_checkpointing=spec.get("checkpointing", False), activation_checkpointing=spec.get("checkpointing", False),
    )


def train_and_measure(trainer, shape: Shape, is_cuda: bool, watch_gradients: bool = False) -> tuple[dict, "_StepClock"]:
    """``trainer.train()`` with a step clock and a token counter: losses, tokens/s after the warm-up steps,
    peak memory. Also returns the clock (it knows whether gradients were present before each step)."""
    counter = _CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    clock = _StepClock(is_cuda, watch_gradients=watch_gradients)
    trainer.add_callback(clock)
    if is_cuda:
        torch.cuda.reset_peak_memory_stats()
    with HeapPeak() as heap:
        trainer.train()

    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    if len(clock.step_end_times) < shape.steps:
        raise RuntimeError(f"only {len(clock.step_end_times)} of {shape.steps} steps ran")
    warmup, times = shape.warmup, clock.step_end_times
    timed_seconds = times[shape.steps - 1] - times[warmup - 1]
    timed_tokens = sum(counter.tokens[warmup : shape.steps])  # gradient_accumulation_steps == 1
    per_step_rates = [counter.tokens[i] / (times[i] - times[i - 1]) for i in range(warmup, shape.steps)]
    return {
        "losses": [e["loss"] for e in steps],
        "grad_norms": [e.get("grad_norm") for e in steps],
        "tokens_per_second": timed_tokens / timed_seconds,
        "timed_tokens": timed_tokens,
        "timed_seconds": timed_seconds,
        "median_step_tokens_per_second": statistics.median(per_step_rates),  # robust to a preempted step
        "step_seconds": [b - a for a, b in zip(times, times[1:])],
        "peak_rss_mib": peak_rss_mib(),
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if is_cuda else None,
        "peak_heap_mib": heap.peak_mib,
        "activation_checkpointing": _checkpointing_on(trainer),
        "torch_threads": torch.get_num_threads(),
    }, clock


class _CountingCollator:
    """Wraps a collator; remembers the trained input tokens of every batch, in order."""

    def __init__(self, inner):
        self.inner, self.tokens = inner, []

    def __call__(self, features):
        batch = self.inner(features)
        mask = batch.get("attention_mask")
        self.tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        return batch


class _StepClock(TrainerCallback):
    """Wall-clock time at the end of every optimizer step (after a device sync on CUDA)."""

    def __init__(self, sync: bool, watch_gradients: bool = False):
        self.sync, self.watch_gradients = sync, watch_gradients
        self.step_end_times: list[float] = []
        self.gradients_seen_before_step = False

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.watch_gradients and model is not None:
            self.gradients_seen_before_step |= any(p.grad is not None for p in model.parameters())

    def on_step_end(self, args, state, control, **kwargs):
        if self.sync:
            torch.cuda.synchronize()
        self.step_end_times.append(time.perf_counter())


def _checkpointing_on(trainer) -> bool:
    model = trainer.model
    if hasattr(model, "checkpointed_layers"):  # hfnative's Transformer
        return bool(model.checkpointed_layers)
    return bool(getattr(model, "is_gradient_checkpointing", False))


# ------------------------------------------------------------------------------------------------
# report


def _max_relative_difference(a: list, b: list) -> float:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not pairs or len(a) != len(b):
        return float("nan")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)


def summarize(results: list[dict], runners: list[str], flops: dict, peak_gflops: float, device: str) -> tuple[str, dict]:
    """The report text and the per-runner medians."""
    lines, summary = [], {}
    memory = "peak GPU MiB" if device == "cuda" else "peak RSS MiB"
    header = (f"{'runner':<28}{'tokens/s':>10}{'min..max':>20}{'step-median':>13}{memory:>14}{'RSS@import':>12}"
              f"{'peak heap':>11}{'final loss':>12}{'MFU':>8}")
    lines += [header, "-" * len(header)]
    for runner in runners:
        runs = [r for r in results if r["runner"] == runner]
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            reason = runs[0].get("note", "") if runs else "not run"
            lines.append(f"{runner:<28}{runs[0]['status'] if runs else 'skipped':>10}  {reason.splitlines()[-1] if reason else ''}")
            continue
        rates = [r["tokens_per_second"] for r in ok]
        median = statistics.median(rates)
        peak_mem = max(r["peak_gpu_mib"] if device == "cuda" else r["peak_rss_mib"] for r in ok)
        summary[runner] = {
            "tokens_per_second": median,
            "peak_memory_mib": peak_mem,
            "losses": ok[0]["losses"],
            "grad_norms": ok[0]["grad_norms"],
            "mfu": median * flops["flops_per_token"] / (peak_gflops * 1e9),
            "checkpointing": ok[0]["activation_checkpointing"],
            "timed_tokens": ok[0]["timed_tokens"],
            "rounds_agree": all(r["losses"] == ok[0]["losses"] for r in ok),
            "peak_heap_mib": max((r.get("peak_heap_mib") or float("nan") for r in ok), default=float("nan")),
        }
        s = summary[runner]
        step_median = statistics.median(r["median_step_tokens_per_second"] for r in ok)
        lines.append(
            f"{runner:<28}{median:>10,.0f}{f'{min(rates):,.0f}..{max(rates):,.0f}':>20}{step_median:>13,.0f}"
            f"{peak_mem:>14,.0f}{statistics.median(r['rss_after_imports_mib'] for r in ok):>12,.0f}"
            f"{s['peak_heap_mib']:>11,.0f}{s['losses'][-1]:>12.6f}{s['mfu']:>8.2%}"
        )
    notes = sorted({f"{r['runner']}: {n}" for r in results for n in r.get("notes", [])} |
                   {f"{r['runner']}: {r['note'].splitlines()[-1]}" for r in results if r["status"] == "unavailable"})

    lines.append("")
    if "ours" in summary:
        for peer in ("trl", "hf"):
            if peer in summary:
                ours, other = summary["ours"], summary[peer]
                # no peak-heap ratio here: transformers keeps the weights it loads in the safetensors file
                # mapping, outside malloc, so its heap peak leaves them out while ours counts them
                lines.append(
                    f"ours / {peer}: tokens/s x{ours['tokens_per_second'] / other['tokens_per_second']:.2f}, "
                    f"{memory} x{ours['peak_memory_mib'] / other['peak_memory_mib']:.2f}"
                )
    for runner in summary:
        if runner != "ours" and runner.startswith("ours:") and "ours" in summary:
            variant, ours = summary[runner], summary["ours"]
            line = (f"{runner} / ours: tokens/s x{variant['tokens_per_second'] / ours['tokens_per_second']:.2f}, "
                    f"{memory} {variant['peak_memory_mib'] - ours['peak_memory_mib']:+,.0f}")
            if device != "cuda":
                line += f", peak heap MiB {variant['peak_heap_mib'] - ours['peak_heap_mib']:+,.0f}"
            if runner == "ours:optimizer_in_backward":  # fp32 parameters, so fp32 gradients
                line += f" (gradients: {flops['total_params'] * 4 / 2**20:,.0f} MiB)"
            lines.append(line)

    reference = next((r for r in ("trl", "hf", "ours") if r in summary), None)
    if reference:
        lines += ["", f"per-step loss (max relative difference against {reference} over all steps):"]
        names = list(summary)
        widths = [max(16, len(n) + 2) for n in names]
        lines.append(f"{'step':>6}" + "".join(f"{n:>{w}}" for n, w in zip(names, widths)))
        count = len(summary[reference]["losses"])
        shown = range(count) if count <= 12 else sorted({0, 1, 2, *range(count - 3, count), *range(0, count, max(count // 6, 1))})
        for i in shown:
            row = [summary[n]["losses"][i] if i < len(summary[n]["losses"]) else float("nan") for n in names]
            lines.append(f"{i + 1:>6}" + "".join(f"{v:>{w}.6f}" for v, w in zip(row, widths)))
        for label, key in (("loss", "losses"), ("gnorm", "grad_norms")):
            if all(summary[n][key][0] is not None for n in names):
                lines.append(f"{'maxrel':>6}" if key == "losses" else f"{label:>6}")
                lines[-1] += "".join(f"{_max_relative_difference(summary[n][key], summary[reference][key]):>{w}.2e}"
                                     for n, w in zip(names, widths))
        token_counts = {n: summary[n]["timed_tokens"] for n in names}
        if len(set(token_counts.values())) > 1:
            notes.append(f"runners trained different numbers of tokens in the timed steps: {token_counts}")
        unstable = [n for n in names if not summary[n]["rounds_agree"]]
        if unstable:
            notes.append(f"losses differ between rounds of the same runner (non-deterministic): {', '.join(unstable)}")
        checkpointing = {n: summary[n]["checkpointing"] for n in names}
        if len(set(checkpointing.values())) > 1:
            notes.append(f"activation checkpointing differs between runners (unfair comparison): {checkpointing}")
    if notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in notes]
    return "\n".join(lines), summary


def describe_setup(cli, shape: Shape, flops: dict, data: dict, peak_gflops: float, machine: dict) -> str:
    precision = "bf16 autocast, fp32 master weights" if cli.device == "cuda" else "fp32"
    return "\n".join([
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}"
        + (f", GPU {machine['gpu']}" if "gpu" in machine else ""),
        f"software: python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}, "
        f"trl {machine['trl']}; date {machine['date']}; load average {machine['load_average']}",
        f"model: Qwen3-shaped, hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads / {shape.kv_heads} KV, "
        f"head_dim {shape.head_dim}, intermediate {shape.intermediate}, vocab {shape.vocab}, tied; "
        f"{flops['total_params'] / 1e6:.2f}M parameters ({flops['body_params'] / 1e6:.2f}M in blocks)",
        f"training: {precision}, seq {shape.seq}, batch {shape.batch}, {shape.steps} steps ({shape.warmup} warm-up steps "
        f"not timed), AdamW lr 1e-3 constant, max_grad_norm {cli.max_grad_norm}, packing {cli.packing}, "
        f"{'activation checkpointing' if cli.activation_checkpointing else 'no activation checkpointing'}, seed {cli.seed}; data: {data['rows']} rows, {data['tokens']:,} tokens",
        f"FLOPs/token {flops['flops_per_token'] / 1e6:.1f}M = 6*(N_body + V*D) + 12*L*H*d_head*S; "
        f"matmul peak {peak_gflops:,.1f} GFLOP/s ({'fp32 2048^3 mm' if cli.device == 'cpu' else 'bf16 8192^3 mm'})",
    ])


def write_results(cli, setup: str, report: str) -> None:
    smoke = cli.preset == "smoke"
    title = f"## {datetime.date.today().isoformat()} — preset `{cli.preset}`, {cli.device}" + (", packing" if cli.packing else "")
    if smoke:
        title += " — SMOKE RUN (checks the script end to end; not a measurement)"
    append_results(title, setup, report)


def append_results(title: str, setup: str, report: str, script: str = __file__) -> None:
    """Append a dated section to RESULTS.md: the title, the exact command line of ``script``, setup and report."""
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(script, ROOT), *sys.argv[1:]])
    if not RESULTS.exists():
        RESULTS.write_text("# SFT benchmark results\n\n")
    with open(RESULTS, "a") as f:
        f.write(f"\n{title}\n\nCommand: `{command}`\n\n```\n{setup}\n\n{report}\n```\n")


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model and batch shape (default: reference on cpu, qwen3_0.6b on cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=3, help="each round runs every runner once, in turn")
    parser.add_argument("--runners", default=",".join(BASE_RUNNERS), help="comma-separated subset of trl,hf,ours")
    parser.add_argument("--ours_variants", "--ours-variants", default="default",
                        help=f"comma-separated from {','.join(OURS_VARIANTS)}")
    parser.add_argument("--packing", action="store_true", help="variable-length documents packed to seq (no hf runner)")
    parser.add_argument("--activation_checkpointing", action="store_true",
                        help="activation checkpointing for every runner (TRL's default; the peak then sits at the optimizer step)")
    parser.add_argument("--max_grad_norm", "--max-grad-norm", type=float, default=1.0,
                        help="the same for every runner; 0 turns clipping off (optimizer_in_backward needs 0)")
    for name in ("seq", "batch", "steps", "warmup", "vocab"):
        parser.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    parser.add_argument("--peak_seconds", "--peak-seconds", type=float, default=2.0, help="matmul peak timing length")
    add_run_arguments(parser, timeout=3600)
    return parser.parse_args(argv)


def add_run_arguments(parser: argparse.ArgumentParser, timeout: float) -> None:
    """The options every benchmark script here shares: seed, threads, per-runner timeout, results file,
    keeping the work folder, and the hidden ones a child process is started with."""
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in every process (0: torch's default)")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds per runner process")
    parser.add_argument("--write-results", "--write_results", action="store_true", help="append to benchmarks/RESULTS.md")
    parser.add_argument("--keep", action="store_true", help="keep the temporary model, data and outputs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


def main() -> None:
    cli = parse_args()
    if cli.child:
        child_main(cli.child, Path(cli.spec), Path(cli.out))
        return

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    if cli.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                 "run on a GPU machine or drop --device cuda")
    cli.preset = cli.preset or ("qwen3_0.6b" if cli.device == "cuda" else "reference")
    shape = dataclasses.replace(PRESETS[cli.preset], **{k: getattr(cli, k) for k in ("seq", "batch", "steps", "warmup", "vocab")
                                                         if getattr(cli, k) is not None})
    if not 1 <= shape.warmup < shape.steps:
        sys.exit(f"--warmup must be in [1, steps); got warmup {shape.warmup}, steps {shape.steps}")

    runners, skipped, order = [], [], []  # order: every requested runner, as shown in the table
    for name in cli.runners.split(","):
        if name not in BASE_RUNNERS:
            sys.exit(f"--runners: unknown runner {name!r}; use a subset of {','.join(BASE_RUNNERS)}")
        if name == "hf" and cli.packing:
            skipped.append({"runner": "hf", "status": "skipped", "note": "transformers' Trainer has no packing"})
            order.append(name)
            continue
        if name != "ours":
            runners.append(name)
            order.append(name)
            continue
        for variant in cli.ours_variants.split(","):
            if variant not in OURS_VARIANTS:
                sys.exit(f"--ours_variants: unknown variant {variant!r}; use a subset of {','.join(OURS_VARIANTS)}")
            runner = "ours" if variant == "default" else f"ours:{variant}"
            order.append(runner)
            if variant == "optimizer_in_backward" and cli.max_grad_norm != 0:
                skipped.append({"runner": runner, "status": "skipped",
                                "note": "needs --max_grad_norm 0 (clipping off for every runner, for fairness)"})
                continue
            runners.append(runner)

    work = Path(tempfile.mkdtemp(prefix="bench_sft_"))
    try:
        model_dir, data_dir = work / "model", work / "data"
        parameters = build_model(shape, model_dir, cli.seed)
        data = build_dataset(shape, data_dir, cli.packing, cli.seed)
        flops = flops_per_token(shape)
        if parameters != flops["total_params"]:  # the FLOPs formula must count the model that trains
            sys.exit(f"FLOPs count {flops['total_params']:,} parameters, the model has {parameters:,}")
        peak_gflops = measure_matmul_peak(cli.device, cli.peak_seconds)
        machine = machine_description(cli.device)
        setup = describe_setup(cli, shape, flops, data, peak_gflops, machine)
        print(setup, flush=True)

        spec = {"device": cli.device, "shape": dataclasses.asdict(shape), "model_dir": str(model_dir),
                "data_dir": str(data_dir), "work_dir": str(work), "packing": cli.packing,
                "checkpointing": cli.activation_checkpointing,
                "max_grad_norm": cli.max_grad_norm, "seed": cli.seed, "threads": cli.threads}
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        results = list(skipped)
        for round_index in range(cli.rounds):
            for runner in runners:
                if round_index and any(r["runner"] == runner and r["status"] != "ok" for r in results):
                    continue  # failed or unavailable once: do not retry every round
                result = run_child(runner, spec_path, work / "result.json", cli.timeout)
                results.append(result)
                shown = (f"{result['tokens_per_second']:,.0f} tokens/s, peak RSS {result['peak_rss_mib']:,.0f} MiB, "
                         f"final loss {result['losses'][-1]:.6f}") if result["status"] == "ok" else result.get("note", "")
                print(f"round {round_index + 1}/{cli.rounds} {runner}: {result['status']} {shown}", flush=True)

        report, _ = summarize(results, order, flops, peak_gflops, cli.device)
        setup += f"\nload average after: {[round(x, 2) for x in os.getloadavg()]}; rounds {cli.rounds}"
        print("\n" + report)
        if cli.write_results and not any(r["status"] == "ok" for r in results):
            print("\nnothing to write: no runner finished")
        elif cli.write_results:
            write_results(cli, setup, report)
            print(f"\nappended to {RESULTS}")
    finally:
        if cli.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
