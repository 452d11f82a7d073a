"""Cross-entropy over the output head, with the token statistics SFT logs (entropy, top-1 accuracy).

Shapes: N label tokens (ignored positions already dropped), D hidden dim, V vocabulary, C chunk.

``fused_linear_cross_entropy`` never keeps [N, V] logits for backward: each chunk's gradient
w.r.t. the hidden states and the head weight is computed during forward and only those
([N, D] and [V, D]) are kept. ``linear_cross_entropy`` is the plain reference on materialized logits.

Where the device policy allows host reads (a CPU, ``hfnative.device_policy``) the ignored positions are dropped
first (``label_positions``: a boolean index, whose output size the host must read); elsewhere every position is
projected and the ignored ones masked (``masked=True``), so no step waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._chunks import (
    IGNORE_INDEX,
    ChunkKernel,
    ReplacedRows,
    SoftmaxStats,
    expected_logit_from_hidden_grad,
    fused_head_loss,
    head_output,
    softmax_in_place_verified,
)

__all__ = [
    "IGNORE_INDEX",
    "CrossEntropyOutput",
    "at_least_one",
    "fused_linear_cross_entropy",
    "label_positions",
    "linear_cross_entropy",
    "shift_labels",
]


@head_output
@dataclass
class CrossEntropyOutput:
    """Sums over the label tokens; divide by the step's token count to get means."""

    loss_sum: torch.Tensor  # scalar, differentiable
    entropy_sum: torch.Tensor  # scalar, no grad
    correct_sum: torch.Tensor  # scalar, no grad: tokens whose label is the argmax
    num_tokens: int | torch.Tensor  # label tokens: an int when counted on the host, else a device scalar (int64)


