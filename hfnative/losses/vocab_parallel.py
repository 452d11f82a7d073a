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
The per-token statistics (mean logit, log sum_v p_v^2) ride the same all-reduce as extra rows.

The generalized JSD needs log Z of the student and of the teacher (one all-gather per chunk of each
rank's row max and local log-sum); its divergence is a sum over the vocabulary of elementwise terms, so each rank's
rows give a partial sum, added over the group once after the last chunk. The student's gradient
p_s * (g - <p_s, g>) needs the full-vocabulary <p_s, g> per token: one all-reduce of [C] per chunk (none
for beta = 0, where the gradient p_s - p_t is local). The teacher's head is split by the same rows.
Every rank of the group must call with the same tokens and targets (the collectives line up per chunk).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._chunks import (
    IGNORE_INDEX,
    ChunkBuffers,
    ChunkKernel,
    chunk_logits,
    chunk_size_for,
    fused_head_loss,
    matmul_inputs,
)
from .cross_entropy import CrossEntropyOutput, label_count, zero_where_ignored
from .distillation import DistillationOutput
from .logprobs import _check_statistics


# every rank's tensor, concatenated along dim 0 into one output tensor: all_gather_single where torch has it (2.13 has
# it and deprecates all_gather_into_tensor; 2.11 has only all_gather_into_tensor)
_all_gather_rows = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _VocabParallelStats:
    """Full-softmax statistics of one chunk from this rank's logits z_CV [C, Vr]; fills probs_CV with
    this rank's columns of softmax(z). Two collectives: an all-gather of the row max, an all-reduce.
    ``statistics`` (names from TOKEN_STATISTICS) adds ``self.statistics_C``: name -> [C] (is_top1 is
    ``correct_C``), each statistic one more row of the all-reduce."""

    def __init__(self, z_CV, targets_C, probs_CV, vocab_start: int, group, vocab_size: int | None = None,
                 statistics=()):
        rows, local_vocab = z_CV.shape
        local_targets_C = targets_C - vocab_start
        self.in_range_C = (local_targets_C >= 0) & (local_targets_C < local_vocab)
        self.local_targets_C = torch.where(self.in_range_C, local_targets_C, 0)
        self.rows_C = torch.arange(rows, device=z_CV.device)

        local_max_C = z_CV.amax(dim=-1)
        group_size = dist.get_world_size(group)
        max_PC = torch.empty(group_size * rows, dtype=local_max_C.dtype, device=z_CV.device)
        _all_gather_rows(max_PC, local_max_C, group=group)
        max_PC = max_PC.view(group_size, rows)
        self.max_C = max_PC.amax(dim=0)
        # argmax over the full vocabulary, first index on ties (torch.argmax's rule): the lowest rank among
        # those holding the max (ranks hold increasing vocabulary rows), then the first local index
        holder_C = max_PC.argmax(dim=0)
        is_holder_C = holder_C == dist.get_rank(group)
        hits_C = is_holder_C & self.in_range_C & (z_CV.argmax(dim=-1) == self.local_targets_C)

        target_logit_C = torch.where(self.in_range_C, z_CV[self.rows_C, self.local_targets_C], 0.0)
        extra = []  # local partial sums of the statistics, in the order asked for
        if "mean_logits" in statistics:
            extra.append(z_CV.sum(dim=-1))
        torch.sub(z_CV, self.max_C[:, None], out=probs_CV).exp_()
        if "log_sum_sq_probs" in statistics:
            extra.append(torch.linalg.vecdot(probs_CV, probs_CV))  # sum exp(2 (z - max))
        sums_KC = torch.stack([
            probs_CV.sum(dim=-1), torch.linalg.vecdot(probs_CV, z_CV), target_logit_C, hits_C.to(z_CV.dtype), *extra,
        ])
        dist.all_reduce(sums_KC, group=group)
        sum_exp_C, sum_exp_z_C, self.target_logit_C, hits = sums_KC[:4]
        self.correct_C = hits > 0.5
        self.log_z_C = self.max_C + sum_exp_C.log()
        self.entropy_C = self.log_z_C - sum_exp_z_C / sum_exp_C
        self.statistics_C = {}
        extra_sums = iter(sums_KC[4:])
        if "mean_logits" in statistics:
            self.statistics_C["mean_logits"] = next(extra_sums) / vocab_size
        if "log_sum_sq_probs" in statistics:  # log sum_v p_v^2 = log sum exp(2 (z - max)) - 2 log sum exp(z - max)
            self.statistics_C["log_sum_sq_probs"] = next(extra_sums).log() - 2 * sum_exp_C.log()
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
    """Summed NLL, entropy and top-1 hits over the full vocabulary; dNLL/dz formed chunk by chunk in forward.
    ``masked``: targets may be IGNORE_INDEX, whose positions add nothing and get no gradient."""

    def __init__(self, targets_N, vocab_start, group, softcap, temperature, chunk_size, masked: bool = False):
        super().__init__(softcap, temperature, chunk_size)
        self.valid_N = targets_N != IGNORE_INDEX if masked else None
        self.targets_N = targets_N if not masked else torch.where(self.valid_N, targets_N, 0)
        self.vocab_start, self.group = vocab_start, group

    def prepare(self, hidden_ND, need_hidden):
        device = hidden_ND.device
        zeros = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(2)]
        return zeros[0], zeros[1], torch.zeros((), dtype=torch.int64, device=device)

    def forward_chunk(self, chunk, loss, entropy, correct):
        targets_C = self.targets_N[chunk.rows]
        valid_C = None if self.valid_N is None else self.valid_N[chunk.rows]
        stats = _VocabParallelStats(chunk.z_CV, targets_C, chunk.probs_CV, self.vocab_start, self.group)
        loss -= zero_where_ignored(stats.log_probs(), valid_C).sum()
        entropy += zero_where_ignored(stats.entropy_C, valid_C).sum()
        correct += (stats.correct_C if valid_C is None else stats.correct_C & valid_C).sum()
        if chunk.needs_grad:
            stats.subtract_target(chunk.probs_CV)  # softmax(z) - onehot(target), on this rank's columns
            chunk.backpropagate(chunk.probs_CV, None if valid_C is None else valid_C.to(chunk.probs_CV.dtype))


