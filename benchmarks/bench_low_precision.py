"""Low precision on one GPU: float8 against bf16 tokens/s, and the largest full fine-tune batch against TRL's.

    python benchmarks/bench_low_precision.py float8 --device cuda                 # Qwen3-4B shape, compiled both
    python benchmarks/bench_low_precision.py fit --device cuda                    # Qwen3-4B, seq 2,048
    python benchmarks/bench_low_precision.py fit --device cuda --preset qwen3_8b
    python benchmarks/bench_low_precision.py float8 --device cpu --preset smoke   # the CPU rehearsal (emulated float8)

float8: hfnative's SFTTrainer with bf16 autocast over fp32 master weights, compiled (on CUDA), once as is and once
with ``float8_recipe`` (torchao, the blocks' projections in float8); tokens/s after the warm-up steps and the loss of
every step side by side; peak memory is the GPU's (on a CPU, the process's RSS). The goal is float8 >= 1.2x bf16 tokens/s with every step's loss within 1% of bf16's (the
bound tests/test_float8.py states and checks on CPU). ``--layers`` cuts the 36 blocks of the Qwen3-4B shape (each
block is the same, so the ratio holds) to fit a short GPU slot.

fit: a full fine-tune at seq 2,048 with bf16 weights (``model_init_kwargs={"dtype": "bfloat16"}``): hfnative with
optimizer-in-backward (no whole-model gradients), activation checkpointing, the fused linear-cross-entropy head and
stochastically rounded AdamW updates (``bf16_weight_updates``), against TRL's SFTTrainer on the same weights with
gradient checkpointing; each at the batch sizes of ``--batches`` in turn, stopping at the first that runs out of
memory. Printed: the largest batch each fits, its tokens/s and peak GPU memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import datasets
import torch
import transformers
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402  (benchmarks/ is not a package)
    PRESETS,
    Shape,
    Unavailable,
    add_run_arguments,
    child_main,
    finish,
    loss_rows,
    machine_description,
    max_relative_difference,
    prepare_workload,
    run_child,
    start_parent,
    train_and_measure,
    training_arguments,
    work_folder,
)

LOW_PRECISION_PRESETS = {
    **PRESETS,
    # Qwen3-4B and Qwen3-8B's shapes (tied head for 4B, as the Hub checkpoint; 8B's is untied)
    "qwen3_4b": Shape(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936,
                      seq=2048, batch=4, steps=10, warmup=3),
    "qwen3_8b": Shape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
                      seq=2048, batch=2, steps=6, warmup=2),
}
LOSS_BOUND = 0.01  # float8's loss against bf16's, relative, every step (tests/test_float8.py says why)
FLOAT8_GOAL = 1.2


# ------------------------------------------------------------------------------------------------
# child: one runner, one training run


def train_once(runner: str, spec: dict, notes: list[str]) -> dict:
    """``ours:bf16`` / ``ours:float8`` (the float8 comparison) or ``ours:batch<N>`` / ``trl:batch<N>`` (the fit
    search)."""
    shape, is_cuda = Shape(**spec["shape"]), spec["device"] == "cuda"
    base, _, variant = runner.partition(":")
    if variant.startswith("batch"):
        shape = dataclasses.replace(shape, batch=int(variant.removeprefix("batch")))
        spec = {**spec, "shape": dataclasses.asdict(shape)}
    dataset = datasets.load_from_disk(spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    common = training_arguments(runner, spec)
    sft = dict(max_length=shape.seq, packing=False)
    if spec["mode"] == "fit":
        # bf16 weights; no gradient clipping (optimizer-in-backward cannot clip, so neither runner does)
        sft.update(model_init_kwargs={"dtype": "bfloat16"}, max_grad_norm=0.0, gradient_checkpointing=True,
                   activation_checkpointing=True)
    if base == "trl":
        import trl

        trainer = trl.SFTTrainer(model=spec["model_dir"], args=trl.SFTConfig(**{**common, **sft}),
                                 train_dataset=dataset, processing_class=tokenizer)
    else:
        import hfnative

        if spec["mode"] == "fit":
            sft.update(optimizer_in_backward=True)
        else:
            sft.update(torch_compile=spec["compile"], float8_recipe=spec["recipe"] if variant == "float8" else None)
        trainer = hfnative.SFTTrainer(model=spec["model_dir"], args=hfnative.SFTConfig(**{**common, **sft}),
                                      train_dataset=dataset, processing_class=tokenizer)
    try:
        result, _ = train_and_measure(trainer, shape, is_cuda)
    except torch.OutOfMemoryError as error:
        raise Unavailable(f"out of memory: {str(error).splitlines()[0]}") from error
    return {**result, "batch": shape.batch}


# ------------------------------------------------------------------------------------------------
# parent


def _peak_mib(result: dict) -> float:
    """Peak GPU memory, or on a CPU the process's peak RSS."""
    return result["peak_gpu_mib"] if result["peak_gpu_mib"] is not None else result["peak_rss_mib"]


