"""One block of context parallelism's ring attention (``hfnative.parallel.context_parallel``): a query chunk over a key
chunk, its output and log-sum-exp, and its backward given the ring's merged output and log-sum-exp.

Shapes: B batch, c chunk length, H heads (keys and values already repeated to the query heads), d head_dim.

A block is causal (the diagonal), full (earlier keys) or masked (documents, padding or a sliding window cut in). A
masked block's mask is a ``BlockMask``: [B, c] vectors (its queries' and keys' documents, which keys are real), made
into a mask for a run of query rows when a kernel needs it, never kept as a [B, c, c] matrix. The kernels
(``block_kernel``):
- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, any block (a masked block's whole mask
  made once per batch);
- CUDA in bf16/fp16 on Ampere or later: ``aten._scaled_dot_product_flash_attention`` and its backward for causal and
  full blocks, and for a masked block of packed documents one such call per document's segment (its query rows over
  its key columns; at most ``_MAX_SEGMENTS``);
- otherwise (windows, padding keys, float32): an explicit softmax over the block's scores, a run of query rows at a
  time (at most ``_MATH_SCORE_ELEMENTS`` scores at once).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

# block kinds
CAUSAL, FULL, MASKED = "causal", "full", "masked"


@dataclass(eq=False)
class BlockMask:
    """Which keys of a (query chunk, key chunk) block each query may see, made for a run of query rows when a kernel
    needs it, from the block's positions and [B, c] vectors (documents, padding), never kept as a [B, c, c] matrix:
    causal, within the sliding window, within the query's document, not padding; every query of a diagonal block
    sees itself (so padding rows stay finite, as the dense plan's)."""

    query_chunk: int
    key_chunk: int
    chunk_len: int
    window: int | None = None
    doc_q: torch.Tensor | None = None  # [B, c] the queries' document ids
    doc_k: torch.Tensor | None = None  # [B, c] the keys' document ids
    real_k: torch.Tensor | None = None  # [B, c] bool: the key is a real token
    # packed documents only (no window, no padding key): per row, each document's query rows and key columns in the
    # block, (row, q_start, q_end, k_start, k_end), attended whole (off the diagonal) or causally (on it) by a kernel
    # that takes no mask; None where the block is not so made (host ints, made with the plan)
    segments: tuple | None = None
    # the whole additive mask per (dtype, device), for a kernel that takes the whole block at once (the CPU flash
    # kernel: every layer of the batch reuses it)
    _whole: dict = field(default_factory=dict, repr=False)

    def whole(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``additive`` for every query row, made once per batch."""
        if (dtype, device) not in self._whole:
            self._whole[dtype, device] = self.additive(slice(None), dtype, device)
        return self._whole[dtype, device]

    def allowed(self, rows: slice = slice(None), device: torch.device | None = None) -> torch.Tensor:
        """bool [B|1, 1, r, c] (True = attend) for the query ``rows`` of the block."""
        c = self.chunk_len
        device = device if device is not None else torch.device("cpu")
        q = torch.arange(self.query_chunk * c, (self.query_chunk + 1) * c, device=device)[rows]
        k = torch.arange(self.key_chunk * c, (self.key_chunk + 1) * c, device=device)
        allowed = k[None, :] <= q[:, None]
        if self.window is not None:
            allowed = allowed & (k[None, :] > q[:, None] - self.window)
        allowed = allowed[None]
        if self.doc_q is not None:
            allowed = allowed & (self.doc_q[:, rows, None] == self.doc_k[:, None, :])
        if self.real_k is not None:
            allowed = allowed & self.real_k[:, None, :]
        if self.key_chunk == self.query_chunk:
            allowed = allowed | (k[None, :] == q[:, None])[None]
        return allowed[:, None]

    def additive(self, rows: slice, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The mask [B|1, 1, r, c] to add to the scores: 0 where a query may attend, -inf elsewhere."""
        allowed = self.allowed(rows, device)
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))

    def to(self, device: torch.device) -> BlockMask:
        def moved(x):
            return None if x is None else x.to(device)

        return BlockMask(self.query_chunk, self.key_chunk, self.chunk_len, self.window, moved(self.doc_q),
                         moved(self.doc_k), moved(self.real_k), self.segments)

    def document_segments(self) -> tuple | None:
        """``segments`` for this block (from its host vectors), or None when a window or a padding key cuts in, or a
        document is not one run of positions in a row."""
        if self.window is not None or self.doc_q is None or (self.real_k is not None and not bool(self.real_k.all())):
            return None
        segments = []
        for row, (doc_q, doc_k) in enumerate(zip(self.doc_q.tolist(), self.doc_k.tolist())):
            queries, keys = _runs(doc_q), _runs(doc_k)
            if queries is None or keys is None:
                return None
            for document, (q_start, q_end) in queries.items():
                if document in keys:
                    segments.append((row, q_start, q_end, *keys[document]))
        # many short documents: as many kernel calls (and host work) each layer; the explicit softmax then
        return tuple(segments) if len(segments) <= _MAX_SEGMENTS else None


