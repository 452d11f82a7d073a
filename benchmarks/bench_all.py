"""The whole benchmark table in one command: every trainer against its peer on one preset, one process tree.

Runs, one after the other, each benchmark script of this folder with its peer beside it (every script alternates
its runners over ``--rounds`` and gives each run its own process, so peak memory is that runner's alone):

    SFT            bench_sft.py        vs TRL's SFTTrainer and transformers' Trainer
    DPO            bench_dpo.py        vs TRL's DPOTrainer
    distillation   bench_kd.py         vs TRL's DistillationTrainer (--trainer distillation)
    GKD            bench_kd.py         vs TRL's GKDTrainer (--trainer gkd)
    reward, KTO,   bench_reward.py     vs TRL's RewardTrainer, KTOTrainer and trl.experimental's ORPO, CPO and
    ORPO, CPO,                         online DPO trainers
    online DPO
    GRPO           bench_grpo.py       vs TRL's GRPOTrainer (speed only: seconds per step, 64-token completions)

and prints one table: speed ratio (ours over the peer's tokens/s; for GRPO the peer's seconds per step over ours),
peak RSS and peak heap ratios (ours over the peer's), and the largest relative difference of the per-step losses.

A ratio taken beside other jobs is not a result (on 2 cores, a second job slows small ops by up to 10x), so before
each script it measures the CPU time the machine spends outside this process tree over ``--probe`` seconds; if
other work keeps more than ``--max_busy`` of the cores busy for ``--wait`` seconds it stops and says what it saw.

    python benchmarks/bench_all.py                                   # reference preset, 2 rounds, prints the table
    python benchmarks/bench_all.py --write-results                   # and appends it to RESULTS.md
    python benchmarks/bench_all.py --preset smoke --rounds 1 --only SFT,DPO   # a quick check of the script
    python benchmarks/bench_all.py --preset 100m --rounds 1 --steps 4 --warmup 1   # the 100m rows, shorter runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import machine_description, max_relative_difference  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"

# name, script, its arguments besides --preset/--rounds/--json, our runner, the peers
ENTRIES = (
    ("SFT", "bench_sft.py", [], "ours", ("trl", "hf")),
    ("DPO", "bench_dpo.py", [], "ours", ("trl",)),
    ("distillation", "bench_kd.py", ["--trainer", "distillation"], "ours", ("trl",)),
    ("GKD", "bench_kd.py", ["--trainer", "gkd"], "ours", ("trl",)),
    ("reward", "bench_reward.py", ["--trainer", "reward"], "ours", ("trl",)),
    ("KTO", "bench_reward.py", ["--trainer", "kto"], "ours", ("trl",)),
    ("ORPO", "bench_reward.py", ["--trainer", "orpo"], "ours", ("trl",)),
    ("CPO", "bench_reward.py", ["--trainer", "cpo"], "ours", ("trl",)),
    ("online DPO", "bench_reward.py", ["--trainer", "online_dpo"], "ours", ("trl",)),
    ("GRPO", "bench_grpo.py", ["--what", "speed", "--lengths", "64", "--steps", "4"], "hfnative", ("trl",)),
)
PEER_NAMES = {"trl": "TRL", "hf": "transformers"}


def _cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def other_work(probe: float) -> float:
    """Cores kept busy by other processes over ``probe`` seconds (this process sleeps meanwhile)."""
    busy0, total0 = _cpu_seconds()
    time.sleep(probe)
    busy1, total1 = _cpu_seconds()
    cores = os.cpu_count() or 1
    return cores * (busy1 - busy0) / max(total1 - total0, 1e-9)


def wait_for_quiet(cli, label: str) -> float:
    """Cores busy with other work once it is below ``--max_busy``; exits when it is not within ``--wait`` s."""
    deadline = time.monotonic() + cli.wait
    while True:
        busy = other_work(cli.probe)
        if busy <= cli.max_busy:
            return busy
        if time.monotonic() >= deadline:
            sys.exit(f"bench_all: before {label}, other processes kept {busy:.2f} of {os.cpu_count()} cores busy "
                     f"(load average {os.getloadavg()[0]:.2f}) for more than --wait {cli.wait:.0f} s; above "
                     f"--max_busy {cli.max_busy}. Ratios taken beside other work are not results: rerun on a "
                     "quiet machine")
        print(f"bench_all: waiting for a quiet machine ({busy:.2f} cores busy with other work)", flush=True)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def harness_rows(name: str, data: dict, ours: str, peers: tuple[str, ...]) -> list[dict]:
    """One row per peer from a harness script's runs: medians over the rounds of tokens/s, peak RSS and heap."""
    runs = {}
    for result in data["results"]:
        if result["status"] == "ok":
            runs.setdefault(result["runner"], []).append(result)
    rows = []
    for peer in peers:
        row = {"trainer": name, "peer": PEER_NAMES.get(peer, peer)}
        if ours not in runs or peer not in runs:
            failed = [r for r in data["results"] if r["runner"] in (ours, peer) and r["status"] != "ok"]
            row["error"] = (failed[0].get("note") or failed[0]["status"]).strip().splitlines()[-1] if failed else "no run"
            rows.append(row)
            continue
        a, b = runs[ours], runs[peer]
        memory = "peak_gpu_mib" if a[0].get("peak_gpu_mib") else "peak_rss_mib"
        row.update(
            ours_rate=_median(r["tokens_per_second"] for r in a), peer_rate=_median(r["tokens_per_second"] for r in b),
            ours_memory=_median(r[memory] for r in a), peer_memory=_median(r[memory] for r in b),
            ours_heap=_median(r.get("peak_heap_mib") for r in a), peer_heap=_median(r.get("peak_heap_mib") for r in b),
            loss_maxrel=max_relative_difference(a[0].get("losses") or [], b[0].get("losses") or []), unit="tokens/s",
            rounds=min(len(a), len(b)),
        )
        row["speed"] = row["ours_rate"] / row["peer_rate"]
        rows.append(row)
    return rows


