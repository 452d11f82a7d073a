"""RewardTrainer as ranks of a torchrun launch, for tests/test_reward_trainer.py.

usage: torchrun --standalone --nproc_per_node 2 _reward_layout_worker.py OUTPUT_DIR MODEL CELL [CELL ...]
Each CELL (a key of CELLS) trains with its layout's parallelism_config; rank 0 writes OUTPUT_DIR/CELL/log.json (the
log history). The test runs the same cell on one process over the same global batches (``trainer_for`` with
``ranks=2``: both ranks' rows in one per-device batch).
"""

import json
import os
import sys
from pathlib import Path

from transformers import AutoTokenizer

import hfnative

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
PER_DEVICE = 2

LAYOUTS = {
    "ddp": dict(dp_replicate_size=2, dp_shard_size=1),
    "fsdp2": dict(dp_shard_size=2),
}
# name -> (layout, settings)
CELLS = {
    "ddp": ("ddp", dict(center_rewards_coefficient=0.1)),
    "fsdp2-accumulation-eval": ("fsdp2", dict(gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=STEPS,
                                              per_device_eval_batch_size=2)),
}


def rows(n: int) -> list[dict]:
    with open(ROOT / "examples" / "data" / "preference.jsonl") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def trainer_for(cell: str, output_dir: str, model: str, ranks: int, layout: dict | None = None):
    """The cell's trainer: ``ranks`` data-parallel ranks' worth of rows per device on one process (``layout`` None),
    or PER_DEVICE rows per device under ``layout``."""
    _, settings = CELLS[cell]
    settings = dict(settings)
    if "per_device_eval_batch_size" in settings:
        settings["per_device_eval_batch_size"] *= ranks
    common = dict(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                  max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=PER_DEVICE * ranks,
                  learning_rate=5e-3, lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.01, seed=5,
                  max_length=96, gradient_checkpointing=False)
    if layout is not None:
        common["parallelism_config"] = dict(layout)
    data = rows(48)
    eval_rows = data[40:] if "eval_strategy" in settings else None
    return hfnative.RewardTrainer(model=model, args=hfnative.RewardConfig(**common, **settings), train_dataset=data[:40],
                                  eval_dataset=eval_rows, processing_class=AutoTokenizer.from_pretrained(model))


def main(output_dir: str, model: str, cells: list[str]) -> None:
    for cell in cells:
        layout, _ = CELLS[cell]
        out = Path(output_dir) / cell
        trainer = trainer_for(cell, str(out), model, 1, LAYOUTS[layout])
        trainer.train()
        if os.environ["RANK"] == "0":
            out.mkdir(parents=True, exist_ok=True)
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
