"""GRPO (or RLOO, ``--trainer rloo``): hfnative's trainer vs TRL's on the same model, task, prompts and settings.

Two measurements, each runner in its own child process (so peak RSS is its own):

  speed   seconds per optimizer step, wall and CPU time of the process (the first step excluded; CPU time
          is the fairer figure on a machine other jobs share) and peak RSS, for short and long completions (--lengths, default 64 and 1024 tokens; a random
          model rarely stops early, so completions run to the limit), G = 8 completions of 1 prompt per step.
  curve   the reward curve of a toy task learnt from the reward alone: reward = fraction of the letter "e"
          in the completion's text, tiny-qwen3 (examples/), 16 completions (2 prompts x 8) of 16 tokens
          per step, constant LR 3e-3, same seed. Reported: mean reward of the first and last 10 steps.

    python benchmarks/bench_grpo.py                       # both, default sizes
    python benchmarks/bench_grpo.py --what speed --lengths 64 256 --steps 4
    python benchmarks/bench_grpo.py --what curve --curve-steps 60
    python benchmarks/bench_grpo.py --device cuda         # speed at Qwen3-0.6B's shape in bf16, 256 tokens

The speed model is a Qwen3 of hidden 256, 4 layers, vocabulary 32000 (benchmarks/harness.py's
"reference" shape) with random weights. Both runners train in fp32 with activation checkpointing on (both
trainers' default), loss_type dapo, beta 0. With ``--device cuda`` both train on the GPU in bf16 (bf16=True, fp32
master weights) a model of Qwen3-0.6B's shape (``--preset``), generating with their default engines: transformers'
``generate`` for TRL (use_vllm=False), the native engine for hfnative (its decode step in a CUDA graph).
``--trainer rloo``: RLOOTrainer / RLOOConfig of each package with the same settings (RLOO has no ``loss_type``; its
baseline is the other completions' mean reward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import PRESETS, HeapPeak, build_model, machine_description, peak_rss_mib, result_line_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-qwen3"
RUNNERS = ("hfnative", "trl")


def letter_e(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [t.count("e") / max(len(t), 1) for t in texts]


def prompts(n: int) -> list[dict]:
    return [{"prompt": f"Write a short note number {i} about the sea."} for i in range(n)]


def _child(runner: str, spec: dict) -> dict:
    import torch
    from datasets import Dataset

    torch.set_num_threads(spec["threads"])
    if runner == "trl":
        import trl as module
    else:
        import hfnative as module
    on_cuda = spec.get("device") == "cuda"
    rloo = spec.get("trainer") == "rloo"
    settings = dict(
        output_dir=spec["output_dir"], use_cpu=not on_cuda, bf16=on_cuda, report_to="none", disable_tqdm=True,
        max_steps=spec["steps"], logging_steps=1, save_strategy="no", per_device_train_batch_size=spec["batch"],
        num_generations=8, max_completion_length=spec["length"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", seed=spec["seed"], beta=0.0, **({} if rloo else {"loss_type": "dapo"}),
    )
    trainer_class, config_class = ((module.RLOOTrainer, module.RLOOConfig) if rloo
                                   else (module.GRPOTrainer, module.GRPOConfig))
    trainer = trainer_class(model=spec["model"], reward_funcs=letter_e, args=config_class(**settings),
                            train_dataset=Dataset.from_list(prompts(spec["prompts"])))
    times, cpu_times = [], []
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)
            cpu_times.append(time.process_time() - self.cpu_start)

    trainer.add_callback(Clock())
    with HeapPeak() as heap:
        trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history if "reward" in entry]
    # on CUDA the peak of device memory stands in the heap's column
    peak = torch.cuda.max_memory_allocated() / 2**20 if on_cuda else heap.peak_mib
    return {"step_seconds": times, "step_cpu_seconds": cpu_times, "rewards": rewards, "mean_length": lengths,
            "peak_rss_mib": peak_rss_mib(), "peak_heap_mib": peak}


def run_child(runner: str, spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        spec = {**spec, "output_dir": folder}
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
        command = [sys.executable, __file__, "--child", runner, "--spec", json.dumps(spec)]
        return result_line_child(command, timeout, env)


def speed(cli, model: str) -> dict:
    """Prints the speed table; returns every length's results by runner."""
    print(f"speed ({cli.trainer}): G=8 completions of 1 prompt per step, {cli.steps} steps (first excluded), "
          f"model {model}, "
          f"{'bf16 on cuda' if cli.device == 'cuda' else 'fp32 on cpu'}")
    memory = "peak GPU MiB" if cli.device == "cuda" else "peak heap MiB"
    print(f"{'length':>7} {'runner':>9} {'s/step':>8} {'CPU s/step':>11} {'peak RSS MiB':>13} {memory:>14} "
          f"{'mean len':>9}")
    by_length = {}
    for length in cli.lengths:
        results = by_length[length] = {}
        for runner in RUNNERS:
            spec = dict(model=model, steps=cli.steps, batch=8, prompts=8, length=length, lr=1e-6, seed=0,
                        threads=cli.threads, device=cli.device, trainer=cli.trainer)
            results[runner] = result = run_child(runner, spec, cli.timeout)
            if "error" in result:
                print(f"{length:>7} {runner:>9} {result['error']}")
                continue
            per_step = statistics.mean(result["step_seconds"][1:] or result["step_seconds"])
            result["per_step"] = per_step
            result["cpu_per_step"] = statistics.mean(result["step_cpu_seconds"][1:] or result["step_cpu_seconds"])
            heap = result["peak_heap_mib"] or float("nan")
            print(f"{length:>7} {runner:>9} {per_step:>8.2f} {result['cpu_per_step']:>11.2f} "
                  f"{result['peak_rss_mib']:>13.0f} {heap:>14.0f} {statistics.mean(result['mean_length']):>9.1f}")
        if all("per_step" in r for r in results.values()):
            ours, theirs = results["hfnative"], results["trl"]
            heap_ratio = (ours["peak_heap_mib"] or float("nan")) / (theirs["peak_heap_mib"] or float("nan"))
            print(f"{length:>7} {'ratio':>9} {theirs['per_step'] / ours['per_step']:>7.2f}x "
                  f"{theirs['cpu_per_step'] / ours['cpu_per_step']:>10.2f}x "
                  f"{ours['peak_rss_mib'] / theirs['peak_rss_mib']:>12.2f}x {heap_ratio:>13.2f}x"
                  "   (speed-ups; memory hfnative/trl)")
    return by_length


