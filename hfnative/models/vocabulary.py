"""A model's vocabulary grown or cut, as transformers' ``resize_token_embeddings(mean_resizing=True)`` does it (what
TRL's ``clone_chat_template`` calls when a chat template brings tokens the tokenizer lacks, or rounds the vocabulary to
a multiple of 64).

Rows past the new size are dropped; each added row of the embedding, and of an untied output head, is drawn from a
normal distribution with the old rows' mean and 1e-9 times their covariance (the mean itself where that covariance is
not positive definite): new tokens start at the average token, so the next-token distribution barely moves. A tied
head follows the embedding. A sequence classifier's score head has no vocabulary rows and is left as it is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributions import constraints
from torch.distributions.multivariate_normal import MultivariateNormal

from .head import OutputHead

COVARIANCE_SCALE = 1e-9  # transformers' epsilon


@torch.no_grad()
def mean_rows(weight_VD: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows drawn around the mean of ``weight_VD``'s rows (see the module docstring), in its dtype."""
    weight = weight_VD.detach().to(torch.float32)
    mean_D = weight.mean(dim=0)
    centered = weight - mean_D
    covariance_DD = centered.T @ centered / weight.shape[0]
    scaled = COVARIANCE_SCALE * covariance_DD
    if not constraints.positive_definite.check(scaled).all():
        return mean_D[None, :].repeat(count, 1).to(weight_VD.dtype)
    # the draw leaves the global random stream where it was: training draws (dropout, NEFTune noise) go on from the
    # run's seed as they do where the model was resized before the seed was set (TRL clones before its Trainer seeds)
    devices = [weight_VD.device] if weight_VD.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        rows = MultivariateNormal(mean_D, covariance_matrix=scaled).sample((count,))
    return rows.to(weight_VD.dtype)


def _resized(weight_VD: torch.Tensor, rows: int) -> nn.Parameter:
    old = weight_VD.shape[0]
    new = torch.empty(rows, weight_VD.shape[1], dtype=weight_VD.dtype, device=weight_VD.device)
    kept = min(old, rows)
    new[:kept] = weight_VD[:kept]
    if rows > old:
        new[old:] = mean_rows(weight_VD, rows - old)
    return nn.Parameter(new, requires_grad=weight_VD.requires_grad)


@torch.no_grad()
def resize_vocabulary(model: nn.Module, rows: int) -> None:
    """Give ``model`` (a native Transformer, whole: not sharded) ``rows`` token rows, in place: its embedding, an
    untied output head, ``args.vocab_size`` and a padding index past the new end (dropped)."""
    embedding = model.tok_embeddings
    if type(embedding.weight.data) is not torch.Tensor:
        raise ValueError("resize_vocabulary: the embedding is sharded or quantized; resize the whole model first")
    if rows < 1:
        raise ValueError(f"resize_vocabulary: rows={rows}: expected a positive number of token rows")
    if rows == embedding.weight.shape[0]:
        return
    head = getattr(model, "output", None)
    resizes_head = isinstance(head, OutputHead) and not head.is_tied and getattr(model.args, "num_labels", None) is None
    embedding.weight = _resized(embedding.weight, rows)
    embedding.num_embeddings = rows
    if embedding.padding_idx is not None and embedding.padding_idx >= rows:
        embedding.padding_idx = None
    if resizes_head:
        head.weight = _resized(head.weight, rows)
    model.args.vocab_size = rows
    if getattr(model.args, "padding_idx", None) is not None and model.args.padding_idx >= rows:
        model.args.padding_idx = None


__all__ = ["mean_rows", "resize_vocabulary"]