# the most document segments a masked block runs as kernel calls (each a launch per layer, forward and backward)
_MAX_SEGMENTS = 64


def _runs(ids: list[int]) -> dict[int, tuple[int, int]] | None:
    """Each id's [start, end) in ``ids``, or None when an id occurs in more than one run."""
    runs: dict[int, tuple[int, int]] = {}
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            if ids[start] in runs:
                return None
            runs[ids[start]] = (start, i)
            start = i
    return runs


def block_kernel(q: torch.Tensor, kind: str, kernel: str | None, mask: BlockMask | None = None) -> str:
    """How a block runs: "flash_cpu" (aten's CPU flash kernel, any block), "flash_cuda" (aten's CUDA flash kernel:
    an Ampere or later GPU, bf16/fp16, head_dim a multiple of 8 up to 256, causal or full blocks, and masked blocks
    of packed documents as one call per document's segment, "flash_cuda_segments") or "math" (an explicit softmax
    over the block's scores, in float32, a run of query rows at a time). ``kernel``: the plan's choice, None for the
    device's: flash on either device where it serves the block. A masked block that a window or padding cuts into
    takes "math" under "flash_cuda" (the CUDA flash kernel takes no mask)."""
    if kernel is None:
        if q.device.type == "cpu":
            return "flash_cpu"
        serves = (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0
                  and q.shape[-1] <= 256 and _flash_capable(q.device))
        kernel = "flash_cuda" if serves else "math"
    if kernel == "flash_cuda" and kind == MASKED:
        return "flash_cuda_segments" if mask is not None and mask.segments is not None else "math"
    return kernel


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    """Whether aten's CUDA flash kernel runs on this GPU (compute capability 8.0, Ampere, or later)."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _cuda_flash_forward(q, k, v, causal: bool, scale: float):
    """aten's CUDA flash kernel on one block: (output, float32 log-sum-exp [B, H, c], what its backward takes back)."""
    out, lse, cum_q, cum_k, _, _, rng_state, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, rng_state, unused)


def _cuda_flash_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, state):
    """(dq, dk, dv) of one block from the kernel, given the merged output and log-sum-exp of its query rows and the
    state a forward of the kernel returned (its random state: no dropout, so any block's)."""
    cum_q, cum_k, rng_state, unused = state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, rng_state, unused, scale=scale)


def _segment_views(mask: BlockMask, *tensors):
    """Per document segment of a masked block: whether it is causal (the block's diagonal), and each of ``tensors``
    ([B, H, c, ...] over the block's query rows or key columns, as named by the tensor's role) cut to it."""
    causal = mask.key_chunk == mask.query_chunk
    for row, q_start, q_end, k_start, k_end in mask.segments:
        rows, cols = slice(q_start, q_end), slice(k_start, k_end)
        yield causal, rows, cols, row, [t[row:row + 1, :, rows if side == "q" else cols] for side, t in tensors]


