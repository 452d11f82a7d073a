"""TRL's SFTTrainer and hfnative's under one torchrun launch (2 processes), with average_tokens_across_devices as
given, for tests/test_average_tokens.py.

usage: torchrun --standalone --nproc_per_node 2 _average_tokens_worker.py OUTPUT_DIR RUNNER
  RUNNER   trl | hfnative; trains twice, average_tokens_across_devices False then True
Rank 0 writes OUTPUT_DIR/RUNNER-false.json and RUNNER-true.json: the per-step logs.
"""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset

from _distributed_train_worker import MODEL, rows

STEPS = 4


def main(output_dir: str, runner: str) -> None:
    if runner == "trl":
        import trl as module
    else:
        import hfnative as module
    for average in ("false", "true"):
        train(module, output_dir, runner, average)


def train(module, output_dir: str, runner: str, average: str) -> None:
    args = module.SFTConfig(
        output_dir=str(Path(output_dir) / runner / average), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="constant", max_length=64, seed=11,
        average_tokens_across_devices=average == "true")
    trainer = module.SFTTrainer(model=MODEL, args=args, train_dataset=Dataset.from_list(rows(64)))
    trainer.train()
    if int(os.environ["RANK"]) == 0:
        steps = [e for e in trainer.state.log_history if "loss" in e]
        Path(output_dir, f"{runner}-{average}.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main(*sys.argv[1:])
