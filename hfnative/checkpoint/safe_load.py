"""Reading a checkpoint's torch.save files without running code that may be pickled inside them.

Every file goes through ``torch.load(..., weights_only=True)``: tensors, numbers, strings and plain
containers only, plus the few classes a caller allows by name (numpy's array rebuilders for the RNG
state). A file that holds anything else is refused before any of it is executed.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable

import torch


class RefusedCheckpointFile(ValueError):
    """A checkpoint file that holds pickled code, or that is not a torch file at all."""


def _refused_object(message: str) -> str | None:
    for line in message.splitlines():
        if "GLOBAL" in line:  # "Trying to load unsupported GLOBAL posix.mkdir whose module posix is blocked."
            return line.strip()
    return None


def safe_torch_load(path, map_location=None, allowed_globals: Iterable = ()):
    """``torch.load(path, weights_only=True)`` with ``allowed_globals`` allowlisted for this call.

    Raises RefusedCheckpointFile naming ``path`` when the file holds other Python objects (they
    could run code when unpickled) or cannot be read as a torch file.
    """
    try:
        with torch.serialization.safe_globals(list(allowed_globals)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        refused = _refused_object(str(err))
        if refused is None:
            raise RefusedCheckpointFile(
                f"{path}: refused to load it: it is not a torch file of tensors and plain values (corrupted, or "
                "pickled by something else); resume from another checkpoint"
            ) from err
        raise RefusedCheckpointFile(
            f"{path}: refused to load it: it holds Python objects other than tensors and plain values, and "
            f"unpickling them could run code ({refused}). hfnative and transformers never write such objects "
            "there; use a checkpoint from a source you trust"
        ) from err
    except RuntimeError as err:
        if "PytorchStreamReader" not in str(err):
            raise
        raise RefusedCheckpointFile(
            f"{path}: not a readable torch file (truncated or corrupted); resume from another checkpoint"
        ) from err