def _segments_forward(q, k, v, mask: BlockMask, scale: float):
    """A masked block of packed documents through the CUDA flash kernel, one call per document's segment (its query
    rows over its key columns): rows of a document with no key in the block keep a 0 output and a -inf
    log-sum-exp."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=accumulation(q), device=q.device)
    state = None
    for causal, rows, _, row, (q_s, k_s, v_s) in _segment_views(mask, ("q", q), ("k", k), ("k", v)):
        out_s, lse_s, state = _cuda_flash_forward(q_s.contiguous(), k_s, v_s, causal, scale)
        out[row:row + 1, :, rows] = out_s
        lse[row:row + 1, :, rows] = lse_s
    return out, lse, state


def _segments_backward(grad_out, q, k, v, out, lse, mask: BlockMask, scale: float, state):
    """(dq, dk, dv) of ``_segments_forward``'s block from the merged output and log-sum-exp of its query rows. A row's
    query rows and key columns are each in one segment at most: each gradient is written once."""
    dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
    views = _segment_views(mask, ("q", grad_out), ("q", q), ("k", k), ("k", v), ("q", out), ("q", lse[..., None]))
    for causal, rows, cols, row, (grad_s, q_s, k_s, v_s, out_s, lse_s) in views:
        dq_s, dk_s, dv_s = _cuda_flash_backward(grad_s.contiguous(), q_s.contiguous(), k_s, v_s, out_s.contiguous(),
                                                lse_s[..., 0].contiguous(), causal, scale, state)
        dq[row:row + 1, :, rows] = dq_s
        dk[row:row + 1, :, cols] = dk_s
        dv[row:row + 1, :, cols] = dv_s
    return dq, dk, dv


def block_forward(q, k, v, kind, mask, has_key, scale, kernel=None):
    """Output [B, H, c, d], log-sum-exp [B, H, c] (float32; -inf for rows that see no key of the block) and, from
    the CUDA flash kernel, the state its backward takes (else None)."""
    kernel = block_kernel(q, kind, kernel, mask)
    if kernel == "flash_cuda":
        out, lse, state = _cuda_flash_forward(q, k, v, kind == CAUSAL, scale)
        return out, lse.to(accumulation(q)), state
    if kernel == "flash_cuda_segments":
        return _segments_forward(q, k, v, mask, scale)
    if kernel == "flash_cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, kind == CAUSAL, attn_mask=_whole(mask, q), scale=scale)
        if has_key is not None:  # the op returns 0 (not -inf) for a row with every key masked
            lse = lse.masked_fill(~has_key, float("-inf"))
        return out, lse.to(accumulation(q)), None
    outs, lses = [], []
    for rows in _row_chunks(q, k):
        scores = _scores(q, k, kind, mask, scale, rows)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        outs.append(torch.matmul(probs.to(v.dtype), v))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2), None


def block_backward(grad_out, q, k, v, out, lse, kind, mask, scale, kernel=None, state=None):
    """(dq, dk, dv) of one block, given the merged output and log-sum-exp of its query rows (``state``: what the CUDA
    flash kernel's forward returned for its backward)."""
    kernel = block_kernel(q, kind, kernel, mask)
    if kernel == "flash_cuda":
        return _cuda_flash_backward(grad_out, q, k, v, out, lse.to(accumulation(q)), kind == CAUSAL, scale, state)
    if kernel == "flash_cuda_segments":
        return _segments_backward(grad_out, q, k, v, out, lse.to(accumulation(q)), mask, scale, state)
    if kernel == "flash_cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.to(accumulation(q)), 0.0, kind == CAUSAL, attn_mask=_whole(mask, q),
            scale=scale)
    acc = accumulation(q)
    k_acc, v_acc = k.to(acc), v.to(acc)
    dq, dk, dv = torch.empty_like(q, dtype=acc), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    for rows in _row_chunks(q, k):
        probs = torch.exp(_scores(q, k, kind, mask, scale, rows) - lse[:, :, rows, None])
        grad_acc = grad_out[:, :, rows].to(acc)
        dv += torch.matmul(probs.transpose(-2, -1), grad_acc)
        dprobs = torch.matmul(grad_acc, v_acc.transpose(-2, -1))
        delta = (grad_acc * out[:, :, rows].to(acc)).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta) * scale
        dq[:, :, rows] = torch.matmul(dscores, k_acc)
        dk += torch.matmul(dscores.transpose(-2, -1), q[:, :, rows].to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def accumulation(x: torch.Tensor) -> torch.dtype:
    """float32, or the tensor's own dtype when wider (log-sum-exps and partial sums are kept in it)."""
    return torch.promote_types(x.dtype, torch.float32)


# the explicit softmax's scores at most this many entries at a time (256 MiB in float32): a block's query rows are
# taken in runs, so a long chunk never makes its whole [B, H, c, c] scores (and their probabilities) at once
_MATH_SCORE_ELEMENTS = 1 << 26


def _row_chunks(q: torch.Tensor, k: torch.Tensor) -> list[slice]:
    """The runs of a block's query rows whose scores [B, H, rows, c_k] stay within ``_MATH_SCORE_ELEMENTS``."""
    B, H, c = q.shape[0], q.shape[1], q.shape[2]
    rows = max(1, _MATH_SCORE_ELEMENTS // max(1, B * H * k.shape[2]))
    return [slice(start, min(start + rows, c)) for start in range(0, c, rows)]


def _whole(mask: BlockMask | None, q: torch.Tensor) -> torch.Tensor | None:
    """A masked block's whole additive mask [B|1, 1, c, c] in q's dtype (made once per batch)."""
    return None if mask is None else mask.whole(q.dtype, q.device)


def _scores(q, k, kind, mask: BlockMask | None, scale, rows: slice = slice(None)):
    """The block's scaled scores [B, H, rows, c] in the accumulation dtype, for the query ``rows``, masked."""
    acc = accumulation(q)
    scores = torch.matmul(q[:, :, rows].to(acc), k.to(acc).transpose(-2, -1)) * scale
    if kind == CAUSAL:
        positions = torch.arange(k.shape[2], device=q.device)
        scores = scores.masked_fill(positions[None, :] > positions[rows, None], float("-inf"))
    elif mask is not None:
        scores = scores.masked_fill(~mask.allowed(rows, q.device), float("-inf"))
    return scores
