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

IGNORE_INDEX = -100
_CHUNK_ELEMENTS = 1 << 23  # logits elements per chunk (32 MiB in fp32)


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


def _chunk_size(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // vocab)


def _entropy_and_correct(z_CV: torch.Tensor, log_z_C: torch.Tensor, targets_C: torch.Tensor):
    probs = torch.exp(z_CV - log_z_C[:, None])
    entropy = (log_z_C - (probs * z_CV).sum(-1)).sum()
    correct = (z_CV.argmax(-1) == targets_C).sum()
    return entropy, correct


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, softcap, temperature, needs_grad):
        N, V = hidden_ND.shape[0], weight_VD.shape[0]
        loss = hidden_ND.new_zeros((), dtype=torch.float32)
        entropy = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        correct = torch.zeros((), dtype=torch.int64, device=hidden_ND.device)
        grad_hidden = torch.empty_like(hidden_ND) if needs_grad else None
        grad_weight = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if needs_grad else None
        for start in range(0, N, _chunk_size(V)):
            h_CD = hidden_ND[start : start + _chunk_size(V)]
            t_C = targets_N[start : start + _chunk_size(V)]
            raw_CV = (h_CD @ weight_VD.T).float()
            capped_CV = _softcap(raw_CV, softcap)
            z_CV = capped_CV / temperature
            log_z_C = torch.logsumexp(z_CV, dim=-1)
            loss += (log_z_C - z_CV.gather(1, t_C[:, None])[:, 0]).sum()
            chunk_entropy, chunk_correct = _entropy_and_correct(z_CV, log_z_C, t_C)
            entropy += chunk_entropy
            correct += chunk_correct
            if needs_grad:
                # d(nll)/dz = softmax(z) - onehot(target), then back through temperature and soft-cap
                grad_z = torch.exp(z_CV - log_z_C[:, None])
                grad_z[torch.arange(t_C.shape[0], device=t_C.device), t_C] -= 1.0
                grad_raw = grad_z / temperature
                if softcap is not None:
                    grad_raw = grad_raw * (1.0 - torch.tanh(raw_CV / softcap) ** 2)
                grad_raw = grad_raw.to(hidden_ND.dtype)
                grad_hidden[start : start + h_CD.shape[0]] = grad_raw @ weight_VD
                grad_weight.addmm_(grad_raw.T.float(), h_CD.float())
        if needs_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight_VD.dtype))
        ctx.mark_non_differentiable(entropy, correct)
        return loss, entropy, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_entropy, _grad_correct):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype), None, None, None, None


def fused_linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> CrossEntropyOutput:
    """Summed NLL of ``targets_N`` under softmax(softcap(hidden @ weight.T) / temperature)."""
    needs_grad = torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad)
    loss, entropy, correct = _FusedLinearCrossEntropy.apply(hidden_ND, weight_VD, targets_N, softcap, temperature, needs_grad)
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
