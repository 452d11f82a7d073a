"""Distributed training against one process: hfnative's SFTTrainer under FSDP2, tensor and pipeline parallelism.

Every layout trains the same saved model on the same token rows for the same steps with the same global
batch G, each launched with torchrun in its own process tree (the 1-process run too), layouts alternating
over rounds:

    1-process   one process, per-device batch G
    fsdp2       2 processes, ParallelismConfig(dp_shard_size=2): FSDP2, per-device batch G/2
    tp2         2 processes, ParallelismConfig(tp_size=2): tensor parallel, per-device batch G (tp ranks share it)
    pp2-1f1b    2 processes, parallelism_config pp_size=2, pp_schedule="1f1b": 2 pipeline stages, the global batch
                as 2 accumulated micro-batches of G/2 (the schedule's micro-batches; both stages read them)
    pp2-gpipe   the same with pp_schedule="gpipe"

On CPU: fp32, gloo, ``use_cpu=True``, and the cores split between a layout's processes (OMP_NUM_THREADS);
on CUDA: bf16, NCCL, one GPU per rank. Printed per layout: global trained tokens/s (warm-up steps excluded)
and its ratio to the 1-process run, every rank's peak memory (VmHWM on CPU, torch.cuda.max_memory_allocated
on CUDA) and the ratio of the largest to the 1-process run, and the per-step losses side by side with their
largest relative difference from the 1-process run (fp32: the layouts must agree to ~1e-5).

    python benchmarks/bench_distributed.py --preset smoke --rounds 1
    python benchmarks/bench_distributed.py --preset reference --write-results
    python benchmarks/bench_distributed.py --device cuda --write-results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import hfnative

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402  (benchmarks/ is not a package)
    PRESETS,
    Shape,
    add_run_arguments,
    child_main,
    finish,
    loss_rows,
    machine_description,
    max_relative_difference,
    not_finished_line,
    prepare_workload,
    rss_mib,
    run_notes,
    run_rounds,
    start_parent,
    train_and_measure,
    training_arguments,
    work_folder,
)

REFERENCE = "1-process"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one layout runs: its processes, accelerate's ParallelismConfig sizes, and its share of the global batch."""

    processes: int
    sizes: dict | None  # None: no parallelism_config (a plain single-process run)
    batch_divisor: int  # per-device batch = global batch / batch_divisor (the data-parallel ranks)
    tp: int = 1  # ranks that share one batch
    pp: int = 1  # pipeline stages (they read the same batches too)
    accumulation: int = 1  # micro-batches per step (a pipeline's schedule runs them together)

    def per_device_batch(self, global_batch: int) -> int:
        return global_batch // self.batch_divisor // self.accumulation


LAYOUTS = {
    REFERENCE: Layout(processes=1, sizes=None, batch_divisor=1),
    "fsdp2": Layout(processes=2, sizes=dict(dp_shard_size=2), batch_divisor=2),
    "tp2": Layout(processes=2, sizes=dict(tp_size=2), batch_divisor=1, tp=2),
    "pp2-1f1b": Layout(processes=2, sizes=dict(dp_shard_size=1, pp_size=2, pp_schedule="1f1b"), batch_divisor=1, pp=2,
                       accumulation=2),
    "pp2-gpipe": Layout(processes=2, sizes=dict(dp_shard_size=1, pp_size=2, pp_schedule="gpipe"), batch_divisor=1,
                        pp=2, accumulation=2),
}


