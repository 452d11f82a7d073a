"""PPO: hfnative's PPOTrainer vs TRL 0.29.1's PPOTrainer (``trl.experimental.ppo``) on the same models, prompts and
settings.

TRL 0.29.1 is installed on its own and run through tests/trl029_ppo.py (the dev extra's TRL 1.16 has the same
package name): ``HFNATIVE_TRL029=DIR`` names an installed copy, else it is installed into ``--cache``; without a
package registry TRL's side is skipped with the reason. Each runner trains in its own child process (so its peak RSS
is its own).

  speed   seconds per update (one rollout batch: generation, the four forwards, num_ppo_epochs passes; the first
          update excluded), response tokens generated per second and peak RSS, on the "reference" preset
          (benchmarks/harness.py: Qwen3, hidden 256, 4 layers, vocabulary 32000, random weights; or --preset 100m) as
          policy, and a
          one-label classifier of the same shape as reward and value model; 8 prompts per update, response_length
          53 (TRL's default), num_ppo_epochs 4, stop token EOS (a random model rarely stops, so responses run to the
          limit), fp32, no activation checkpointing (TRL's PPO never turns it on, whatever gradient_checkpointing says).
  curve   the mean score per update on a toy task (tests/test_ppo_learning.py's: tiny-qwen3, a random reward model
          whose score head is scaled x100), both trainers sampling for real with the same seed.

    python benchmarks/bench_ppo.py                        # both
    python benchmarks/bench_ppo.py --what speed --updates 4
    python benchmarks/bench_ppo.py --what curve --curve-updates 160
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
from harness import PRESETS, build_model, machine_description, peak_rss_mib, result_line_child  # noqa: E402
from trl029_ppo import NotInstalled, install_trl029, run_trl029  # noqa: E402

TINY = ROOT / "examples" / "tiny-qwen3"
RUNNERS = ("hfnative", "trl")


def prompt_ids(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    return [tokenizer(f"Write a short note number {i} about the sea.")["input_ids"] for i in range(n)]


def save_classifier(policy: Path, folder: Path, seed: int, scale: float = 1.0) -> str:
    """A one-label classifier of the policy's shape: its decoder, a new score head drawn under ``seed`` (x ``scale``)."""
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    with torch.no_grad():
        model.score.weight.mul_(scale)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(policy / name, folder / name)
    return str(folder)


def settings(spec: dict, output_dir: str) -> dict:
    return dict(output_dir=output_dir, use_cpu=True, bf16=False, report_to=[], disable_tqdm=True, logging_steps=1,
                save_strategy="no", per_device_train_batch_size=spec["batch"], num_ppo_epochs=4,
                response_length=spec["length"], stop_token="eos", total_episodes=spec["batch"] * spec["updates"],
                learning_rate=spec["lr"], lr_scheduler_type="constant", seed=0, kl_coef=spec["kl_coef"],
                temperature=spec["temperature"], num_sample_generations=0, gradient_checkpointing=False)


def _hfnative_child(spec: dict) -> dict:
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    import hfnative

    torch.set_num_threads(spec["threads"])
    seconds, cpu_seconds = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - self.start)
            cpu_seconds.append(time.process_time() - self.cpu_start)

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = AutoTokenizer.from_pretrained(spec["policy"], padding_side="left")
        trainer = hfnative.PPOTrainer(hfnative.PPOConfig(**settings(spec, folder)), tokenizer, spec["policy"], None,
                                      spec["reward"], Dataset.from_list([{"input_ids": p} for p in spec["prompts"]]),
                                      spec["value"], callbacks=[Clock()])
        trainer.train()
    return {"step_seconds": seconds, "step_cpu_seconds": cpu_seconds, "peak_rss_mib": peak_rss_mib(), "log_history": trainer.state.log_history}


