"""Rollout speed: hfnative's native KV-cache engine vs transformers' ``generate`` on the same model and prompts.

Every runner loads the same saved Qwen3-shaped model (harness.py's presets), completes the same ragged prompts
(documents of examples/data/sft_text.jsonl cut to 16..64 tokens, left-padded for transformers) greedily for a
fixed number of new tokens (no EOS, so every row generates all of them), at each batch size (the first B prompts),
each runner in its own child process, alternating over rounds. Printed per batch size and runner: generated tokens/s
(batch x new tokens over the wall time of one whole ``generate`` call: prefill, decoding, sampling), the ratio to
transformers, how many completions equal transformers' token for token (and, in those that differ, the first token
that does); for the native runners the time of one decode step (a call of T new tokens minus one of 1 token, the
prefill, over T - 1) beside the memory-bandwidth floor: the bytes a step
must read (every weight it multiplies by, and the KV cache of each row's tokens so far, averaged over the call) over
the device's copy bandwidth measured in the same process.

    python benchmarks/bench_generate.py --quick                  # ~1 min: 32 new tokens, reference preset
    python benchmarks/bench_generate.py --write-results          # batch 32, 128 new tokens, reference and 100m
    python benchmarks/bench_generate.py --device cuda            # Qwen3-0.6B's shape in bf16, batch 64 and 8, 256 tokens

Runners: ``hf`` (transformers' AutoModelForCausalLM.generate, SDPA attention, its dynamic KV cache),
``native`` (hfnative.generation.NativeRolloutEngine as it is by default: eager on a CPU, the decode step captured in
a CUDA graph on CUDA), ``native-compiled`` (compile=True: the decode step through torch.compile, and on CUDA
captured), ``native-uncaptured`` (cuda_graph=False: the eager loop on CUDA), ``native-uncompacted`` (compact=False:
rows that stopped stay in the batch to the end of the call). Each child makes one warm-up call
per batch size (8 new tokens for hf; the full call for the native runners: it compiles and captures, and is
reported separately) before the timed ones. ``linear-floor`` is not an engine: it times only the matmuls any
token-by-token decoder of this batch does (every linear layer and the head on [batch, in] inputs, once
per new token; no prefill, attention or sampling) — the bound both engines approach where those
matmuls dominate, as they do on a CPU at batch 32 in fp32.

``--stopping``: the saved model's EOS token gets a head row along a random direction of its hidden states, scaled so
that greedy decoding makes it the top token at about one position in ``new_tokens / 2``: completions end at many
lengths, some run to the limit, as a policy's do in RL. Every runner stops a row at EOS, and tokens/s counts the tokens
made (each row up to its EOS); the per-step time and floor columns are then left out.

    python benchmarks/bench_generate.py --stopping --runners hf,native,native-uncompacted --batch 64 --presets 100m

``--lora``: a LoRA policy, as GRPO with a ``peft_config`` decodes one: an adapter (r 16 on every linear layer, B drawn
so that it changes the tokens) saved as a PEFT folder that every runner loads over the model (``hf``: peft's
``PeftModel.from_pretrained``, its adapters unmerged, as TRL generates without vLLM; native: hfnative's
``load_adapter``). ``native`` folds the adapters into bf16 copies of the weights once per call on CUDA (the engine's
default where the copies fit; on a CPU not), ``native-folded`` / ``native-unfolded`` (fold_adapters=True / False)
fold them or multiply the base and the adapter at every token whatever the device; the floor counts the base weights.

    python benchmarks/bench_generate.py --device cuda --lora --runners hf,native,native-unfolded --batch 64
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

from hfnative.generation.native import READ_SLOT_MULTIPLE

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

RUNNERS = ("hf", "native", "native-compiled", "native-uncaptured", "native-uncompacted", "native-folded",
           "native-unfolded", "linear-floor")
DEFAULT_RUNNERS = {"cpu": "hf,native,native-compiled,linear-floor", "cuda": "hf,native,native-compiled,native-uncaptured"}
WARMUP_NEW_TOKENS = 8
EOS = 2  # harness.build_model's eos_token_id


def make_prompts(batch: int, seed: int, shortest: int = 16, longest: int = 64) -> list[list[int]]:
    """``batch`` prompts: corpus documents (tokenized with the tiny tokenizer) cut to random lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    with open(CORPUS) as f:
        documents = [tokenizer(json.loads(line)["text"])["input_ids"] for line in f]
    documents = [d for d in documents if len(d) >= shortest]
    rng = random.Random(seed)
    chosen = [documents[rng.randrange(len(documents))] for _ in range(batch)]  # with replacement: any batch size
    return [d[: rng.randint(shortest, min(longest, len(d)))] for d in chosen]


