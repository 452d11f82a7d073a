"""Cross-entropy over the output head, with the token statistics SFT logs (entropy, top-1 accuracy).

Shapes: N label tokens (ignored positions already dropped), D hidden dim, V vocabulary, C chunk.

``fused_linear_cross_entropy`` never keeps [N, V] logits for backward: each chunk's gradient
w.r.t. the hidden states and the head weight is computed during forward and only those
([N, D] and [V, D]) are kept. ``linear_cross_entropy`` is the plain reference on materialized logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._chunks import (
    IGNORE_INDEX,
    ChunkKernel,
    SoftmaxStats,
    expected_logit_from_hidden_grad,
    fused_head_loss,
    softmax_in_place_verified,
)

__all__ = [
    "IGNORE_INDEX",
    "CrossEntropyOutput",
    "fused_linear_cross_entropy",
    "label_positions",
    "linear_cross_entropy",
    "shift_labels",
]


@dataclass
class CrossEntropyOutput:
    """Sums over the label tokens; divide by the step's token count to get means."""

    loss_sum: torch.Tensor  # scalar, differentiable
    entropy_sum: torch.Tensor  # scalar, no grad
    correct_sum: torch.Tensor  # scalar, no grad: tokens whose label is the argmax
    num_tokens: int


def shift_labels(labels_BS: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1: targets [B, S] with IGNORE_INDEX in the last column."""
    return F.pad(labels_BS[:, 1:], (0, 1), value=IGNORE_INDEX)


def label_positions(hidden_BSD: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep only the positions that have a label: hidden [N, D], targets [N]."""
    keep = targets_BS != IGNORE_INDEX
    return hidden_BSD[keep], targets_BS[keep]


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _entropy_and_correct(z_NV: torch.Tensor, log_z_N: torch.Tensor, targets_N: torch.Tensor):
    probs = torch.exp(z_NV - log_z_N[:, None])
    entropy = (log_z_N - (probs * z_NV).sum(-1)).sum()
    correct = (z_NV.argmax(-1) == targets_N).sum()
    return entropy, correct


class _CrossEntropyKernel(ChunkKernel):
    """Summed NLL, entropy and top-1 hits; dNLL/dhidden and dNLL/dweight are formed chunk by chunk in forward."""

    def __init__(self, targets_N, softcap, temperature, chunk_size):
        super().__init__(softcap, temperature, chunk_size)
        self.targets_N = targets_N

    def prepare(self, hidden_ND, need_hidden):
        # linear logits in fp32 and dNLL/dh computed: the entropy comes from dNLL/dh (no [C, V] pass), and
        # the logits are not needed once softmaxed. On CPU the softmax then runs in place (one [C, V] buffer,
        # so chunks twice as long for the same memory).
        self.entropy_from_grad = need_hidden and self.softcap is None and hidden_ND.dtype == torch.float32
        self.softmax_in_place = self.entropy_from_grad and softmax_in_place_verified(hidden_ND.device)
        device = hidden_ND.device
        loss = torch.zeros((), dtype=torch.float32, device=device)
        entropy = torch.zeros((), dtype=torch.float32, device=device)
        return loss, entropy, torch.zeros((), dtype=torch.int64, device=device)

    def forward_chunk(self, chunk, loss, entropy, correct):
        t_C = self.targets_N[chunk.rows]
        stats = SoftmaxStats(chunk.z_CV, t_C, chunk.probs_CV)
        loss -= stats.log_probs().sum()
        correct += stats.correct_C.sum()
        if not self.entropy_from_grad:
            # the logits are needed after this only to differentiate the soft-cap
            entropy += stats.entropy(overwrite_logits=self.softcap is None).sum()
        if chunk.needs_grad:
            # dNLL/dz = softmax(z) - onehot(target), built in the probabilities buffer
            chunk.probs_CV[stats.rows_C, t_C] -= 1.0
            grad_h_CD = chunk.backpropagate(chunk.probs_CV)
        if self.entropy_from_grad:
            expected_logit_C = expected_logit_from_hidden_grad(chunk.h_CD, grad_h_CD, stats.target_logit_C)
            entropy += (stats.log_z_C - expected_logit_C).sum()


def fused_linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    softcap: float | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> CrossEntropyOutput:
    """Summed NLL of ``targets_N`` under softmax(softcap(hidden @ weight.T) / temperature).

    hidden_ND: [N, D] states of the label positions only (drop ignored ones with ``label_positions``).
    weight_VD: [V, D] head (the embedding matrix when tied; its gradient adds to the lookup's).
    targets_N: [N] token ids, all real labels.
    chunk_size: tokens per chunk (default: hidden size / 2, at least 128, at most 64M logits per chunk).
    Under torch.autocast the projection runs in the autocast dtype, as the plain path's matmul would.
    Returns loss, entropy and correct-prediction sums; fp32 statistics whatever the input dtype.
    """
    kernel = _CrossEntropyKernel(targets_N, softcap, temperature, chunk_size)
    loss, entropy, correct = fused_head_loss(kernel, hidden_ND, weight_VD)
    return CrossEntropyOutput(loss, entropy, correct, targets_N.shape[0])


def linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> CrossEntropyOutput:
    """The same quantity on materialized logits (autograd keeps [N, V] for backward)."""
    z_NV = _softcap((hidden_ND @ weight_VD.T).float(), softcap) / temperature
    loss = F.cross_entropy(z_NV, targets_N, reduction="sum")
    with torch.no_grad():
        entropy, correct = _entropy_and_correct(z_NV, torch.logsumexp(z_NV, -1), targets_N)
    return CrossEntropyOutput(loss, entropy, correct, targets_N.shape[0])