def run(runner: str, spec: dict, trl_dir, timeout: float) -> dict:
    """One runner's training in a child process: its per-update seconds, peak RSS and log history."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    with tempfile.TemporaryDirectory() as folder:
        if runner == "trl":
            if trl_dir is None:
                return {"error": "TRL 0.29.1 not installed"}
            payload = {"tokenizer": spec["policy"], "policy": spec["policy"], "reward": spec["reward"],
                       "value": spec["value"], "config": settings(spec, folder), "prompts": spec["prompts"]}
            os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
            try:
                return run_trl029(payload, Path(folder) / "run", trl_dir, timeout=timeout)
            except RuntimeError as error:
                return {"error": str(error).splitlines()[-1]}
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {timeout:.0f} s"}
        command = [sys.executable, __file__, "--child", "--spec", json.dumps(spec)]
        return result_line_child(command, timeout, env)


def scores(result: dict) -> list[float]:
    return [row["objective/scores"] for row in result["log_history"] if "objective/scores" in row]


def speed(cli, trl_dir) -> None:
    with tempfile.TemporaryDirectory() as folder:
        policy = Path(folder) / "policy"
        parameters = build_model(PRESETS[cli.preset], policy, seed=0)
        spec = dict(policy=str(policy), reward=save_classifier(policy, Path(folder) / "reward", 1),
                    value=save_classifier(policy, Path(folder) / "value", 2), prompts=prompt_ids(8), batch=8,
                    length=cli.length, updates=cli.updates, lr=3e-6, kl_coef=0.05, temperature=0.7,
                    threads=cli.threads)
        print(f"speed: {cli.preset} preset ({parameters / 1e6:.1f}M parameters) as policy, reward and value model; "
              f"8 prompts per update, response_length {cli.length}, num_ppo_epochs 4, {cli.updates} updates "
              "(first excluded)")
        print(f"{'runner':>9} {'s/update':>9} {'CPU s/update':>13} {'response tok/s':>15} {'peak RSS MiB':>13}")
        results = {}
        for runner in RUNNERS:
            result = results[runner] = run(runner, spec, trl_dir, cli.timeout)
            if "error" in result:
                print(f"{runner:>9} {result['error']}")
                continue
            per_update = statistics.mean(result["step_seconds"][1:] or result["step_seconds"])
            cpu = statistics.mean(result["step_cpu_seconds"][1:] or result["step_cpu_seconds"])
            eos = [row["val/num_eos_tokens"] for row in result["log_history"] if "objective/scores" in row]
            result["per_update"], result["cpu_per_update"] = per_update, cpu
            print(f"{runner:>9} {per_update:>9.2f} {cpu:>13.2f} {8 * cli.length / per_update:>15.1f} "
                  f"{result['peak_rss_mib']:>13.0f}   (EOS tokens per update: {statistics.mean(eos):.1f})")
        if all("per_update" in r for r in results.values()):
            ours, theirs = results["hfnative"], results["trl"]
            print(f"{'ratio':>9} {theirs['per_update'] / ours['per_update']:>8.2f}x "
                  f"{theirs['cpu_per_update'] / ours['cpu_per_update']:>12.2f}x {'':>15} "
                  f"{ours['peak_rss_mib'] / theirs['peak_rss_mib']:>12.2f}x   (speed-ups; memory hfnative/trl)")


def curve(cli, trl_dir) -> None:
    with tempfile.TemporaryDirectory() as folder:
        from _ppo_worker import save_classifier as save_tiny_classifier

        reward = save_classifier(Path(save_tiny_classifier(Path(folder) / "reward-base", 1)), Path(folder) / "reward",
                                 1, scale=100.0)
        spec = dict(policy=str(TINY), reward=reward, value=save_tiny_classifier(Path(folder) / "value", 2),
                    prompts=prompt_ids(8), batch=8, length=4, updates=cli.curve_updates, lr=1e-3, kl_coef=0.01,
                    temperature=1.0, threads=cli.threads)
        print(f"curve: toy reward (a random classifier, score head x100), tiny-qwen3, 8 rollouts of 4 tokens per "
              f"update, {cli.curve_updates} updates")
        curves = {}
        for runner in RUNNERS:
            result = run(runner, spec, trl_dir, cli.timeout)
            if "error" in result:
                print(f"{runner:>9} {result['error']}")
                continue
            curves[runner] = scores(result)
        every = max(cli.curve_updates // 8, 1)
        print("update    " + " ".join(f"{i + 1:>7}" for i in range(0, cli.curve_updates, every)))
        for runner, values in curves.items():
            means = [statistics.mean(values[i : i + every]) for i in range(0, len(values), every)]
            print(f"{runner:<9} " + " ".join(f"{m:>7.2f}" for m in means) + f"   (mean score of each {every} updates)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("speed", "curve", "both"), default="both")
    parser.add_argument("--preset", choices=("reference", "100m"), default="reference",
                        help="the policy's shape (benchmarks/harness.py); reward and value model the same")
    parser.add_argument("--length", type=int, default=53)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--curve-updates", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "hfnative-bench"),
                        help="where TRL 0.29.1 is installed when HFNATIVE_TRL029 is not set")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--spec")
    cli = parser.parse_args()
    if cli.child:
        print("RESULT " + json.dumps(_hfnative_child(json.loads(cli.spec))))
        return
    print(json.dumps(machine_description("cpu")))
    try:
        trl_dir = install_trl029(cli.cache)
    except NotInstalled as error:
        print(f"TRL's side skipped: {error}")
        trl_dir = None
    if cli.what in ("speed", "both"):
        speed(cli, trl_dir)
    if cli.what in ("curve", "both"):
        curve(cli, trl_dir)


if __name__ == "__main__":
    main()