def threads_per_process(layout: Layout, cli) -> int:
    """--threads when given, else the cores this process may use split evenly between the layout's processes."""
    return cli.threads or max(1, len(os.sched_getaffinity(0)) // layout.processes)


# ------------------------------------------------------------------------------------------------
# child: one rank of one layout


def train_layout(runner: str, spec: dict, notes: list[str]) -> dict:
    """Train as one rank of ``runner``'s layout; every rank's measurements, gathered (the result rank 0 writes)."""
    rss_after_imports = rss_mib()
    layout, shape, is_cuda = LAYOUTS[runner], Shape(**spec["shape"]), spec["device"] == "cuda"
    dataset = datasets.load_from_disk(spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    common = training_arguments(runner, spec)
    common["per_device_train_batch_size"] = layout.per_device_batch(shape.batch)
    common["gradient_accumulation_steps"] = layout.accumulation
    parallel = {}
    if layout.sizes:
        from hfnative.trainers.running.parallel_plan import parallelism_config_from

        # accelerate's ParallelismConfig, with hfnative's own keys (pp_size, pp_schedule) kept on it
        parallel["parallelism_config"] = parallelism_config_from(layout.sizes)
    args = hfnative.SFTConfig(**common, max_length=shape.seq, packing=False, **parallel)
    trainer = hfnative.SFTTrainer(model=spec["model_dir"], args=args, train_dataset=dataset, processing_class=tokenizer)
    if (trainer.distributed is not None) != (layout.processes > 1):
        raise RuntimeError(f"{runner}: launched on {layout.processes} processes but the trainer's distributed run "
                           f"is {trainer.distributed}")
    measured, _ = train_and_measure(trainer, shape, is_cuda)

    rank = {key: measured[key] for key in ("timed_tokens", "timed_seconds", "step_seconds", "peak_rss_mib",
                                           "peak_gpu_mib", "peak_heap_mib", "torch_threads")}
    rank["rss_after_imports_mib"] = rss_after_imports
    ranks = [rank]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, rank)
    # tensor-parallel ranks and pipeline stages count the same rows; the step ends when its slowest rank does
    global_tokens = sum(r["timed_tokens"] for r in ranks) / (layout.tp * layout.pp)
    timed_seconds = max(r["timed_seconds"] for r in ranks)
    timed_steps = shape.steps - shape.warmup
    slowest_steps = [max(r["step_seconds"][i] for r in ranks) for i in range(shape.warmup - 1, shape.steps - 1)]
    return {
        "losses": measured["losses"],
        "grad_norms": measured["grad_norms"],
        "timed_tokens": global_tokens,
        "tokens_per_second": global_tokens / timed_seconds,
        "median_step_tokens_per_second": global_tokens / timed_steps / statistics.median(slowest_steps),
        "ranks": ranks,
        "processes": dist.get_world_size() if dist.is_initialized() else 1,
        "per_device_batch": args.per_device_train_batch_size,
    }


# ------------------------------------------------------------------------------------------------
# report


def layout_summary(ok: list[dict], memory_key: str) -> dict:
    """One layout's finished runs: median tokens/s, and per rank the largest peak memory over the rounds."""
    ranks = ok[0]["processes"]
    return {
        "rates": [r["tokens_per_second"] for r in ok],
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in ok),
        "step_median": statistics.median(r["median_step_tokens_per_second"] for r in ok),
        "peaks": [max(run["ranks"][i][memory_key] for run in ok) for i in range(ranks)],
        "heaps": [max(run["ranks"][i]["peak_heap_mib"] or float("nan") for run in ok) for i in range(ranks)],
        "imports": statistics.median(r["rss_after_imports_mib"] for run in ok for r in run["ranks"]),
        "threads": "/".join(sorted({str(r["torch_threads"]) for r in ok[0]["ranks"]})),
        "processes": ranks,
        "per_device_batch": ok[0]["per_device_batch"],
        "losses": ok[0]["losses"],
        "grad_norms": ok[0]["grad_norms"],
        "timed_tokens": ok[0]["timed_tokens"],
        "rounds_agree": all(r["losses"] == ok[0]["losses"] for r in ok),
    }


