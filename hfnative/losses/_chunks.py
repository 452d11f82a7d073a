"""The chunk loop shared by the fused losses: logits of a chunk of tokens, their softmax statistics,
the projection of a logit gradient back onto the hidden states and the head weight, and the one
autograd wrapper (``fused_head_loss``) that runs a loss's per-chunk ``ChunkKernel`` in that loop.

Shapes: N tokens, D hidden dim, V vocabulary, C tokens in a chunk.

Logits are z = softcap(h @ W.T) / temperature with softcap(x) = cap * tanh(x / cap). The
cross-entropy and log-prob loops keep every [C, V] tensor in two fp32 buffers reused across chunks
(plus one in the input dtype for bf16/fp16; the cross-entropy on CPU in fp32 needs only one, its
softmax running in place); nothing of size [N, V] is ever allocated.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch.utils._pytree import register_dataclass

from hfnative.device_policy import DevicePolicy, device_policy
from hfnative.precision import autocast_dtype

IGNORE_INDEX = -100
# Tokens per chunk: half the hidden size D, so the two [C, V] fp32 buffers together are as large as
# the [V, D] fp32 weight gradient the loss keeps anyway (the loss adds at most that much again to the
# training peak); at least 128 tokens, at most 64M logits (256 MiB) per buffer. Measured on CPU
# (2 cores, fp32, 2040 tokens, forward + backward), against chunks of 512 tokens: V=32000, D=256 -> 128
# tokens, same time (446 vs 446 ms); D=768 -> 384 tokens, +2..4% (128 tokens would be +11%: every
# chunk rereads and rewrites the [V, D] gradient); V=151936, D=256 -> 128 tokens, +4%.
_MIN_CHUNK = 128
_MAX_CHUNK_ELEMENTS = 1 << 26


def head_output(cls: type) -> type:
    """Register ``cls``, a dataclass a head's ``forward`` returns, as a pytree node, so that wrappers which find the
    tensors a module returned by flattening its output see the fields inside. FSDP2 hangs its pre-backward
    all-gather on them: on torch 2.11, which flattens with ``tree_flatten``, an unregistered dataclass hides the
    loss, no all-gather runs before the head unit's backward, and the final norm's backward reads a parameter
    freed after forward (a tied head resharded after forward)."""
    register_dataclass(cls)
    return cls


def chunk_size_for(
    num_tokens: int, vocab_size: int, hidden_size: int, chunk_size: int | None = None, buffers: int = 2,
    chunk_elements: int | None = None,
) -> int:
    """Tokens per chunk: ``chunk_size`` if given; else ``chunk_elements / vocab_size`` when given (a device policy's
    rule, ``hfnative.device_policy``); else hidden_size / 2 within [128, 64M / vocab_size] (hidden_size with a single
    [C, V] buffer: the same scratch memory)."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size}: expected a positive number of tokens")
        return chunk_size
    if chunk_elements is not None:
        return max(1, min(num_tokens, chunk_elements // vocab_size))
    # all buffers together hold as many logits as the [V, D] gradient has entries
    default = min(max(hidden_size // buffers, _MIN_CHUNK * 2 // buffers), max(1, _MAX_CHUNK_ELEMENTS // vocab_size))
    return max(1, min(num_tokens, default))


def matmul_inputs(hidden_ND: torch.Tensor, weight_VD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands in the dtype the projection runs in: the autocast dtype when autocast is on (as
    ``hidden @ weight.T`` would be; gradients flow back through the cast), else their common dtype."""
    dtype = autocast_dtype(hidden_ND.device.type)
    if dtype is not None:
        return hidden_ND.to(dtype), weight_VD.to(dtype)
    if hidden_ND.dtype != weight_VD.dtype:
        raise ValueError(
            f"hidden states are {hidden_ND.dtype} but the head weight is {weight_VD.dtype}: cast one of them, or run "
            "under torch.autocast"
        )
    return hidden_ND, weight_VD


def no_autocast(device: torch.device):
    """The chunk loops choose their own precisions (fp32 softmax, explicit out= buffers)."""
    return torch.autocast(device.type, enabled=False)


@dataclass
class ReplacedRows:
    """Rows ``indices_K`` of the head matrix W taken from ``rows_KD`` instead (peft's trained token rows,
    ``hfnative.peft.token_rows``), without a copy of W: each chunk's product h @ W.T gets those columns from
    h @ rows.T, and their gradient goes to the rows, not to W. K is small (the trained tokens), so the extra work is
    two [C, K] x [K, D]-sized products per chunk; a copy of W with the rows in place would cost a [V, D] tensor and,
    through autograd, a [V, D] gradient."""

    indices_K: torch.Tensor
    rows_KD: torch.Tensor

    def weight(self, weight_VD: torch.Tensor) -> torch.Tensor:
        """W with the rows in place (a new [V, D] tensor): for the paths that materialise the logits."""
        return weight_VD.index_copy(0, self.indices_K, self.rows_KD.to(weight_VD.dtype))

    def put_columns(self, h_CD: torch.Tensor, product_CV: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """In place, and returned: the replaced columns of ``product_CV`` (h @ W.T times ``scale``; any leading
        dimensions) from h @ rows.T times ``scale``, the product formed in h's dtype (the rows' values cast to it, as a
        copy of W would hold them)."""
        columns_CK = h_CD @ self.rows_KD.to(h_CD.dtype).T
        if scale != 1.0:
            columns_CK = columns_CK.mul_(scale)
        return product_CV.index_copy_(-1, self.indices_K, columns_CK.to(product_CV.dtype))

    def take_columns(self, grad_CV: torch.Tensor) -> torch.Tensor:
        """The replaced columns of a logit gradient, in float32 [C, K], zeroed in ``grad_CV`` (W's rows there do not
        reach the logits: they get no gradient, and the hidden states get theirs through the rows)."""
        taken_CK = grad_CV.index_select(1, self.indices_K).float()
        grad_CV.index_fill_(1, self.indices_K, 0)
        return taken_CK


class ChunkBuffers:
    """The [C, V] scratch tensors one chunk loop reuses: logits z (fp32), probabilities/gradient (fp32),
    and, for bf16/fp16 inputs, a low-precision one for the matmuls."""

    def __init__(self, chunk: int, vocab: int, dtype: torch.dtype, device: torch.device, probs: bool = True,
                 fp32_logits: bool = True):
        """``fp32_logits=False``: for bf16/fp16 inputs only the matmul's own [C, V] buffer (a kernel reading the
        product as it is: ``ChunkKernel.reads_matmul_logits``)."""
        low = dtype != torch.float32
        keep_fp32 = fp32_logits or not low
        self.logits = torch.empty(chunk, vocab, dtype=torch.float32, device=device) if keep_fp32 else None
        self.probs = torch.empty(chunk, vocab, dtype=torch.float32, device=device) if probs else None
        self.low_precision = torch.empty(chunk, vocab, dtype=dtype, device=device) if low else None
        self._weight_fp32 = None

    def weight_fp32(self, weight_VD: torch.Tensor) -> torch.Tensor | None:
        """On a CPU without fast kernels for the operands' bf16/fp16 (``cpu_low_precision_is_slow``), the head
        weight in fp32 (its low-precision values, exactly), made once per loop; None elsewhere."""
        if self.low_precision is None or weight_VD.device.type != "cpu":
            return None
        from hfnative.metrics import cpu_low_precision_is_slow  # (metrics imports the models, which import the losses)

        if not cpu_low_precision_is_slow(weight_VD.dtype):
            return None
        if self._weight_fp32 is None:
            self._weight_fp32 = weight_VD.float()
        return self._weight_fp32

    def views(self, rows: int):
        logits = None if self.logits is None else self.logits[:rows]
        probs = None if self.probs is None else self.probs[:rows]
        low = None if self.low_precision is None else self.low_precision[:rows]
        return logits, probs, low


# Many CPUs have no fast bf16/fp16 matmul kernels: a [128, 32000] @ [32000, 256] product took 4.0 s in bf16 against
# 18 ms in fp32 (2-core AMD EPYC without AVX512-BF16, torch 2.13), and the head's two products per chunk were 70% of a
# bf16 SFT step. On such a CPU (``cpu_low_precision_is_slow``, measured once per process) the loops multiply the
# low-precision operands in fp32 (their values exactly, an fp32 sum as the low-precision kernel accumulates) and round
# the product to the input dtype, as that kernel does. The fp32 copy of the head weight costs one [V, D] fp32 tensor.


def chunk_logits(h_CD, weight_VD, softcap, temperature, z_CV, low_CV, weight_fp32_VD=None,
                 replaced: ReplacedRows | None = None) -> torch.Tensor:
    """z = softcap(h @ W.T) / temperature, written into z_CV (fp32). With ``weight_fp32_VD`` (CPU, low-precision
    operands: ``ChunkBuffers.weight_fp32``) the product runs in fp32 and is rounded to the operands' dtype.
    ``replaced``: rows of W read from elsewhere (``ReplacedRows``)."""
    scale = 1.0 / softcap if softcap is not None else 1.0 / temperature
    if low_CV is None:
        if scale == 1.0:
            torch.mm(h_CD, weight_VD.T, out=z_CV)
        else:
            torch.addmm(z_CV, h_CD, weight_VD.T, beta=0.0, alpha=scale, out=z_CV)
        if replaced is not None:
            replaced.put_columns(h_CD, z_CV, scale)
    else:
        if weight_fp32_VD is not None:
            torch.mm(h_CD.float(), weight_fp32_VD.T, out=z_CV)
            if replaced is not None:  # the rows' low-precision values exactly, in fp32 like the rest
                replaced.put_columns(h_CD.float(), z_CV)
            low_CV.copy_(z_CV)
        else:
            torch.mm(h_CD, weight_VD.T, out=low_CV)
            if replaced is not None:
                replaced.put_columns(h_CD, low_CV)
        z_CV.copy_(low_CV)
        if scale != 1.0:
            z_CV.mul_(scale)
    if softcap is not None:
        z_CV.tanh_().mul_(softcap / temperature)
    return z_CV


def softmax_in_place_verified(device: torch.device) -> bool:
    """Whether the chunk loops may softmax the logits buffer in place: checked (bit-identical to the
    out-of-place softmax) on CPU; other devices keep a second buffer."""
    return device.type == "cpu"


class SoftmaxStats:
    """Per-token statistics of one chunk, from z [C, V]; fills probs_CV with softmax(z).

    With ``host_reads`` (a CPU), three cheap passes besides the softmax: the row max (``amax``), the largest
    probability, and the row max with each target masked (the tie check of top-1 accuracy, exact argmax only for
    the rows that tie, found on the host); ``max(dim)``/``argmax`` would give the same but on CPU cost as much as
    the softmax itself. Without (a GPU): one ``max(dim)`` pass gives the max and the argmax, no host read.
    """

    def __init__(self, z_CV: torch.Tensor, targets_C: torch.Tensor, probs_CV: torch.Tensor, host_reads: bool = True):
        """``probs_CV`` may be ``z_CV`` itself: the softmax then overwrites the logits (one buffer instead
        of two; ``entropy`` is unavailable then)."""
        self.rows_C = torch.arange(z_CV.shape[0], device=z_CV.device)  # with targets_C: each row's target entry
        self.target_logit_C = z_CV.gather(1, targets_C[:, None])[:, 0]
        if host_reads:
            max_C = z_CV.amax(dim=-1)
            self.correct_C = top1_matches(z_CV, max_C, self.target_logit_C, targets_C, self.rows_C)
        else:  # torch.max returns the first index of a tied maximum, as argmax does
            max_C, argmax_C = z_CV.max(dim=-1)
            self.correct_C = argmax_C == targets_C
        torch.softmax(z_CV, dim=-1, out=probs_CV)
        # the largest probability is exp(0) / sum(exp(z - max)) >= 1/V, never underflows: log Z = max - log p_max
        self.log_z_C = max_C - probs_CV.amax(dim=-1).log()
        self.probs_CV = probs_CV
        self._z_CV = None if probs_CV is z_CV else z_CV

    def log_probs(self) -> torch.Tensor:
        return self.target_logit_C - self.log_z_C

    def entropy(self, overwrite_logits: bool) -> torch.Tensor:
        """H = log Z - sum_v p_v z_v. With ``overwrite_logits`` the product p * z is formed in the logits
        buffer (faster than a batched dot product); otherwise a temporary [C, V] is allocated."""
        if self._z_CV is None:
            raise RuntimeError("the softmax overwrote the logits (probs_CV is z_CV): no entropy from them")
        if overwrite_logits:
            expected_z_C = self._z_CV.mul_(self.probs_CV).sum(dim=-1)
        else:
            expected_z_C = torch.linalg.vecdot(self.probs_CV, self._z_CV)
        return self.log_z_C - expected_z_C


def top1_matches(z_CV, max_C, target_logit_C, targets_C, rows_C) -> torch.Tensor:
    """argmax(z) == target per row, with ``torch.argmax``'s rule for tied maxima (the first index wins).

    A row matches when its target logit is the row max and no other entry reaches it; the max over
    the row with the target masked decides that. Rows where another entry ties the max (rare) get
    an exact argmax. z_CV is restored before returning.
    """
    hits_C = target_logit_C == max_C
    z_CV[rows_C, targets_C] = float("-inf")
    others_max_C = z_CV.amax(dim=-1)
    z_CV[rows_C, targets_C] = target_logit_C
    tied_C = hits_C & (others_max_C == max_C)
    if tied_C.any():
        tied = tied_C.nonzero()[:, 0]
        hits_C[tied] = z_CV[tied].argmax(dim=-1) == targets_C[tied]
    return hits_C


def expected_logit_from_hidden_grad(h_CD, grad_hidden_CD, target_logit_C) -> torch.Tensor:
    """sum_v p_v z_v per row, from the hidden-state gradient of the chunk instead of a pass over [C, V].

    With z = h @ W.T / T (no soft-cap) and g = dNLL/dh = (p - onehot(t)) @ W / T:
    h . g = sum_v p_v z_v - z_t, so the expectation is h . g + z_t: O(C * D) instead of O(C * V).
    """
    return torch.linalg.vecdot(h_CD.float(), grad_hidden_CD.float()) + target_logit_C


def logit_grad_to_raw(grad_z_CV, z_CV, softcap, temperature) -> None:
    """In place: dL/dz -> dL/d(h @ W.T) without the 1/temperature factor (folded into the matmuls).

    With soft-capping, dz/draw = (1 - tanh^2) / temperature and tanh = z * temperature / cap.
    Overwrites z_CV.
    """
    if softcap is not None:
        tanh_sq = z_CV.mul_(temperature / softcap).square_()
        grad_z_CV.addcmul_(grad_z_CV, tanh_sq, value=-1.0)


class HeadGradients:
    """Accumulates dL/dh [N, D] and dL/dW [V, D] from each chunk's dL/draw [C, V].

    Without ``block_rows`` (the CPU rule) chunk by chunk: dL/dW summed in fp32 with one addmm per chunk; for
    bf16/fp16 inputs on CPU the addmm runs in fp32 (CPU has no mixed-precision addmm), on accelerators in the input
    precision. With ``block_rows`` (a GPU policy's ``head_gradient_block_elements``) the chunks' dL/draw are held in
    the matmul dtype for up to that many rows, and each block makes its part of dL/dh and dL/dW with one GEMM each
    (a single block: the weight's gradient never exists in fp32); dL/dh is then ready only at ``finish``.

    ``replaced`` (``ReplacedRows``): the replaced columns of each dL/draw are taken out before the GEMMs (W's rows
    there get none) and make dL/dh's share through the rows and dL/drows [K, D] (fp32 sums; ``need_rows``).
    """

    def __init__(self, hidden_ND, weight_VD, need_hidden: bool, need_weight: bool, scale: float,
                 block_rows: int | None = None, replaced: ReplacedRows | None = None, need_rows: bool = False):
        self.hidden_ND, self.weight_VD, self.scale = hidden_ND, weight_VD, scale
        self.replaced = replaced
        self.grad_rows = (torch.zeros(replaced.rows_KD.shape, dtype=torch.float32, device=weight_VD.device)
                          if replaced is not None and need_rows else None)
        self.block_rows = block_rows
        self.grad_hidden = torch.empty_like(hidden_ND) if need_hidden else None
        self.need_weight = need_weight
        self.grad_weight = (
            torch.empty(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
            if need_weight and block_rows is None else None
        )
        self._weight_started = False
        self._held = None  # [block_rows, V] in the matmul dtype: the current block's dL/draw
        self._held_start = self._held_rows = 0

    @property
    def defers_hidden(self) -> bool:
        """Whether a chunk's dL/dh is made only when its block is (not when the chunk is added)."""
        return self.block_rows is not None

    def add_chunk(self, start: int, grad_raw_CV, h_CD, low_CV, weight_fp32_VD=None, row_scale_C=None) -> None:
        """Overwrites grad_raw_CV when ``weight_fp32_VD`` or ``row_scale_C`` is given (CPU, low precision: dL/dh in
        fp32). ``row_scale_C``: each row of grad_raw_CV multiplied by it first (in blocks: as it is held, one pass)."""
        if self.block_rows is not None:
            self._hold(start, grad_raw_CV, row_scale_C)
            return
        if row_scale_C is not None:
            grad_raw_CV.mul_(row_scale_C[:, None])
        taken_CK = self.replaced.take_columns(grad_raw_CV) if self.replaced is not None else None
        rows = h_CD.shape[0]
        low_precision = low_CV is not None
        if low_precision:
            low_CV.copy_(grad_raw_CV)
        if self.grad_hidden is not None and weight_fp32_VD is None:
            out = self.grad_hidden[start : start + rows]
            torch.addmm(out, low_CV if low_precision else grad_raw_CV, self.weight_VD, beta=0.0, alpha=self.scale,
                        out=out)
        if self.grad_weight is not None:
            beta = 1.0 if self._weight_started else 0.0
            if not low_precision:
                torch.addmm(self.grad_weight, grad_raw_CV.T, h_CD, beta=beta, alpha=self.scale, out=self.grad_weight)
            elif grad_raw_CV.device.type == "cpu":
                torch.addmm(
                    self.grad_weight, grad_raw_CV.T, h_CD.float(), beta=beta, alpha=self.scale, out=self.grad_weight
                )
            else:
                chunk_grad = torch.mm(low_CV.T, h_CD)
                if self._weight_started:
                    self.grad_weight.add_(chunk_grad, alpha=self.scale)
                else:
                    torch.mul(chunk_grad, self.scale, out=self.grad_weight)
            self._weight_started = True
        if self.grad_hidden is not None and weight_fp32_VD is not None:  # after dL/dW, which reads grad_raw_CV
            grad_raw_CV.copy_(low_CV)  # the gradient rounded as the low-precision product would see it
            self.grad_hidden[start : start + rows].copy_(torch.mm(grad_raw_CV, weight_fp32_VD).mul_(self.scale))
        if taken_CK is not None:
            self._add_replaced(start, taken_CK, h_CD)

    def _add_replaced(self, start: int, taken_CK: torch.Tensor, h_CD: torch.Tensor) -> None:
        """The replaced columns' share: dL/dh += g @ rows and dL/drows += g.T @ h (g: their dL/draw, fp32)."""
        if self.grad_hidden is not None:
            out = self.grad_hidden[start : start + h_CD.shape[0]]
            out.add_(torch.mm(taken_CK, self.replaced.rows_KD.float()).mul_(self.scale))
        if self.grad_rows is not None:
            self.grad_rows.addmm_(taken_CK.T, h_CD.float(), alpha=self.scale)

    def hold_slot(self, start: int, rows: int) -> torch.Tensor:
        """In block mode (``defers_hidden``): the held rows [rows, V] (matmul dtype) where the chunk starting at token
        ``start`` puts its dL/draw, for the block's GEMMs to read."""
        if self._held is None:
            block = min(self.block_rows, self.hidden_ND.shape[0])
            self._held = torch.empty(block, self.weight_VD.shape[0], dtype=self.weight_VD.dtype,
                                     device=self.weight_VD.device)
        if self._held_rows + rows > self._held.shape[0]:
            self._flush()
        if self._held_rows == 0:
            self._held_start = start
        held_CV = self._held[self._held_rows : self._held_rows + rows]
        self._held_rows += rows
        return held_CV

    def _hold(self, start: int, grad_raw_CV, row_scale_C=None) -> None:
        held_CV = self.hold_slot(start, grad_raw_CV.shape[0])
        if row_scale_C is None:
            held_CV.copy_(grad_raw_CV)
        else:
            torch.mul(grad_raw_CV, row_scale_C[:, None], out=held_CV)

    def _flush(self) -> None:
        """The held block's dL/dh rows and its part of dL/dW: one GEMM each."""
        rows, start = self._held_rows, self._held_start
        if rows == 0:
            return
        grad_CV = self._held[:rows]
        taken_CK = self.replaced.take_columns(grad_CV) if self.replaced is not None else None
        if self.grad_hidden is not None:
            out = self.grad_hidden[start : start + rows]
            torch.addmm(out, grad_CV, self.weight_VD, beta=0.0, alpha=self.scale, out=out)
        if self.need_weight:
            part_VD = torch.mm(grad_CV.T, self.hidden_ND[start : start + rows])
            if self.grad_weight is None:
                self.grad_weight = part_VD
            else:  # a second block: the sum in fp32
                if self.grad_weight.dtype != torch.float32:
                    self.grad_weight = self.grad_weight.float()
                self.grad_weight.add_(part_VD)
            self._weight_started = True
        if taken_CK is not None:
            self._add_replaced(start, taken_CK, self.hidden_ND[start : start + rows])
        self._held_rows = 0

    def finish(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """dL/dh, dL/dW and dL/drows (None where not wanted)."""
        grad_weight = self.grad_weight
        if self.block_rows is not None:
            self._flush()
            self._held = None
            grad_weight = self.grad_weight
            if self.need_weight:
                if grad_weight is None:  # no tokens
                    grad_weight = torch.zeros_like(self.weight_VD)
                elif self.scale != 1.0:
                    grad_weight.mul_(self.scale)
        elif grad_weight is not None and not self._weight_started:  # no tokens
            grad_weight.zero_()
        grad_weight = None if grad_weight is None else grad_weight.to(self.weight_VD.dtype)
        grad_rows = None if self.grad_rows is None else self.grad_rows.to(self.replaced.rows_KD.dtype)
        return self.grad_hidden, grad_weight, grad_rows


class Chunk:
    """Rows ``rows`` of the loop: their states h_CD, logits z_CV (fp32), a second fp32 buffer probs_CV (z_CV
    itself when the kernel's softmax runs in place) and, when gradients are wanted, where dL/dz goes."""

    def __init__(self, start, h_CD, z_CV, probs_CV, low_CV, kernel: ChunkKernel, grads: HeadGradients | None,
                 weight_fp32_VD=None):
        self.rows = slice(start, start + h_CD.shape[0])
        self.h_CD, self.z_CV, self.probs_CV, self.low_CV = h_CD, z_CV, probs_CV, low_CV
        self.weight_fp32_VD = weight_fp32_VD
        self.needs_grad = grads is not None
        self._kernel, self._grads = kernel, grads

    def gradient_slot(self) -> torch.Tensor | None:
        """Where a kernel may write this chunk's dL/dz [C, V] itself (the matmul dtype; no soft-cap), when the
        gradients are made per block (``HeadGradients.defers_hidden``); else None (``backpropagate`` then)."""
        if not self.needs_grad or not self._grads.defers_hidden:
            return None
        return self._grads.hold_slot(self.rows.start, self.h_CD.shape[0])

    def backpropagate(self, grad_z_CV: torch.Tensor, row_scale_C: torch.Tensor | None = None) -> torch.Tensor | None:
        """Adds this chunk's share of dL/dh and dL/dW from dL/dz [C, V] (times ``row_scale_C`` [C] per row when given,
        e.g. 0 for ignored rows; overwrites it and z_CV); returns the chunk's rows of dL/dh [C, D] (None when the
        hidden states need no gradient, or when the gradients are made per block: ``HeadGradients.defers_hidden``)."""
        logit_grad_to_raw(grad_z_CV, self.z_CV, self._kernel.softcap, self._kernel.temperature)
        self._grads.add_chunk(self.rows.start, grad_z_CV, self.h_CD, self.low_CV, self.weight_fp32_VD, row_scale_C)
        if self._grads.grad_hidden is None or self._grads.defers_hidden:
            return None
        return self._grads.grad_hidden[self.rows]


class ChunkKernel(abc.ABC):
    """What one fused loss computes on each chunk of its logits z = softcap(h @ W.T) / temperature; ``fused_head_loss``
    runs the chunk loop and the autograd plumbing around it.

    With ``gradient_in_forward`` (a scalar loss) forward_chunk hands dL/dz to ``chunk.backpropagate`` and backward only
    scales the result by the upstream gradient; otherwise (a loss per token, its upstream gradient known only in
    backward) backward recomputes each chunk's logits and calls backward_chunk.
    """

    gradient_in_forward = True
    softmax_in_place = False  # True: one [C, V] buffer, chunk.probs_CV is chunk.z_CV
    # True: forward_chunk reads the matmul's product itself (chunk.low_CV for bf16/fp16 inputs; no fp32 copy, no
    # second buffer) and scales it by 1 / temperature (no soft-cap)
    reads_matmul_logits = False
    replaced: ReplacedRows | None = None  # rows of W read from elsewhere, set by fused_head_loss
    policy: DevicePolicy  # the device's trades (hfnative.device_policy), set by fused_head_loss before prepare

    def __init__(self, softcap: float | None, temperature: float, chunk_size: int | None):
        self.softcap, self.temperature, self.chunk_size = softcap, temperature, chunk_size

    def new_gradients(self, hidden_ND, weight_VD, need_hidden: bool, need_weight: bool,
                      need_rows: bool = False) -> HeadGradients:
        """Where the chunks' gradients go: chunk by chunk (CPU rule) or in blocks (the policy's)."""
        block_rows = None
        if self.gradients_in_blocks():
            elements = self.policy.head_gradient_block_elements
            chunk = self.chunk_rows(hidden_ND.shape[0], weight_VD)
            block_rows = max(chunk, elements // weight_VD.shape[0] // chunk * chunk)
        return HeadGradients(hidden_ND, weight_VD, need_hidden, need_weight, 1.0 / self.temperature, block_rows,
                             self.replaced, need_rows)

    def gradients_in_blocks(self) -> bool:
        """Whether the chunks' gradients are held and made per block (the policy's rule, unless a chunk size is
        given)."""
        return self.policy.head_gradient_block_elements is not None and self.chunk_size is None

    def chunk_rows(self, num_tokens: int, weight_VD) -> int:
        return chunk_size_for(num_tokens, weight_VD.shape[0], weight_VD.shape[1], self.chunk_size,
                              buffers=1 if self.softmax_in_place else 2, chunk_elements=self.policy.head_chunk_elements)

    @abc.abstractmethod
    def prepare(self, hidden_ND: torch.Tensor, need_hidden: bool) -> tuple[torch.Tensor, ...]:
        """Before the forward loop, with the operands in their matmul dtype: the outputs to accumulate into (the
        first one differentiable, the rest statistics). May set ``softmax_in_place``."""

    @abc.abstractmethod
    def forward_chunk(self, chunk: Chunk, *outputs: torch.Tensor) -> None:
        """Adds the chunk's part to the outputs (in place); with gradient_in_forward, passes dL/dz on when
        ``chunk.needs_grad``."""

    def backward_chunk(self, chunk: Chunk, grad_output: torch.Tensor) -> None:
        """Only without ``gradient_in_forward``: hands the chunk's dL/dz under grad_output to chunk.backpropagate."""
        raise TypeError(f"{type(self).__name__} sets gradient_in_forward = False, so it must define backward_chunk")


def _for_each_chunk(kernel: ChunkKernel, hidden_ND, weight_VD, grads: HeadGradients | None, step) -> None:
    """Computes each chunk's logits and calls step(chunk); the [C, V] buffers are freed on return."""
    N, V = hidden_ND.shape[0], weight_VD.shape[0]
    one_buffer = kernel.softmax_in_place
    chunk = kernel.chunk_rows(N, weight_VD)
    lean = kernel.reads_matmul_logits
    buffers = (ChunkBuffers(min(chunk, N), V, hidden_ND.dtype, hidden_ND.device, probs=not (one_buffer or lean),
                            fp32_logits=not lean) if N else None)
    weight_fp32_VD = buffers.weight_fp32(weight_VD) if N else None
    for start in range(0, N, chunk):
        h_CD = hidden_ND[start : start + chunk]
        z_CV, probs_CV, low_CV = buffers.views(h_CD.shape[0])
        if lean:  # the product alone, in the matmul's dtype: the kernel scales it
            product_CV = low_CV if low_CV is not None else z_CV
            torch.mm(h_CD, weight_VD.T, out=product_CV)
            if kernel.replaced is not None:
                kernel.replaced.put_columns(h_CD, product_CV)
        else:
            chunk_logits(h_CD, weight_VD, kernel.softcap, kernel.temperature, z_CV, low_CV, weight_fp32_VD,
                         kernel.replaced)
        step(Chunk(start, h_CD, z_CV, z_CV if one_buffer else probs_CV, low_CV, kernel, grads, weight_fp32_VD))


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: ChunkKernel, hidden_ND, weight_VD, rows_KD, need_hidden: bool, need_weight: bool,
                need_rows: bool):
        """``rows_KD``: ``kernel.replaced``'s rows (an input here for their gradient), or None."""
        grads = None
        with no_autocast(hidden_ND.device):
            outputs = kernel.prepare(hidden_ND, need_hidden)
        if kernel.gradient_in_forward and (need_hidden or need_weight or need_rows):
            grads = kernel.new_gradients(hidden_ND, weight_VD, need_hidden, need_weight, need_rows)
        with no_autocast(hidden_ND.device):
            _for_each_chunk(kernel, hidden_ND, weight_VD, grads, lambda chunk: kernel.forward_chunk(chunk, *outputs))
        if grads is not None:
            ctx.save_for_backward(*grads.finish())
        elif not kernel.gradient_in_forward:  # the rows saved too: autograd then checks they are not changed in place
            ctx.save_for_backward(hidden_ND, weight_VD, rows_KD)
        ctx.kernel = None if kernel.gradient_in_forward else kernel  # it holds no outputs: no reference cycle
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_output, *_grad_statistics):
        kernel = ctx.kernel
        if kernel is None:
            # in place: no second [V, D] tensor; a second backward (retain_graph=True) then fails autograd's
            # saved-tensor version check instead of applying the scale twice
            grads = [None if grad is None else _scaled_in_place(grad, grad_output) for grad in ctx.saved_tensors]
        else:
            hidden_ND, weight_VD, rows_KD = ctx.saved_tensors
            if rows_KD is not None:
                kernel.replaced = ReplacedRows(kernel.replaced.indices_K, rows_KD)
            need_hidden, need_weight, need_rows = ctx.needs_input_grad[1:4]
            recomputed = kernel.new_gradients(hidden_ND, weight_VD, need_hidden, need_weight, need_rows)
            with no_autocast(hidden_ND.device):
                _for_each_chunk(kernel, hidden_ND, weight_VD, recomputed,
                                lambda chunk: kernel.backward_chunk(chunk, grad_output))
            grads = recomputed.finish()
        return None, *grads, None, None, None


_SCALED_ROWS = 1 << 14  # rows a block when a low-precision gradient is scaled through float32


def _scaled_in_place(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grad * scale`` into ``grad``, the product formed in float32: a bf16/fp16 gradient times the upstream
    gradient (a float32 scalar such as 1 / the step's token count) rounds once, as autograd's float32 loss would give
    it, not after the scale itself was rounded to the gradient's dtype (a bias of up to 0.4% on every entry). Row
    blocks keep the float32 temporary small (a [V, D] head gradient would double)."""
    if grad.dtype in (torch.float32, torch.float64):
        return grad.mul_(scale)
    for block in grad.split(_SCALED_ROWS):
        block.copy_(block.float().mul_(scale))
    return grad


def fused_head_loss(kernel: ChunkKernel, hidden_ND: torch.Tensor, weight_VD: torch.Tensor,
                    replaced_rows: ReplacedRows | None = None) -> tuple[torch.Tensor, ...]:
    """The kernel's outputs over hidden [N, D] and the head weight [V, D] (projected in the dtype ``matmul_inputs``
    gives); the first output is differentiable w.r.t. both, the others are statistics without gradient.
    ``replaced_rows``: rows of the weight read from there instead (``ReplacedRows``; differentiable w.r.t. them)."""
    hidden_ND, weight_VD = matmul_inputs(hidden_ND, weight_VD)
    kernel.policy = device_policy(hidden_ND.device)
    rows_KD = None
    if replaced_rows is not None:  # in the matmul dtype, the values a copy of the weight would hold
        rows_KD = replaced_rows.rows_KD.to(weight_VD.dtype)
        kernel.replaced = ReplacedRows(replaced_rows.indices_K, rows_KD)
    grad_enabled = torch.is_grad_enabled()
    need_hidden, need_weight = grad_enabled and hidden_ND.requires_grad, grad_enabled and weight_VD.requires_grad
    need_rows = grad_enabled and rows_KD is not None and rows_KD.requires_grad
    return _FusedHeadLoss.apply(kernel, hidden_ND, weight_VD, rows_KD, need_hidden, need_weight, need_rows)
