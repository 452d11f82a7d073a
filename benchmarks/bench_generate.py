"""Rollout speed: hfnative's native KV-cache engine vs transformers' ``generate`` on the same model and prompts.

Every runner loads the same saved Qwen3-shaped model (harness.py's presets), completes the same batch of
ragged prompts (documents of examples/data/sft_text.jsonl cut to 16..64 tokens, left-padded for
transformers) greedily for a fixed number of new tokens (no EOS, so every row generates all of them),
each runner in its own child process, alternating over rounds. Printed per runner: generated tokens/s
(batch x new tokens over the wall time of one whole ``generate`` call: prefill, decoding, sampling),
the ratio to transformers, how many completions equal transformers' token for token, and peak RSS.

    python benchmarks/bench_generate.py --quick                  # ~1 min: 32 new tokens, reference preset
    python benchmarks/bench_generate.py --write-results          # batch 32, 128 new tokens, reference and 100m
    python benchmarks/bench_generate.py --device cuda --presets qwen3_0.6b

Runners: ``hf`` (transformers' AutoModelForCausalLM.generate, SDPA attention, its dynamic KV cache),
``native`` (hfnative.generation.NativeRolloutEngine, eager) and ``native-compiled`` (the same with
compile=True: the decode step through torch.compile; its first call, which compiles, is a warm-up
reported separately). Each child makes one warm-up call (8 new tokens; the full call for the compiled
runner) before the timed ones. ``linear-floor`` is not an engine: it times only the matmuls any
token-by-token decoder of this batch does (every linear layer and the head on [batch, in] inputs, once
per new token; no prefill, attention or sampling) — the bound both engines approach where those
matmuls dominate, as they do on a CPU at batch 32 in fp32.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402  (benchmarks/ is not a package)
    CORPUS,
    PRESETS,
    TOKENIZER_DIR,
    Workload,
    append_results,
    build_model,
    child_main,
    machine_description,
    peak_rss_mib,
    run_rounds,
    work_folder,
)

RUNNERS = ("hf", "native", "native-compiled", "linear-floor")
WARMUP_NEW_TOKENS = 8


def make_prompts(batch: int, seed: int, shortest: int = 16, longest: int = 64) -> list[list[int]]:
    """``batch`` prompts: corpus documents (tokenized with the tiny tokenizer) cut to random lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    with open(CORPUS) as f:
        documents = [tokenizer(json.loads(line)["text"])["input_ids"] for line in f]
    documents = [d for d in documents if len(d) >= shortest]
    rng = random.Random(seed)
    return [d[: rng.randint(shortest, min(longest, len(d)))] for d in rng.sample(documents, batch)]


# ------------------------------------------------------------------------------------------------
# one runner (in a child process)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _hf_generator(spec: dict):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, attn_implementation="sdpa")
    model.to(spec["device"]).eval()
    model.generation_config.eos_token_id = None  # every row generates all its tokens
    prompts = spec["prompts"]
    P = max(map(len, prompts))
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, P - len(prompt):], mask[row, P - len(prompt):] = torch.tensor(prompt), 1
    ids, mask = ids.to(spec["device"]), mask.to(spec["device"])

    @torch.no_grad()
    def run(new_tokens: int) -> list[list[int]]:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, use_cache=True)
        return out[:, P:].tolist()

    return run


def _native_generator(spec: dict, compile: bool):
    from hfnative.converters.loading import load_pretrained
    from hfnative.generation import NativeRolloutEngine, SamplingParams

    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    engine = NativeRolloutEngine(load_pretrained(spec["model_dir"], dtype=dtype, device=spec["device"]), compile=compile)

    def run(new_tokens: int) -> list[list[int]]:
        return engine.generate(spec["prompts"], SamplingParams(max_new_tokens=new_tokens, do_sample=False)).completion_ids

    return run


def _linear_floor(spec: dict):
    """Only the matmuls of decoding: every linear layer and the head on [batch, in] inputs, once per new
    token. Any engine decoding this batch one token at a time does at least these (no prefill, no attention)."""
    from hfnative.converters.loading import load_pretrained

    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    model = load_pretrained(spec["model_dir"], dtype=dtype, device=spec["device"]).model
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.output.projection()]
    batch = len(spec["prompts"])
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype, device=spec["device"]) for w in weights}

    @torch.no_grad()
    def run(new_tokens: int) -> list[list[int]]:
        for _ in range(new_tokens):
            for weight in weights:
                torch.nn.functional.linear(inputs[weight.shape[1]], weight)
        return [[0] * new_tokens for _ in range(batch)]

    return run


def generate_once(runner: str, spec: dict, notes: list) -> dict:
    """Warm up, then time ``spec['repeats']`` whole calls."""
    if runner == "hf":
        run = _hf_generator(spec)
    elif runner == "linear-floor":
        run = _linear_floor(spec)
    else:
        run = _native_generator(spec, compile=runner == "native-compiled")
    new_tokens = spec["new_tokens"]
    start = time.perf_counter()
    run(new_tokens if runner == "native-compiled" else WARMUP_NEW_TOKENS)
    _sync(spec["device"])
    warmup_seconds = time.perf_counter() - start
    seconds = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        completions = run(new_tokens)
        _sync(spec["device"])
        seconds.append(time.perf_counter() - start)
    if any(len(c) != new_tokens for c in completions):
        notes.append("some rows generated fewer tokens than asked")
    return {"seconds": seconds, "warmup_seconds": warmup_seconds, "completions": completions,
            "tokens": sum(map(len, completions)), "peak_rss_mib": peak_rss_mib(),
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if spec["device"] == "cuda" else None}