class _VocabParallelLogprobsKernel(ChunkKernel):
    """log p(target) and the entropy per token (and the ``statistics`` asked for); backward recomputes each
    chunk's logits and uses the log Z kept from forward, so it needs no collective."""

    gradient_in_forward = False

    def __init__(self, targets_N, vocab_start, vocab_size, group, softcap, temperature, chunk_size, statistics=()):
        super().__init__(softcap, temperature, chunk_size)
        self.valid_N = targets_N != IGNORE_INDEX
        self.targets_N = torch.where(self.valid_N, targets_N, 0)
        self.vocab_start, self.vocab_size, self.group = vocab_start, vocab_size, group
        self.statistics = _check_statistics(statistics)
        self.log_z_N = None

    def prepare(self, hidden_ND, need_hidden):
        N, device = hidden_ND.shape[0], hidden_ND.device
        self.log_z_N = torch.zeros(N, dtype=torch.float32, device=device)
        outputs = [torch.zeros(N, dtype=torch.float32, device=device) for _ in range(2)]
        for name in self.statistics:
            outputs.append(torch.zeros(N, dtype=torch.bool if name == "is_top1" else torch.float32, device=device))
        return tuple(outputs)

    def forward_chunk(self, chunk, logprobs_N, entropy_N, *statistics_N):
        targets_C = self.targets_N[chunk.rows]
        stats = _VocabParallelStats(chunk.z_CV, targets_C, chunk.probs_CV, self.vocab_start, self.group,
                                    self.vocab_size, self.statistics)
        valid_C = self.valid_N[chunk.rows]
        self.log_z_N[chunk.rows] = stats.log_z_C
        logprobs_N[chunk.rows] = torch.where(valid_C, stats.log_probs(), 0.0)
        entropy_N[chunk.rows] = torch.where(valid_C, stats.entropy_C, 0.0)
        for name, out_N in zip(self.statistics, statistics_N):
            if name == "is_top1":
                out_N[chunk.rows] = stats.correct_C & valid_C
            else:
                out_N[chunk.rows] = torch.where(valid_C, stats.statistics_C[name], 0.0)

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


