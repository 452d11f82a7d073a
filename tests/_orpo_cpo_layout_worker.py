"""ORPO and CPO as ranks of a torchrun launch, for tests/test_orpo_cpo.py.

usage: torchrun --standalone --nproc_per_node 2 _orpo_cpo_layout_worker.py OUTPUT_DIR POLICY CELL [CELL ...]
Each CELL (a key of CELLS) trains (and evaluates) with its layout's parallelism_config, 2 pairs per rank; rank 0 writes
OUTPUT_DIR/CELL/log.json (the log history). The test runs each cell on one process with 2 accumulated micro-batches
of 2 pairs (``trainer_for`` with ``layout=None``): the micro-batches the ranks held.
"""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset

import hfnative

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
LAYOUTS = {"ddp": dict(dp_replicate_size=2, dp_shard_size=1), "fsdp2": dict(dp_shard_size=2)}
# name -> (algorithm, layout, settings)
CELLS = {
    "orpo-ddp": ("orpo", "ddp", dict(beta=0.2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)),
    "orpo-fsdp2": ("orpo", "fsdp2", dict(beta=0.2)),
    "cpo-fsdp2": ("cpo", "fsdp2", dict(loss_type="simpo", beta=2.0, cpo_alpha=0.5)),
}


def rows(n: int) -> list[dict]:
    with open(ROOT / "examples" / "data" / "preference.jsonl") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def trainer_for(cell: str, output_dir: str, policy: str, layout: str | None = "cell"):
    """The cell's trainer under its layout, or (``layout=None``) one process accumulating the ranks' micro-batches."""
    algorithm, layout_name, settings = CELLS[cell]
    common = dict(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                  max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=2,
                  learning_rate=2e-3, lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.01, max_length=64,
                  gradient_checkpointing=False, seed=3)
    if layout is None:
        common["gradient_accumulation_steps"] = 2
    else:
        common["parallelism_config"] = dict(LAYOUTS[layout_name])
    config, trainer = ((hfnative.ORPOConfig, hfnative.ORPOTrainer) if algorithm == "orpo"
                       else (hfnative.CPOConfig, hfnative.CPOTrainer))
    data = rows(24)
    evaluating = settings.get("eval_strategy", "no") != "no"
    return trainer(model=policy, args=config(**common, **settings), train_dataset=Dataset.from_list(data[:16]),
                   eval_dataset=Dataset.from_list(data[16:]) if evaluating else None)


def main(output_dir: str, policy: str, cells: list[str]) -> None:
    rank = int(os.environ["RANK"])
    for cell in cells:
        out = Path(output_dir) / cell
        trainer = trainer_for(cell, str(out), policy)
        trainer.train()
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