# ------------------------------------------------------------------------------------------------
# parent: one preset


def _same_as(runner: str, completions: list[list[int]], reference: list[list[int]] | None) -> str:
    if reference is None or runner == "linear-floor":
        return "-"
    rows = sum(a == b for a, b in zip(completions, reference))
    return f"{rows}/{len(reference)}"


def report_preset(preset: str, parameters: int, results: list[dict], runners: list[str]) -> str:
    shape = PRESETS[preset]
    ok = {r: [x for x in results if x["runner"] == r and x["status"] == "ok"] for r in runners}
    rates = {r: [x["tokens"] / s for x in runs for s in x["seconds"]] for r, runs in ok.items()}
    reference = ok["hf"][0]["completions"] if ok.get("hf") else None
    hf_rate = statistics.median(rates["hf"]) if rates.get("hf") else None
    lines = [
        f"preset {preset}: Qwen3-shaped, hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads / "
        f"{shape.kv_heads} KV, head_dim {shape.head_dim}, intermediate {shape.intermediate}, vocab {shape.vocab}, "
        f"tied; {parameters / 1e6:.2f}M parameters",
        "",
        f"{'runner':<17}{'tokens/s':>10}{'min..max':>18}{'s/call':>9}{'warm-up s':>11}{'x hf':>7}"
        f"{'same as hf':>12}{'peak RSS MiB':>14}",
        "-" * 98,
    ]
    for runner in runners:
        runs = ok.get(runner)
        if not runs:
            failed = [x for x in results if x["runner"] == runner]
            note = (failed[0].get("note") or "").strip().splitlines()[-1:] if failed else ["not run"]
            lines.append(f"{runner:<17}{'failed' if failed else 'skipped':>10}  {' '.join(note)}")
            continue
        rate = statistics.median(rates[runner])
        seconds = statistics.median(s for x in runs for s in x["seconds"])
        warmup = statistics.median(x["warmup_seconds"] for x in runs)
        ratio = f"{rate / hf_rate:.2f}" if hf_rate else "-"
        spread = f"{min(rates[runner]):,.0f}..{max(rates[runner]):,.0f}"
        lines.append(
            f"{runner:<17}{rate:>10,.0f}{spread:>18}{seconds:>9.2f}{warmup:>11.1f}{ratio:>7}"
            f"{_same_as(runner, runs[0]['completions'], reference):>12}{max(x['peak_rss_mib'] for x in runs):>14,.0f}"
        )
    notes = sorted({f"{x['runner']}: {n}" for x in results for n in x.get("notes", [])})
    return "\n".join(lines + [f"note: {n}" for n in notes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=None, help="comma-separated harness presets (default: reference,100m on CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--runners", default=",".join(RUNNERS), help=f"comma-separated subset of {','.join(RUNNERS)}")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", "--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per child process")
    parser.add_argument("--rounds", type=int, default=2, help="each round runs every runner once, in turn")
    parser.add_argument("--quick", action="store_true", help="32 new tokens, 1 round, the reference preset only")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in every process (0: torch's default)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per runner process")
    parser.add_argument("--write-results", "--write_results", action="store_true", help="append to benchmarks/RESULTS.md")
    parser.add_argument("--keep", action="store_true", help="keep the temporary model folders")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        child_main(cli, generate_once)
        return
    if cli.quick:
        cli.new_tokens, cli.rounds = 32, 1
    default_presets = "reference" if cli.quick else "reference,100m" if cli.device == "cpu" else "qwen3_0.6b"
    presets = (cli.presets or default_presets).split(",")
    runners = cli.runners.split(",")
    if cli.threads:
        torch.set_num_threads(cli.threads)
    machine = machine_description(cli.device)
    prompts = make_prompts(cli.batch, cli.seed)
    setup = (
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}"
        + (f", {machine['gpu']}" if "gpu" in machine else "")
        + f"\nsoftware: python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}; "
        f"date {machine['date']}; load average before {machine['load_average']}"
        f"\nworkload: batch {cli.batch} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens "
        f"(mean {statistics.mean(map(len, prompts)):.1f}), greedy, {cli.new_tokens} new tokens each (no EOS), "
        f"{'bf16 on cuda' if cli.device == 'cuda' else 'fp32 on cpu'}; "
        f"{cli.rounds} round(s) x {cli.repeats} timed call(s) per runner"
    )
    print(setup, flush=True)
    reports = []
    for preset in presets:
        with work_folder("bench_generate_", cli.keep) as work:
            parameters = build_model(PRESETS[preset], work / "model", cli.seed)
            spec = {"device": cli.device, "model_dir": str(work / "model"), "prompts": prompts, "new_tokens": cli.new_tokens,
                    "repeats": cli.repeats, "threads": cli.threads}
            spec_path = work / "spec.json"
            spec_path.write_text(json.dumps(spec))
            results = run_rounds(runners, Workload(parameters, {}, spec_path), cli, __file__,
                                 shown=lambda r: f"{r['tokens'] / statistics.median(r['seconds']):,.0f} tokens/s")
            reports.append(report_preset(preset, parameters, results, runners))
    report = "\n\n".join(reports)
    print("\n" + report)
    if cli.write_results:
        title = f"## {machine['date'][:10]} — generation: native KV-cache engine vs transformers' generate"
        append_results(title, setup, report, __file__)
        print("\nappended to benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
