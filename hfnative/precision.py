"""The dtype ``torch.autocast`` computes in, for the engine's kernels and buffers that autocast does not reach (custom
ops, preallocated caches, explicit chunk loops) and must follow it by hand."""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype on ``device_type`` ("cuda", "cpu", ...) when autocast is on there, else None."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
