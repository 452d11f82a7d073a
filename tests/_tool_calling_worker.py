"""GRPOTrainer with tools as the ranks of a torchrun launch, for tests/test_tool_calling.py.

usage: torchrun --standalone --nproc_per_node 2 _tool_calling_worker.py OUTPUT_DIR MODELS_DIR LAYOUT [LAYOUT ...]
Each LAYOUT (ddp, fsdp2, tp2, cp2 on MODELS_DIR/dense; ep2 on MODELS_DIR/moe, a mixture-of-experts policy) trains GRPO
with tools (distill-fsdp2: DistillationTrainer, the teacher MODELS_DIR/teacher) on the global batch of the one-process run: each rollout's first turn
is steered to a tool call (as a model that has learned the format writes it), its later turns are sampled from the
native engine on the parallelized policy's replica (each row's own stream), the tools run, the reference model
runs (beta > 0). Rank r writes OUTPUT_DIR/LAYOUT-rank<r>.json (the log history).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

GLOBAL_BATCH = 8  # completions per step (2 prompts x 4 generations)
LAYOUTS = {"ddp": (dict(dp_replicate_size=2), 2), "fsdp2": (dict(dp_shard_size=2), 2), "tp2": (dict(tp_size=2), 1),
           "cp2": (dict(cp_size=2), 1), "ep2": (dict(dp_shard_size=2, ep_size=2), 2),
           "fsdp2xtp2": (dict(dp_shard_size=2, tp_size=2), 2)}  # on 4 processes
# "distill-<layout>": DistillationTrainer with tools under that layout (on-policy, MODELS_DIR/teacher the teacher)
FIRST_TURNS = ['<tool_call>\n{"name": "double", "arguments": {"x": 3}}\n</tool_call>',
               '<tool_call>\n{"name": "fail", "arguments": {}}\n</tool_call>', "No tools needed.",
               '<tool_call>\n{"name": "double", "arguments": {"x": 5}}\n</tool_call>']


def double(x: int) -> int:
    """Double x.

    Args:
        x: A number.
    """
    return 2 * x


def fail() -> int:
    """Fail."""
    raise RuntimeError("no")


def tool_results(completions, **kwargs):
    return [sum(m["role"] == "tool" for m in c) + len(c[-1]["content"]) / 100 for c in completions]


class SteeredEngine:
    """An engine whose rollouts' first turns are written as FIRST_TURNS gives them for the row's place in the batch
    (as a model that has learned the call format writes them); later turns are sampled, and their lengths kept in
    ``later_rows``. For async GRPO, where the episodes run in the generator actor, through ``steered_episodes``."""

    def __init__(self, engine, tokenizer):
        self.sample, self.tokenizer, self.later_rows = engine.generate, tokenizer, []

    def generate(self, prompts, sampling):
        out = self.sample(prompts, sampling)
        for i, prompt in enumerate(prompts):
            if self.tokenizer.decode(prompt).count("<|im_start|>assistant") == 1:  # a first turn: steered by its place
                place = (sampling.first_row + i) % 4
                out.completion_ids[i] = self.tokenizer(FIRST_TURNS[place] + "<|im_end|>", add_special_tokens=False)["input_ids"]
                out.logprobs[i] = [0.0] * len(out.completion_ids[i])
            else:
                self.later_rows.append(len(out.completion_ids[i]))
        return out


def steered_episodes():
    from hfnative.trainers.rollout.tool_calling import ToolEpisodes

    class SteeredEpisodes(ToolEpisodes):
        def __call__(self, engine, prompt_ids, sampling, rows=None):
            return super().__call__(SteeredEngine(engine, self.tool_calling.tokenizer), prompt_ids, sampling, rows)

    return SteeredEpisodes


def train(model: str, output_dir: str, per_device: int, **extra) -> list[dict]:
    import hfnative
    from datasets import Dataset

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    args = hfnative.GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=per_device, num_generations=4,
        max_completion_length=128, learning_rate=1e-2, seed=0, gradient_checkpointing=False, beta=0.04,
        max_tool_calling_iterations=1, **extra)
    prompts = [{"prompt": [{"role": "user", "content": f"Double {i}."}]} for i in range(8)]
    trainer = hfnative.GRPOTrainer(model=model, reward_funcs=tool_results, args=args, train_dataset=Dataset.from_list(prompts),
                                   tools=[double, fail])
    return _steered_run(trainer, trainer.objective.engine)


def train_distillation(model: str, teacher: str, output_dir: str, per_device: int, **extra) -> list[dict]:
    """DistillationTrainer with the same tools (every micro-batch completed by the student)."""
    import hfnative
    from datasets import Dataset

    args = hfnative.DistillationConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=per_device, max_completion_length=128,
        learning_rate=1e-2, seed=0, gradient_checkpointing=False, beta=0.5, max_tool_calling_iterations=1,
        **extra)
    prompts = [{"prompt": [{"role": "user", "content": f"Double {i}."}]} for i in range(16)]
    trainer = hfnative.DistillationTrainer(model=model, teacher_model=teacher, args=args,
                                           train_dataset=Dataset.from_list(prompts), tools=[double, fail])
    return _steered_run(trainer, trainer.objective.rollout.engine_for())


def _steered_run(trainer, engine) -> list[dict]:
    """Train with each rollout's first turn steered by its row's place in the batch (a tool call or an answer)."""
    steered = SteeredEngine(engine, trainer.processing_class)
    engine.generate = steered.generate  # the engine's own generate is kept in steered.sample
    trainer.train()
    logs = trainer.state.log_history[:-1]
    logs[0]["later_turn_rows"] = len(steered.later_rows)  # rows sampled after a tool result, over the run
    return logs


def main(output_dir: str, models: str, layouts: list[str]) -> None:
    rank = int(os.environ["RANK"])
    for layout in layouts:
        sizes, dp = LAYOUTS[layout.removeprefix("distill-")]
        model = str(Path(models) / ("moe" if layout.endswith("ep2") else "dense"))
        if layout.startswith("distill-"):
            logs = train_distillation(model, str(Path(models) / "teacher"), str(Path(output_dir) / layout),
                                      GLOBAL_BATCH // dp, parallelism_config=dict(sizes))
        else:
            logs = train(model, str(Path(output_dir) / layout), GLOBAL_BATCH // dp, parallelism_config=dict(sizes))
        (Path(output_dir) / f"{layout}-rank{rank}.json").write_text(json.dumps(logs))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
