"""Per-token log-probabilities of given tokens under the output head, chunked, with their gradient
(the building block of DPO, GRPO and on-policy distillation losses).

Shapes: N tokens, D hidden dim, V vocabulary, C chunk.

The upstream gradient of each token's log-prob is only known in backward, so backward recomputes
each chunk's logits and forms d logp / dz = onehot(target) - softmax(z) there: one matmul more than
the fused cross-entropy, and nothing of size [N, V] is ever kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._chunks import (
    IGNORE_INDEX,
    ChunkBuffers,
    HeadGradients,
    SoftmaxStats,
    chunk_logits,
    chunk_size_for,
    logit_grad_to_raw,
    matmul_inputs,
    no_autocast,
)


class _FusedLinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, softcap, temperature, chunk_size):
        with no_autocast(hidden_ND.device):
            return _FusedLinearTokenLogprobs._forward(
                ctx, hidden_ND, weight_VD, targets_N, softcap, temperature, chunk_size
            )

    @staticmethod
    def _forward(ctx, hidden_ND, weight_VD, targets_N, softcap, temperature, chunk_size):
        N, V = hidden_ND.shape[0], weight_VD.shape[0]
        valid_N = targets_N != IGNORE_INDEX
        safe_targets_N = torch.where(valid_N, targets_N, 0)
        logprobs = torch.zeros(N, dtype=torch.float32, device=hidden_ND.device)
        entropy = torch.zeros(N, dtype=torch.float32, device=hidden_ND.device)
        chunk = chunk_size_for(N, V, weight_VD.shape[1], chunk_size)
        buffers = ChunkBuffers(min(chunk, N), V, hidden_ND.dtype, hidden_ND.device) if N else None
        for start in range(0, N, chunk):
            h_CD = hidden_ND[start : start + chunk]
            z_CV, probs_CV, low_CV = buffers.views(h_CD.shape[0])
            chunk_logits(h_CD, weight_VD, softcap, temperature, z_CV, low_CV)
            stats = SoftmaxStats(z_CV, safe_targets_N[start : start + chunk], probs_CV)
            logprobs[start : start + chunk] = stats.log_probs()
            entropy[start : start + chunk] = stats.entropy(overwrite_logits=True)
        logprobs.masked_fill_(~valid_N, 0.0)
        entropy.masked_fill_(~valid_N, 0.0)
        ctx.save_for_backward(hidden_ND, weight_VD, safe_targets_N, valid_N)
        ctx.softcap, ctx.temperature, ctx.chunk = softcap, temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs_N, _grad_entropy):
        with no_autocast(grad_logprobs_N.device):
            return _FusedLinearTokenLogprobs._backward(ctx, grad_logprobs_N)

    @staticmethod
    def _backward(ctx, grad_logprobs_N):
        hidden_ND, weight_VD, targets_N, valid_N = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        softcap, temperature, chunk = ctx.softcap, ctx.temperature, ctx.chunk
        N, V = hidden_ND.shape[0], weight_VD.shape[0]
        grad_N = torch.where(valid_N, grad_logprobs_N.float(), 0.0)
        grads = HeadGradients(hidden_ND, weight_VD, need_hidden, need_weight, 1.0 / temperature)
        buffers = ChunkBuffers(min(chunk, N), V, hidden_ND.dtype, hidden_ND.device) if N else None
        for start in range(0, N, chunk):
            h_CD = hidden_ND[start : start + chunk]
            t_C, g_C = targets_N[start : start + chunk], grad_N[start : start + chunk]
            z_CV, probs_CV, low_CV = buffers.views(h_CD.shape[0])
            chunk_logits(h_CD, weight_VD, softcap, temperature, z_CV, low_CV)
            torch.softmax(z_CV, dim=-1, out=probs_CV)
            # g * d logp / dz = g * (onehot - p), built in the probabilities buffer
            probs_CV.mul_(-g_C[:, None])
            probs_CV[torch.arange(t_C.shape[0], device=t_C.device), t_C] += g_C
            logit_grad_to_raw(probs_CV, z_CV, softcap, temperature)
            grads.add_chunk(start, probs_CV, h_CD, low_CV)
        grad_hidden, grad_weight = grads.finish()
        return grad_hidden, grad_weight, None, None, None, None


def fused_linear_token_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    softcap: float | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(softcap(hidden @ weight.T) / temperature)[target] per token, and the entropy.

    hidden_ND: [N, D]; weight_VD: [V, D] (the embedding when tied); targets_N: [N] token ids.
    Positions whose target is IGNORE_INDEX get log-prob 0 and entropy 0 and no gradient (they are
    still projected: drop them first with ``label_positions`` when many are ignored).
    Returns (logprobs_N, entropy_N), fp32; logprobs_N is differentiable w.r.t. hidden and weight for
    any upstream gradient, entropy_N is not (a logged statistic).
    """
    hidden_ND, weight_VD = matmul_inputs(hidden_ND, weight_VD)
    return _FusedLinearTokenLogprobs.apply(hidden_ND, weight_VD, targets_N, softcap, temperature, chunk_size)


def linear_token_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same on materialized [N, V] logits (the plain reference; autograd keeps [N, V])."""
    logits_NV = (hidden_ND @ weight_VD.T).float()
    if softcap is not None:
        logits_NV = torch.tanh(logits_NV / softcap) * softcap
    logp_NV = F.log_softmax(logits_NV / temperature, dim=-1)
    valid_N = targets_N != IGNORE_INDEX
    logprobs_N = logp_NV.gather(1, torch.where(valid_N, targets_N, 0)[:, None])[:, 0] * valid_N
    with torch.no_grad():
        entropy_N = -(logp_NV.exp() * logp_NV).sum(-1) * valid_N
    return logprobs_N, entropy_N
