"""A warning logged once per process, by rank 0 of a distributed run: settings the engine chose for the user."""

from __future__ import annotations

import logging

import torch.distributed as dist

_said: set[str] = set()


def warn_once(logger: logging.Logger, message: str) -> None:
    if message in _said:
        return
    _said.add(message)
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(message)