def _group_log_softmax_parts(group, *z_CV: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each of this rank's logits [C, Vr]: the row max M [C] over the full vocabulary and log sum_v exp(z_v - M)
    [C], so that log softmax(z) = (z - M) - log_sum as accurately as one process's log_softmax. One all-gather of
    each rank's row max and local log-sum, combined over the ranks."""
    local = []
    for z in z_CV:
        max_C = z.amax(dim=-1)
        local += [max_C, torch.sub(z, max_C[:, None]).exp_().sum(dim=-1).log_()]
    local_KC = torch.stack(local)
    K, C = local_KC.shape
    gathered_PKC = torch.empty(dist.get_world_size(group) * K, C, dtype=local_KC.dtype, device=local_KC.device)
    _all_gather_rows(gathered_PKC, local_KC, group=group)
    gathered_PKC = gathered_PKC.view(-1, K, C)
    parts = []
    for k in range(0, K, 2):
        max_PC, log_sum_PC = gathered_PKC[:, k], gathered_PKC[:, k + 1]
        max_C = max_PC.amax(dim=0)
        parts.append((max_C, torch.logsumexp(max_PC - max_C + log_sum_PC, dim=0)))
    return parts


class _VocabParallelGeneralizedJSDKernel(ChunkKernel):
    """Summed JSD_beta and student entropy over the full vocabulary from this rank's rows of the student's and
    the teacher's heads; the student's gradient for its rows is formed chunk by chunk in forward."""

    def __init__(self, teacher_logits_fn, beta, group, temperature, student_softcap, chunk_size):
        super().__init__(student_softcap, temperature, chunk_size)
        self.teacher_logits_fn, self.beta, self.group = teacher_logits_fn, beta, group
        self.num_tokens = 0

    def prepare(self, hidden_ND, need_hidden):
        self.num_tokens = hidden_ND.shape[0]
        return tuple(torch.zeros((), dtype=torch.float32, device=hidden_ND.device) for _ in range(2))

    def forward_chunk(self, chunk, loss, entropy):
        z_t_CV = self.teacher_logits_fn(chunk.rows)
        (max_s_C, log_sum_s_C), (max_t_C, log_sum_t_C) = _group_log_softmax_parts(self.group, chunk.z_CV, z_t_CV)
        # z_CV stays intact (the soft-cap's backward reads it); log p_s goes to the second buffer
        log_ps_CV = torch.sub(chunk.z_CV, max_s_C[:, None], out=chunk.probs_CV).sub_(log_sum_s_C[:, None])
        log_pt_CV = z_t_CV.sub_(max_t_C[:, None]).sub_(log_sum_t_C[:, None])
        ps_CV = log_ps_CV.exp()
        entropy -= torch.linalg.vecdot(ps_CV, log_ps_CV).sum()
        divergence_C, grad_z_CV = self._divergence_and_grad(ps_CV, log_ps_CV, log_pt_CV, chunk.needs_grad)
        loss += divergence_C.sum()
        if chunk.needs_grad:
            chunk.backpropagate(grad_z_CV)
        if chunk.rows.stop == self.num_tokens:  # the last chunk: this rank's partial sums over the group
            sums_2 = torch.stack([loss, entropy])
            dist.all_reduce(sums_2, group=self.group)
            loss.copy_(sums_2[0])
            entropy.copy_(sums_2[1])

    def _divergence_and_grad(self, ps_CV, log_ps_CV, log_pt_CV, needs_grad: bool):
        """This rank's part of JSD_beta per token [C], and dJSD/dz_s on its rows [C, Vr] (None without
        ``needs_grad``); the same cases as the single-process kernel (distillation._divergence_and_grad)."""
        beta = self.beta
        if beta == 0.0:  # KL(p_t || p_s): the gradient p_s - p_t is elementwise
            pt_CV = log_pt_CV.exp()
            divergence_C = torch.linalg.vecdot(pt_CV, log_pt_CV - log_ps_CV)
            return divergence_C, ps_CV.sub_(pt_CV) if needs_grad else None
        if beta == 1.0:  # KL(p_s || p_t)
            gap_CV = log_ps_CV - log_pt_CV
            student_kl_C = torch.linalg.vecdot(ps_CV, gap_CV)
            divergence_C, grad_scale = student_kl_C, 1.0
        else:
            log_m_CV = torch.logaddexp(log_ps_CV + math.log1p(-beta), log_pt_CV + math.log(beta))
            teacher_kl_C = torch.linalg.vecdot(log_pt_CV.exp(), log_pt_CV - log_m_CV)
            gap_CV = log_ps_CV - log_m_CV
            student_kl_C = torch.linalg.vecdot(ps_CV, gap_CV)
            divergence_C, grad_scale = beta * teacher_kl_C + (1 - beta) * student_kl_C, 1 - beta
        if not needs_grad:
            return divergence_C, None
        # through the softmax: p_s * (g - <p_s, g>), the inner product over the full vocabulary
        full_student_kl_C = student_kl_C.clone()
        dist.all_reduce(full_student_kl_C, group=self.group)
        grad_CV = gap_CV.sub_(full_student_kl_C[:, None]).mul_(ps_CV)
        return divergence_C, grad_CV.mul_(grad_scale) if grad_scale != 1.0 else grad_CV


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
    masked: bool = False,
) -> CrossEntropyOutput:
    """Summed NLL of ``targets_N`` under the full-vocabulary softmax, this rank holding rows
    [vocab_start, vocab_start + Vr) of the head.

    hidden_ND: [N, D] states of the label positions (or, with ``masked``, of any positions: those whose target is
    IGNORE_INDEX add nothing, and ``num_tokens`` is then a device scalar), the same on every rank of ``group``.
    weight_VrD: this rank's rows of the [V, D] head. targets_N: [N] token ids in [0, vocab_size).
    Returns the same sums as ``fused_linear_cross_entropy`` (identical on every rank); the gradient it gives
    the hidden states is this rank's share: sum it over the group.
    """
    chunk = _group_chunk_size(hidden_ND, vocab_size, chunk_size)
    kernel = _VocabParallelCrossEntropyKernel(targets_N, vocab_start, group, softcap, temperature, chunk, masked)
    loss, entropy, correct = fused_head_loss(kernel, hidden_ND, weight_VrD)
    return CrossEntropyOutput(loss, entropy, correct, label_count(targets_N, masked))


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
    statistics: tuple[str, ...] = (),
) -> tuple[torch.Tensor, ...]:
    """``fused_linear_token_logprobs`` with the head split by vocabulary rows (arguments as in
    ``vocab_parallel_cross_entropy``; IGNORE_INDEX targets give 0 and no gradient). Returns (logprobs_N,
    entropy_N, *statistics_N), identical on every rank: ``statistics`` names from TOKEN_STATISTICS, [N] each
    in that order (0 / False where ignored; is_top1 bool, the first index winning ties as torch.argmax), without
    gradient. The hidden states' gradient is this rank's share."""
    chunk = _group_chunk_size(hidden_ND, vocab_size, chunk_size)
    kernel = _VocabParallelLogprobsKernel(targets_N, vocab_start, vocab_size, group, softcap, temperature, chunk,
                                          statistics)
    return fused_head_loss(kernel, hidden_ND, weight_VrD)


