"""SFT throughput, memory and loss agreement: TRL's SFTTrainer vs transformers' Trainer vs hfnative.

Every runner trains the same saved model on the same token rows, in the same seeded order, with the
same hyperparameters, each in its own child process (so peak RSS is per runner), alternating runners
over several rounds. Printed: tokens/s (trained input tokens, warm-up steps excluded), peak RSS,
final and per-step losses side by side, and MFU against a matmul peak measured on this machine.

    python benchmarks/bench_sft.py --preset smoke --rounds 1
    python benchmarks/bench_sft.py --preset reference --write-results
    python benchmarks/bench_sft.py --device cuda --packing --write-results
    python benchmarks/bench_sft.py --preset smoke_depth28 --lora --activation_checkpointing --runners trl,ours

--lora trains LoRA adapters on every linear layer (the same peft.LoraConfig for TRL and hfnative, harness.LORA) instead
of the whole model; transformers' Trainer is skipped. With it, the hfnative variants ``qlora`` (the frozen base in NF4,
computed in bf16: ``quantization_config={"load_in_4bit": True, "bnb_4bit_compute_dtype": "bfloat16"}``) and
``qlora_torch_dequantize`` (the same, its weights made whole by torchao's op sequence instead of the Triton kernel) time
QLoRA against LoRA; their losses part from the others' by the NF4 rounding of the base.

FLOPs per trained token (PaLM appendix B convention, causal masking not discounted):
    F = 6 * (N_body + V * D) + 12 * L * H * d_head * S
N_body = parameters of the decoder blocks and final norm (no embedding table); V * D = the output
projection, counted even when tied to the embedding (the lookup is free, the head matmul is not);
L layers, H query heads, d_head head dim, S sequence length (the packed row length with --packing).
With --lora the frozen weights get no gradient: F = 4 * (N_body + V * D) + 12 * L * H * d_head * S (the
adapters' own FLOPs, r / D of the rest, not counted).
MFU = tokens/s * F / peak, peak = 2 n^3 / t of a timed n x n torch.mm loop (fp32 on CPU, bf16 on CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import datasets
import torch
import torch._dynamo
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402  (benchmarks/ is not a package)
    LORA,
    PRESETS,
    Shape,
    Unavailable,
    add_run_arguments,
    child_main,
    finish,
    finished_runs,
    loss_rows,
    machine_description,
    max_relative_difference,
    prepare_workload,
    profile_path,
    rss_mib,
    run_notes,
    run_rounds,
    start_parent,
    train_and_measure,
    training_arguments,
    work_folder,
)

BASE_RUNNERS = ("trl", "hf", "ours")
# cpu_policy: hfnative with the CPU's device policy forced (hfnative/device_policy.py), to see the GPU policy's trades;
# torch_kernels: the GPU policy without its Triton kernels (hfnative/models/triton_kernels.py), to see what they pay;
# keep_attention / keep_nothing: with --activation_checkpointing, TRL's gradient_checkpointing_kwargs={"selective":
# True / False} (checkpointed blocks keep the attention's output / nothing), against the device policy's choice
OURS_VARIANTS = ("default", "optimizer_in_backward", "compile", "cpu_policy", "torch_kernels", "keep_attention",
                 "keep_nothing", "qlora", "qlora_torch_dequantize")


# ------------------------------------------------------------------------------------------------
# FLOPs and the matmul peak (MFU)


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


def flops_per_token(shape: Shape, lora: bool = False) -> dict:
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
        # forward 2, backward 2 for the inputs' gradients and 2 for the weights' (none for frozen weights, LoRA)
        "flops_per_token": (4 if lora else 6) * (body + head) + attention_scores,
    }


# ------------------------------------------------------------------------------------------------
# child: one runner, one training run


def train_once(runner: str, spec: dict, notes: list[str]) -> dict:
    rss_after_imports = rss_mib()
    device, shape = spec["device"], Shape(**spec["shape"])
    dataset = datasets.load_from_disk(spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    is_cuda = device == "cuda"
    common = training_arguments(runner, spec)
    sft = dict(max_length=shape.seq, packing=spec["packing"])
    peft_config = None
    if spec.get("lora"):
        import peft

        peft_config = peft.LoraConfig(**LORA)

    base, _, variant = runner.partition(":")
    if base == "trl":
        import trl

        args = trl.SFTConfig(**common, **sft)
        trainer = trl.SFTTrainer(model=spec["model_dir"], args=args, train_dataset=dataset, processing_class=tokenizer,
                                 peft_config=peft_config)
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
        elif variant == "cpu_policy":
            os.environ["HFNATIVE_DEVICE_POLICY"] = "cpu"  # this child process only
        elif variant == "torch_kernels":
            os.environ["HFNATIVE_TRITON_KERNELS"] = "0"  # this child process only
        elif variant in ("qlora", "qlora_torch_dequantize"):
            if peft_config is None:
                raise Unavailable(f"{variant} needs --lora")
            # QLoRA as TRL's scripts ask for it: the base in NF4, its matmuls in bf16
            extra["model_init_kwargs"] = {"quantization_config": {
                "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"}}
            if variant == "qlora_torch_dequantize":  # this child process only: the NF4 weights made whole by
                from hfnative.models import triton_dequant  # torchao's op sequence, every other kernel kept

                triton_dequant.nf4_supported = lambda *args: False
        elif variant in ("keep_attention", "keep_nothing"):
            if not common.get("gradient_checkpointing"):
                raise Unavailable(f"{variant} needs --activation_checkpointing")
            extra["gradient_checkpointing_kwargs"] = {"selective": variant == "keep_attention"}
        try:
            args = hfnative.SFTConfig(**common, **sft, **extra)
            trainer = hfnative.SFTTrainer(model=spec["model_dir"], args=args, train_dataset=dataset,
                                          processing_class=tokenizer, peft_config=peft_config)
        except (TypeError, ValueError) as error:
            if variant:
                raise Unavailable(f"{type(error).__name__}: {error}") from error
            raise
    else:
        raise ValueError(f"unknown runner {runner!r}")

    if variant == "compile":
        torch._dynamo.reset()
    result, clock = train_and_measure(trainer, shape, is_cuda, watch_gradients=variant == "optimizer_in_backward",
                                      profile_to=profile_path(spec, runner))

    if variant == "compile":
        from torch._dynamo.utils import counters

        if not counters["stats"]["unique_graphs"]:
            notes.append("torch_compile=True was accepted but torch.compile compiled no frame: the option is ignored")
    if variant == "optimizer_in_backward" and clock.gradients_seen_before_step:
        notes.append("optimizer_in_backward=True was accepted but parameters still held a .grad at "
                     "on_pre_optimizer_step (the optimizer did not step inside backward): the option is ignored")
    return {**result, "rss_after_imports_mib": rss_after_imports}


# ------------------------------------------------------------------------------------------------
# report


def summarize(results: list[dict], runners: list[str], flops: dict, peak_gflops: float, device: str) -> tuple[str, dict]:
    """The report text and the per-runner medians."""
    lines, summary = [], {}
    memory = "peak GPU MiB" if device == "cuda" else "peak RSS MiB"
    header = (f"{'runner':<28}{'tokens/s':>10}{'min..max':>20}{'step-median':>13}{memory:>14}{'RSS@import':>12}"
              f"{'peak heap':>11}{'final loss':>12}{'MFU':>8}")
    lines += [header, "-" * len(header)]
    for runner, ok, rates in finished_runs(results, runners, lines, runner_width=28, status_width=10):
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
    notes = sorted(run_notes(results) |
                   {f"{r['runner']}: {r['note'].splitlines()[-1]}" for r in results if r["status"] == "unavailable"})
    lines += host_and_device_lines(results, runners)

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
        count = len(summary[reference]["losses"])
        shown = range(count) if count <= 12 else sorted({0, 1, 2, *range(count - 3, count), *range(0, count, max(count // 6, 1))})
        rows, widths = loss_rows({n: summary[n]["losses"] for n in names}, shown, min_width=16)
        lines += rows
        for label, key in (("loss", "losses"), ("gnorm", "grad_norms")):
            if all(summary[n][key][0] is not None for n in names):
                lines.append(f"{'maxrel':>6}" if key == "losses" else f"{label:>6}")
                lines[-1] += "".join(f"{max_relative_difference(summary[n][key], summary[reference][key]):>{w}.2e}"
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


def host_and_device_lines(results: list[dict], runners: list[str]) -> list[str]:
    """Per runner (CUDA runs), the median timed step split into the host's time to queue it and its wait for the device
    at the step's end (harness._StepClock): a wait near zero means the device waited on the host."""
    rows = []
    for runner in runners:
        ok = [r for r in results if r["runner"] == runner and r["status"] == "ok" and r.get("host_seconds")]
        if ok:
            host = statistics.median(x for r in ok for x in r["host_seconds"])
            wait = statistics.median(x for r in ok for x in r["wait_seconds"])
            rows.append(f"{runner:<28}{(host + wait) * 1e3:>9,.1f}{host * 1e3:>9,.1f}{wait * 1e3:>9,.1f}")
    if not rows:
        return []
    return ["", "a timed step (median), ms: the host's time to queue it, then its wait for the device at the step's end "
            "(a runner that reads a device value inside its step waits there instead)",
            f"{'runner':<28}{'step':>9}{'host':>9}{'wait':>9}", *rows]


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
        f"{'activation checkpointing' if cli.activation_checkpointing else 'no activation checkpointing'}, seed {cli.seed}; data: {data['rows']} rows, {data['tokens']:,} tokens"
        + (f"; LoRA: peft.LoraConfig({', '.join(f'{k}={v!r}' for k, v in LORA.items())})" if cli.lora else ""),
        f"FLOPs/token {flops['flops_per_token'] / 1e6:.1f}M = {4 if cli.lora else 6}*(N_body + V*D) + 12*L*H*d_head*S; "
        f"matmul peak {peak_gflops:,.1f} GFLOP/s ({'fp32 2048^3 mm' if cli.device == 'cpu' else 'bf16 8192^3 mm'})",
    ] + ([] if cli.lora else [
        # what every runner holds whatever its activations (optimizer_in_backward: no whole set of gradients)
        f"fixed state (fp32): weights {flops['total_params'] * 4 / 2**20:,.0f} MiB + gradients "
        f"{flops['total_params'] * 4 / 2**20:,.0f} + AdamW's two moments {flops['total_params'] * 8 / 2**20:,.0f} = "
        f"{flops['total_params'] * 16 / 2**20:,.0f} MiB; the rest of a peak is activations and buffers",
    ]))


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model and batch shape (default: reference on cpu, qwen3_0.6b on cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--runners", default=",".join(BASE_RUNNERS), help="comma-separated subset of trl,hf,ours")
    parser.add_argument("--ours_variants", "--ours-variants", default="default",
                        help=f"comma-separated from {','.join(OURS_VARIANTS)} (optimizer_in_backward needs --max_grad_norm 0)")
    parser.add_argument("--packing", action="store_true", help="variable-length documents packed to seq (no hf runner)")
    parser.add_argument("--activation_checkpointing", action="store_true",
                        help="activation checkpointing for every runner (TRL's default; the peak then sits at the optimizer step)")
    parser.add_argument("--lora", action="store_true",
                        help="LoRA adapters on every linear layer (harness.LORA) for trl and ours; no hf runner")
    parser.add_argument("--peak_seconds", "--peak-seconds", type=float, default=2.0, help="matmul peak timing length")
    add_run_arguments(parser, timeout=3600, rounds=3, overrides=("seq", "batch", "steps", "warmup", "vocab"))
    return parser.parse_args(argv)


def runners_to_run(cli) -> tuple[list[str], list[dict], list[str]]:
    """The runners to start, the skipped ones (as results), and every requested runner in table order."""
    runners, skipped, order = [], [], []
    for name in cli.runners.split(","):
        if name not in BASE_RUNNERS:
            sys.exit(f"--runners: unknown runner {name!r}; use a subset of {','.join(BASE_RUNNERS)}")
        if name == "hf" and (cli.packing or cli.lora):
            note = "transformers' Trainer has no packing" if cli.packing else "transformers' Trainer takes no peft_config"
            skipped.append({"runner": "hf", "status": "skipped", "note": note})
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
    return runners, skipped, order


def main() -> None:
    cli = parse_args()
    if cli.child:
        child_main(cli, train=train_once)
        return

    cli.preset = cli.preset or ("qwen3_0.6b" if cli.device == "cuda" else "reference")
    shape = start_parent(cli, PRESETS)
    runners, skipped, order = runners_to_run(cli)

    with work_folder("bench_sft_", cli.keep) as work:
        workload = prepare_workload(work, shape, cli, cli.device, cli.packing, checkpointing=cli.activation_checkpointing,
                                    lora=cli.lora)
        flops = flops_per_token(shape, cli.lora)
        if workload.parameters != flops["total_params"]:  # the FLOPs formula must count the model that trains
            sys.exit(f"FLOPs count {flops['total_params']:,} parameters, the model has {workload.parameters:,}")
        peak_gflops = measure_matmul_peak(cli.device, cli.peak_seconds)
        setup = describe_setup(cli, shape, flops, workload.data, peak_gflops, machine_description(cli.device))
        print(setup, flush=True)

        def shown(result: dict) -> str:
            return (f"{result['tokens_per_second']:,.0f} tokens/s, peak RSS {result['peak_rss_mib']:,.0f} MiB, "
                    f"final loss {result['losses'][-1]:.6f}")

        results = skipped + run_rounds(runners, workload, cli, __file__, shown)
        report, _ = summarize(results, order, flops, peak_gflops, cli.device)
        title = (f"## {datetime.date.today().isoformat()} — preset `{cli.preset}`, {cli.device}"
                 + (", packing" if cli.packing else "") + (", LoRA" if cli.lora else ""))
        finish(cli, setup, report, results, title, __file__)


if __name__ == "__main__":
    main()