def summarize(results: list[dict], order: list[str], device: str, clipping: bool) -> str:
    memory = "peak GPU MiB" if device == "cuda" else "peak RSS MiB"
    header = (f"{'layout':<11}{'procs':>6}{'threads':>8}{'batch/rank':>11}{'tokens/s':>10}{'min..max':>16}"
              f"{'step-median':>12}{'x 1-proc':>9}{memory + ' per rank':>24}{'x 1-proc':>9}")
    if device != "cuda":
        header += f"{'RSS@import':>12}{'peak heap per rank':>20}"
    memory_key = "peak_gpu_mib" if device == "cuda" else "peak_rss_mib"
    finished = {name: [r for r in results if r["runner"] == name and r["status"] == "ok"] for name in order}
    summary = {name: layout_summary(ok, memory_key) for name, ok in finished.items() if ok}
    reference = summary.get(REFERENCE)
    lines = [header, "-" * len(header)]
    for name in order:
        if name not in summary:
            lines.append(not_finished_line(name, [r for r in results if r["runner"] == name], runner_width=11, status_width=6))
            continue
        s = summary[name]
        # the memory ratio is the largest rank's peak over the single process's
        speed_ratio = f"x{s['tokens_per_second'] / reference['tokens_per_second']:.2f}" if reference else "-"
        memory_ratio = f"x{max(s['peaks']) / max(reference['peaks']):.2f}" if reference else "-"
        rates = f"{min(s['rates']):,.0f}..{max(s['rates']):,.0f}"
        line = (f"{name:<11}{s['processes']:>6}{s['threads']:>8}{s['per_device_batch']:>11}{s['tokens_per_second']:>10,.0f}"
                f"{rates:>16}{s['step_median']:>12,.0f}{speed_ratio:>9}"
                f"{' / '.join(f'{p:,.0f}' for p in s['peaks']):>24}{memory_ratio:>9}")
        if device != "cuda":
            line += f"{s['imports']:>12,.0f}{' / '.join(f'{h:,.0f}' for h in s['heaps']):>20}"
        lines.append(line)

    notes = sorted(run_notes(results) | {f"{r['runner']}: {r['note'].splitlines()[-1]}"
                                         for r in results if r["status"] == "unavailable"})
    if reference:
        names = list(summary)
        count = len(reference["losses"])
        shown = range(count) if count <= 12 else sorted({0, 1, 2, *range(count - 3, count), *range(0, count, max(count // 6, 1))})
        rows, widths = loss_rows({n: summary[n]["losses"] for n in names}, shown, min_width=14)
        lines += ["", f"per-step loss (maxrel: largest relative difference from {REFERENCE} over all {count} steps):", *rows]
        for label, key in (("maxrel", "losses"), ("gnorm", "grad_norms")):
            if all(summary[n][key] and summary[n][key][0] is not None for n in names):
                lines.append(f"{label:>6}" + "".join(
                    f"{max_relative_difference(summary[n][key], reference[key]):>{w}.2e}" for n, w in zip(names, widths)))
        if clipping and device != "cuda" and any(max_relative_difference(summary[n]["losses"], reference["losses"]) > 1e-5
                                                 for n in names):
            notes.append("clipping scales every step's gradients by max_grad_norm / norm, and torch's fp32 norm of a whole "
                         "tensor and of its shards differ by round-off (up to ~1e-4 relative for a multi-million-element gradient on CPU), "
                         "which the following steps amplify; --max_grad_norm 0 compares the layouts without clipping")
        token_counts = {n: summary[n]["timed_tokens"] for n in names}
        if len(set(token_counts.values())) > 1:
            notes.append(f"layouts trained different numbers of tokens in the timed steps: {token_counts}")
        unstable = [n for n in names if not summary[n]["rounds_agree"]]
        if unstable:
            notes.append(f"losses differ between rounds of the same layout (non-deterministic): {', '.join(unstable)}")
    if notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in notes]
    return "\n".join(lines)


def describe_setup(cli, shape: Shape, parameters: int, data: dict, machine: dict, layouts: list[str], tied: bool) -> str:
    if cli.device == "cuda":
        precision, backend = "bf16 autocast, fp32 master weights", "NCCL, one GPU per rank"
    else:
        precision, backend = "fp32, use_cpu=True", "gloo"
    threads = "; ".join(f"{name}: {LAYOUTS[name].processes} x {threads_per_process(LAYOUTS[name], cli)}"
                        for name in layouts)
    return "\n".join([
        f"machine: {machine['cpu']}, {machine['cores']} cores" + (f", GPU {machine['gpu']} x {torch.cuda.device_count()}"
                                                                if "gpu" in machine else ""),
        f"software: python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}; "
        f"date {machine['date']}; load average {machine['load_average']}",
        f"model: Qwen3-shaped, hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads / {shape.kv_heads} KV, "
        f"head_dim {shape.head_dim}, intermediate {shape.intermediate}, vocab {shape.vocab}, {'tied' if tied else 'untied'}; "
        f"{parameters / 1e6:.2f}M parameters",
        f"training: {precision}, {backend}; global batch {shape.batch} x seq {shape.seq}, {shape.steps} steps "
        f"({shape.warmup} warm-up steps not timed), AdamW lr 1e-3 constant, max_grad_norm {cli.max_grad_norm}, "
        f"no activation checkpointing, seed {cli.seed}; data: {data['rows']} rows, {data['tokens']:,} tokens",
        f"launch: torchrun --standalone per layout, processes x torch threads each (OMP_NUM_THREADS): {threads}",
    ])


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model and batch shape; the batch is the global batch (default: reference on cpu, "
                             "qwen3_0.6b on cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {','.join(LAYOUTS)}")
    add_run_arguments(parser, timeout=600, rounds=2, overrides=("seq", "batch", "steps", "warmup", "vocab"))
    return parser.parse_args(argv)


def layouts_to_run(cli, shape: Shape) -> tuple[list[str], list[dict], list[str]]:
    """The layouts to start, the ones that cannot run here (as results), and every requested layout in order."""
    order = [name.strip() for name in cli.layouts.split(",") if name.strip()]
    unknown = [name for name in order if name not in LAYOUTS]
    if unknown:
        sys.exit(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    runners, skipped = [], []
    for name in order:
        layout = LAYOUTS[name]
        if shape.batch % layout.batch_divisor:
            sys.exit(f"--batch {shape.batch}: the global batch must divide by {layout.batch_divisor} for {name}")
        if cli.device == "cuda" and torch.cuda.device_count() < layout.processes:
            skipped.append({"runner": name, "status": "unavailable",
                            "note": f"needs {layout.processes} GPUs (one per NCCL rank), torch sees "
                                    f"{torch.cuda.device_count()}"})
            continue
        runners.append(name)
    return runners, skipped, order


def main() -> None:
    cli = parse_args()
    if cli.child:
        child_main(cli, train=train_layout)
        return

    cli.preset = cli.preset or ("qwen3_0.6b" if cli.device == "cuda" else "reference")
    shape = start_parent(cli, PRESETS)
    runners, skipped, order = layouts_to_run(cli, shape)

    def launch(name: str) -> tuple[list[str], dict[str, str]]:
        layout = LAYOUTS[name]
        return (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(layout.processes)],
                {"OMP_NUM_THREADS": str(threads_per_process(layout, cli))})

    with work_folder("bench_distributed_", cli.keep) as work:
        # pipeline parallel needs untied embeddings (the first stage holds the embedding, the last the head): with a
        # pp layout in the run, every layout trains the untied model
        tied = not any(LAYOUTS[name].pp > 1 for name in order)
        workload = prepare_workload(work, shape, cli, cli.device, packing=False, tied=tied)
        setup = describe_setup(cli, shape, workload.parameters, workload.data, machine_description(cli.device), order,
                               tied)
        print(setup, flush=True)

        def shown(result: dict) -> str:
            memory = "peak_gpu_mib" if cli.device == "cuda" else "peak_rss_mib"
            peaks = " / ".join(f"{r[memory]:,.0f}" for r in result["ranks"])
            return (f"{result['tokens_per_second']:,.0f} tokens/s, peak {'GPU' if cli.device == 'cuda' else 'RSS'} "
                    f"MiB per rank {peaks}, final loss {result['losses'][-1]:.6f}")

        results = skipped + run_rounds(runners, workload, cli, __file__, shown, launch)
        report = summarize(results, order, cli.device, clipping=cli.max_grad_norm > 0)
        title = f"## {datetime.date.today().isoformat()} — distributed (`bench_distributed.py`), preset `{cli.preset}`, {cli.device}"
        finish(cli, setup, report, results, title, __file__)


if __name__ == "__main__":
    main()
