"""Distributed runs that are preempted or lose a rank, for tests/test_preemption.py.

usage: torchrun --nproc_per_node 2 _preemption_worker.py OUTPUT_DIR MODE          (MODE: full-then-sigterm, resume)
       RANK=r WORLD_SIZE=2 MASTER_ADDR=... python _preemption_worker.py OUTPUT_DIR MODE   (MODE: kill, hang)
  full-then-sigterm  OUTPUT_DIR/full: an uninterrupted FSDP2 run (rank 0 writes losses.json); then OUTPUT_DIR/run,
                     with enable_jit_checkpoint=True, where rank 1 (only) sends itself SIGTERM in step 3: each rank
                     writes stopped-rank<r>.json (its global_step and exit code) and exits as train() makes it
  resume             OUTPUT_DIR/run resumed (resume_from_checkpoint=True); rank 0 writes OUTPUT_DIR/run/resumed.json
  kill / hang        saving every 2 steps with ddp_timeout=TIMEOUT[MODE]; rank 1 writes OUTPUT_DIR/lost-at.json (the
                     time) and SIGKILLs itself (kill) or sleeps (hang) in step 3; rank 0 writes OUTPUT_DIR/error.json
                     (its error and the time) before raising it
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from accelerate.parallelism_config import ParallelismConfig
from datasets import Dataset
from transformers import TrainerCallback

from _distributed_train_worker import MODEL, config, rows
from hfnative import SFTTrainer

STEPS, PER_DEVICE, SIGNALLED_STEP = 5, 2, 3
TIMEOUT = {"kill": 20, "hang": 15}  # ddp_timeout, seconds


class OnRankOneInStep(TrainerCallback):
    """Calls ``action`` on rank 1 only, as step ``step`` begins."""

    def __init__(self, step: int, action):
        self.step, self.action = step, action

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1 and int(os.environ["RANK"]) == 1:
            self.action()


def trainer(output_dir: Path, callbacks=(), **extra) -> SFTTrainer:
    args = config(str(output_dir), PER_DEVICE, max_steps=STEPS, parallelism_config=ParallelismConfig(dp_shard_size=2),
                  **extra)
    return SFTTrainer(model=MODEL, args=args, train_dataset=Dataset.from_list(rows()), callbacks=list(callbacks))


def losses(trainer: SFTTrainer) -> dict:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def full_then_sigterm(output_dir: Path, rank: int) -> None:
    full = trainer(output_dir / "full")
    full.train()
    if rank == 0:
        (output_dir / "full" / "losses.json").write_text(json.dumps(losses(full)))
    run = trainer(output_dir / "run", [OnRankOneInStep(SIGNALLED_STEP, lambda: os.kill(os.getpid(), signal.SIGTERM))],
                  enable_jit_checkpoint=True)
    try:
        run.train()
    except SystemExit as stop:
        (output_dir / f"stopped-rank{rank}.json").write_text(json.dumps({"step": run.state.global_step,
                                                                          "code": stop.code}))
        raise


def resume(output_dir: Path, rank: int) -> None:
    run = trainer(output_dir / "run", enable_jit_checkpoint=True)
    run.train(resume_from_checkpoint=True)
    if rank == 0:
        (output_dir / "run" / "resumed.json").write_text(json.dumps(losses(run)))


def lose_rank_one(output_dir: Path, rank: int, mode: str) -> None:
    def lost():
        (output_dir / "lost-at.json").write_text(json.dumps(time.time()))
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # hung: the test ends this process

    run = trainer(output_dir / "run", [OnRankOneInStep(SIGNALLED_STEP, lost)], save_strategy="steps", save_steps=2,
                  ddp_timeout=TIMEOUT[mode])
    try:
        run.train()
    except Exception as error:
        if rank == 0:
            (output_dir / "error.json").write_text(json.dumps({"type": type(error).__name__, "message": str(error),
                                                               "at": time.time()}))
        raise


def main(output_dir: str, mode: str) -> None:
    rank, output_dir = int(os.environ["RANK"]), Path(output_dir)
    if mode == "full-then-sigterm":
        full_then_sigterm(output_dir, rank)
    elif mode == "resume":
        resume(output_dir, rank)
    else:
        lose_rank_one(output_dir, rank, mode)


if __name__ == "__main__":
    main(*sys.argv[1:])
