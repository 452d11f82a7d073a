"""The measurement harness every benchmark script here shares.

A benchmark script names its runners and how one runner trains (``train(runner, spec, notes) -> metrics``);
this module does the rest the same way for all of them:

- the workload: a Qwen3-shaped model (``Shape``, ``PRESETS``) saved once with random weights, token rows
  cut from examples/data/sft_text.jsonl, the TrainingArguments every runner gets;
- the measurement: step times (after a device sync on CUDA), trained tokens, peak RSS (VmHWM), peak live
  heap (glibc mallinfo2, sampled), peak CUDA memory;
- the orchestration: each run of each runner in its own child process (``script --child runner``), runners
  alternating over rounds, a failed or unavailable runner reported and never retried;
- the report: machine and library versions, result table helpers, appending to RESULTS.md;
- the command-line options all scripts share.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import random
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import hfnative  # noqa: F401  (first: importing it drops torchao's import-time noise that transformers triggers)
import datasets
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, TrainerCallback

from hfnative.allocator import heap_stats

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "examples" / "tiny-qwen3"  # a BPE tokenizer (ids < 1024) the runners load
CORPUS = ROOT / "examples" / "data" / "sft_text.jsonl"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


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


# the LoRA every LoRA runner trains, TRL's (SFTTrainer(peft_config=peft.LoraConfig(**LORA))) and hfnative's alike
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")

PRESETS = {
    "smoke": Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1024,
                   seq=64, batch=8, steps=5, warmup=2),
    # Qwen3-0.6B's depth (28 blocks) at the smoke preset's width: a step is all host work (Python, dispatch), as
    # much of it as the 0.6B step launches on a GPU: where the GPU waits for the host, this shows it on a CPU
    "smoke_depth28": Shape(hidden=64, layers=28, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1024,
                           seq=64, batch=8, steps=10, warmup=3),
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
# memory (used by parent and children)


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


def package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
        "transformers": package_version("transformers"),
        "trl": package_version("trl"),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ------------------------------------------------------------------------------------------------
# the workload: model, data, training arguments


def build_model(shape: Shape, folder: Path, seed: int, tied: bool = True, dtype: torch.dtype = torch.float32) -> int:
    """Save a randomly initialised Qwen3 (in ``dtype``, tied embeddings unless ``tied`` is False) and the tiny tokenizer
    to ``folder``."""
    config = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate, max_position_embeddings=max(shape.seq, 2048),
        tie_word_embeddings=tied, pad_token_id=0, eos_token_id=2, bos_token_id=None, dtype=str(dtype).split(".")[-1],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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


@dataclasses.dataclass
class Workload:
    """What ``prepare_workload`` saved: the model's parameter count, the data's size, the children's spec file."""

    parameters: int
    data: dict
    spec_path: Path


def prepare_workload(work: Path, shape: Shape, cli, device: str, packing: bool, tied: bool = True,
                     dtype: torch.dtype = torch.float32, **spec_extra) -> Workload:
    """Save the model (in ``dtype``, embeddings tied unless ``tied`` is False) and data under ``work`` and the spec
    every child process reads."""
    model_dir, data_dir = work / "model", work / "data"
    parameters = build_model(shape, model_dir, cli.seed, tied, dtype)
    data = build_dataset(shape, data_dir, packing, cli.seed)
    spec = {"device": device, "shape": dataclasses.asdict(shape), "model_dir": str(model_dir),
            "data_dir": str(data_dir), "work_dir": str(work), "packing": packing, **spec_extra,
            "max_grad_norm": cli.max_grad_norm, "seed": cli.seed, "threads": cli.threads,
            "profile_dir": profile_dir(cli)}
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return Workload(parameters, data, spec_path)


def training_arguments(runner: str, spec: dict) -> dict:
    """The TrainingArguments every runner gets (the SFT-specific ones come on top)."""
    shape, is_cuda = Shape(**spec["shape"]), spec["device"] == "cuda"
    return dict(
        output_dir=str(Path(spec["work_dir"]) / f"out-{runner.replace(':', '-')}"),
        use_cpu=not is_cuda, bf16=spec.get("bf16", is_cuda), report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, max_steps=shape.steps, per_device_train_batch_size=shape.batch,
        gradient_accumulation_steps=1, learning_rate=1e-3, optim="adamw_torch", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=spec["max_grad_norm"], seed=spec["seed"],
        dataloader_num_workers=0,
        # both names: transformers 5 resolves gradient_checkpointing into activation_checkpointing
        gradient_checkpointing=spec.get("checkpointing", False), activation_checkpointing=spec.get("checkpointing", False),
    )


