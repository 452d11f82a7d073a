"""Tool-calling rollouts: seconds per optimizer step of AsyncGRPOTrainer (episodes in the generator actor, so tool
latency overlaps training) against GRPOTrainer (tools called between the turns of the step's own generation), with
a tool that takes --tool-ms per call.

Both runners train tiny-qwen3 (examples/) with hfnative's multi-turn Qwen3 chat template, the same prompts, seed and
settings: 8 completions per step (2 prompts x 4), up to --max-completion tokens, one tool turn. A random model does
not call tools, so each rollout's first turn is written for it (3 rows of 4 call the tool, as a model that has
learned the format would); the turn after the tool result is sampled. Each runner runs in a child process of its
own; the first --warmup steps are not timed.

    python benchmarks/bench_tools.py                     # 50 ms per call, 8 steps
    python benchmarks/bench_tools.py --tool-ms 200 --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_description  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-qwen3"
RUNNERS = ("sync", "async")
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": 7}}\n</tool_call>'
TOOL_SECONDS = float(os.environ.get("BENCH_TOOL_SECONDS", "0.05"))


def lookup(key: int) -> int:
    """Look a key up in a slow store.

    Args:
        key: The key.
    """
    time.sleep(TOOL_SECONDS)
    return key * 3


class SteeredEngine:
    """A rollout engine whose first turns call the tool in 3 rows of 4 (later turns sampled)."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer

    def generate(self, prompts, sampling):
        out = self.engine.generate(prompts, sampling)
        for i, prompt in enumerate(prompts):
            if self.tokenizer.decode(prompt).count("<|im_start|>assistant") == 1:
                text = CALL if i % 4 else "No tool needed."
                out.completion_ids[i] = self.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
                out.logprobs[i] = [0.0] * len(out.completion_ids[i])
        return out


def answered(completions, **kwargs):
    return [float(c[-1]["role"] == "assistant" and bool(c[-1]["content"])) for c in completions]


def child(runner: str, spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    import hfnative
    from hfnative.data.chat_templates import TEMPLATE_DIR

    torch.set_num_threads(spec["threads"])
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    folder = Path(spec["workdir"]) / "model"
    shutil.copytree(TINY, folder)
    shutil.copy(TEMPLATE_DIR / "qwen3_multiturn.jinja", folder / "chat_template.jinja")
    rows = [{"prompt": [{"role": "user", "content": f"Look up key {i}."}]} for i in range(64)]
    settings = dict(output_dir=str(Path(spec["workdir"]) / "out"), bf16=False, report_to="none", disable_tqdm=True,
                    max_steps=spec["steps"], logging_steps=1, save_strategy="no", per_device_train_batch_size=8,
                    num_generations=4, max_completion_length=spec["max_completion"], learning_rate=1e-4, seed=0,
                    gradient_checkpointing=False, max_tool_calling_iterations=1)
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    if runner == "sync":
        trainer = hfnative.GRPOTrainer(model=str(folder), reward_funcs=answered, tools=[lookup],
                                       args=hfnative.GRPOConfig(use_cpu=True, **settings), train_dataset=Dataset.from_list(rows),
                                       callbacks=[Clock()])
        engine = trainer.objective.engine
        engine.generate = SteeredEngine(SimpleNamespace(generate=engine.generate), trainer.processing_class).generate
    else:
        from hfnative.trainers.rollout.tool_calling import ToolEpisodes

        class SteeredEpisodes(ToolEpisodes):
            def __call__(self, engine, prompt_ids, sampling):
                return super().__call__(SteeredEngine(engine, self.tool_calling.tokenizer), prompt_ids, sampling)

        os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
        trainer = hfnative.AsyncGRPOTrainer(str(folder), reward_funcs=answered, tools=[lookup],
                                            args=hfnative.AsyncGRPOConfig(max_staleness=1, **settings),
                                            train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
        trainer.objective.episodes_class = SteeredEpisodes
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    steps = [b - a for a, b in zip(stamps, stamps[1:])][spec["warmup"] - 1:]
    return {"runner": runner, "step_s": steps, "calls_per_step": logs[-1]["tools/call_frequency"] * 8,
            "reward_last": logs[-1].get("reward")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool-ms", type=float, default=50.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-completion", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=RUNNERS)
    parser.add_argument("--spec")
    options = parser.parse_args()
    if options.child:
        print("RESULT " + json.dumps(child(options.child, json.loads(options.spec))))
        return
    print(machine_description("cpu"))
    print(f"load average at start: {os.getloadavg()[0]:.2f}; tool {options.tool_ms:g} ms per call; "
          f"{options.steps} steps, the first {options.warmup} not timed; torch threads {options.threads}")
    results = {}
    for runner in RUNNERS:
        with tempfile.TemporaryDirectory() as workdir:
            spec = dict(steps=options.steps, warmup=options.warmup, max_completion=options.max_completion,
                        threads=options.threads, workdir=workdir)
            env = dict(os.environ, BENCH_TOOL_SECONDS=str(options.tool_ms / 1000))
            out = subprocess.run([sys.executable, __file__, "--child", runner, "--spec", json.dumps(spec)],
                                 capture_output=True, text=True, env=env, check=False)
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{runner} failed:\n{out.stderr[-4000:]}")
            results[runner] = json.loads(line[len("RESULT "):])
    print("| runner | s / step (mean) | s / step (median) | tool calls / step | tool time / step (s) |")
    print("|---|---|---|---|---|")
    for runner, result in results.items():
        steps = result["step_s"]
        print(f"| {runner} | {statistics.mean(steps):.3f} | {statistics.median(steps):.3f} | "
              f"{result['calls_per_step']:.1f} | {result['calls_per_step'] * options.tool_ms / 1000:.2f} |")
    ratio = statistics.mean(results["sync"]["step_s"]) / statistics.mean(results["async"]["step_s"])
    print(f"sync / async seconds per step: {ratio:.2f}x")


if __name__ == "__main__":
    main()
