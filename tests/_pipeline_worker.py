"""SFT and DPO under pipeline parallel, as ranks of a torchrun launch, for tests/test_pipeline_parallel.py.

usage: torchrun --standalone --nproc_per_node N _pipeline_worker.py OUTPUT_DIR MODEL_DIR CELL [CELL ...]
Each CELL (a key of CELLS whose layout runs on N processes) trains SFTTrainer or DPOTrainer with that
parallelism_config over the same global batches as one process (``trainer_for(..., layout=None)``, which the test
runs); rank 0 writes
OUTPUT_DIR/CELL/log.json (the log history). A cell with ``resume`` set resumes from another cell's checkpoint.
"""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset

import hfnative

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
ROWS_PER_STEP = 8  # the global batch: 2 micro-batches of 4 rows
ACCUMULATION = 2
SAVED_AT = 2

# name -> (parallelism_config, data-parallel ranks, processes)
LAYOUTS = {
    "pp2-gpipe": (dict(dp_shard_size=1, pp_size=2, pp_schedule="gpipe"), 1, 2),
    "pp2-1f1b": (dict(dp_shard_size=1, pp_size=2, pp_schedule="1f1b"), 1, 2),
    "pp2xfsdp2": (dict(dp_shard_size=2, pp_size=2), 2, 4),
    "fsdp2": (dict(dp_shard_size=2), 2, 2),
    # 4 stages of one block each (GPipe: 1F1B needs at least as many micro-batches as stages)
    "pp4-gpipe": (dict(dp_shard_size=1, pp_size=4, pp_schedule="gpipe"), 1, 4),
    # PP2 x replication (each stage's parameters whole on both data-parallel ranks, gradients averaged)
    "pp2xddp": (dict(dp_replicate_size=2, dp_shard_size=1, pp_size=2), 2, 4),
    "pp2-1f1b-checkpointed": (dict(dp_shard_size=1, pp_size=2, pp_schedule="1f1b"), 1, 2),
}
# a layout's other training arguments (activation checkpointing recomputes exactly: the same numbers)
SETTINGS = {"pp2-1f1b-checkpointed": dict(gradient_checkpointing=True)}

# name -> (algorithm, layout, the cell whose checkpoint-SAVED_AT it resumes or None, whether it saves one)
CELLS = {
    "pp2-gpipe": ("sft", "pp2-gpipe", None, True),
    "pp2-1f1b": ("sft", "pp2-1f1b", None, False),
    "fsdp2-from-pp2-gpipe": ("sft", "fsdp2", "pp2-gpipe", False),
    "dpo-pp2-1f1b": ("dpo", "pp2-1f1b", None, False),
    "pp2xfsdp2": ("sft", "pp2xfsdp2", None, True),
    "dpo-pp2xfsdp2": ("dpo", "pp2xfsdp2", None, False),
    "pp4-gpipe": ("sft", "pp4-gpipe", None, False),
    "pp2xddp": ("sft", "pp2xddp", None, False),
    "pp2-1f1b-checkpointed": ("sft", "pp2-1f1b-checkpointed", None, False),
    # no training: each on-policy trainer built under PP2 x FSDP2, its refusal recorded (refusals.json)
    "on-policy-refusals": ("on-policy", "pp2xfsdp2", None, False),
}
ON_POLICY = ("GRPOTrainer", "RLOOTrainer", "AsyncGRPOTrainer", "GKDTrainer", "DistillationTrainer")


def on_policy_refusals(output_dir: str, model_dir: str) -> dict[str, str]:
    """Each on-policy trainer of ON_POLICY built as a user builds it under PP2 x FSDP2: its error, by name (the
    message of a clean refusal, or the exception's type and text)."""
    prompts = Dataset.from_list([{"prompt": f"Say {i}", "messages": [{"role": "user", "content": f"Say {i}"},
                                                                      {"role": "assistant", "content": "ok"}]}
                                 for i in range(8)])
    common = dict(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=1,
                  save_strategy="no", per_device_train_batch_size=2, parallelism_config=dict(LAYOUTS["pp2xfsdp2"][0]))
    rl = dict(num_generations=2, max_completion_length=4)

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    builders = {
        "GRPOTrainer": lambda: hfnative.GRPOTrainer(model_dir, reward, hfnative.GRPOConfig(**common, **rl),
                                                    train_dataset=prompts),
        "RLOOTrainer": lambda: hfnative.RLOOTrainer(model_dir, reward, hfnative.RLOOConfig(**common, **rl),
                                                    train_dataset=prompts),
        "AsyncGRPOTrainer": lambda: hfnative.AsyncGRPOTrainer(model_dir, reward, hfnative.AsyncGRPOConfig(**common, **rl),
                                                              train_dataset=prompts),
        "GKDTrainer": lambda: hfnative.GKDTrainer(model_dir, model_dir, hfnative.GKDConfig(**common, max_new_tokens=4),
                                                  train_dataset=prompts),
        "DistillationTrainer": lambda: hfnative.DistillationTrainer(
            model_dir, model_dir, hfnative.DistillationConfig(**common, max_completion_length=4), train_dataset=prompts),
    }
    errors = {}
    for name in ON_POLICY:
        try:
            builders[name]()
            errors[name] = "built"
        except Exception as error:  # recorded for the test to read, whatever it is
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


def rows(name: str, n: int) -> list[dict]:
    with open(ROOT / "examples" / "data" / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def trainer_for(output_dir: str, model_dir: str, layout: str | None = None, save: bool = True, algorithm: str = "sft"):
    """SFTTrainer (or DPOTrainer, its reference a frozen copy of the checkpoint) over ROWS_PER_STEP rows (pairs) a
    step, on one process (``layout`` None) or in ``layout``; with ``save`` a checkpoint at step SAVED_AT."""
    dp_ranks = 1 if layout is None else LAYOUTS[layout][1]
    common = dict(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="steps" if save else "no", save_steps=SAVED_AT,
        per_device_train_batch_size=ROWS_PER_STEP // ACCUMULATION // dp_ranks,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=0,
        weight_decay=0.01, max_grad_norm=0.5, max_length=40, seed=7,
        parallelism_config=None if layout is None else dict(LAYOUTS[layout][0]),
        **SETTINGS.get(layout, {}),
    )
    if algorithm == "dpo":
        args = hfnative.DPOConfig(**common, beta=0.1)
        return hfnative.DPOTrainer(model=model_dir, args=args, train_dataset=Dataset.from_list(rows("preference.jsonl", 32)))
    return hfnative.SFTTrainer(model=model_dir, args=hfnative.SFTConfig(**common),
                               train_dataset=Dataset.from_list(rows("sft_messages.jsonl", 32)))


def main(output_dir: str, model_dir: str, cells: list[str]) -> None:
    rank = int(os.environ["RANK"])
    for cell in cells:
        algorithm, layout, resume, save = CELLS[cell]
        out = Path(output_dir) / cell
        if algorithm == "on-policy":
            errors = on_policy_refusals(str(out), model_dir)
            if rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                (out / "refusals.json").write_text(json.dumps(errors))
            continue
        trainer = trainer_for(str(out), model_dir, layout, save, algorithm)
        checkpoint = None if resume is None else str(Path(output_dir) / resume / f"checkpoint-{SAVED_AT}")
        if trainer.args.gradient_checkpointing:  # this stage's blocks recompute
            assert trainer.native_model.checkpointed_layers, trainer.native_model.checkpointed_layers
        trainer.train(resume_from_checkpoint=checkpoint)
        if rank == 0:
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
