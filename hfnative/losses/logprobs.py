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

from ._chunks import IGNORE_INDEX, ChunkKernel, SoftmaxStats, fused_head_loss


class _TokenLogprobsKernel(ChunkKernel):
    """log p(target) and the entropy per token; ignored targets give 0 and get no gradient."""

    gradient_in_forward = False

    def __init__(self, targets_N, softcap, temperature, chunk_size):
        super().__init__(softcap, temperature, chunk_size)
        self.valid_N = targets_N != IGNORE_INDEX
        self.targets_N = torch.where(self.valid_N, targets_N, 0)

    def prepare(self, hidden_ND, need_hidden):
        N = hidden_ND.shape[0]
        return tuple(torch.zeros(N, dtype=torch.float32, device=hidden_ND.device) for _ in range(2))

    def forward_chunk(self, chunk, logprobs_N, entropy_N):
        stats = SoftmaxStats(chunk.z_CV, self.targets_N[chunk.rows], chunk.probs_CV)
        valid_C = self.valid_N[chunk.rows]
        logprobs_N[chunk.rows] = torch.where(valid_C, stats.log_probs(), 0.0)
        entropy_N[chunk.rows] = torch.where(valid_C, stats.entropy(overwrite_logits=True), 0.0)

    def backward_chunk(self, chunk, grad_logprobs_N):
        t_C = self.targets_N[chunk.rows]
        g_C = torch.where(self.valid_N[chunk.rows], grad_logprobs_N[chunk.rows].float(), 0.0)
        probs_CV = torch.softmax(chunk.z_CV, dim=-1, out=chunk.probs_CV)
        # g * d logp / dz = g * (onehot - p), built in the probabilities buffer
        probs_CV.mul_(-g_C[:, None])
        probs_CV[torch.arange(t_C.shape[0], device=t_C.device), t_C] += g_C
        chunk.backpropagate(probs_CV)


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
    return fused_head_loss(_TokenLogprobsKernel(targets_N, softcap, temperature, chunk_size), hidden_ND, weight_VD)


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