def float8_report(results: dict[str, dict]) -> str:
    bf16, float8 = results.get("ours:bf16"), results.get("ours:float8")
    lines = [f"{'runner':<14}{'status':>8}{'tokens/s':>12}{'peak MiB':>14}{'final loss':>12}"]
    for name, result in results.items():
        if result["status"] != "ok":
            lines.append(f"{name:<14}{result['status']:>8}  {(result.get('note') or '').strip().splitlines()[-1:]}")
            continue
        lines.append(f"{name:<14}{'ok':>8}{result['tokens_per_second']:>12,.0f}{_peak_mib(result):>14,.0f}"
                     f"{result['losses'][-1]:>12.6f}")
    if bf16 and float8 and bf16["status"] == float8["status"] == "ok":
        ratio = float8["tokens_per_second"] / bf16["tokens_per_second"]
        gap = max_relative_difference(float8["losses"], bf16["losses"])
        rows, _ = loss_rows({"bf16": bf16["losses"], "float8": float8["losses"]}, range(len(bf16["losses"])), 14)
        lines += ["", "per-step loss:", *rows, "",
                  f"float8 / bf16 tokens/s: x{ratio:.2f} (goal x{FLOAT8_GOAL}: {'met' if ratio >= FLOAT8_GOAL else 'NOT met'})",
                  f"float8 vs bf16 loss, max relative difference over the steps: {gap:.2e} "
                  f"(bound {LOSS_BOUND}: {'within' if gap <= LOSS_BOUND else 'OUTSIDE'})"]
    return "\n".join(lines)


def fit_search(cli, workload, batches: list[int]) -> dict[str, list[dict]]:
    """Each runner at each batch of ``batches`` in turn, up to its first out-of-memory (or failure)."""
    tried = {}
    for base in cli.runners.split(","):
        tried[base] = []
        for batch in batches:
            runner = f"{base}:batch{batch}"
            result = run_child(runner, workload.spec_path, workload.spec_path.parent / "result.json", cli.timeout,
                               __file__)
            if "out of memory" in (result.get("note") or ""):
                result["status"] = "out of memory"
            tried[base].append(result)
            detail = (f"{result['tokens_per_second']:,.0f} tokens/s, peak {_peak_mib(result):,.0f} MiB"
                      if result["status"] == "ok" else (result.get("note") or "").strip().splitlines()[-1:])
            print(f"{runner}: {result['status']} {detail}", flush=True)
            if result["status"] != "ok":
                break
    return tried


