"""hfnative on CPU under each host allocator: its own CPU tensor pool, glibc's malloc, and the two allocators
PyTorch's CPU performance guidance names, jemalloc and tcmalloc, preloaded with ``LD_PRELOAD``.

Two rows: the 100m distillation row (``bench_kd.py --preset 100m``, 4 steps, 1 warm-up) and the reference SFT row
(``bench_sft.py --preset reference``). Each run is that script's own parent and child with ``--runners ours``,
under one allocator; the allocators take turns within a round, the same workload every time. Printed: tokens/s
and peak RSS of every run, the medians, and whether the losses were the same under every allocator.

    python benchmarks/bench_allocators.py --rounds 2
    python benchmarks/bench_allocators.py --rows sft-reference --allocators pool,glibc --rounds 1

A preloaded allocator replaces malloc for the whole process (the pool is then off: the comparison is the allocator
alone); a library that is not found (``--jemalloc``/``--tcmalloc`` name another path) is reported and skipped.
The peak live heap is not compared: glibc's counters do not see a preloaded allocator's blocks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402

ROWS = {
    "distillation-100m": ["bench_kd.py", "--preset", "100m", "--steps", "4", "--warmup", "1"],
    "sft-reference": ["bench_sft.py", "--preset", "reference"],
}
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
DEFAULT_LIBRARIES = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}


def find_library(name: str) -> str | None:
    candidate = Path(name)
    if candidate.is_absolute():
        return str(candidate) if candidate.exists() else None
    return next((str(Path(d) / name) for d in LIBRARY_DIRS if (Path(d) / name).exists()), None)


def variant_env(allocator: str, libraries: dict[str, str | None]) -> dict[str, str] | str:
    """The environment one allocator runs under, or why it cannot run here."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "HFNATIVE_CPU_TENSOR_POOL")}
    if allocator == "pool":
        return {**env, "HFNATIVE_CPU_TENSOR_POOL": "1"}
    env["HFNATIVE_CPU_TENSOR_POOL"] = "0"
    if allocator == "glibc":
        return env
    library = libraries[allocator]
    if library is None:
        return f"{allocator}: library not found (install it, e.g. Debian's lib{allocator}, or pass --{allocator} PATH)"
    return {**env, "LD_PRELOAD": library}


def run_once(row: str, env: dict[str, str], cli) -> dict:
    """One parent run of the row's script (ours alone): its one result, or {"status": "failed", "note": ...}."""
    with tempfile.TemporaryDirectory(prefix="hfnative-alloc-") as folder:
        out = Path(folder) / "runs.json"
        script, *arguments = ROWS[row]
        command = [sys.executable, str(HERE / script), *arguments, "--runners", "ours", "--rounds", "1",
                   "--json", str(out), "--timeout", str(cli.timeout)]
        if cli.threads:
            command += ["--threads", str(cli.threads)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=cli.timeout + 600)
        if not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            return {"status": "failed", "note": f"exit {done.returncode}: " + " | ".join(tail)}
        results = json.loads(out.read_text())["results"]
    return results[0] if results else {"status": "failed", "note": "no run"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--allocators", default="pool,glibc,jemalloc,tcmalloc",
                        help="comma-separated subset of pool,glibc,jemalloc,tcmalloc")
    parser.add_argument("--jemalloc", default=DEFAULT_LIBRARIES["jemalloc"], help="the library to preload")
    parser.add_argument("--tcmalloc", default=DEFAULT_LIBRARIES["tcmalloc"], help="the library to preload")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--write-results", "--write_results", action="store_true", help="append to benchmarks/RESULTS.md")
    cli = parser.parse_args()

    rows = cli.rows.split(",")
    allocators = cli.allocators.split(",")
    unknown = [r for r in rows if r not in ROWS] + [a for a in allocators if a not in ("pool", "glibc", *DEFAULT_LIBRARIES)]
    if unknown:
        sys.exit(f"unknown --rows/--allocators entries {unknown}; rows: {list(ROWS)}, allocators: pool, glibc, jemalloc, tcmalloc")
    libraries = {name: find_library(getattr(cli, name)) for name in DEFAULT_LIBRARIES}
    envs = {a: variant_env(a, libraries) for a in allocators}
    for allocator, env in list(envs.items()):
        if isinstance(env, str):
            print(f"skipped {env}", flush=True)
            del envs[allocator]

    setup = json.dumps(harness.machine_description("cpu")) + "\nlibraries: " + json.dumps(libraries)
    print(setup, flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(cli.rounds):
        for row in rows:
            for allocator, env in envs.items():
                result = run_once(row, env, cli)
                runs.setdefault((row, allocator), []).append(result)
                shown = (f"{result['tokens_per_second']:,.0f} tokens/s, peak RSS {result['peak_rss_mib']:,.0f} MiB"
                         if result.get("status") == "ok" else result.get("note", ""))
                print(f"round {round_index + 1}/{cli.rounds} {row} {allocator}: {result.get('status')} {shown}", flush=True)

    lines = [f"{'row':<20}{'allocator':<11}{'tokens/s (runs)':>26}{'median':>9}{'peak RSS MiB (runs)':>28}{'median':>9}"
             f"{'RSS vs pool':>13}  losses"]
    for row in rows:
        pool = [r for r in runs.get((row, "pool"), []) if r.get("status") == "ok"]
        pool_rss = statistics.median(r["peak_rss_mib"] for r in pool) if pool else None
        first_losses = pool[0]["losses"] if pool else None
        for allocator in envs:
            done = [r for r in runs[(row, allocator)] if r.get("status") == "ok"]
            if not done:
                lines.append(f"{row:<20}{allocator:<11}  no run finished")
                continue
            speeds = [r["tokens_per_second"] for r in done]
            rss = [r["peak_rss_mib"] for r in done]
            ratio = f"x{statistics.median(rss) / pool_rss:.3f}" if pool_rss else "-"
            reference = first_losses or done[0]["losses"]
            same = max(harness.max_relative_difference(r["losses"], reference) for r in done)
            lines.append(f"{row:<20}{allocator:<11}{', '.join(f'{s:,.0f}' for s in speeds):>26}"
                         f"{statistics.median(speeds):>9,.0f}{', '.join(f'{m:,.0f}' for m in rss):>28}"
                         f"{statistics.median(rss):>9,.0f}{ratio:>13}  maxrel {same:.1e}")
    lines.append("pool: hfnative's CPU tensor pool (HFNATIVE_CPU_TENSOR_POOL=1) over glibc; glibc: torch's allocator on "
                 "glibc malloc with the trainer's kept heap; jemalloc, tcmalloc: preloaded, the pool off; losses: the "
                 "largest relative per-step difference from the pool's first run")
    report = "\n".join(lines)
    setup += f"\nload average after: {[round(x, 2) for x in os.getloadavg()]}; rounds {cli.rounds}"
    print("\n" + report)
    if cli.write_results:
        harness.append_results(f"## {datetime.date.today().isoformat()} — hfnative under each host allocator (CPU tensor pool, glibc, jemalloc, tcmalloc), cpu",
                               setup, report, __file__)
        print(f"\nappended to {harness.RESULTS}")


if __name__ == "__main__":
    main()
