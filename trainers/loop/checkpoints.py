"""The ``output_dir/checkpoint-N`` layout transformers' Trainer writes and reads back.

checkpoint-N/: model (Hub format) + tokenizer + training_args.bin, optimizer.pt, scheduler.pt,
rng_state.pth, trainer_state.json. A distributed run writes training_state/ (model, optimizer,
scheduler, per-rank RNG; safetensors + JSON) instead of the three .pt/.pth files. Each folder is
written aside and renamed when complete.
"""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path

import torch

PREFIX_CHECKPOINT_DIR = "checkpoint"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
LOSS_SCALE_NAME = "loss_scale.json"  # fp16 loss scaling's scale (hfnative.optim.loss_scale)
RNG_STATE_NAME = "rng_state.pth"
TRAINING_ARGS_NAME = "training_args.bin"
TRAINING_STATE_DIR = "training_state"  # a distributed run's model + optimizer + scheduler + RNG (DCP, no pickle)


def checkpoint_step(path: Path) -> int | None:
    match = _CHECKPOINT_RE.match(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


def sorted_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders, oldest step first (folders being written are hidden)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in output_dir.iterdir()]
    return [p for step, p in sorted((s, p) for s, p in found if s is not None)]


def get_last_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = sorted_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_checkpoint(resume_from_checkpoint, output_dir: str | Path) -> Path | None:
    """``resume_from_checkpoint`` as the checkpoint folder to resume from: None / False -> None; True (or
    "true" from a command line, when no folder has that name) -> output_dir's latest checkpoint; a path
    -> that folder. Raises ValueError saying what to do when there is none."""
    text = str(resume_from_checkpoint)
    if isinstance(resume_from_checkpoint, str) and text.lower() in ("true", "false") and not Path(text).exists():
        resume_from_checkpoint = text.lower() == "true"
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        found = get_last_checkpoint(output_dir)
        if found is None:
            raise ValueError(
                f"resume_from_checkpoint=True but output_dir {str(output_dir)!r} has no {PREFIX_CHECKPOINT_DIR}-N "
                "folder to resume from; drop resume_from_checkpoint to start a new run, or pass a checkpoint folder"
            )
        return found
    path = Path(text)
    if not (path / TRAINER_STATE_NAME).exists():
        raise ValueError(
            f"resume_from_checkpoint={text!r} is not a checkpoint folder (no {TRAINER_STATE_NAME} in it); "
            f"pass a {PREFIX_CHECKPOINT_DIR}-N folder, or True for output_dir's latest"
        )
    return path


def rotate_checkpoints(output_dir: str | Path, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """Delete the oldest checkpoints beyond ``save_total_limit``; the newest and the best are kept."""
    if not save_total_limit or save_total_limit <= 0:
        return
    checkpoints = sorted_checkpoints(output_dir)
    protected = {checkpoints[-1].resolve()} if checkpoints else set()
    if best_model_checkpoint:
        protected.add(Path(best_model_checkpoint).resolve())
    keep = max(save_total_limit, len(protected))
    for path in list(checkpoints):
        if len(checkpoints) <= keep:
            break
        if path.resolve() in protected:
            continue
        shutil.rmtree(path)
        checkpoints.remove(path)


def save_training_args(args, path: Path) -> None:
    """training_args.bin as transformers writes it — but never with the Hub token inside."""
    args = copy.copy(args)
    args.hub_token = None
    torch.save(args, path)
