"""The inner attention, swappable per batch: one ``AttentionPlan`` is made before the blocks run and
every layer's ``attend`` follows it.

Shapes: B batch, S sequence, H query heads, K key/value heads, d head_dim, T real tokens.

Kinds of plan:
- "causal": no padding, one document per row: SDPA with ``is_causal`` (flash kernels on GPU).
- "dense":  SDPA with a boolean [B|1, 1, S, S] mask (padding, packed documents, sliding windows).
- "context_parallel": the sequence is split over context-parallel ranks; ring attention
  (``hfnative.parallel.context_parallel``) with the plan it carries.
- "varlen": each document attends only to itself, with no [S, S] mask: on CUDA in bf16/fp16
  ``torch.nn.attention.varlen.varlen_attn`` over the real tokens (cu_seq_lens), elsewhere one SDPA
  call per document. Padding positions get a zero output (no loss or real token ever reads it).

Attention sinks (GPT-OSS: one learned logit per query head joins every softmax denominator, with no
value) have no SDPA or flash kernel; layers with sinks take ``_attend_with_sinks``, an explicit
softmax over the [S, S] scores, for every kind of plan (varlen: per document).

``plan_attention`` reads positions and padding on the host once per batch, so no layer makes a
host-side decision from a device tensor.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hfnative.device_policy import host_to_device
from hfnative.precision import autocast_dtype

IMPLEMENTATIONS = ("varlen", "sdpa")
VARLEN_KERNEL_DEVICES = ("cuda",)  # where torch.nn.attention.varlen.varlen_attn has a kernel


def document_ids(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Packed documents: a new document starts wherever the position does not follow its predecessor."""
    previous = torch.cat([position_ids_BS[:, :1] - 1, position_ids_BS[:, :-1]], dim=1)
    return (position_ids_BS != previous + 1).cumsum(dim=1)


def build_attention_mask(
    seq_len: int,
    device: torch.device,
    padding_mask_BS: torch.Tensor | None = None,
    document_ids_BS: torch.Tensor | None = None,
    sliding_window: int | None = None,
    padding_attends_itself: bool = True,
) -> torch.Tensor | None:
    """Boolean mask [B|1, 1, S, S] (True = attend), or None when plain causal attention suffices.

    Every query may attend at least to itself, so rows of padding stay finite (their outputs are
    never used); keys that are padding, in another document, in the future or outside the
    sliding window are masked. ``padding_attends_itself=False``: a padding query attends only to the
    real keys before it, as transformers' masks do (for right padding, whose outputs some metrics read).
    """
    if padding_mask_BS is None and document_ids_BS is None and sliding_window is None:
        return None
    positions = torch.arange(seq_len, device=device)
    allowed_SS = positions[None, :] <= positions[:, None]
    if sliding_window is not None:
        allowed_SS = allowed_SS & (positions[None, :] > positions[:, None] - sliding_window)
    allowed = allowed_SS[None, None]
    if document_ids_BS is not None:
        allowed = allowed & (document_ids_BS[:, None, :, None] == document_ids_BS[:, None, None, :])
    if padding_mask_BS is not None:
        allowed = allowed & padding_mask_BS.bool()[:, None, None, :]
        if not padding_attends_itself:
            return allowed
    return allowed | torch.eye(seq_len, dtype=torch.bool, device=device)


@dataclass(eq=False)
class AttentionPlan:
    """How attention runs for one batch (see the module docstring for the kinds). Not a frozen dataclass: torch
    2.11's dynamo builds every field of a frozen one passed into a compiled block and guards on them all (the
    number of rows in ``spans``, each int), recompiling the blocks for batches that differ only there; of a plain
    object it guards only the attributes the graph reads. Compared by identity; nothing changes a plan once made."""

    kind: str
    seq_len: int
    sliding_window: int | None = None
    # dense (and causal with a sliding window shorter than the sequence): the masks, on the device
    global_mask: torch.Tensor | None = None
    sliding_mask: torch.Tensor | None = None
    # varlen: per row, its documents' [start, end) spans; positions outside every span are padding
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()
    # varlen on flash kernels: the real tokens of the flattened [B * S] batch and their documents
    token_index: torch.Tensor | None = None  # [T] (None: every position is a real token)
    cu_seq_lens: torch.Tensor | None = None  # [documents + 1] int32
    max_len: int = 0
    # "context_parallel": this rank's ring-attention plan (hfnative.parallel.context_parallel)
    context_parallel: object = None


