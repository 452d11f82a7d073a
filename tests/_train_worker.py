"""A short SFT run in its own process, for the kill-and-resume tests.

usage: python _train_worker.py OUTPUT_DIR MODE
  MODE = full        train 6 steps, saving every 2
         kill-after  SIGKILL itself right after checkpoint-4 is saved
         kill-during SIGKILL itself in the middle of writing checkpoint-4
         resume      resume_from_checkpoint=True
Writes OUTPUT_DIR/losses-MODE.json: {step: loss} of the steps this process trained.
"""

import json
import os
import signal
import sys
from pathlib import Path

from datasets import Dataset
from transformers import TrainerCallback

from hfnative import SFTConfig, SFTTrainer

ROOT = Path(__file__).resolve().parents[1]


class KillAfterSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 4:
            os.kill(os.getpid(), signal.SIGKILL)


def main(output_dir: str, mode: str) -> None:
    rows = [json.loads(line) for line in open(ROOT / "examples/data/sft_messages.jsonl")][:40]
    args = SFTConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        max_steps=6,
        save_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        num_train_epochs=1,
    )
    trainer = SFTTrainer(model=str(ROOT / "examples/tiny-qwen3"), args=args, train_dataset=Dataset.from_list(rows))
    if mode == "kill-after":
        trainer.add_callback(KillAfterSave())
    if mode == "kill-during":
        import torch

        real_save = torch.save

        def dying_save(obj, path, *a, **k):
            if "checkpoint-4" in str(path) and str(path).endswith("scheduler.pt"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, path, *a, **k)

        torch.save = dying_save
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    Path(output_dir, f"losses-{mode}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
