"""``enable_jit_checkpoint``: a SIGTERM (a scheduler preempting the job) ends the run with a checkpoint.

While ``train()`` runs with the field set, SIGTERM only raises a flag. At the end of each optimizer step every
rank puts its flag in one all-reduce (MAX over all ranks), so the ranks agree on the step: the run finishes the
step the signal arrived in, writes the normal ``checkpoint-N`` (``training_state/`` in a distributed run), records
``{"stopped_by": "SIGTERM"}`` as the last entry of ``trainer_state.json``'s log history, and ``train()`` raises
``SystemExit(0)``. A SIGTERM during a save (this one or a ``save_steps`` one) is logged and changes nothing
until the save is complete. ``train(resume_from_checkpoint=True)`` picks the checkpoint up.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

STOPPED_BY = "stopped_by"  # the log-history key that says why a run stopped before its last step
SIGTERM_REASON = "SIGTERM"


class Preemption:
    """The SIGTERM flag of one ``train()`` call; ``install`` in the main thread, ``uninstall`` when it ends.

    distributed: whether the flag is agreed over every rank of the default process group (on ``device``)."""

    def __init__(self, distributed: bool, device: torch.device):
        self.distributed, self.device = distributed, device
        self.requested = False
        self._saving = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "enable_jit_checkpoint=True needs train() to run in the main thread (only it can receive SIGTERM "
                "in Python); call train() from the main thread, or set enable_jit_checkpoint=False"
            )
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        if self._saving:
            logger.warning("SIGTERM during a checkpoint save: the save goes on to the end")
        elif not self.requested:
            logger.warning("SIGTERM: the run stops with a checkpoint at the end of this optimizer step")
        self.requested = True

    def agreed(self) -> bool:
        """Whether any rank got SIGTERM (a collective: every rank calls it once per optimizer step)."""
        if not self.distributed:
            return self.requested
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @contextmanager
    def saving(self):
        """A block a SIGTERM does not interrupt (the handler only takes note of it)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False


__all__ = ["Preemption", "SIGTERM_REASON", "STOPPED_BY"]
