"""The chunked head losses when the head weight is split by vocabulary rows across a tensor-parallel group
(loss parallel, as Megatron's vocab-parallel cross-entropy): no rank ever holds a full-vocabulary logit.

Shapes: N tokens, D hidden dim, V the full vocabulary, Vr this rank's rows of it, C chunk, P group size.

Each rank projects every token (the hidden states are the same on all ranks of the group) onto its own
rows [vocab_start, vocab_start + Vr) and, chunk by chunk, the group combines per-token statistics:
the row max (all-gathered: it also says which rank holds the argmax), then one all-reduce of
sum exp(z - max), sum exp(z - max) * z, the target logit (from the rank that holds it) and top-1 hits.
From these every rank has log Z, the target log-prob and the entropy of the full softmax. The gradient
of a chunk's logits, softmax(z) - onehot(target), is local to each rank's rows, so dL/dW is complete for
its rows and dL/dh is this rank's partial sum: the caller sums dL/dh over the group (a reduce-scatter
or all-reduce in backward; DTensor does it when the hidden states come in as a DTensor).
Every rank of the group must call with the same tokens and targets (the collectives line up per chunk).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._chunks import IGNORE_INDEX, ChunkKernel, chunk_size_for, fused_head_loss
from .cross_entropy import CrossEntropyOutput


class _VocabParallelStats:
    """Full-softmax statistics of one chunk from this rank's logits z_CV [C, Vr]; fills probs_CV with
    this rank's columns of softmax(z). Two collectives: an all-gather of the row max, an all-reduce."""

    def __init__(self, z_CV, targets_C, probs_CV, vocab_start: int, group):
        rows, local_vocab = z_CV.shape
        local_targets_C = targets_C - vocab_start
        self.in_range_C = (local_targets_C >= 0) & (local_targets_C < local_vocab)
        self.local_targets_C = torch.where(self.in_range_C, local_targets_C, 0)
        self.rows_C = torch.arange(rows, device=z_CV.device)

        local_max_C = z_CV.amax(dim=-1)
        group_size = dist.get_world_size(group)
        max_PC = torch.empty(group_size * rows, dtype=local_max_C.dtype, device=z_CV.device)
        dist.all_gather_single(max_PC, local_max_C, group=group)
        max_PC = max_PC.view(group_size, rows)
        self.max_C = max_PC.amax(dim=0)
        # argmax over the full vocabulary, first index on ties (torch.argmax's rule): the lowest rank among
        # those holding the max (ranks hold increasing vocabulary rows), then the first local index
        holder_C = max_PC.argmax(dim=0)
        is_holder_C = holder_C == dist.get_rank(group)
        hits_C = is_holder_C & self.in_range_C & (z_CV.argmax(dim=-1) == self.local_targets_C)

        target_logit_C = torch.where(self.in_range_C, z_CV[self.rows_C, self.local_targets_C], 0.0)
        torch.sub(z_CV, self.max_C[:, None], out=probs_CV).exp_()
        sums_4C = torch.stack([
            probs_CV.sum(dim=-1), torch.linalg.vecdot(probs_CV, z_CV), target_logit_C, hits_C.to(z_CV.dtype),
        ])
        dist.all_reduce(sums_4C, group=group)
        sum_exp_C, sum_exp_z_C, self.target_logit_C, hits = sums_4C
        self.correct_C = hits > 0.5
        self.log_z_C = self.max_C + sum_exp_C.log()
        self.entropy_C = self.log_z_C - sum_exp_z_C / sum_exp_C
        probs_CV.div_(sum_exp_C[:, None])
        self.probs_CV = probs_CV

    def log_probs(self) -> torch.Tensor:
        return self.target_logit_C - self.log_z_C

    def subtract_target(self, grad_CV: torch.Tensor, scale_C: torch.Tensor | None = None) -> None:
        """grad_CV[c, target_c] -= scale_c (1 without a scale) where this rank holds the target."""
        value_C = self.in_range_C.to(grad_CV.dtype)
        if scale_C is not None:
            value_C = value_C * scale_C
        grad_CV[self.rows_C, self.local_targets_C] -= value_C


class _VocabParallelCrossEntropyKernel(ChunkKernel):
    """Summed NLL, entropy and top-1 hits over the full vocabulary; dNLL/dz formed chunk by chunk in forward."""

    def __init__(self, targets_N, vocab_start, group, softcap, temperature, chunk_size):
        super().__init__(softcap, temperature, chunk_size)
        self.targets_N, self.vocab_start, self.group = targets_N, vocab_start, group

    def prepare(self, hidden_ND, need_hidden):
        device = hidden_ND.device
        zeros = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(2)]
        return zeros[0], zeros[1], torch.zeros((), dtype=torch.int64, device=device)

    def forward_chunk(self, chunk, loss, entropy, correct):
        targets_C = self.targets_N[chunk.rows]
        stats = _VocabParallelStats(chunk.z_CV, targets_C, chunk.probs_CV, self.vocab_start, self.group)
        loss -= stats.log_probs().sum()
        entropy += stats.entropy_C.sum()
        correct += stats.correct_C.sum()
        if chunk.needs_grad:
            stats.subtract_target(chunk.probs_CV)  # softmax(z) - onehot(target), on this rank's columns
            chunk.backpropagate(chunk.probs_CV)


