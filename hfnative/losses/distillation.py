"""Knowledge distillation: the generalized Jensen-Shannon divergence between the student's and the
teacher's next-token distributions, fused with the student's head and chunked over tokens.

Shapes: N tokens, D student hidden dim, Dt teacher hidden dim, V vocabulary (shared), C chunk.

p_s = softmax(z_s / T), p_t = softmax(z_t / T), m = beta p_t + (1 - beta) p_s,
JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m), summed over the vocabulary;
beta = 0 is KL(p_t || p_s) and beta = 1 is KL(p_s || p_t) (TRL's generalized_jsd_loss).
As in the fused cross-entropy, the gradient w.r.t. the student's hidden states and head is formed
chunk by chunk during forward; the teacher gets none. Nothing of size [N, V] is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._chunks import (
    IGNORE_INDEX,
    ChunkBuffers,
    ChunkKernel,
    ReplacedRows,
    chunk_logits,
    fused_head_loss,
    head_output,
    matmul_inputs,
    softmax_in_place_verified,
)


@head_output
@dataclass
class DistillationOutput:
    """Sums over the tokens; divide by the step's token count to get means."""

    loss_sum: torch.Tensor  # scalar, differentiable w.r.t. the student
    student_entropy_sum: torch.Tensor  # scalar, no grad: entropy of p_s (at the temperature)
    num_tokens: int | torch.Tensor  # an int when counted on the host, else a device scalar (int64)