def at_least_one(count: int | torch.Tensor) -> int | torch.Tensor:
    """max(count, 1) for a host count or a device scalar (no host read)."""
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def shift_labels(labels_BS: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1: targets [B, S] with IGNORE_INDEX in the last column."""
    return F.pad(labels_BS[:, 1:], (0, 1), value=IGNORE_INDEX)


def label_positions(hidden_BSD: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep only the positions that have a label: hidden [N, D], targets [N]."""
    keep = targets_BS != IGNORE_INDEX
    return hidden_BSD[keep], targets_BS[keep]


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _entropy_and_correct(z_NV: torch.Tensor, log_z_N: torch.Tensor, targets_N: torch.Tensor, valid_N=None):
    probs = torch.exp(z_NV - log_z_N[:, None])
    entropy_N = log_z_N - (probs * z_NV).sum(-1)
    correct_N = z_NV.argmax(-1) == targets_N
    if valid_N is not None:
        entropy_N, correct_N = torch.where(valid_N, entropy_N, 0.0), correct_N & valid_N
    return entropy_N.sum(), correct_N.sum()


class _CrossEntropyKernel(ChunkKernel):
    """Summed NLL, entropy and top-1 hits; dNLL/dhidden and dNLL/dweight are formed chunk by chunk in forward.
    ``masked``: targets may be IGNORE_INDEX, whose positions add nothing and get no gradient."""

    def __init__(self, targets_N, softcap, temperature, chunk_size, masked: bool = False):
        super().__init__(softcap, temperature, chunk_size)
        self.valid_N = targets_N != IGNORE_INDEX if masked else None
        self.targets_N = targets_N if not masked else torch.where(self.valid_N, targets_N, 0)

    def prepare(self, hidden_ND, need_hidden):
        from hfnative.models.triton_kernels import cross_entropy_supported, use_triton_kernels

        # the GPU's Triton kernel: statistics and gradient from the head's own product in one program a row, the
        # gradient straight into the held block (the policy's gradients made per block)
        self.reads_matmul_logits = (self.gradients_in_blocks() and use_triton_kernels(hidden_ND)
                                    and cross_entropy_supported(hidden_ND.dtype, self.softcap))
        if self.reads_matmul_logits:
            valid = self.valid_N if self.valid_N is not None else torch.ones_like(self.targets_N, dtype=torch.bool)
            self.row_scale_N = valid.to(torch.float32)
        # linear logits in fp32 and dNLL/dh computed chunk by chunk: the entropy comes from dNLL/dh (no [C, V]
        # pass), and the logits are not needed once softmaxed. On CPU the softmax then runs in place (one [C, V]
        # buffer, so chunks twice as long for the same memory).
        self.entropy_from_grad = (need_hidden and self.softcap is None and hidden_ND.dtype == torch.float32
                                  and self.policy.head_gradient_block_elements is None)
        self.softmax_in_place = self.entropy_from_grad and softmax_in_place_verified(hidden_ND.device)
        device = hidden_ND.device
        loss = torch.zeros((), dtype=torch.float32, device=device)
        entropy = torch.zeros((), dtype=torch.float32, device=device)
        return loss, entropy, torch.zeros((), dtype=torch.int64, device=device)

    def forward_chunk(self, chunk, loss, entropy, correct):
        t_C = self.targets_N[chunk.rows]
        if self.reads_matmul_logits:
            from hfnative.models.triton_kernels import cross_entropy_rows

            z_CV = chunk.low_CV if chunk.low_CV is not None else chunk.z_CV
            slot = chunk.gradient_slot()
            if chunk.needs_grad and slot is None:
                raise RuntimeError("the cross-entropy kernel needs the head's gradients made per block")
            loss_C, entropy_C, correct_C = cross_entropy_rows(z_CV, 1.0 / self.temperature, t_C,
                                                              self.row_scale_N[chunk.rows], slot)
            loss += loss_C.sum()
            entropy += entropy_C.sum()
            correct += correct_C.sum()
            return
        valid_C = None if self.valid_N is None else self.valid_N[chunk.rows]
        stats = SoftmaxStats(chunk.z_CV, t_C, chunk.probs_CV, self.policy.host_reads)
        loss -= zero_where_ignored(stats.log_probs(), valid_C).sum()
        correct += (stats.correct_C if valid_C is None else stats.correct_C & valid_C).sum()
        if not self.entropy_from_grad:
            # the logits are needed after this only to differentiate the soft-cap
            entropy += zero_where_ignored(stats.entropy(overwrite_logits=self.softcap is None), valid_C).sum()
        if chunk.needs_grad:
            # dNLL/dz = softmax(z) - onehot(target), built in the probabilities buffer (zero on ignored rows)
            chunk.probs_CV[stats.rows_C, t_C] -= 1.0
            grad_h_CD = chunk.backpropagate(chunk.probs_CV, None if valid_C is None else valid_C.to(chunk.probs_CV.dtype))
        if self.entropy_from_grad:
            expected_logit_C = expected_logit_from_hidden_grad(chunk.h_CD, grad_h_CD, stats.target_logit_C)
            entropy += zero_where_ignored(stats.log_z_C - expected_logit_C, valid_C).sum()


def zero_where_ignored(values_C: torch.Tensor, valid_C: torch.Tensor | None) -> torch.Tensor:
    """A masked kernel's per-row values, 0 where the row's target is ignored (``valid_C`` None: every row counts)."""
    return values_C if valid_C is None else torch.where(valid_C, values_C, 0.0)


def fused_linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    softcap: float | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    masked: bool = False,
    replaced_rows: ReplacedRows | None = None,
) -> CrossEntropyOutput:
    """Summed NLL of ``targets_N`` under softmax(softcap(hidden @ weight.T) / temperature).

    hidden_ND: [N, D] states of the label positions only (drop ignored ones with ``label_positions``), or, with
    ``masked``, of any positions: those whose target is IGNORE_INDEX add nothing (and ``num_tokens`` is then a
    device scalar).
    weight_VD: [V, D] head (the embedding matrix when tied; its gradient adds to the lookup's).
    targets_N: [N] token ids, all real labels unless ``masked``.
    chunk_size: tokens per chunk (default: the device policy's rule, ``hfnative.device_policy``).
    replaced_rows: rows of the weight read from elsewhere (trained token rows: ``ReplacedRows``).
    Under torch.autocast the projection runs in the autocast dtype, as the plain path's matmul would.
    Returns loss, entropy and correct-prediction sums; fp32 statistics whatever the input dtype.
    """
    kernel = _CrossEntropyKernel(targets_N, softcap, temperature, chunk_size, masked)
    loss, entropy, correct = fused_head_loss(kernel, hidden_ND, weight_VD, replaced_rows)
    return CrossEntropyOutput(loss, entropy, correct, label_count(targets_N, masked))


def label_count(targets_N: torch.Tensor, masked: bool) -> int | torch.Tensor:
    """The positions with a label: a host int, or with ``masked`` a device scalar (no host read)."""
    return (targets_N != IGNORE_INDEX).sum() if masked else targets_N.shape[0]


def linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    softcap: float | None = None,
    temperature: float = 1.0,
    masked: bool = False,
) -> CrossEntropyOutput:
    """The same quantity on materialized logits (autograd keeps [N, V] for backward)."""
    z_NV = _softcap((hidden_ND @ weight_VD.T).float(), softcap) / temperature
    loss = F.cross_entropy(z_NV, targets_N, reduction="sum", ignore_index=IGNORE_INDEX)
    with torch.no_grad():
        entropy, correct = _entropy_and_correct(z_NV, torch.logsumexp(z_NV, -1), targets_N,
                                                targets_N != IGNORE_INDEX if masked else None)
    return CrossEntropyOutput(loss, entropy, correct, label_count(targets_N, masked))
