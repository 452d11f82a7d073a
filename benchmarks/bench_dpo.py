"""DPO throughput, memory and loss agreement: TRL's DPOTrainer vs hfnative's, side by side.

Both runners train the same saved model (the reference model being a frozen copy of it, loaded by each
trainer as it does with ``ref_model=None``) on the same preference rows, in the same seeded order, with
the same hyperparameters, each in its own child process (so peak memory is per runner), alternating
over several rounds. Printed: tokens/s (non-padding tokens of the chosen and rejected sequences, warm-up
steps excluded), peak RSS (peak GPU memory on CUDA), per-step losses and grad norms side by side.

    python benchmarks/bench_dpo.py --preset smoke --rounds 1
    python benchmarks/bench_dpo.py --preset reference
    python benchmarks/bench_dpo.py --preset 100m --rounds 1
    python benchmarks/bench_dpo.py --device cuda --preset qwen3_0.6b

Rows: text prompts of several "Question: ...\\nAnswer: ..." pairs from examples/data/preference.jsonl,
grown until prompt + completion fill about ``seq`` tokens; chosen / rejected are the last question's
right answer and another question's answer. ``batch`` sequences per forward: batch / 2 pairs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
from pathlib import Path

import datasets
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402  (benchmarks/ is not a package)
    PRESETS,
    ROOT,
    TOKENIZER_DIR,
    Shape,
    Workload,
    add_run_arguments,
    build_model,
    child_main,
    finish,
    loss_rows,
    machine_description,
    max_relative_difference,
    not_finished_line,
    profile_dir,
    profile_path,
    run_rounds,
    start_parent,
    train_and_measure,
    training_arguments,
    work_folder,
)

RUNNERS = ("trl", "ours")
PREFERENCE_DATA = ROOT / "examples" / "data" / "preference.jsonl"


def build_preference_rows(shape: Shape, folder: Path, seed: int) -> dict:
    """Text preference rows whose prompt + longer completion fill about ``seq`` tokens; saved to ``folder``."""
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    with open(PREFERENCE_DATA) as f:
        pairs = [(r["prompt"][-1]["content"], r["chosen"][0]["content"], r["rejected"][0]["content"])
                 for r in (json.loads(line) for line in f)]
    rng = random.Random(seed)
    pairs_per_step = max(shape.batch // 2, 1)
    count = int(shape.steps * pairs_per_step * 1.2) + pairs_per_step
    rows, tokens = [], 0
    for _ in range(count):
        question, chosen, rejected = pairs[rng.randrange(len(pairs))]
        context = []
        while True:  # earlier questions with their answers, until the row is about seq tokens long
            q, a, _ = pairs[rng.randrange(len(pairs))]
            candidate = context + [f"Question: {q}\nAnswer: {a}\n"]
            prompt = "".join(candidate) + f"Question: {question}\nAnswer:"
            length = len(tokenizer(prompt + " " + max(chosen, rejected, key=len))["input_ids"]) + 1
            if length > shape.seq and context:
                break
            context = candidate
            if length > shape.seq:
                break
        prompt = "".join(context) + f"Question: {question}\nAnswer:"
        rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
        tokens += len(tokenizer(prompt + " " + chosen)["input_ids"]) + len(tokenizer(prompt + " " + rejected)["input_ids"])
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    return {"rows": len(rows), "tokens": tokens}


# ------------------------------------------------------------------------------------------------
# child: one runner, one training run


def train_once(runner: str, spec: dict, notes: list[str]) -> dict:
    shape = Shape(**spec["shape"])
    dataset = datasets.load_from_disk(spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    common = training_arguments(runner, spec)
    common["per_device_train_batch_size"] = max(shape.batch // 2, 1)  # pairs: 2x that many sequences per forward
    dpo = dict(max_length=shape.seq, beta=0.1)
    if runner == "trl":
        import trl

        module = trl
    elif runner == "ours":
        import hfnative

        module = hfnative
    else:
        raise ValueError(f"unknown runner {runner!r}")
    trainer = module.DPOTrainer(model=spec["model_dir"], args=module.DPOConfig(**common, **dpo), train_dataset=dataset,
                                processing_class=tokenizer)
    result, _ = train_and_measure(trainer, shape, spec["device"] == "cuda", profile_to=profile_path(spec, runner))
    return result


# ------------------------------------------------------------------------------------------------
# report


def summarize(results: list[dict], device: str, runners=RUNNERS) -> str:
    lines, summary = [], {}
    memory = "peak GPU MiB" if device == "cuda" else "peak RSS MiB"
    header = f"{'runner':<10}{'tokens/s':>10}{'min..max':>20}{'step-median':>13}{memory:>14}{'peak heap':>11}{'final loss':>12}"
    lines += [header, "-" * len(header)]
    for runner in runners:
        runs = [r for r in results if r["runner"] == runner]
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            lines.append(not_finished_line(runner, runs, runner_width=10, status_width=10))
            continue
        rates = [r["tokens_per_second"] for r in ok]
        summary[runner] = {
            "tokens_per_second": statistics.median(rates),
            "peak_memory_mib": max(r["peak_gpu_mib"] if device == "cuda" else r["peak_rss_mib"] for r in ok),
            "peak_heap_mib": max((r.get("peak_heap_mib") or float("nan") for r in ok), default=float("nan")),
            "losses": ok[0]["losses"], "grad_norms": ok[0]["grad_norms"], "timed_tokens": ok[0]["timed_tokens"],
        }
        s = summary[runner]
        lines.append(
            f"{runner:<10}{s['tokens_per_second']:>10,.0f}{f'{min(rates):,.0f}..{max(rates):,.0f}':>20}"
            f"{statistics.median(r['median_step_tokens_per_second'] for r in ok):>13,.0f}{s['peak_memory_mib']:>14,.0f}"
            f"{s['peak_heap_mib']:>11,.0f}{s['losses'][-1]:>12.6f}"
        )
    if len(summary) == 2:
        ours, trl = summary["ours"], summary["trl"]
        lines += ["", f"ours / trl: tokens/s x{ours['tokens_per_second'] / trl['tokens_per_second']:.2f}, "
                      f"{memory} x{ours['peak_memory_mib'] / trl['peak_memory_mib']:.2f}"]
        count = len(trl["losses"])
        rows, widths = loss_rows({n: summary[n]["losses"] for n in summary}, range(count), min_width=16)
        lines += ["", "per-step loss (max relative difference against trl):"] + rows
        for label, key in (("maxrel", "losses"), ("gnorm", "grad_norms")):
            lines.append(f"{label:>6}" + "".join(
                f"{max_relative_difference(summary[n][key], trl[key]):>{w}.2e}" for n, w in zip(summary, widths)))
        if ours["timed_tokens"] != trl["timed_tokens"]:
            lines.append(f"note: the runners trained different token counts: {ours['timed_tokens']} vs {trl['timed_tokens']}")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model and batch shape (default: reference on cpu, qwen3_0.6b on cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--activation_checkpointing", action="store_true",
                        help="activation checkpointing for both runners (TRL's default)")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated, from trl and ours")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16=True (autocast over fp32 weights) on a CPU too (always on cuda)")
    add_run_arguments(parser, timeout=3600, rounds=3, overrides=("seq", "batch", "steps", "warmup", "vocab"))
    return parser.parse_args(argv)


def main() -> None:
    cli = parse_args()
    if cli.child:
        child_main(cli, train=train_once)
        return
    cli.preset = cli.preset or ("qwen3_0.6b" if cli.device == "cuda" else "reference")
    runners = [runner for runner in RUNNERS if runner in cli.runners.split(",")]
    if not runners or len(runners) != len(cli.runners.split(",")):
        raise SystemExit(f"--runners {cli.runners}: choose from {', '.join(RUNNERS)}")
    shape = start_parent(cli, PRESETS)
    with work_folder("bench_dpo_", cli.keep) as work:
        parameters = build_model(shape, work / "model", cli.seed)
        data = build_preference_rows(shape, work / "data", cli.seed)
        spec = {"device": cli.device, "shape": shape.__dict__, "model_dir": str(work / "model"),
                "data_dir": str(work / "data"), "work_dir": str(work), "checkpointing": cli.activation_checkpointing,
                "max_grad_norm": cli.max_grad_norm, "seed": cli.seed, "threads": cli.threads,
                "profile_dir": profile_dir(cli), "bf16": cli.bf16 or cli.device == "cuda"}
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        machine = machine_description(cli.device)
        setup = "\n".join([
            f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}"
            + (f", GPU {machine['gpu']}" if "gpu" in machine else ""),
            f"software: python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}, "
            f"trl {machine['trl']}; date {machine['date']}; load average {machine['load_average']}",
            f"model: Qwen3-shaped, hidden {shape.hidden}, {shape.layers} layers, vocab {shape.vocab}, tied; "
            f"{parameters / 1e6:.2f}M parameters; reference: a frozen copy (ref_model=None)",
            f"training: {'bf16 autocast' if spec['bf16'] else 'fp32'}, DPO sigmoid beta 0.1, max_length {shape.seq}, "
            f"{max(shape.batch // 2, 1)} pairs ({shape.batch} sequences) per step, {shape.steps} steps ({shape.warmup} "
            f"warm-up not timed), AdamW lr 1e-3, max_grad_norm {cli.max_grad_norm}, "
            f"{'activation checkpointing' if cli.activation_checkpointing else 'no activation checkpointing'}; "
            f"data: {data['rows']} pairs, {data['tokens']:,} tokens",
        ])
        print(setup, flush=True)

        def shown(result: dict) -> str:
            memory = result["peak_gpu_mib"] if cli.device == "cuda" else result["peak_rss_mib"]
            return f"{result['tokens_per_second']:,.0f} tokens/s, peak {memory:,.0f} MiB, final loss {result['losses'][-1]:.6f}"

        results = run_rounds(runners, Workload(parameters, data, spec_path), cli, __file__, shown)
        title = f"## {datetime.date.today().isoformat()} — DPO, preset `{cli.preset}`, {cli.device}"
        finish(cli, setup, summarize(results, cli.device, runners), results, title, __file__)


if __name__ == "__main__":
    main()