# ------------------------------------------------------------------------------------------------
# one training run, measured (in the child)


def train_and_measure(trainer, shape: Shape, is_cuda: bool, watch_gradients: bool = False,
                      profile_to: Path | None = None) -> tuple[dict, "_StepClock"]:
    """``trainer.train()`` with a step clock and a token counter: losses, tokens/s after the warm-up steps,
    peak memory. Also returns the clock (it knows whether gradients were present before each step).
    ``profile_to``: a file for the top kernels of one profiled step, the last warm-up step (not timed)."""
    counter = _CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    if profile_to is not None:  # before the clock: the profile is written before the step's end is stamped
        trainer.add_callback(_ProfiledStep(max(shape.warmup - 1, 0), profile_to, is_cuda))
    clock = _StepClock(is_cuda, watch_gradients=watch_gradients)
    trainer.add_callback(clock)
    if is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with HeapPeak() as heap:
        trainer.train()

    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    if len(clock.step_end_times) < shape.steps:
        raise RuntimeError(f"only {len(clock.step_end_times)} of {shape.steps} steps ran")
    warmup, times = shape.warmup, clock.step_end_times
    timed_seconds = times[shape.steps - 1] - times[warmup - 1]
    accumulation = trainer.args.gradient_accumulation_steps  # collated batches per optimizer step
    step_tokens = [sum(counter.tokens[i * accumulation : (i + 1) * accumulation]) for i in range(shape.steps)]
    timed_tokens = sum(step_tokens[warmup : shape.steps])
    per_step_rates = [step_tokens[i] / (times[i] - times[i - 1]) for i in range(warmup, shape.steps)]
    return {
        "losses": [e["loss"] for e in steps],
        "grad_norms": [e.get("grad_norm") for e in steps],
        "tokens_per_second": timed_tokens / timed_seconds,
        "timed_tokens": timed_tokens,
        "timed_seconds": timed_seconds,
        "median_step_tokens_per_second": statistics.median(per_step_rates),  # robust to a preempted step
        "step_seconds": [b - a for a, b in zip(times, times[1:])],
        # the timed steps' host queueing and device wait (CUDA only: _StepClock)
        "host_seconds": clock.host_seconds[warmup:shape.steps] if len(clock.host_seconds) == len(times) else None,
        "wait_seconds": clock.wait_seconds[warmup:shape.steps] if len(clock.wait_seconds) == len(times) else None,
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


def profile_dir(cli) -> str | None:
    """``--profile_dir`` as an absolute path for the children's spec, or None."""
    folder = getattr(cli, "profile_dir", None)
    return str(Path(folder).resolve()) if folder else None


def profile_path(spec: dict, runner: str) -> Path | None:
    """Where a runner writes its profiled step's top kernels (``--profile_dir``), or None."""
    folder = spec.get("profile_dir")
    return None if not folder else Path(folder) / f"{runner.replace(':', '-')}-top-kernels.txt"


class _ProfiledStep(TrainerCallback):
    """torch.profiler over one optimizer step (0-based index ``step``); its ops and kernels by self device time (CPU
    time on a CPU), the top 30, written to ``path``."""

    def __init__(self, step: int, path: Path, is_cuda: bool):
        self.step, self.path, self.is_cuda = step, path, is_cuda
        self.profiler = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.is_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is None or state.global_step != self.step + 1:
            return
        if self.is_cuda:
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        averages = self.profiler.key_averages()
        sort_by = "self_cuda_time_total" if self.is_cuda else "self_cpu_time_total"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(f"# {self.path.stem}: optimizer step {self.step + 1}, sorted by {sort_by}\n"
                             + averages.table(sort_by=sort_by, row_limit=30, max_name_column_width=70) + "\n")


class _StepClock(TrainerCallback):
    """Wall-clock time at the end of every optimizer step (after a device sync on CUDA). With ``sync``, also how
    long the host took to queue each step (its begin to its end, before the sync) and how long it then waited for
    the device: a step that waits about nothing kept the device waiting on the host instead. A runner that reads a
    device value inside its step waits there, not at the end, so its wait here is a lower bound."""

    def __init__(self, sync: bool, watch_gradients: bool = False):
        self.sync, self.watch_gradients = sync, watch_gradients
        self.step_end_times: list[float] = []
        self.host_seconds: list[float] = []
        self.wait_seconds: list[float] = []
        self._began: float | None = None
        self.gradients_seen_before_step = False

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.watch_gradients and model is not None:
            self.gradients_seen_before_step |= any(p.grad is not None for p in model.parameters())

    def on_step_end(self, args, state, control, **kwargs):
        if self.sync:
            queued = time.perf_counter()
            torch.cuda.synchronize()
            if self._began is not None:
                self.host_seconds.append(queued - self._began)
                self.wait_seconds.append(time.perf_counter() - queued)
        self.step_end_times.append(time.perf_counter())


def _checkpointing_on(trainer) -> bool:
    model = trainer.model
    if hasattr(model, "checkpointed_layers"):  # hfnative's Transformer
        return bool(model.checkpointed_layers)
    return bool(getattr(model, "is_gradient_checkpointing", False))


# ------------------------------------------------------------------------------------------------
# child processes, rounds


class Unavailable(Exception):
    """A variant the trainer does not offer (yet): reported, never fatal."""


def child_main(cli, train: Callable[[str, dict, list], dict]) -> None:
    """Child process: ``train(runner, spec, notes) -> metrics`` for ``--child``, written as JSON to ``--out``.
    In a launched run (torchrun sets RANK) every rank trains and rank 0 writes."""
    spec = json.loads(Path(cli.spec).read_text())
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    result = {"runner": cli.child, "status": "ok", "notes": []}
    try:
        result.update(train(cli.child, spec, result["notes"]))
    except Unavailable as unavailable:
        result.update(status="unavailable", note=str(unavailable))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(cli.out).write_text(json.dumps(result))


# how a runner's process starts: interpreter arguments before the script (a launcher such as
# ["-m", "torch.distributed.run", "--nproc_per_node", "2"]) and environment variables on top of ours
Launch = Callable[[str], tuple[list[str], dict[str, str]]]


def run_child(runner: str, spec_path: Path, out_path: Path, timeout: float, script: str,
              launcher: list[str] = (), env_extra: dict[str, str] | None = None) -> dict:
    """Run ``script --child runner`` in a fresh process (``python *launcher script ...``); its result JSON,
    or a failed entry with the stderr tail. On timeout the process and all its descendants are killed (torchrun
    starts its ranks in sessions of their own, out of reach of a process-group kill)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", **(env_extra or {}))
    command = [sys.executable, *launcher, script, "--child", runner, "--spec", str(spec_path), "--out", str(out_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [process.pid, *_descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.communicate()
        return {"runner": runner, "status": "failed", "note": f"timed out after {timeout:.0f} s"}
    if out_path.exists():
        result = json.loads(out_path.read_text())
        out_path.unlink()
        return result
    tail = (stderr or stdout).strip().splitlines()[-15:]
    return {"runner": runner, "status": "failed", "note": f"exit {process.returncode}: " + "\n".join(tail)}


def result_line_child(command: list[str], timeout: float, env: dict | None = None) -> dict:
    """The JSON a child process prints on its ``RESULT `` line, or {"error": why} when it timed out or printed none."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from the parent ids in /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue += children.get(child, [])
    return found


def run_rounds(runners: list[str], workload: Workload, cli, script: str, shown: Callable[[dict], str],
               launch: Launch | None = None) -> list[dict]:
    """Every runner once per round, in turn, each in its own process (started as ``launch(runner)`` says);
    ``shown(result)`` is printed per finished run. A runner that failed or was unavailable is not retried
    in later rounds."""
    results = []
    for round_index in range(cli.rounds):
        for runner in runners:
            if round_index and any(r["runner"] == runner and r["status"] != "ok" for r in results):
                continue
            launcher, env_extra = launch(runner) if launch else ((), None)
            result = run_child(runner, workload.spec_path, workload.spec_path.parent / "result.json", cli.timeout, script,
                               launcher, env_extra)
            results.append(result)
            detail = shown(result) if result["status"] == "ok" else result.get("note", "")
            print(f"round {round_index + 1}/{cli.rounds} {runner}: {result['status']} {detail}", flush=True)
    return results


@contextlib.contextmanager
def work_folder(prefix: str, keep: bool):
    """A temporary folder for the model, data and outputs; removed afterwards unless ``keep``."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def start_parent(cli, presets: dict[str, Shape]) -> Shape:
    """Refuse --device cuda without a CUDA device; quiet progress bars, set torch's threads; the preset's shape
    with the command line's overrides."""
    if getattr(cli, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                 "run on a GPU machine or drop --device cuda")
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    overrides = {k: getattr(cli, k) for k in ("seq", "batch", "steps", "warmup", "vocab") if getattr(cli, k, None) is not None}
    shape = dataclasses.replace(presets[cli.preset], **overrides)
    if not 1 <= shape.warmup < shape.steps:
        sys.exit(f"--warmup must be in [1, steps); got warmup {shape.warmup}, steps {shape.steps}")
    return shape


# ------------------------------------------------------------------------------------------------
# report


def max_relative_difference(a: list, b: list) -> float:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not pairs or len(a) != len(b):
        return float("nan")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)