def fit_report(tried: dict[str, list[dict]]) -> str:
    lines = [f"{'runner':<8}{'largest batch':>15}{'tokens/s':>12}{'peak MiB':>14}  then"]
    for base, results in tried.items():
        fitted = [r for r in results if r["status"] == "ok"]
        stopped = next((r for r in results if r["status"] != "ok"), None)
        after = f"batch {results[len(fitted)]['runner'].split(':batch')[1]}: {stopped['status']}" if stopped else "-"
        if not fitted:
            lines.append(f"{base:<8}{'none':>15}{'':>12}{'':>14}  {after}")
            continue
        best = fitted[-1]
        lines.append(f"{base:<8}{best['batch']:>15}{best['tokens_per_second']:>12,.0f}{_peak_mib(best):>14,.0f}  {after}")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=("float8", "fit"), default="float8")
    parser.add_argument("--preset", choices=sorted(LOW_PRECISION_PRESETS), default=None,
                        help="model and batch shape (default: qwen3_4b on cuda, smoke on cpu)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's block count")
    parser.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise", help="float8 recipe")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile both float8 runners (default: on CUDA only; on a CPU, float8 is emulated "
                             "and compiling it only costs build time)")
    parser.add_argument("--runners", default="ours,trl", help="fit: comma-separated subset of ours,trl")
    parser.add_argument("--batches", default="1,2,4,8,16,32", help="fit: the batch sizes tried, in order")
    add_run_arguments(parser, timeout=900, rounds=1, overrides=("seq", "batch", "steps", "warmup", "vocab"))
    return parser.parse_args(argv)


def main() -> None:
    cli = parse_args()
    if cli.child:
        child_main(cli, train=train_once)
        return
    cli.preset = cli.preset or ("qwen3_4b" if cli.device == "cuda" else "smoke")
    shape = start_parent(cli, LOW_PRECISION_PRESETS)
    if cli.layers:
        shape = dataclasses.replace(shape, layers=cli.layers)
    compile_both = cli.device == "cuda" if cli.compile is None else cli.compile
    with work_folder("bench_low_precision_", cli.keep) as work:
        # fit: a bf16 checkpoint, as the Hub's Qwen3 (half the bytes to write and read)
        workload = prepare_workload(work, shape, cli, cli.device, packing=False, tied=cli.preset != "qwen3_8b",
                                    dtype=torch.bfloat16 if cli.mode == "fit" else torch.float32,
                                    mode=cli.mode, recipe=cli.recipe, compile=compile_both)
        machine = machine_description(cli.device)
        setup = (f"machine: {machine.get('gpu', machine['cpu'])}; torch {machine['torch']}, transformers "
                 f"{machine['transformers']}, trl {machine['trl']}; {machine['date']}\n"
                 f"model: Qwen3-shaped, hidden {shape.hidden}, {shape.layers} layers, intermediate {shape.intermediate}, "
                 f"vocab {shape.vocab}, {workload.parameters / 1e6:,.1f}M parameters; seq {shape.seq}, "
                 f"{shape.steps} steps ({shape.warmup} not timed)")
        if cli.mode == "float8":
            precision = "bf16 autocast over fp32 master weights" if cli.device == "cuda" else "fp32 (CPU)"
            setup += (f"\nfloat8: {precision}, batch {shape.batch}, "
                      f"{'compiled' if compile_both else 'eager'}, float8 recipe {cli.recipe}")
            results = {}
            for runner in ("ours:bf16", "ours:float8"):
                results[runner] = run_child(runner, workload.spec_path, work / "result.json", cli.timeout, __file__)
                print(f"{runner}: {results[runner]['status']}", flush=True)
            report, runs, title = float8_report(results), list(results.values()), "float8 vs bf16"
        else:
            setup += ("\nfit: bf16 weights, activation checkpointing, no clipping; hfnative with optimizer-in-backward, "
                      "the fused head and stochastically rounded AdamW; TRL with its own defaults otherwise")
            tried = fit_search(cli, workload, [int(b) for b in cli.batches.split(",")])
            report, runs, title = fit_report(tried), [r for rs in tried.values() for r in rs], "one-GPU full fine-tune"
        print(setup, flush=True)
        finish(cli, setup, report, runs, f"## {machine['date']} — {title}, preset `{cli.preset}`, {cli.device}", __file__)


if __name__ == "__main__":
    transformers.utils.logging.set_verbosity_error()
    main()
