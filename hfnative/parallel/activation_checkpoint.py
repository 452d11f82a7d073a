"""Activation checkpointing: which decoder blocks recompute their activations in backward, and what they keep.

The decoder checkpoints the blocks listed in ``model.checkpointed_layers``
(``hfnative.models.block_checkpoint``: torch's non-reentrant checkpoint with less host work): their inputs are kept,
and ``model.checkpoint_keeps`` says what else (``hfnative.models.selective_checkpoint``): None for the device
policy's choice, "nothing" (everything inside recomputed in backward), "attention" or "attention_and_projections".
"""

from __future__ import annotations

from torch import nn

from hfnative.models.selective_checkpoint import CHECKPOINT_KEEPS

AC_MODES = ("full", "selective")


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", keep: str | None = None) -> nn.Module:
    """mode "full": every block recomputed; "selective": every other block (0, 2, 4, ...), about half
    the activation memory saved for a third less recomputation. keep: what a checkpointed block keeps besides its
    input (``CHECKPOINT_KEEPS``; None: the device policy's choice). In place; returns the model."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing_mode={mode!r}; use 'full' or 'selective'")
    if keep is not None and keep not in CHECKPOINT_KEEPS:
        raise ValueError(f"a checkpointed block keeps one of {list(CHECKPOINT_KEEPS)} or None, not {keep!r}")
    every = 1 if mode == "full" else 2
    model.checkpointed_layers = frozenset(range(0, len(model.layers), every))
    model.checkpoint_keeps = keep
    return model