def finished_runs(results: list[dict], runners, lines: list[str], runner_width: int, status_width: int):
    """(runner, its finished runs, their tokens/s) for each runner with a finished run, in ``runners`` order; for each
    without one, its ``not_finished_line`` appended to ``lines`` (the report's table)."""
    for runner in runners:
        runs = [r for r in results if r["runner"] == runner]
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            lines.append(not_finished_line(runner, runs, runner_width=runner_width, status_width=status_width))
            continue
        yield runner, ok, [r["tokens_per_second"] for r in ok]


def not_finished_line(runner: str, runs: list[dict], runner_width: int, status_width: int) -> str:
    """The table row of a runner with no finished run: its status and the last line of its note."""
    note = (runs[0].get("note") or "").strip() if runs else "not run"
    status = runs[0]["status"] if runs else "skipped"
    return f"{runner:<{runner_width}}{status:>{status_width}}  {note.splitlines()[-1] if note else ''}"


def loss_rows(losses: dict[str, list], steps, min_width: int) -> tuple[list[str], list[int]]:
    """A per-step loss table, one column per runner: header and the rows for ``steps`` (0-based), and the
    column widths (for a summary row below it)."""
    names = list(losses)
    widths = [max(min_width, len(n) + 2) for n in names]
    lines = [f"{'step':>6}" + "".join(f"{n:>{w}}" for n, w in zip(names, widths))]
    for i in steps:
        row = [losses[n][i] if i < len(losses[n]) else float("nan") for n in names]
        lines.append(f"{i + 1:>6}" + "".join(f"{v:>{w}.6f}" for v, w in zip(row, widths)))
    return lines, widths