# ------------------------------------------------------------------------------------------------
# one runner (in a child process)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _hf_generator(spec: dict):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, attn_implementation="sdpa")
    if spec.get("adapter_dir"):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, spec["adapter_dir"])
    model.to(spec["device"]).eval()
    eos = EOS if spec["stopping"] else None
    model.generation_config.eos_token_id = eos  # without --stopping every row generates all its tokens

    @torch.no_grad()
    def run(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        P = max(map(len, prompts))
        ids = torch.zeros(len(prompts), P, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, P - len(prompt):], mask[row, P - len(prompt):] = torch.tensor(prompt), 1
        out = model.generate(input_ids=ids.to(spec["device"]), attention_mask=mask.to(spec["device"]),
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0,
                             use_cache=True)
        rows = out[:, P:].tolist()
        return [r[: r.index(eos) + 1] if eos in r else r for r in rows]  # a stopped row is padded after its EOS

    return run, None


def _native_generator(spec: dict, runner: str):
    from hfnative.converters.loading import load_pretrained
    from hfnative.generation import NativeRolloutEngine, SamplingParams

    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    converted = load_pretrained(spec["model_dir"], dtype=dtype, device=spec["device"])
    if spec.get("adapter_dir"):
        from hfnative.converters.peft import load_adapter

        load_adapter(converted, spec["adapter_dir"], is_trainable=False)
    model = converted.model
    options = {"native": {}, "native-compiled": {"compile": True}, "native-uncaptured": {"cuda_graph": False},
               "native-uncompacted": {"compact": False}, "native-folded": {"fold_adapters": True},
               "native-unfolded": {"fold_adapters": False}}[runner]
    engine = NativeRolloutEngine(model, **options)
    eos = EOS if spec["stopping"] else None

    def run(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        sampling = SamplingParams(max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos)
        return engine.generate(prompts, sampling).completion_ids

    return run, model


def _linear_floor(spec: dict):
    """Only the matmuls of decoding: every linear layer and the head on [batch, in] inputs, once per new
    token. Any engine decoding this batch one token at a time does at least these (no prefill, no attention)."""
    from hfnative.converters.loading import load_pretrained

    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    model = load_pretrained(spec["model_dir"], dtype=dtype, device=spec["device"]).model
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.output.projection()]

    @torch.no_grad()
    def run(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        inputs = {w.shape[1]: torch.randn(len(prompts), w.shape[1], dtype=dtype, device=spec["device"]) for w in weights}
        for _ in range(new_tokens):
            for weight in weights:
                torch.nn.functional.linear(inputs[weight.shape[1]], weight)
        return [[0] * new_tokens for _ in prompts]

    return run, None


def make_rows_stop(model_dir: Path, prompts: list[list[int]], new_tokens: int, seed: int, device: str) -> None:
    """Give the saved model's EOS token (a tied model: its embedding row too; no prompt holds it) a head row along a
    random direction of the hidden states, scaled so that greedy decoding stops half of the rows within their first
    ``new_tokens / 4`` tokens and the others later or never: completions then end at many lengths. Each row's greedy
    completion without EOS is what it makes up to its EOS (EOS's row changes no other logit), so the scale is read off
    those completions: a row stops at its first position where scale * (hidden . direction) tops every other logit."""
    from transformers import AutoModelForCausalLM

    from hfnative.converters.loading import load_pretrained
    from hfnative.generation import NativeRolloutEngine, SamplingParams

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = NativeRolloutEngine(load_pretrained(str(model_dir), dtype=dtype, device=device).model)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, do_sample=False)).completion_ids
    del engine
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)  # edited and saved in fp32
    # read in the runners' dtype and device (on a CPU: the model itself)
    reader = model if device == "cpu" else AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    first_wins = []  # per row, per completion position: the smallest scale at which EOS has topped the logits by then
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            out = reader(torch.tensor([prompt + completion[:-1]], device=device), output_hidden_states=True)
            at = slice(len(prompt) - 1, None)
            along = out.hidden_states[-1][0, at].float().cpu() @ direction
            logits = out.logits[0, at].float().cpu()
            logits[:, EOS] = float("-inf")
            ratio = torch.where(along > 0, logits.amax(-1) / along.clamp(min=1e-30), float("inf"))
            first_wins.append(ratio.cummin(0).values)
        by_quarter = torch.stack([wins[max(new_tokens // 4, 1) - 1] for wins in first_wins])
        half = by_quarter.sort().values[len(prompts) // 2]  # half of the rows stop by then (inf: fewer can)
        scale = (half if half.isfinite() else by_quarter[by_quarter.isfinite()].max()).item()
        model.get_output_embeddings().weight[EOS] = direction * scale
    model.save_pretrained(str(model_dir))


def make_adapter(model_dir: Path, adapter_dir: Path, seed: int) -> None:
    """``--lora``: a PEFT adapter folder for the saved model, r 16 on every linear layer, its B drawn (not peft's
    zeros) at a scale that moves the logits without drowning them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    peft_model.save_pretrained(str(adapter_dir))


def copy_bandwidth(device: str) -> float:
    """The device's memory bandwidth in bytes/s as a copy measures it: (bytes read + bytes written) / seconds, the
    best of a few copies of 1 GiB (256 MiB on a CPU)."""
    size = 2**30 if device == "cuda" else 2**28
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


def bytes_per_step(model, prompts: list[list[int]], new_tokens: int, slot_multiple: int | None) -> dict:
    """Bytes a decode step must read, averaged over the steps of a call: every weight a step multiplies by (the
    embedding table only as a tied head; a lookup reads B rows), and the KV cache entries of each row's tokens so far.
    ``static_kv_cache``: what a step reading the whole cache of ``slot_multiple``-padded prompts reads instead (a
    compiled step); ``bucketed_kv_cache``: what a captured step whose attention is SDPA reads on average, the cache up
    to the next multiple of ``READ_SLOT_MULTIPLE`` slots past the one it writes (with the Triton attention kernel a
    captured step reads each row's entries: ``kv_cache``)."""

    args = model.args
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if ".lora_" not in name)  # the base's weights (a folded LoRA layer reads a copy of its size)
    if not model.output.is_tied:
        weights -= model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    per_entry = 2 * args.n_kv_heads * args.head_dim * model.tok_embeddings.weight.element_size() * len(model.layers)
    filled = sum(len(p) for p in prompts) + len(prompts) * (new_tokens - 1) / 2
    longest = max(map(len, prompts))
    prompt_slots = -(-longest // slot_multiple) * slot_multiple if slot_multiple else longest
    slots = prompt_slots + new_tokens
    read = [min(slots, -(-(prompt_slots + t) // READ_SLOT_MULTIPLE) * READ_SLOT_MULTIPLE) for t in range(1, new_tokens)]
    return {"weights": weights, "kv_cache": per_entry * filled, "static_kv_cache": per_entry * slots * len(prompts),
            "bucketed_kv_cache": per_entry * statistics.mean(read or [slots]) * len(prompts)}


def _time_calls(run, prompts, new_tokens: int, repeats: int, device: str) -> tuple[list[float], list[list[int]]]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        completions = run(prompts, new_tokens)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return seconds, completions


def generate_once(runner: str, spec: dict, notes: list) -> dict:
    """For each batch size: warm up, then time ``spec['repeats']`` whole calls; native runners also time calls of one
    new token (prefill only), whose difference over T - 1 is the time of a decode step, and report the bytes a step
    reads."""
    if runner == "hf":
        run, model = _hf_generator(spec)
    elif runner == "linear-floor":
        run, model = _linear_floor(spec)
    else:
        run, model = _native_generator(spec, runner)
    device, new_tokens = spec["device"], spec["new_tokens"]
    by_batch = {}
    for batch in spec["batches"]:
        prompts = spec["prompts"][:batch]
        start = time.perf_counter()
        run(prompts, new_tokens if runner.startswith("native") else WARMUP_NEW_TOKENS)  # compiles, captures
        _sync(device)
        entry = {"warmup_seconds": time.perf_counter() - start}
        entry["seconds"], completions = _time_calls(run, prompts, new_tokens, spec["repeats"], device)
        if not spec["stopping"] and any(len(c) != new_tokens for c in completions):
            notes.append("some rows generated fewer tokens than asked")
        entry.update(completions=completions, tokens=sum(map(len, completions)))
        if model is not None and new_tokens >= 16 and not spec["stopping"]:
            run(prompts, 1)  # prefill and the first token only: no decode step (nothing compiled or captured)
            prefill_seconds, _ = _time_calls(run, prompts, 1, spec["repeats"], device)
            entry["step_seconds"] = (min(entry["seconds"]) - min(prefill_seconds)) / (new_tokens - 1)
            static = runner != "native-uncaptured" and (runner != "native" or device == "cuda")
            entry["bytes"] = bytes_per_step(model, prompts, new_tokens, 64 if static else None)
        by_batch[str(batch)] = entry
    return {"by_batch": by_batch, "peak_rss_mib": peak_rss_mib(),
            "bandwidth": copy_bandwidth(device) if model is not None else None,
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None}


# ------------------------------------------------------------------------------------------------
# parent: one preset


def _same_as(runner: str, completions: list[list[int]], reference: list[list[int]] | None) -> str:
    if reference is None or runner == "linear-floor":
        return "-"
    rows = sum(a == b for a, b in zip(completions, reference))
    return f"{rows}/{len(reference)}"


def _first_differences(completions: list[list[int]], reference: list[list[int]]) -> list[int]:
    """For each completion that differs from its reference row, the index of the first token where they part."""
    firsts = []
    for made, ref in zip(completions, reference):
        if made != ref:
            firsts.append(next((i for i, (a, b) in enumerate(zip(made, ref)) if a != b), min(len(made), len(ref))))
    return firsts


def report_preset(preset: str, parameters: int, results: list[dict], runners: list[str], batches: list[int]) -> str:
    shape = PRESETS[preset]
    ok = {r: [x for x in results if x["runner"] == r and x["status"] == "ok"] for r in runners}
    lines = [
        f"preset {preset}: Qwen3-shaped, hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads / "
        f"{shape.kv_heads} KV, head_dim {shape.head_dim}, intermediate {shape.intermediate}, vocab {shape.vocab}, "
        f"tied; {parameters / 1e6:.2f}M parameters",
    ]
    for batch in batches:
        key = str(batch)
        rates = {r: [x["by_batch"][key]["tokens"] / s for x in runs for s in x["by_batch"][key]["seconds"]]
                 for r, runs in ok.items() if runs}
        reference = ok["hf"][0]["by_batch"][key]["completions"] if ok.get("hf") else None
        hf_rate = statistics.median(rates["hf"]) if rates.get("hf") else None
        lines += [
            "",
            f"batch {batch}:",
            f"{'runner':<19}{'tokens/s':>10}{'min..max':>18}{'s/call':>9}{'warm-up s':>11}{'x hf':>7}"
            f"{'same as hf':>12}{'step ms':>9}{'floor ms':>10}{'x floor':>9}",
            "-" * 114,
        ]
        for runner in runners:
            runs = ok.get(runner)
            if not runs:
                failed = [x for x in results if x["runner"] == runner]
                note = (failed[0].get("note") or "").strip().splitlines()[-1:] if failed else ["not run"]
                lines.append(f"{runner:<19}{'failed' if failed else 'skipped':>10}  {' '.join(note)}")
                continue
            entries = [x["by_batch"][key] for x in runs]
            rate = statistics.median(rates[runner])
            seconds = statistics.median(s for e in entries for s in e["seconds"])
            warmup = statistics.median(e["warmup_seconds"] for e in entries)
            ratio = f"{rate / hf_rate:.2f}" if hf_rate else "-"
            spread = f"{min(rates[runner]):,.0f}..{max(rates[runner]):,.0f}"
            step = floor = ratio_floor = "-"
            if "step_seconds" in entries[0]:
                step_s = statistics.median(e["step_seconds"] for e in entries)
                sizes = entries[0]["bytes"]
                floor_s = (sizes["weights"] + sizes["kv_cache"]) / max(x["bandwidth"] for x in runs)
                step, floor = f"{step_s * 1e3:.2f}", f"{floor_s * 1e3:.3f}"
                ratio_floor = f"{step_s / floor_s:.1f}"
            lines.append(
                f"{runner:<19}{rate:>10,.0f}{spread:>18}{seconds:>9.2f}{warmup:>11.1f}{ratio:>7}"
                f"{_same_as(runner, entries[0]['completions'], reference):>12}{step:>9}{floor:>10}"
                f"{ratio_floor:>9}"
            )
        parted = {runner: _first_differences(runs[0]["by_batch"][key]["completions"], reference)
                  for runner, runs in ok.items() if runs and reference is not None and runner not in ("hf", "linear-floor")}
        parted = {runner: firsts for runner, firsts in parted.items() if firsts}
        if parted:  # greedy decoding in bf16 parts from transformers' at near-ties; where, says how near
            lines.append("first token that differs from hf's, in the rows that differ: " + "; ".join(
                f"{runner} median {statistics.median(firsts):g}, earliest {min(firsts)}"
                for runner, firsts in parted.items()))
        made = next((x["by_batch"][key]["completions"] for runs in ok.values() for x in runs), None)
        if made and any(len(c) != len(made[0]) for c in made):
            lengths = sorted(map(len, made))
            lines.append(
                f"completion lengths: mean {statistics.mean(lengths):.1f}, median {statistics.median(lengths):g}, "
                f"{lengths[0]}..{lengths[-1]}; {sum(lengths) / (len(lengths) * lengths[-1]):.0%} of batch x longest"
            )
        floors = [(r, x) for r, runs in ok.items() for x in runs if x.get("bandwidth") and "bytes" in x["by_batch"][key]]
        if floors:
            runner, x = floors[0]
            sizes = x["by_batch"][key]["bytes"]
            lines.append(
                f"floor: (weights {sizes['weights'] / 2**20:,.0f} MiB + KV cache {sizes['kv_cache'] / 2**20:,.1f} MiB "
                f"a step, on average) / copy bandwidth {max(r['bandwidth'] for r in ok[runner]) / 1e9:,.0f} GB/s; "
                f"a step reading the whole static cache (compiled) reads {sizes['static_kv_cache'] / 2**20:,.1f} MiB "
                f"of it, a captured one the floor's where its attention runs as the Triton kernel (each row's "
                f"entries), else ({READ_SLOT_MULTIPLE}-slot lengths) "
                f"{sizes.get('bucketed_kv_cache', sizes['static_kv_cache']) / 2**20:,.1f} MiB on average"
            )
    notes = sorted({f"{x['runner']}: {n}" for x in results for n in x.get("notes", [])})
    return "\n".join(lines + [f"note: {n}" for n in notes])


def _shown(result: dict) -> str:
    return ", ".join(f"batch {b}: {e['tokens'] / statistics.median(e['seconds']):,.0f} tokens/s"
                     for b, e in result["by_batch"].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=None, help="comma-separated harness presets (default: reference,100m on CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--runners", default=None, help=f"comma-separated subset of {','.join(RUNNERS)} (default: "
                        f"{DEFAULT_RUNNERS['cpu']} on cpu, {DEFAULT_RUNNERS['cuda']} on cuda)")
    parser.add_argument("--batch", default=None, help="comma-separated batch sizes (default: 32 on cpu, 64,8 on cuda)")
    parser.add_argument("--new-tokens", "--new_tokens", type=int, default=None, help="default: 128 on cpu, 256 on cuda")
    parser.add_argument("--stopping", action="store_true",
                        help="rows stop at EOS at many lengths (the model's EOS head row is set for it)")
    parser.add_argument("--lora", action="store_true", help="a LoRA policy: every runner decodes one adapter (see above)")
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
    on_cuda = cli.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")
    cli.new_tokens = cli.new_tokens or (256 if on_cuda else 128)
    if cli.quick:
        cli.new_tokens, cli.rounds = 32, 1
    default_presets = "reference" if cli.quick else "qwen3_0.6b" if on_cuda else "reference,100m"
    presets = (cli.presets or default_presets).split(",")
    runners = (cli.runners or DEFAULT_RUNNERS[cli.device] + (",native-unfolded" if cli.lora else "")).split(",")
    unknown = sorted(set(runners) - set(RUNNERS))
    if unknown:
        sys.exit(f"--runners: unknown {', '.join(unknown)}; expected a subset of {','.join(RUNNERS)}")
    if cli.stopping and cli.lora:
        sys.exit("--stopping with --lora: the EOS row is scaled on the base model's completions, not the policy's; "
                 "run them apart")
    if {"native-folded", "native-unfolded"} & set(runners) and not cli.lora:
        sys.exit("--runners native-folded / native-unfolded decode adapters: add --lora")
    batches = [int(b) for b in (cli.batch or ("64,8" if on_cuda else "32")).split(",")]
    if cli.threads:
        torch.set_num_threads(cli.threads)
    machine = machine_description(cli.device)
    prompts = make_prompts(max(batches), cli.seed)
    setup = (
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}"
        + (f", {machine['gpu']}" if "gpu" in machine else "")
        + f"\nsoftware: python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}; "
        f"date {machine['date']}; load average before {machine['load_average']}"
        f"\nworkload: batch {'/'.join(map(str, batches))} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens "
        f"(mean {statistics.mean(map(len, prompts)):.1f}), greedy, "
        + (f"up to {cli.new_tokens} new tokens, stopping at EOS (--stopping), " if cli.stopping else
           f"{cli.new_tokens} new tokens each (no EOS), ")
        + f"{'bf16 on cuda' if cli.device == 'cuda' else 'fp32 on cpu'}; "
        + ("a LoRA policy (r 16 on every linear layer, --lora); " if cli.lora else "")
        + f"{cli.rounds} round(s) x {cli.repeats} timed call(s) per runner"
    )
    print(setup, flush=True)
    reports = []
    for preset in presets:
        with work_folder("bench_generate_", cli.keep) as work:
            parameters = build_model(PRESETS[preset], work / "model", cli.seed)
            if cli.stopping:
                make_rows_stop(work / "model", prompts, cli.new_tokens, cli.seed, cli.device)
            if cli.lora:
                make_adapter(work / "model", work / "adapter", cli.seed)
            spec = {"device": cli.device, "model_dir": str(work / "model"), "prompts": prompts, "batches": batches,
                    "new_tokens": cli.new_tokens, "repeats": cli.repeats, "threads": cli.threads,
                    "stopping": cli.stopping, "adapter_dir": str(work / "adapter") if cli.lora else None}
            spec_path = work / "spec.json"
            spec_path.write_text(json.dumps(spec))
            results = run_rounds(runners, Workload(parameters, {}, spec_path), cli, __file__, shown=_shown)
            reports.append(report_preset(preset, parameters, results, runners, batches))
    report = "\n\n".join(reports)
    print("\n" + report)
    if cli.write_results:
        title = (f"## {machine['date'][:10]} — generation{' of a LoRA policy' if cli.lora else ''}: native KV-cache "
                 "engine vs transformers' generate")
        append_results(title, setup, report, __file__)
        print("\nappended to benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