def vocab_parallel_generalized_jsd(
    student_hidden_ND: torch.Tensor,
    student_weight_VrD: torch.Tensor,
    teacher_hidden_ND: torch.Tensor,
    teacher_weight_VrDt: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group,
    beta: float = 0.5,
    temperature: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    chunk_size: int | None = None,
) -> DistillationOutput:
    """``fused_linear_generalized_jsd`` with both heads split by the same vocabulary rows.

    student_hidden_ND: [N, D] states of the label positions, the same on every rank of ``group``;
    student_weight_VrD: this rank's rows [vocab_start, vocab_start + Vr) of the student's [V, D] head.
    teacher_hidden_ND: [N, Dt], the same on every rank; teacher_weight_VrDt: the same rows of the teacher's
    [V, Dt] head. The teacher gets no gradient. beta in [0, 1]: 0 is KL(teacher || student), 1 is
    KL(student || teacher). Returns the same sums as the single-process loss (identical on every rank); the
    gradient it gives the student's hidden states is this rank's share: sum it over the group.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: the generalized JSD needs 0 <= beta <= 1")
    if teacher_weight_VrDt.shape[0] != student_weight_VrD.shape[0]:
        raise ValueError(
            f"the teacher's head has {teacher_weight_VrDt.shape[0]} rows on this rank, the student's "
            f"{student_weight_VrD.shape[0]}: split both heads' vocabularies the same way"
        )
    teacher_hidden_ND, teacher_weight_VrDt = matmul_inputs(teacher_hidden_ND.detach(), teacher_weight_VrDt.detach())
    teacher_buffer = None

    def teacher_logits_fn(rows: slice) -> torch.Tensor:
        nonlocal teacher_buffer
        h_CD = teacher_hidden_ND[rows]
        if teacher_buffer is None:
            teacher_buffer = ChunkBuffers(h_CD.shape[0], teacher_weight_VrDt.shape[0], h_CD.dtype, h_CD.device,
                                          probs=False)
        z_CV, _, low_CV = teacher_buffer.views(h_CD.shape[0])
        return chunk_logits(h_CD, teacher_weight_VrDt, teacher_softcap, temperature, z_CV, low_CV,
                            teacher_buffer.weight_fp32(teacher_weight_VrDt))

    chunk = _group_chunk_size(student_hidden_ND, vocab_size, chunk_size)
    kernel = _VocabParallelGeneralizedJSDKernel(teacher_logits_fn, beta, group, temperature, student_softcap, chunk)
    loss, entropy = fused_head_loss(kernel, student_hidden_ND, student_weight_VrD)
    return DistillationOutput(loss, entropy, student_hidden_ND.shape[0])


__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_generalized_jsd", "vocab_parallel_token_logprobs"]
