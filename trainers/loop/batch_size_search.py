"""``auto_find_batch_size``: transformers' search for a per-device train batch size that fits. Training runs from
the start; when it fails with an out-of-memory error (accelerate's ``should_reduce_batch_size``: CUDA, XPU, MPS or
CPU allocator messages) the batch size is reduced by accelerate's rule (``find_executable_batch_size``: 90% of the
last, rounded down) and training starts again, until one fits or none does.

As in transformers, each try starts the run afresh (state, optimizer, scheduler, data order at the new batch size;
the model made by ``model_init`` once, before the first try) and the gradient accumulation steps stay as set, so the
global batch shrinks with the per-device one; a resumed run starts from the batch size its checkpoint was trained
with, from the checkpoint resolved before the first try. An evaluation that runs out of memory is not retried at a
smaller train batch size (its error says to lower per_device_eval_batch_size). An optimizer that steps in backward
(``optimizer_in_backward``) may have stepped some parameters when a backward ran out of memory: their values from
before the try's first step are kept on the host until that step ends, and put back before the next try.
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import TrainerState

from hfnative.optim.in_backward import OptimizerInBackward

from .checkpoints import TRAINER_STATE_NAME

logger = logging.getLogger(__name__)


def batch_size_search_conflicts(trainer) -> list[str]:
    """What auto_find_batch_size cannot serve: several processes (a rank that runs out of memory alone would leave
    the others waiting in a collective) and trainers that make their own batches (prompt groups, rollouts: their
    sizes are derived from the batch size when the config is made)."""
    if not getattr(trainer.args, "auto_find_batch_size", False):
        return []
    conflicts = []
    if trainer.distributed is not None:
        conflicts.append(f"auto_find_batch_size=True in a run of {trainer.distributed.world_size} processes: a rank "
                         "that runs out of memory alone would leave the others waiting; set per_device_train_batch_size "
                         "to a size that fits")
    if not trainer.batches_are_dataset_rows:
        conflicts.append(f"auto_find_batch_size=True with {type(trainer).__name__}, whose batches are made by the "
                         "trainer itself (prompt groups, rollouts); set per_device_train_batch_size to a size that fits")
    return conflicts


def train_finding_batch_size(trainer, resume_from_checkpoint):
    """``trainer._train(resume_from_checkpoint)`` at the largest batch size that fits, from
    ``per_device_train_batch_size`` (or the checkpoint's) down; the arguments keep the size given, the state
    (``state.train_batch_size``) the size trained with."""
    from accelerate.utils import find_executable_batch_size

    args = trainer.args
    given = args.per_device_train_batch_size
    created = trainer.optimizer is None  # the trainer makes (and may remake) its optimizer and scheduler
    # resolved once: a failed try may have saved a checkpoint of its own (resume_from_checkpoint=True would find it)
    checkpoint = trainer._resolve_checkpoint(resume_from_checkpoint)
    resume = None if checkpoint is None else str(checkpoint)
    tries = []

    def attempt(batch_size: int):
        if tries:
            _reset(trainer, tries[-1], created)
            logger.warning("auto_find_batch_size: out of memory at per_device_train_batch_size=%d; training again at "
                           "%d", args.per_device_train_batch_size, batch_size)
        args.per_device_train_batch_size = batch_size
        tries.append(_KeepUntilTheFirstStep(trainer))
        trainer.callback_handler.add_callback(tries[-1])
        try:
            return trainer._train(resume)
        finally:
            trainer.callback_handler.remove_callback(tries[-1])

    try:
        return find_executable_batch_size(attempt, starting_batch_size=_starting_batch_size(trainer, checkpoint))()
    finally:
        args.per_device_train_batch_size = given
        tries.clear()


def _starting_batch_size(trainer, checkpoint) -> int:
    """The batch size a resumed run's checkpoint was trained with (transformers restores it with
    auto_find_batch_size), else per_device_train_batch_size."""
    if checkpoint is not None:
        trained = TrainerState.load_from_json(str(checkpoint / TRAINER_STATE_NAME)).train_batch_size
        if trained:
            return trained
    return trainer.args.per_device_train_batch_size


class _KeepUntilTheFirstStep(TrainerCallback):
    """With an optimizer stepping in backward: the trainable parameters' values before the try's first optimizer step
    ends, on the host (None otherwise, or once that step has ended)."""

    def __init__(self, trainer):
        self.saved = None
        if trainer.args.optimizer_in_backward:
            self.saved = {name: p.detach().to("cpu", copy=True)
                          for name, p in trainer.native_model.named_parameters() if p.requires_grad}

    def on_step_end(self, args, state, control, **kwargs):
        self.saved = None

    def restore(self, model) -> None:
        if self.saved is None:
            return
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in self.saved:
                    p.copy_(self.saved[name])
        self.saved = None


def _reset(trainer, failed: _KeepUntilTheFirstStep, created: bool) -> None:
    """Before the next try: the parameters an in-backward optimizer stepped put back, the optimizer and scheduler the
    trainer made dropped (remade at the new batch size's step count), gradients freed."""
    failed.restore(trainer.native_model)
    if created:
        if isinstance(trainer.optimizer, OptimizerInBackward):
            trainer.optimizer.remove_hooks()
        trainer.optimizer = trainer.lr_scheduler = None
    trainer._zero_gradients()


__all__ = ["batch_size_search_conflicts", "train_finding_batch_size"]
