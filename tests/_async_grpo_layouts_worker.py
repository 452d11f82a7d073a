"""AsyncGRPOTrainer as the ranks of a torchrun launch, for tests/test_async_grpo_layouts.py.

usage: torchrun --standalone --nproc_per_node N _async_grpo_layouts_worker.py OUTPUT_DIR MODELS_DIR RUN [RUN ...]
Each RUN (layout-model, a key of _rl_layouts_worker.LAYOUTS and a model folder) trains the path a user runs: the
first rank starts the generator and reward actors (Ray, one local instance for the launch's runs), the generator
samples from the policy's gathered weights, the reward actor scores, and every rank trains on its share of each
scored micro-batch, on the same global batch as the test's one-process run. Rank r writes OUTPUT_DIR/RUN-rank<r>.json
(the steps' logs). The models "tools" and "moetools" (a Qwen3 and a Qwen3-MoE with TRL's Qwen3 template) train with
tool-calling rollouts: the
episodes run in the generator actor, each rollout's first turn steered to a tool call by its row's place in the batch
(as a model that has learned the format writes it), its later turns sampled, the tools run there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _ray_before_the_imports(output_dir: str) -> None:
    """The first rank starts the launch's local Ray instance while the other ranks wait, before any rank imports torch:
    Ray gives its node a fixed 30 s to register, and on 2 cores shared with the other test worker, four ranks'
    imports made it miss that once ("The current node timed out during startup")."""
    import time

    ready = Path(output_dir) / f".ray-started-{os.environ['TORCHELASTIC_RUN_ID']}"  # one launch's, not an earlier one's
    if os.environ["RANK"] == "0":
        import ray

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        ready.touch()
        return
    while not ready.exists():  # torchrun stops the others if the first rank fails; the test's timeout bounds a hang
        time.sleep(0.2)


if __name__ == "__main__":
    _ray_before_the_imports(sys.argv[1])

from _rl_layouts_worker import LAYOUTS, prompts  # noqa: E402
from _tool_calling_worker import double, fail, steered_episodes, tool_results  # noqa: E402

GLOBAL_BATCH = 8  # completions per step (2 prompts x 4 generations)
STEPS = 3


def even_ids(completion_ids, **kwargs):
    """The fraction of even token ids in each completion."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def near_target_length(completions, target, **kwargs):
    """1 / (1 + |characters - target|), from the dataset's `target` column."""
    return [1.0 / (1.0 + abs(len(c) - t)) for c, t in zip(completions, target)]


def train(model: str, output_dir: str, per_device: int, **extra) -> list[dict]:
    """The logs of the run's steps. max_staleness=0: each step's completions come from the weights of the step
    before, so the samples do not depend on how far generation ran ahead. A model folder whose name ends in "tools"
    trains with tool-calling rollouts (the tools double and fail, one tool-calling iteration)."""
    import hfnative
    from datasets import Dataset

    tools = Path(model).name.endswith("tools")
    settings = dict(max_completion_length=128, max_tool_calling_iterations=1) if tools else dict(max_completion_length=8)
    args = hfnative.AsyncGRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=per_device, num_generations=4,
        learning_rate=1e-2, seed=0, gradient_checkpointing=False, max_staleness=0, **settings, **extra,
    )
    if tools:
        rows = [{"prompt": [{"role": "user", "content": f"Double {i}."}]} for i in range(8)]
        trainer = hfnative.AsyncGRPOTrainer(model=model, reward_funcs=tool_results, args=args,
                                            train_dataset=Dataset.from_list(rows), tools=[double, fail])
        trainer.objective.episodes_class = steered_episodes()
    else:
        trainer = hfnative.AsyncGRPOTrainer(model=model, reward_funcs=[even_ids, near_target_length], args=args,
                                            train_dataset=Dataset.from_list(prompts()))
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def main(output_dir: str, models_dir: str, runs: list[str]) -> None:
    rank = int(os.environ["RANK"])
    for run in runs:
        layout, model = run.split("-")
        sizes, dp = LAYOUTS[layout]
        logs = train(str(Path(models_dir) / model), str(Path(output_dir) / run), GLOBAL_BATCH // dp,
                     parallelism_config=dict(sizes))
        (Path(output_dir) / f"{run}-rank{rank}.json").write_text(json.dumps(logs))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