class _Scratch:
    """[C, V] fp32 tensors one chunk loop reuses from chunk to chunk (the first chunk is the largest)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, like_CV: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None:
            buffer = self._buffers[name] = torch.empty_like(like_CV, memory_format=torch.contiguous_format)
        return buffer[: like_CV.shape[0]]


def _divergence_and_grad(log_ps_CV, log_pt_CV, beta: float, scratch: _Scratch, spare_CV=None):
    """Per-token JSD_beta [C] and dJSD/dz_s [C, V] (z_s the student's logits after temperature), given log p_s and
    log p_t. log_pt_CV is overwritten; the [C, V] intermediates live in ``scratch`` (two tensors there at most;
    ``spare_CV``, a [C, V] tensor the caller no longer needs, serves as the second), so a chunk allocates nothing of
    that size. p_s is not kept: exp(log p_s) is formed again where it is needed, in whichever of those tensors is free
    then. Each value is the same op on the same operands as the plain formulas."""
    second = (lambda: scratch("b", log_pt_CV)) if spare_CV is None else (lambda: spare_CV)
    if beta == 0.0:
        pt_CV = torch.exp(log_pt_CV, out=scratch("a", log_pt_CV))
        # pt * (log pt - log ps), the difference formed in log pt's place
        divergence_C = log_pt_CV.sub_(log_ps_CV).mul_(pt_CV).sum(-1)
        return divergence_C, torch.exp(log_ps_CV, out=second()).sub_(pt_CV)
    if beta == 1.0:
        gap_CV = torch.sub(log_ps_CV, log_pt_CV, out=log_pt_CV)
        divergence_C = torch.exp(log_ps_CV, out=scratch("a", gap_CV)).mul_(gap_CV).sum(-1)
        # dKL(p_s||p_t)/dz_s = p_s * (log p_s - log p_t - KL)
        return divergence_C, gap_CV.sub_(divergence_C[:, None]).mul_(torch.exp(log_ps_CV, out=scratch("a", gap_CV)))
    log_m_CV = torch.add(log_ps_CV, math.log1p(-beta), out=scratch("a", log_ps_CV))
    teacher_part_CV = torch.add(log_pt_CV, math.log(beta), out=second())
    log_m_CV = torch.logaddexp(log_m_CV, teacher_part_CV, out=log_m_CV)
    # p_t * (log p_t - log m): p_t in the second tensor, the difference in log p_t's place
    pt_CV = torch.exp(log_pt_CV, out=teacher_part_CV)
    kl_teacher_C = log_pt_CV.sub_(log_m_CV).mul_(pt_CV).sum(-1)
    student_gap_CV = torch.sub(log_ps_CV, log_m_CV, out=log_m_CV)
    ps_CV = torch.exp(log_ps_CV, out=pt_CV)
    kl_student_C = ps_CV.mul_(student_gap_CV).sum(-1)
    divergence_C = beta * kl_teacher_C + (1 - beta) * kl_student_C
    # dJSD/dp_s = (1 - beta)(log p_s - log m); through the softmax: p_s * (g - <p_s, g>)
    ps_CV = torch.exp(log_ps_CV, out=ps_CV)
    grad_CV = student_gap_CV.sub_(kl_student_C[:, None]).mul_(ps_CV).mul_(1 - beta)
    return divergence_C, grad_CV


def generalized_jsd_terms(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalized JSD's terms per vocabulary entry ([..., V], summing over V gives JSD_beta per token), from
    log p_s and log p_t [..., V]; differentiable in both (the unfused form, for logits that are already there)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: the generalized JSD needs 0 <= beta <= 1")
    if beta == 0.0:  # KL(p_t || p_s)
        return teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)
    if beta == 1.0:  # KL(p_s || p_t)
        return student_log_probs.exp() * (student_log_probs - teacher_log_probs)
    log_m = torch.logaddexp(student_log_probs + math.log1p(-beta), teacher_log_probs + math.log(beta))
    kl_teacher = teacher_log_probs.exp() * (teacher_log_probs - log_m)
    kl_student = student_log_probs.exp() * (student_log_probs - log_m)
    return beta * kl_teacher + (1 - beta) * kl_student


class _GeneralizedJSDKernel(ChunkKernel):
    """Summed JSD_beta and student entropy; the student's gradients are formed chunk by chunk in forward.
    ``teacher_logits_fn(rows)`` returns a [C, V] fp32 tensor the kernel may overwrite. ``valid_N``: the positions
    that count (the others add nothing and get no gradient); None: all of them."""

    def __init__(self, teacher_logits_fn, beta, temperature, student_softcap, chunk_size, valid_N=None):
        super().__init__(student_softcap, temperature, chunk_size)
        self.teacher_logits_fn, self.beta, self.valid_N = teacher_logits_fn, beta, valid_N
        self.scratch = _Scratch()

    def prepare(self, hidden_ND, need_hidden):
        return tuple(torch.zeros((), dtype=torch.float32, device=hidden_ND.device) for _ in range(2))

    def forward_chunk(self, chunk, loss, entropy):
        log_ps_CV = torch.log_softmax(chunk.z_CV, dim=-1, out=chunk.probs_CV)
        z_t_CV = self.teacher_logits_fn(chunk.rows)
        in_place = softmax_in_place_verified(z_t_CV.device)
        log_pt_CV = torch.log_softmax(z_t_CV, dim=-1, out=z_t_CV if in_place else self.scratch("log_pt", z_t_CV))
        valid_C = None if self.valid_N is None else self.valid_N[chunk.rows]
        # p_s * log p_s, p_s formed in the scratch tensor
        plogp_CV = torch.exp(log_ps_CV, out=self.scratch("a", log_ps_CV)).mul_(log_ps_CV)
        entropy -= plogp_CV.sum() if valid_C is None else torch.where(valid_C, plogp_CV.sum(-1), 0.0).sum()
        # without a soft-cap the backward of the logits does not read them: z_s's buffer is free from here
        spare_CV = chunk.z_CV if self.softcap is None else None
        divergence_C, grad_z_CV = _divergence_and_grad(log_ps_CV, log_pt_CV, self.beta, self.scratch, spare_CV)
        loss += (divergence_C if valid_C is None else torch.where(valid_C, divergence_C, 0.0)).sum()
        if chunk.needs_grad:
            chunk.backpropagate(grad_z_CV, None if valid_C is None else valid_C.to(grad_z_CV.dtype))


def fused_linear_generalized_jsd(
    student_hidden_ND: torch.Tensor,
    student_weight_VD: torch.Tensor,
    teacher_hidden_ND: torch.Tensor | None = None,
    teacher_weight_VD: torch.Tensor | None = None,
    teacher_logits_NV: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    chunk_size: int | None = None,
    targets_N: torch.Tensor | None = None,
    student_replaced_rows: ReplacedRows | None = None,
) -> DistillationOutput:
    """Summed generalized JSD between student softmax(softcap(h_s @ W_s.T) / T) and the teacher's.

    student_hidden_ND: [N, D] states of the label positions only, or, with ``targets_N`` [N], of any positions:
    those whose target is IGNORE_INDEX add nothing (``num_tokens`` is then a device scalar); student_weight_VD: [V, D].
    The teacher is either its states and head (teacher_hidden_ND [N, Dt], teacher_weight_VD [V, Dt],
    projected chunk by chunk, with teacher_softcap) or its final logits teacher_logits_NV [N, V]
    (soft-capping already applied; divided by the temperature here). The teacher gets no gradient.
    beta in [0, 1]: 0 is KL(teacher || student), 1 is KL(student || teacher).
    student_replaced_rows: rows of the student's weight read from elsewhere (trained token rows: ``ReplacedRows``).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: the generalized JSD needs 0 <= beta <= 1")
    from_logits = teacher_logits_NV is not None
    if from_logits == (teacher_hidden_ND is not None or teacher_weight_VD is not None):
        raise ValueError("pass the teacher either as teacher_logits_NV or as teacher_hidden_ND and teacher_weight_VD")
    num_tokens, vocab = student_hidden_ND.shape[0], student_weight_VD.shape[0]
    teacher_vocab = teacher_logits_NV.shape[-1] if from_logits else teacher_weight_VD.shape[0]
    if teacher_vocab != vocab:
        raise ValueError(f"the teacher's vocabulary ({teacher_vocab}) differs from the student's ({vocab})")

    if from_logits:
        teacher_logits_NV = teacher_logits_NV.detach()

        def teacher_logits_fn(rows: slice):
            return teacher_logits_NV[rows].float() / temperature
    else:
        teacher_hidden_ND, teacher_weight_VD = matmul_inputs(teacher_hidden_ND.detach(), teacher_weight_VD.detach())
        teacher_buffer = None

        def teacher_logits_fn(rows: slice):
            nonlocal teacher_buffer
            h_CD = teacher_hidden_ND[rows]
            if teacher_buffer is None:
                teacher_buffer = ChunkBuffers(h_CD.shape[0], vocab, h_CD.dtype, h_CD.device, probs=False)
            z_CV, _, low_CV = teacher_buffer.views(h_CD.shape[0])
            return chunk_logits(h_CD, teacher_weight_VD, teacher_softcap, temperature, z_CV, low_CV,
                                teacher_buffer.weight_fp32(teacher_weight_VD))

    valid_N = None if targets_N is None else targets_N != IGNORE_INDEX
    kernel = _GeneralizedJSDKernel(teacher_logits_fn, beta, temperature, student_softcap, chunk_size, valid_N)
    loss, entropy = fused_head_loss(kernel, student_hidden_ND, student_weight_VD, student_replaced_rows)
    return DistillationOutput(loss, entropy, num_tokens if valid_N is None else valid_N.sum())