def curve(cli) -> None:
    print(f"curve ({cli.trainer}): letter-e reward, tiny-qwen3, 16 completions (2 prompts x 8) of 16 tokens, "
          f"{cli.curve_steps} steps")
    curves = {}
    for runner in RUNNERS:
        spec = dict(model=str(TINY), steps=cli.curve_steps, batch=16, prompts=64, length=16, lr=3e-3, seed=0,
                    threads=cli.threads, trainer=cli.trainer)
        result = run_child(runner, spec, cli.timeout)
        if "error" in result:
            print(f"{runner:>9} {result['error']}")
            continue
        curves[runner] = result["rewards"]
        first, last = statistics.mean(result["rewards"][:10]), statistics.mean(result["rewards"][-10:])
        print(f"{runner:>9} reward first 10 steps {first:.3f}  last 10 steps {last:.3f}  "
              f"s/step {statistics.mean(result['step_seconds']):.3f}")
    if len(curves) == 2:
        every = max(len(curves["trl"]) // 12, 1)
        print("step      " + " ".join(f"{i + 1:>6}" for i in range(0, len(curves["trl"]), every)))
        for runner, rewards in curves.items():
            print(f"{runner:<9} " + " ".join(f"{rewards[i]:>6.3f}" for i in range(0, len(rewards), every)))
        ratio = statistics.mean(curves["hfnative"][-10:]) / statistics.mean(curves["trl"][-10:])
        print(f"final reward hfnative / trl: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("speed", "curve", "both"), default="both")
    parser.add_argument("--trainer", choices=("grpo", "rloo"), default="grpo",
                        help="the trainer both packages run")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--curve-steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: speed only, bf16, --preset's model (default qwen3_0.6b), lengths 256 unless given")
    parser.add_argument("--preset", default=None, help="the speed model's harness preset (default: reference on cpu, "
                        "qwen3_0.6b on cuda)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--child", choices=RUNNERS)
    parser.add_argument("--spec")
    parser.add_argument("--json", help="also write the speed runs' measurements to this JSON file")
    cli = parser.parse_args()
    if cli.child:
        print("RESULT " + json.dumps(_child(cli.child, json.loads(cli.spec))))
        return
    if cli.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device here")
        cli.what = "speed"
        if "--lengths" not in sys.argv:
            cli.lengths = [256]
    print(json.dumps(machine_description(cli.device)))
    if cli.what in ("speed", "both"):
        with tempfile.TemporaryDirectory() as folder:
            preset = cli.preset or ("qwen3_0.6b" if cli.device == "cuda" else "reference")
            parameters = build_model(PRESETS[preset], Path(folder), seed=0)
            print(f"model: {parameters / 1e6:.1f}M parameters")
            by_length = speed(cli, folder)
        if cli.json:
            Path(cli.json).write_text(json.dumps({"lengths": by_length}))
    if cli.what in ("curve", "both"):
        curve(cli)


if __name__ == "__main__":
    main()
