"""GRPOTrainer and RLOOTrainer as the ranks of a torchrun launch, for tests/test_rl_layouts.py.

usage: torchrun --standalone --nproc_per_node N _rl_layouts_worker.py OUTPUT_DIR MODELS_DIR RUN [RUN ...]
Each RUN (algorithm-layout-model; model "lora": the dense model with new LoRA adapters, "moelora": the MoE model with
LoRA on its attention and stacked experts) trains with the real path a user runs: sampled completions from the
native engine on a replica of the parallelized policy, the reward functions, the reference model (beta > 0) and
the loop, on the same global batch as test_rl_layouts.py's one-process run. Rank r writes OUTPUT_DIR/RUN-rank<r>.json
(the log history).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_grpo import even_fraction, near_target_length  # noqa: E402

GLOBAL_BATCH = 8  # completions per step (2 prompts x 4 generations)
STEPS = 3

# layout -> (parallelism_config, data-parallel ranks)
LAYOUTS = {
    "ddp": (dict(dp_replicate_size=2), 2),
    "fsdp2": (dict(dp_shard_size=2), 2),
    "tp2": (dict(tp_size=2), 1),
    "cp2": (dict(cp_size=2), 1),
    "ep2": (dict(dp_shard_size=2, ep_size=2), 2),
    "fsdp2xtp2": (dict(dp_shard_size=2, tp_size=2), 2),
}


def prompts(n: int = 16) -> list[dict]:
    words = ["sky", "fox", "robot", "count", "blue", "grass", "tree", "sun"]
    return [{"prompt": f"Tell me about the {words[i % len(words)]} number {i}", "target": 5 + 3 * i} for i in range(n)]


def config(algorithm: str, output_dir: str, per_device: int, **extra):
    import hfnative

    config_class = hfnative.GRPOConfig if algorithm == "grpo" else hfnative.RLOOConfig
    settings = dict(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=per_device, num_generations=4,
        max_completion_length=8, learning_rate=1e-2, seed=0, gradient_checkpointing=False, beta=0.04,
        reward_weights=[1.0, 0.5],
    )
    if algorithm == "grpo":
        # the entropy quantile is the whole batch's (every data-parallel rank's tokens, as TRL gathers them); 0.37
        # keeps the quantile's position off the sorted values' indices, so round-off cannot move a token across it
        settings["top_entropy_quantile"] = 0.37
    settings.update(extra)
    return config_class(**settings)


def train(algorithm: str, model: str, output_dir: str, per_device: int, **extra) -> list[dict]:
    """The run's log history (one entry per step, the summary dropped)."""
    import hfnative
    from datasets import Dataset

    trainer_class = hfnative.GRPOTrainer if algorithm == "grpo" else hfnative.RLOOTrainer
    peft_config = None
    if Path(model).name == "lora":  # the dense policy with new LoRA adapters (the reference: its base, adapters off)
        from peft import LoraConfig

        model, peft_config = str(Path(model).parent / "dense"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    elif Path(model).name == "moelora":  # the MoE policy with LoRA on its stacked experts too (peft's target_parameters)
        from peft import LoraConfig

        model, peft_config = str(Path(model).parent / "moe"), LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = trainer_class(model=model, reward_funcs=[even_fraction, near_target_length],
                            args=config(algorithm, output_dir, per_device, **extra),
                            train_dataset=Dataset.from_list(prompts()), peft_config=peft_config)
    trainer.train()
    return trainer.state.log_history[:-1]


def main(output_dir: str, models_dir: str, runs: list[str]) -> None:
    rank = int(os.environ["RANK"])
    for run in runs:
        algorithm, layout, model = run.split("-")
        sizes, dp = LAYOUTS[layout]
        logs = train(algorithm, str(Path(models_dir) / model), str(Path(output_dir) / run), GLOBAL_BATCH // dp,
                     parallelism_config=dict(sizes))
        (Path(output_dir) / f"{run}-rank{rank}.json").write_text(json.dumps(logs))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
