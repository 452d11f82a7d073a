"""GRPOTrainer's rollouts on one rank of a 2-process torchrun launch, for tests/test_grpo_generation_distributed.py.

usage: torchrun --standalone --nproc_per_node 2 _grpo_generation_worker.py OUTPUT_DIR
Under FSDP2 and under DDP (dp_replicate) each rank greedily completes its own prompts through the trainer's rollout
component (which decodes a replica of the sharded policy) before and after 2 steps of real GRPO training (sampled
completions, the reward functions, the loop). Rank r writes
OUTPUT_DIR/<layout>-rank<r>.json (the greedy completions with their log-probs, and the log history); rank 0 also
OUTPUT_DIR/<layout>-state.pt, the trained weights gathered whole.
"""

import json
import os
import sys
from pathlib import Path

import torch

from test_grpo import MODEL, _prompts, even_fraction, near_target_length


def trained_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for name, t in model.state_dict().items()}


def run(output_dir: Path, layout: str, rank: int) -> None:
    import hfnative
    from accelerate.parallelism_config import ParallelismConfig
    from datasets import Dataset
    from hfnative.generation import SamplingParams

    config = {"fsdp2": ParallelismConfig(dp_shard_size=2), "ddp": ParallelismConfig(dp_replicate_size=2)}[layout]
    args = hfnative.GRPOConfig(
        output_dir=str(output_dir / layout), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        learning_rate=1e-2, seed=0, gradient_checkpointing=False, parallelism_config=config,
    )
    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=[even_fraction, near_target_length], args=args,
                                   train_dataset=Dataset.from_list(_prompts(16)))
    rollout = trainer.objective.rollout
    prompts = rollout.tokenize([row["prompt"] for row in _prompts(4)[2 * rank : 2 * rank + 2]])
    greedy = SamplingParams(max_new_tokens=8, do_sample=False, eos_token_id=rollout.stop_ids)
    before = rollout.engine_for().generate(prompts, greedy)
    trainer.train()
    after = rollout.engine_for().generate(prompts, greedy)
    state = trained_state(trainer.model)
    if rank == 0:
        torch.save(state, output_dir / f"{layout}-state.pt")
    result = {"prompts": prompts, "before": before.completion_ids, "before_logprobs": before.logprobs,
              "after": after.completion_ids, "after_logprobs": after.logprobs, "logs": trainer.state.log_history[:-1]}
    (output_dir / f"{layout}-rank{rank}.json").write_text(json.dumps(result))


def main(output_dir: str) -> None:
    rank = int(os.environ["RANK"])
    for layout in ("fsdp2", "ddp"):
        run(Path(output_dir), layout, rank)


if __name__ == "__main__":
    main(sys.argv[1])