def run_notes(results: list[dict]) -> set[str]:
    """Every run's notes, as ``runner: note``."""
    return {f"{r['runner']}: {n}" for r in results for n in r.get("notes", [])}


def finish(cli, setup: str, report: str, results: list[dict], title: str, script: str) -> None:
    """Print the report; with --write-results append it to RESULTS.md under ``title`` (marked when smoke)."""
    setup += f"\nload average after: {[round(x, 2) for x in os.getloadavg()]}; rounds {cli.rounds}"
    print("\n" + report)
    if getattr(cli, "json", None):  # every run's measurements, for bench_all.py's table
        Path(cli.json).write_text(json.dumps({"setup": setup, "results": results}))
    if cli.write_results and not any(r["status"] == "ok" for r in results):
        print("\nnothing to write: no runner finished")
    elif cli.write_results:
        if cli.preset == "smoke":
            title += " — SMOKE RUN (checks the script end to end; not a measurement)"
        append_results(title, setup, report, script)
        print(f"\nappended to {RESULTS}")


def append_results(title: str, setup: str, report: str, script: str) -> None:
    """Append a dated section to RESULTS.md: the title, the exact command line of ``script``, setup and report."""
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(script, ROOT), *sys.argv[1:]])
    if not RESULTS.exists():
        RESULTS.write_text("# SFT benchmark results\n\n")
    with open(RESULTS, "a") as f:
        f.write(f"\n{title}\n\nCommand: `{command}`\n\n```\n{setup}\n\n{report}\n```\n")


# ------------------------------------------------------------------------------------------------
# command line


def add_run_arguments(parser: argparse.ArgumentParser, timeout: float, rounds: int, overrides: tuple[str, ...]) -> None:
    """The options every benchmark script here shares: rounds, gradient clipping, the preset ``overrides``,
    seed, threads, per-runner timeout, results file, keeping the work folder, and the hidden ones a child
    process is started with."""
    parser.add_argument("--rounds", type=int, default=rounds, help="each round runs every runner once, in turn")
    parser.add_argument("--max_grad_norm", "--max-grad-norm", type=float, default=1.0,
                        help="the same for every runner; 0 turns clipping off")
    for name in overrides:
        parser.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in every process (0: torch's default)")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds per runner process")
    parser.add_argument("--write-results", "--write_results", action="store_true", help="append to benchmarks/RESULTS.md")
    parser.add_argument("--keep", action="store_true", help="keep the temporary model, data and outputs")
    parser.add_argument("--json", help="also write every run's measurements to this JSON file")
    parser.add_argument("--profile_dir", "--profile-dir", default=None,
                        help="profile one warm-up step of every runner; write its top kernels to <runner>-top-kernels.txt here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
