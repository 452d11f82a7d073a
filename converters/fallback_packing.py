"""How a packed batch runs through transformers' own causal LM (the fallback wrapper, converters/fallback.py).

transformers' masks separate packed documents from ``position_ids`` in attention-only models: such a batch
is given to transformers as it is (without its all-ones mask). Models whose masks do not (convolution,
state-space or recurrent layers, or masks that ignore positions) and prompt-learning PEFT (virtual tokens
per sequence) run each document as its own right-padded row, put back in packed order afterwards.

Shapes: B batch, S sequence, K documents, L longest document, N = B * S flat positions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class DocumentRows:
    """A packed batch laid out one document per row. gather_KL: flat index (b * S + s) of each token of
    document k (0 where the row is padding); valid_KL: real tokens; scatter_N: for each flat packed
    position, its flat index (k * L + l) in the document layout (padding positions point at 0)."""

    gather_KL: torch.Tensor
    valid_KL: torch.Tensor
    scatter_N: torch.Tensor


@dataclass
class BatchLayout:
    """How one batch runs through the wrapped model (the wrapper's attention plan).
    rows: run each document as its own row; drop_mask: a packed batch whose mask is all ones, given to
    transformers without it (its masks separate documents by position only when there is no mask)."""

    rows: DocumentRows | None = None
    drop_mask: bool = False


def plan_batch(input_ids_BS, attention_mask_BS, position_ids_BS, masks_separate_documents: bool, device) -> BatchLayout:
    """A batch's layout, from host tensors (no device sync when called before they move)."""
    if position_ids_BS is None:
        return BatchLayout()
    B, S = input_ids_BS.shape
    positions = position_ids_BS.expand(B, S).cpu()
    valid = torch.ones(B, S, dtype=torch.bool) if attention_mask_BS is None else attention_mask_BS.cpu().bool()
    previous_valid = torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    follows = torch.zeros(B, S, dtype=torch.bool)
    follows[:, 1:] = positions[:, 1:] == positions[:, :-1] + 1
    starts = valid & ~(follows & previous_valid)  # a document starts where the positions do not continue
    if B == 0 or int(starts.sum(1).max()) <= 1:
        return BatchLayout()
    if masks_separate_documents and bool(valid.all()):
        return BatchLayout(drop_mask=attention_mask_BS is not None)
    flat_valid, flat_starts = valid.flatten(), starts.flatten()
    tokens = flat_valid.nonzero()[:, 0]
    document = flat_starts.cumsum(0)[tokens] - 1
    lengths = torch.bincount(document)
    first = lengths.cumsum(0) - lengths
    offset = torch.arange(len(tokens)) - first[document]
    K, L = len(lengths), int(lengths.max())
    gather = torch.zeros(K, L, dtype=torch.long)
    gather[document, offset] = tokens
    valid_KL = torch.zeros(K, L, dtype=torch.bool)
    valid_KL[document, offset] = True
    scatter = torch.zeros(B * S, dtype=torch.long)
    scatter[tokens] = document * L + offset
    return BatchLayout(DocumentRows(gather.to(device), valid_KL.to(device), scatter.to(device)))


# words of module class names (CamelCase split) that name a token mixer other than attention
_NON_ATTENTION_WORDS = (
    "mamba", "ssm", "conv", "delta", "lightning", "rwkv", "recurrent", "rglru", "lstm", "retention", "hyena", "mixer",
)
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local"}


def masks_separate_documents(causal_lm: nn.Module) -> bool:
    """Whether every layer mixes tokens only by attention (which transformers' packed-sequence masks can reach):
    no layer type in the config other than attention, and no convolution / state-space / recurrent module.
    (The wrapper then also checks that the masks do keep a packed row's documents apart.)"""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layer, not a convolution

    text = causal_lm.config.get_text_config()
    for name in ("layer_types", "layers_block_type", "block_types"):
        kinds = getattr(text, name, None)
        if isinstance(kinds, (list, tuple)) and any(str(kind) not in _ATTENTION_LAYER_TYPES for kind in kinds):
            return False
    for module in causal_lm.modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.RNNBase)):
            return False
        words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", type(module).__name__)
        if not isinstance(module, Conv1D) and any(w.lower().startswith(_NON_ATTENTION_WORDS) for w in words):
            return False
    return True


__all__ = ["BatchLayout", "DocumentRows", "masks_separate_documents", "plan_batch"]
