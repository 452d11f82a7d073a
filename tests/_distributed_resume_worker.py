"""A distributed SFT run that loses a rank mid-run, and its resumption under another layout.

usage: torchrun ... _distributed_resume_worker.py OUTPUT_DIR LAYOUT MODE
  LAYOUT  fsdp2 (2 processes) | fsdp2xtp2 (4 processes): both read 2 data shards of PER_DEVICE rows
  MODE    kill    train, saving every 2 steps; rank 1 SIGKILLs itself in step 5 (the launcher ends the job)
          resume  resume_from_checkpoint=True; rank 0 writes OUTPUT_DIR/resumed-LAYOUT.json (the log history)
          oib     train with optimizer_in_backward, saving every 2 steps; rank 0 writes OUTPUT_DIR/oib-LAYOUT.json
          sf      the same with the schedule-free AdamW (its optimizer-in-backward form); OUTPUT_DIR/sf-LAYOUT.json
          int8    LoRA on an 8-bit base (load_in_8bit), saving every 2 steps; OUTPUT_DIR/int8-LAYOUT.json
          int8-resume  the same resumed from OUTPUT_DIR/checkpoint-4; OUTPUT_DIR/int8-resume-LAYOUT.json
"""

import json
import os
import signal
import sys
from pathlib import Path

from accelerate.parallelism_config import ParallelismConfig
from datasets import Dataset
from transformers import TrainerCallback

from _distributed_train_worker import MODEL, config, rows
from hfnative import SFTTrainer

STEPS, PER_DEVICE, SHARDS = 6, 2, 2
LAYOUTS = {"fsdp2": dict(dp_shard_size=2), "fsdp2xtp2": dict(dp_shard_size=2, tp_size=2)}


class KillRankOneInStepFive(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 4 and int(os.environ["RANK"]) == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def run_config(output_dir: str, per_device: int, **extra):
    return config(output_dir, per_device, max_steps=STEPS, save_strategy="steps", save_steps=2, **extra)


OPTIMIZER_IN_BACKWARD = dict(optimizer_in_backward=True, max_grad_norm=0.0)
SCHEDULE_FREE = dict(OPTIMIZER_IN_BACKWARD, optim="schedule_free_adamw", lr_scheduler_type="constant")
MODES = {"oib": OPTIMIZER_IN_BACKWARD, "sf": SCHEDULE_FREE}
QUANTIZED = dict(model_init_kwargs=dict(load_in_8bit=True))
QUANTIZED_MODES = {"int8": QUANTIZED, "int8-resume": QUANTIZED}
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def main(output_dir: str, layout: str, mode: str) -> None:
    extra = {**MODES, **QUANTIZED_MODES}.get(mode, {})
    args = run_config(output_dir, PER_DEVICE, parallelism_config=ParallelismConfig(**LAYOUTS[layout]), **extra)
    callbacks = [KillRankOneInStepFive()] if mode == "kill" else []
    adapters = dict(peft_config=LORA) if mode in QUANTIZED_MODES else {}
    trainer = SFTTrainer(model=MODEL, args=args, train_dataset=Dataset.from_list(rows()), callbacks=callbacks,
                         **adapters)
    resume = str(Path(output_dir, "checkpoint-4")) if mode == "int8-resume" else mode == "resume"
    trainer.train(resume_from_checkpoint=resume)
    if mode in ("resume", *MODES, *QUANTIZED_MODES) and int(os.environ["RANK"]) == 0:
        name = "resumed" if mode == "resume" else mode
        Path(output_dir, f"{name}-{layout}.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(*sys.argv[1:])
