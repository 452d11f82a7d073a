"""GRPOTrainer as one rank of a torchrun launch under FSDP2, for tests/test_grpo_distributed.py.

usage: torchrun --standalone --nproc_per_node 2 _grpo_distributed_worker.py OUTPUT_DIR CASE [CASE ...]
Each CASE (a key of CASES) trains tiny-qwen3 (GRPOTrainer or RLOOTrainer) with parallelism_config
dp_shard_size=2 on completions fixed per prompt (test_grpo.fixed_completion, in place of sampling) and writes,
from rank 0, OUTPUT_DIR/CASE.json (the log history); then each rank writes OUTPUT_DIR/extremes-rankR.json (the
clip extremes combined over the ranks from known values). ``run`` also trains the single-process reference
over the same global batches.
"""

import json
import os
import sys
from pathlib import Path

import torch

from test_grpo import MODEL, _prompts, even_fraction, fixed_completion, near_target_length

RANKS = 2
PER_DEVICE = 4  # completions per rank and micro-batch: one group of G=4
STEPS = 3

# name -> (trainer, its config's settings)
CASES = {
    # num_iterations 2: every other step trains on the last generation again, the ratio clipped (small epsilon)
    "batch-std": ("GRPO", dict(scale_rewards="batch", loss_type="grpo", gradient_accumulation_steps=2,
                               num_iterations=2, epsilon=0.01)),
    "group-std-kl": ("GRPO", dict(scale_rewards="group", loss_type="dapo", beta=0.04, gradient_accumulation_steps=2)),
    # RLOO: the KL penalty in the reward (gathered with the rewards), the advantages standardized over the batch
    "rloo-normalized-kl": ("RLOO", dict(beta=0.05, normalize_advantages=True, gradient_accumulation_steps=2)),
    # the prompts as a stream (an IterableDataset, shuffled in a buffer): each rank its slice of every batch
    "stream": ("GRPO", dict(scale_rewards="group", loss_type="dapo", gradient_accumulation_steps=2, stream=True)),
}


def config(output_dir: str, per_device: int, algorithm: str = "GRPO", **extra):
    import hfnative

    settings = dict(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=per_device, num_generations=4,
        max_completion_length=8, learning_rate=1e-2, seed=0, gradient_checkpointing=False, reward_weights=[1.0, 0.5],
    )
    settings.update(extra)
    return getattr(hfnative, f"{algorithm}Config")(**settings)


def run(output_dir: str, case: str, per_device: int, order=None, with_objective=False, **extra):
    """Train ``case`` and return the log history (its last entry, the run summary, left off; with_objective:
    and the trainer's objective). ``order(n)``: the generation batch's order before it is cut into micro-batches
    (default: as generated)."""
    import hfnative
    from datasets import Dataset
    from hfnative.generation import Rollouts

    algorithm, settings = CASES[case]
    settings = dict(settings)
    prompts = Dataset.from_list(_prompts(16))
    if settings.pop("stream", False):
        prompts = prompts.to_iterable_dataset()
    args = config(output_dir, per_device, algorithm, **settings, **extra)
    trainer_class = getattr(hfnative, f"{algorithm}Trainer")
    trainer = trainer_class(model=MODEL, reward_funcs=[even_fraction, near_target_length], args=args,
                            train_dataset=prompts)
    objective = trainer.objective
    max_length = args.max_completion_length

    def generate(prompts, sampling):
        completions = [fixed_completion(list(p), i, max_length) for i, p in enumerate(prompts)]
        return Rollouts(completions, [[0.0] * len(c) for c in completions], ["stop"] * len(completions))

    objective.engine.generate = generate
    objective.shuffled_order = order or torch.arange
    objective.old_logprobs_source = "forward"
    trainer.train()
    logs = trainer.state.log_history[:-1]
    return (logs, objective) if with_objective else logs


def main(output_dir: str, cases: list[str]) -> None:
    assert int(os.environ["WORLD_SIZE"]) == RANKS
    from accelerate.parallelism_config import ParallelismConfig

    rank = int(os.environ["RANK"])
    for case in cases:
        logs, objective = run(str(Path(output_dir) / case), case, PER_DEVICE, with_objective=True,
                              parallelism_config=ParallelismConfig(dp_shard_size=RANKS))
        if rank == 0:
            (Path(output_dir) / f"{case}.json").write_text(json.dumps(logs))
    # the clip extremes of each rank's micro-batch, combined: rank r has low_min r + 1 (rank 0: none, NaN) and
    # high_max 0.25 r; a metric no rank has stays NaN
    nan = float("nan")
    metrics = {"clip_ratio/low_min": torch.tensor(nan if rank == 0 else rank + 1.0),
               "clip_ratio/high_max": torch.tensor(0.25 * rank), "entropy": torch.tensor(float(rank))}
    combined = objective._extremes_over_ranks(metrics)
    none = objective._extremes_over_ranks({"clip_ratio/high_max": torch.tensor(nan)})
    sampling = objective._extremes_over_ranks(
        {"ratio/min": torch.tensor(1.0 - rank), "ratio/max": torch.tensor(rank + 3.0)}, {"ratio/min": -1.0, "ratio/max": 1.0}
    )
    values = {name: float(value) for name, value in {**combined, **sampling}.items()}
    values["none"] = float(none["clip_ratio/high_max"])
    (Path(output_dir) / f"extremes-rank{rank}.json").write_text(json.dumps(values))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
