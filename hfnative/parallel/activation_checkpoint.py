"""Activation checkpointing: which decoder blocks recompute their activations in backward.

The decoder checkpoints the blocks listed in ``model.checkpointed_layers`` (non-reentrant
``torch.utils.checkpoint``): their inputs are kept, everything inside is recomputed in backward.
"""

from __future__ import annotations

from torch import nn

AC_MODES = ("full", "selective")


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> nn.Module:
    """mode "full": every block recomputed; "selective": every other block (0, 2, 4, ...), about half
    the activation memory saved for a third less recomputation. In place; returns the model."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing_mode={mode!r}; use 'full' or 'selective'")
    every = 1 if mode == "full" else 2
    model.checkpointed_layers = frozenset(range(0, len(model.layers), every))
    return model