class _VocabParallelLogprobsKernel(ChunkKernel):
    """log p(target) and the entropy per token; backward recomputes each chunk's logits and uses the log Z
    kept from forward, so it needs no collective."""

    gradient_in_forward = False

    def __init__(self, targets_N, vocab_start, group, softcap, temperature, chunk_size):
        super().__init__(softcap, temperature, chunk_size)
        self.valid_N = targets_N != IGNORE_INDEX
        self.targets_N = torch.where(self.valid_N, targets_N, 0)
        self.vocab_start, self.group = vocab_start, group
        self.log_z_N = None

    def prepare(self, hidden_ND, need_hidden):
        N = hidden_ND.shape[0]
        self.log_z_N = torch.zeros(N, dtype=torch.float32, device=hidden_ND.device)
        return tuple(torch.zeros(N, dtype=torch.float32, device=hidden_ND.device) for _ in range(2))

    def forward_chunk(self, chunk, logprobs_N, entropy_N):
        targets_C = self.targets_N[chunk.rows]
        stats = _VocabParallelStats(chunk.z_CV, targets_C, chunk.probs_CV, self.vocab_start, self.group)
        valid_C = self.valid_N[chunk.rows]
        self.log_z_N[chunk.rows] = stats.log_z_C
        logprobs_N[chunk.rows] = torch.where(valid_C, stats.log_probs(), 0.0)
        entropy_N[chunk.rows] = torch.where(valid_C, stats.entropy_C, 0.0)

    def backward_chunk(self, chunk, grad_logprobs_N):
        local_targets_C = self.targets_N[chunk.rows] - self.vocab_start
        in_range_C = (local_targets_C >= 0) & (local_targets_C < chunk.z_CV.shape[1])
        g_C = torch.where(self.valid_N[chunk.rows], grad_logprobs_N[chunk.rows].float(), 0.0)
        probs_CV = torch.sub(chunk.z_CV, self.log_z_N[chunk.rows, None], out=chunk.probs_CV).exp_()
        # g * d logp / dz = g * (onehot - p), built in the probabilities buffer
        probs_CV.mul_(-g_C[:, None])
        rows_C = torch.arange(g_C.shape[0], device=g_C.device)
        probs_CV[rows_C, torch.where(in_range_C, local_targets_C, 0)] += torch.where(in_range_C, g_C, 0.0)
        chunk.backpropagate(probs_CV)


def _group_chunk_size(hidden_ND, vocab_size: int, chunk_size: int | None) -> int:
    # every rank must cut the same chunks: size them by the full vocabulary, not by this rank's rows
    return chunk_size_for(max(hidden_ND.shape[0], 1), vocab_size, hidden_ND.shape[1], chunk_size)


def vocab_parallel_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VrD: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group,
    softcap: float | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> CrossEntropyOutput:
    """Summed NLL of ``targets_N`` under the full-vocabulary softmax, this rank holding rows
    [vocab_start, vocab_start + Vr) of the head.

    hidden_ND: [N, D] states of the label positions, the same on every rank of ``group``.
    weight_VrD: this rank's rows of the [V, D] head. targets_N: [N] token ids in [0, vocab_size).
    Returns the same sums as ``fused_linear_cross_entropy`` (identical on every rank); the gradient it gives
    the hidden states is this rank's share: sum it over the group.
    """
    chunk = _group_chunk_size(hidden_ND, vocab_size, chunk_size)
    kernel = _VocabParallelCrossEntropyKernel(targets_N, vocab_start, group, softcap, temperature, chunk)
    loss, entropy, correct = fused_head_loss(kernel, hidden_ND, weight_VrD)
    return CrossEntropyOutput(loss, entropy, correct, targets_N.shape[0])


def vocab_parallel_token_logprobs(
    hidden_ND: torch.Tensor,
    weight_VrD: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group,
    softcap: float | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_linear_token_logprobs`` with the head split by vocabulary rows (arguments as in
    ``vocab_parallel_cross_entropy``; IGNORE_INDEX targets give 0 and no gradient). Returns (logprobs_N,
    entropy_N), identical on every rank; the hidden states' gradient is this rank's share."""
    chunk = _group_chunk_size(hidden_ND, vocab_size, chunk_size)
    kernel = _VocabParallelLogprobsKernel(targets_N, vocab_start, group, softcap, temperature, chunk)
    return fused_head_loss(kernel, hidden_ND, weight_VrD)


__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_token_logprobs"]