def grpo_rows(name: str, data: dict, ours: str, peers: tuple[str, ...]) -> list[dict]:
    """One row per completion length: seconds per step (the peer's over ours is the speed-up), peak RSS and heap."""
    rows = []
    for length, results in data["lengths"].items():
        for peer in peers:
            row = {"trainer": f"{name} ({length} tokens)", "peer": PEER_NAMES.get(peer, peer)}
            a, b = results.get(ours, {}), results.get(peer, {})
            if "per_step" not in a or "per_step" not in b:
                row["error"] = a.get("error") or b.get("error") or "no run"
            else:
                row.update(ours_rate=a["per_step"], peer_rate=b["per_step"], unit="s/step", rounds=1,
                           ours_memory=a["peak_rss_mib"], peer_memory=b["peak_rss_mib"], ours_heap=a.get("peak_heap_mib"),
                           peer_heap=b.get("peak_heap_mib"), loss_maxrel=None, speed=b["per_step"] / a["per_step"])
            rows.append(row)
    return rows


def _ratio(a, b) -> str:
    return f"x{a / b:.2f}" if a and b else "-"


def table(rows: list[dict]) -> str:
    header = (f"{'trainer':<20}{'peer':<14}{'ours':>12}{'peer':>12}{'unit':>9}{'speed':>8}{'RSS MiB ours/peer':>20}"
              f"{'RSS':>7}{'heap':>7}{'loss maxrel':>13}")
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['trainer']:<20}{row['peer']:<14}  not measured: {row['error'][:90]}")
            continue
        memory = f"{row['ours_memory']:,.0f}/{row['peer_memory']:,.0f}"
        maxrel = "-" if row["loss_maxrel"] is None or math.isnan(row["loss_maxrel"]) else f"{row['loss_maxrel']:.1e}"
        digits = ",.2f" if row["unit"] == "s/step" else ",.0f"
        lines.append(f"{row['trainer']:<20}{row['peer']:<14}{row['ours_rate']:>12{digits}}{row['peer_rate']:>12{digits}}"
                     f"{row['unit']:>9}{'x' + format(row['speed'], '.2f'):>8}{memory:>20}"
                     f"{_ratio(row['ours_memory'], row['peer_memory']):>7}{_ratio(row['ours_heap'], row['peer_heap']):>7}"
                     f"{maxrel:>13}")
    lines += ["", "speed: ours over the peer (tokens/s; GRPO: the peer's s/step over ours), above 1 = ours faster; "
              "RSS, heap: ours over the peer, below 1 = ours smaller; loss maxrel: largest relative per-step loss "
              "difference (same model, data, order and settings)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="reference", help="the harness preset every harness script runs")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per harness script (runners alternate)")
    for name in ("steps", "warmup", "batch"):
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"override the preset's {name} in every harness script (not bench_grpo.py)")
    parser.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(e[0] for e in ENTRIES))
    parser.add_argument("--max_busy", "--max-busy", type=float, default=0.15,
                        help="cores other processes may keep busy before a script starts")
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for a quiet machine before refusing")
    parser.add_argument("--probe", type=float, default=3.0, help="seconds each quiet-machine check watches")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per script")
    parser.add_argument("--write-results", "--write_results", action="store_true", help="append the table to RESULTS.md")
    cli = parser.parse_args()
    chosen = {name.strip() for name in cli.only.split(",") if name.strip()}
    unknown = chosen - {e[0] for e in ENTRIES}
    if unknown:
        sys.exit(f"--only: unknown {sorted(unknown)}; use a subset of {', '.join(e[0] for e in ENTRIES)}")
    entries = [e for e in ENTRIES if not chosen or e[0] in chosen]

    started = datetime.datetime.now(datetime.timezone.utc)
    rows, watched = [], []
    with tempfile.TemporaryDirectory(prefix="bench_all_") as folder:
        for index, (name, script, extra, ours, peers) in enumerate(entries):
            busy = wait_for_quiet(cli, name)
            load = os.getloadavg()[0]
            out = Path(folder) / f"{index}.json"
            command = [sys.executable, str(HERE / script), *extra, "--json", str(out)]
            if script != "bench_grpo.py":
                command += ["--preset", cli.preset, "--rounds", str(cli.rounds)]
                for option in ("steps", "warmup", "batch"):
                    if getattr(cli, option) is not None:
                        command += [f"--{option}", str(getattr(cli, option))]
            print(f"bench_all: {name}: {shlex.join(command[1:])}", flush=True)
            begin = time.monotonic()
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=cli.timeout)
                note = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]
            except subprocess.TimeoutExpired:
                note = f"timed out after {cli.timeout:.0f} s"
            seconds = time.monotonic() - begin
            watched.append(f"{name}: {busy:.2f} cores busy with other work before, load average {load:.2f}, {seconds:.0f} s")
            if note is not None or not out.exists():
                rows += [{"trainer": name, "peer": PEER_NAMES.get(p, p), "error": note or "wrote no results"} for p in peers]
            else:
                data = json.loads(out.read_text())
                rows += (grpo_rows if script == "bench_grpo.py" else harness_rows)(name, data, ours, peers)
            print(table(rows[-len(peers):]).splitlines()[2], flush=True)

    machine = machine_description("cpu")
    report = table(rows)
    setup = (f"machine: {json.dumps(machine)}\nstarted {started.isoformat(timespec='seconds')}, preset {cli.preset}, "
             f"rounds {cli.rounds}\n" + "\n".join(watched))
    print("\n" + setup + "\n\n" + report)
    if cli.write_results:
        command = "python " + shlex.join([os.path.relpath(__file__, ROOT), *sys.argv[1:]])
        with open(RESULTS, "a") as f:
            f.write(f"\n## {started.date()} — the whole table (`bench_all.py`), preset `{cli.preset}`, cpu\n\n"
                    f"Command: `{command}`\n\n```\n{setup}\n\n{report}\n```\n")
        print(f"\nappended to {RESULTS}")


if __name__ == "__main__":
    main()
