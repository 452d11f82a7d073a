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

from ._chunks import IGNORE_INDEX, ChunkKernel, ReplacedRows, SoftmaxStats, fused_head_loss

# per-token statistics the log-prob losses may also return (no gradient): the mean logit over the vocabulary,
# whether the target is the argmax (first index on ties, as torch.argmax), and log sum_v p_v^2
TOKEN_STATISTICS = ("mean_logits", "is_top1", "log_sum_sq_probs")


def _check_statistics(statistics) -> tuple[str, ...]:
    unknown = [name for name in statistics if name not in TOKEN_STATISTICS]
    if unknown:
        raise ValueError(f"unknown token statistics {unknown}; choose from {list(TOKEN_STATISTICS)}")
    return tuple(statistics)


class _TokenLogprobsKernel(ChunkKernel):
    """log p(target) and the entropy per token (and the ``statistics`` asked for); ignored targets give 0
    and get no gradient."""

    gradient_in_forward = False

    def __init__(self, targets_N, softcap, temperature, chunk_size, statistics=()):
        super().__init__(softcap, temperature, chunk_size)
        self.valid_N = targets_N != IGNORE_INDEX
        self.targets_N = torch.where(self.valid_N, targets_N, 0)
        self.statistics = _check_statistics(statistics)

    def prepare(self, hidden_ND, need_hidden):
        N = hidden_ND.shape[0]
        outputs = [torch.zeros(N, dtype=torch.float32, device=hidden_ND.device) for _ in range(2)]
        for name in self.statistics:
            dtype = torch.bool if name == "is_top1" else torch.float32
            outputs.append(torch.zeros(N, dtype=dtype, device=hidden_ND.device))
        return tuple(outputs)

    def forward_chunk(self, chunk, logprobs_N, entropy_N, *statistics_N):
        valid_C = self.valid_N[chunk.rows]
        # the mean logit is read before the softmax statistics overwrite the logits buffer
        mean_logits_C = chunk.z_CV.mean(dim=-1) if "mean_logits" in self.statistics else None
        stats = SoftmaxStats(chunk.z_CV, self.targets_N[chunk.rows], chunk.probs_CV, self.policy.host_reads)
        logprobs_N[chunk.rows] = torch.where(valid_C, stats.log_probs(), 0.0)
        for name, out_N in zip(self.statistics, statistics_N):
            if name == "mean_logits":
                out_N[chunk.rows] = torch.where(valid_C, mean_logits_C, 0.0)
            elif name == "is_top1":
                out_N[chunk.rows] = stats.correct_C & valid_C
            else:  # log sum_v p_v^2, a dot product per row (no [C, V] temporary)
                log_sum_sq_C = torch.linalg.vecdot(stats.probs_CV, stats.probs_CV).log()
                out_N[chunk.rows] = torch.where(valid_C, log_sum_sq_C, 0.0)
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
    statistics: tuple[str, ...] = (),
    replaced_rows: ReplacedRows | None = None,
) -> tuple[torch.Tensor, ...]:
    """log softmax(softcap(hidden @ weight.T) / temperature)[target] per token, and the entropy.

    hidden_ND: [N, D]; weight_VD: [V, D] (the embedding when tied); targets_N: [N] token ids.
    Positions whose target is IGNORE_INDEX get log-prob 0 and entropy 0 and no gradient (they are
    still projected: drop them first with ``label_positions`` when many are ignored).
    Returns (logprobs_N, entropy_N), fp32; logprobs_N is differentiable w.r.t. hidden and weight for
    any upstream gradient, entropy_N is not (a logged statistic).
    ``statistics``: names from TOKEN_STATISTICS, returned after the entropy in that order ([N] each, 0 / False
    where ignored; is_top1 bool), computed in the same chunk loop.
    replaced_rows: rows of the weight read from elsewhere (trained token rows: ``ReplacedRows``).
    """
    kernel = _TokenLogprobsKernel(targets_N, softcap, temperature, chunk_size, statistics)
    return fused_head_loss(kernel, hidden_ND, weight_VD, replaced_rows)


def linear_token_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    softcap: float | None = None,
    temperature: float = 1.0,
    statistics: tuple[str, ...] = (),
) -> tuple[torch.Tensor, ...]:
    """The same on materialized [N, V] logits (the plain reference; autograd keeps [N, V])."""
    logits_NV = (hidden_ND @ weight_VD.T).float()
    if softcap is not None:
        logits_NV = torch.tanh(logits_NV / softcap) * softcap
    logp_NV = F.log_softmax(logits_NV / temperature, dim=-1)
    valid_N = targets_N != IGNORE_INDEX
    logprobs_N = logp_NV.gather(1, torch.where(valid_N, targets_N, 0)[:, None])[:, 0] * valid_N
    with torch.no_grad():
        entropy_N = -(logp_NV.exp() * logp_NV).sum(-1) * valid_N
        extra = []
        for name in _check_statistics(statistics):
            z_NV = logits_NV / temperature
            if name == "mean_logits":
                extra.append(z_NV.mean(-1) * valid_N)
            elif name == "is_top1":
                extra.append((z_NV.argmax(-1) == targets_N) & valid_N)
            else:
                extra.append(torch.logsumexp(2 * logp_NV, dim=-1) * valid_N)
    return (logprobs_N, entropy_N, *extra)