def _row_spans(attention_mask_BS, position_ids_BS, batch_size: int, seq_len: int):
    """Per row, the [start, end) of each document; None when the real tokens of a row are not contiguous."""
    rows = []
    if attention_mask_BS is not None:
        for mask in attention_mask_BS.tolist():
            real = [i for i, keep in enumerate(mask) if keep]
            if real and real[-1] - real[0] + 1 != len(real):
                return None
            rows.append(((real[0], real[-1] + 1),) if real else ())
        return tuple(rows)
    if position_ids_BS is None:
        return tuple(((0, seq_len),) for _ in range(batch_size))
    for positions in position_ids_BS.expand(batch_size, seq_len).tolist():
        starts = [0] + [i for i in range(1, seq_len) if positions[i] != positions[i - 1] + 1]
        rows.append(tuple(zip(starts, starts[1:] + [seq_len])))
    return tuple(rows)


def plan_attention(
    batch_size: int,
    seq_len: int,
    device: torch.device,
    attention_mask_BS: torch.Tensor | None = None,
    position_ids_BS: torch.Tensor | None = None,
    sliding_window: int | None = None,
    implementation: str = "varlen",
) -> AttentionPlan:
    """Decide, once per batch, how attention runs.

    attention_mask_BS: 1 for real tokens, 0 for padding (either side); position_ids_BS: without a
    padding mask, a position that does not follow its predecessor starts a new document.
    implementation: "varlen" (no [S, S] mask for packed or padded batches) or "sdpa" (dense masks).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r}: expected one of {IMPLEMENTATIONS}")
    host_mask = None
    if attention_mask_BS is not None:
        host_mask = attention_mask_BS.detach().cpu()
        if bool(host_mask.all()):
            host_mask = None
    host_positions = position_ids_BS.detach().cpu() if (position_ids_BS is not None and host_mask is None) else None
    spans = _row_spans(host_mask, host_positions, batch_size, seq_len)
    one_document_per_row = spans is not None and all(row == ((0, seq_len),) for row in spans)
    window = sliding_window if sliding_window is not None and sliding_window < seq_len else None

    if one_document_per_row:
        sliding_mask = build_attention_mask(seq_len, device, sliding_window=window) if window else None
        return AttentionPlan("causal", seq_len, window, sliding_mask=sliding_mask)
    if implementation == "varlen" and spans is not None:
        return _varlen_plan(spans, batch_size, seq_len, window, device)
    padding = host_to_device(attention_mask_BS, device) if host_mask is not None else None
    doc_ids = (document_ids(host_to_device(position_ids_BS, device).expand(batch_size, seq_len))
               if host_positions is not None else None)
    global_mask = build_attention_mask(seq_len, device, padding, doc_ids)
    sliding_mask = build_attention_mask(seq_len, device, padding, doc_ids, window) if window else None
    return AttentionPlan("dense", seq_len, window, global_mask=global_mask, sliding_mask=sliding_mask)


def transformers_padding_plan(plan: AttentionPlan, attention_mask_BS: torch.Tensor) -> AttentionPlan:
    """``plan`` for a right-padded batch with padding queries attending to the real keys before them (not to
    themselves), as transformers' masks do: for what reads the padding positions' outputs (a logged mean logit, the
    logits compute_metrics is handed)."""
    if plan.kind == "causal" and plan.sliding_mask is None:  # no padding in the batch
        return plan
    S, device, window = attention_mask_BS.shape[1], attention_mask_BS.device, plan.sliding_window
    padding_BS = attention_mask_BS.bool()
    return AttentionPlan(
        "dense", S, window,
        global_mask=build_attention_mask(S, device, padding_BS, padding_attends_itself=False),
        sliding_mask=build_attention_mask(S, device, padding_BS, sliding_window=window, padding_attends_itself=False)
        if window else None,
    )


def _varlen_plan(spans, batch_size: int, seq_len: int, window: int | None, device: torch.device) -> AttentionPlan:
    lengths = [end - start for row in spans for start, end in row]
    covered = sum(lengths) == batch_size * seq_len
    token_index = None
    if not covered:
        token_index = torch.tensor(
            [row * seq_len + i for row, row_spans in enumerate(spans) for start, end in row_spans for i in range(start, end)],
            dtype=torch.long,
        )
        token_index = host_to_device(token_index, device)
    cu_seq_lens = host_to_device(torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), device)
    # how many documents (and real tokens) a batch holds changes every batch: a compiled block takes them as dynamic
    # sizes from its first graph on, even where the device policy compiles other sizes static first
    for sizes in (cu_seq_lens, token_index):
        if sizes is not None:
            torch._dynamo.maybe_mark_dynamic(sizes, 0)
    return AttentionPlan(
        "varlen", seq_len, window, spans=spans, token_index=token_index, cu_seq_lens=cu_seq_lens,
        max_len=max(lengths, default=0),
    )


@dataclass(frozen=True)
class VarlenKernel:
    """torch's ``varlen_attn`` (None where this torch has none) and the keywords it takes, which changed between
    releases: torch 2.10 takes ``is_causal`` (no window, no scale), 2.11 ``scale`` and ``window_size``, 2.13 also
    ``enable_gqa``. Read once, when this module is imported: a compiled block reads it as a constant."""

    function: object = None
    takes_is_causal: bool = False
    takes_scale: bool = False
    takes_window: bool = False
    takes_gqa: bool = False

    @classmethod
    def of(cls, function) -> VarlenKernel:
        keywords = frozenset(inspect.signature(function).parameters) if function is not None else frozenset()
        return cls(function, "is_causal" in keywords, "scale" in keywords, "window_size" in keywords,
                   "enable_gqa" in keywords)

    def takes(self, head_dim: int, window: int | None, scale: float | None) -> bool:
        """Whether this release can run a layer with this window and scale (the per-document path serves the rest)."""
        if self.function is None or (window and not self.takes_window):
            return False
        if not (self.takes_window or self.takes_is_causal):
            return False
        return scale is None or self.takes_scale or math.isclose(scale, head_dim ** -0.5, rel_tol=1e-6)


def _torch_varlen_kernel() -> VarlenKernel:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return VarlenKernel()
    return VarlenKernel.of(varlen_attn)


VARLEN_KERNEL = _torch_varlen_kernel()


def flash_varlen_serves(device: torch.device, dtype: torch.dtype, head_dim: int, window: int | None = None,
                        scale: float | None = None, sinks: bool = False) -> bool:
    """Whether ``varlen_attn`` runs a layer whose q, k and v reach attention on ``device`` in ``dtype`` (the
    autocast dtype under autocast): CUDA, bf16/fp16, no attention sinks, and a window and scale this torch's
    kernel takes. Everything else attends per document."""
    return (not sinks and device.type in VARLEN_KERNEL_DEVICES and dtype in (torch.bfloat16, torch.float16)
            and VARLEN_KERNEL.takes(head_dim, window, scale))


def _flash_varlen(q_BHSd, k_BKSd, v_BKSd, plan: AttentionPlan, window: int | None, scale: float) -> torch.Tensor:
    kernel = VARLEN_KERNEL
    B, H, S, d = q_BHSd.shape
    options = {"scale": scale} if kernel.takes_scale else {}
    if kernel.takes_window:  # (left, right): -1 = unbounded; right 0 = causal
        options["window_size"] = (window - 1 if window else -1, 0)
    else:
        options["is_causal"] = True
    if k_BKSd.shape[1] != H:
        if kernel.takes_gqa:
            options["enable_gqa"] = True
        else:  # an older varlen_attn wants as many key/value heads as query heads
            k_BKSd, v_BKSd = repeat_kv_heads(k_BKSd, H), repeat_kv_heads(v_BKSd, H)

    def tokens(x_BHSd):  # -> [T, heads, d]
        x_Nhd = x_BHSd.transpose(1, 2).reshape(B * S, x_BHSd.shape[1], d)
        return x_Nhd if plan.token_index is None else x_Nhd.index_select(0, plan.token_index)

    out_THd = kernel.function(
        tokens(q_BHSd), tokens(k_BKSd), tokens(v_BKSd), plan.cu_seq_lens, plan.cu_seq_lens, plan.max_len,
        plan.max_len, **options,
    )
    if plan.token_index is not None:
        out_THd = out_THd.new_zeros(B * S, H, d).index_copy(0, plan.token_index, out_THd)
    return out_THd.view(B, S, H, d).transpose(1, 2)


def repeat_kv_heads(x_BKSd: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads repeated to ``heads``, each as many times in a row as query heads share it (grouped-query
    attention spelled out for a kernel that wants one key/value head a query head)."""
    return x_BKSd if x_BKSd.shape[1] == heads else x_BKSd.repeat_interleave(heads // x_BKSd.shape[1], dim=1)


def _attend_with_sinks(q_BHSd, k_BKSd, v_BKSd, allowed, sinks_H: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax over [scores, sink] per query, the sink's probability dropped: the output is the plain
    attention output scaled by sigmoid(logsumexp(scores) - sink). allowed: boolean [B|1, 1, S, S]
    (True = attend), or None for causal. Materializes the [B, H, S, S] scores."""
    H, S = q_BHSd.shape[1], q_BHSd.shape[2]
    k_BKSd, v_BKSd = repeat_kv_heads(k_BKSd, H), repeat_kv_heads(v_BKSd, H)
    if allowed is None:
        allowed = torch.ones(S, S, dtype=torch.bool, device=q_BHSd.device).tril()
    scores_BHSS = torch.matmul(q_BHSd, k_BKSd.transpose(-2, -1)) * scale
    scores_BHSS = scores_BHSS.masked_fill(~allowed, float("-inf"))
    sinks_BHS1 = sinks_H.to(scores_BHSS.dtype).view(1, H, 1, 1).expand(scores_BHSS.shape[0], H, S, 1)
    logits = torch.cat([scores_BHSS, sinks_BHS1], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values  # as transformers does (bf16 overflow)
    probs_BHSS = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))[..., :-1]
    return torch.matmul(probs_BHSS.to(v_BKSd.dtype), v_BKSd)


def _document_attention(q_BhSd, k_BkSd, v_BkSd, window: int | None, scale: float, sinks_H) -> torch.Tensor:
    """One document [heads, S, d], causal (and windowed): SDPA, or the explicit path with sinks."""
    S = q_BhSd.shape[1]
    mask = build_attention_mask(S, q_BhSd.device, sliding_window=window) if window and S > window else None
    if sinks_H is not None:
        allowed = mask[0] if mask is not None else None
        return _attend_with_sinks(q_BhSd[None], k_BkSd[None], v_BkSd[None], allowed, sinks_H, scale)[0]
    # as a batch of one [1, heads, S, d]: given 3-D tensors, SDPA on CPU takes its math kernel and materialises the
    # [heads, S, S] scores; 4-D it takes the flash kernel
    return _sdpa(q_BhSd[None], k_BkSd[None], v_BkSd[None], None if mask is None else mask[0:1], scale)[0]


def _sdpa(q_BHSd, k_BKSd, v_BKSd, mask, scale: float, repeat_heads: bool | None = None) -> torch.Tensor:
    """SDPA (causal where ``mask`` is None), query heads sharing key/value heads through ``enable_gqa``; with a mask on
    CUDA (``repeat_heads`` None: the device's choice) the key and value heads are repeated instead: torch's fused CUDA
    kernels take a mask or ``enable_gqa``, not both, and SDPA would fall back to its math kernel, which materialises
    the [B, H, S, S] scores in fp32."""
    grouped = k_BKSd.shape[1] != q_BHSd.shape[1]
    if repeat_heads is None:
        repeat_heads = mask is not None and q_BHSd.device.type == "cuda"
    if grouped and repeat_heads:
        k_BKSd, v_BKSd = repeat_kv_heads(k_BKSd, q_BHSd.shape[1]), repeat_kv_heads(v_BKSd, q_BHSd.shape[1])
        grouped = False
    return F.scaled_dot_product_attention(q_BHSd, k_BKSd, v_BKSd, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=grouped)


def _as_autocast(q_BHSd, k_BKSd, v_BKSd):
    """q, k, v as SDPA takes them under autocast: in the autocast dtype. A norm or rotation in fp32 (Qwen3's QK-norm)
    leaves q and k in fp32 while v comes from the projection in bf16; SDPA casts all three itself, ``varlen_attn``
    (a custom op) does not, so without this a bf16 run would never reach the kernel."""
    dtype = autocast_dtype(q_BHSd.device.type)
    if dtype is None:
        return q_BHSd, k_BKSd, v_BKSd
    return q_BHSd.to(dtype), k_BKSd.to(dtype), v_BKSd.to(dtype)


def _varlen(q_BHSd, k_BKSd, v_BKSd, plan: AttentionPlan, window: int | None, scale: float, sinks_H=None,
            in_graph: bool = True) -> torch.Tensor:
    """Documents attend only within themselves; padding positions get zeros. ``varlen_attn`` where it serves the
    layer, traced into a compiled block's graph (a custom op; the documents' bounds are tensors and their longest
    length an integer input) unless ``in_graph`` is False (then eagerly between two graphs); elsewhere one SDPA call
    per document, eagerly."""
    if sinks_H is None and q_BHSd.device.type in VARLEN_KERNEL_DEVICES:
        q_low, k_low, v_low = _as_autocast(q_BHSd, k_BKSd, v_BKSd)
        if flash_varlen_serves(q_low.device, q_low.dtype, q_low.shape[-1], window, scale):
            return (_flash_varlen if in_graph else _flash_varlen_eagerly)(q_low, k_low, v_low, plan, window, scale)
    return _per_document(q_BHSd, k_BKSd, v_BKSd, plan, window, scale, sinks_H)


_flash_varlen_eagerly = torch.compiler.disable(_flash_varlen)


@torch.compiler.disable
def _per_document(q_BHSd, k_BKSd, v_BKSd, plan: AttentionPlan, window: int | None, scale: float,
                  sinks_H=None) -> torch.Tensor:
    """One SDPA call per document (the explicit path with sinks), zeros at padding. Runs eagerly under torch.compile
    (the spans change every batch and would otherwise be baked into the graph)."""
    rows = []
    for row, row_spans in enumerate(plan.spans):
        pieces, position = [], 0
        for start, end in row_spans:
            if start > position:
                pieces.append(q_BHSd.new_zeros(q_BHSd.shape[1], start - position, q_BHSd.shape[3]))
            pieces.append(_document_attention(
                q_BHSd[row, :, start:end], k_BKSd[row, :, start:end], v_BKSd[row, :, start:end], window, scale, sinks_H,
            ))
            position = end
        if position < plan.seq_len:
            pieces.append(q_BHSd.new_zeros(q_BHSd.shape[1], plan.seq_len - position, q_BHSd.shape[3]))
        rows.append(torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0])
    return torch.stack(rows)


def attend(
    q_BHSd, k_BKSd, v_BKSd, plan: AttentionPlan, sliding: bool, scale: float, sinks_H: torch.Tensor | None = None,
    varlen_in_graph: bool = True,
) -> torch.Tensor:
    """Attention output [B, H, S, d] for one layer; ``sliding``: the layer uses the sliding window;
    ``sinks_H``: the layer's attention-sink logits [H], or None; ``varlen_in_graph``: a compiled block may trace the
    variable-length kernel into its graph."""
    if plan.context_parallel is not None:
        return plan.context_parallel.attend(q_BHSd, k_BKSd, v_BKSd, sliding, scale, sinks_H)
    window = plan.sliding_window if sliding else None
    if plan.kind == "varlen":
        return _varlen(q_BHSd, k_BKSd, v_BKSd, plan, window, scale, sinks_H, varlen_in_graph)
    mask = plan.sliding_mask if window else plan.global_mask
    if sinks_H is not None:
        return _attend_with_sinks(q_BHSd, k_BKSd, v_BKSd, mask, sinks_H, scale)
    return _sdpa(q_BHSd, k_BKSd, v_BKSd, mask, scale)
