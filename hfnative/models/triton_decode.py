"""The decode step's Triton kernels of the native rollout engine (``hfnative.generation``), the sources in
``triton_kernel_sources`` beside the training step's, run where those run (``triton_kernels.use_triton_kernels``):

- ``decode_qkv``: a step's query, key and value heads normed, rotated and written into the KV cache in one kernel, the
  values of the training path's kernels and the cache's writes, to the bit.
- ``decode_attention``: a step's attention in one kernel a layer that reads each row's cache entries from its first
  token to the slot written (no mask, nothing past them), the query heads sharing a key/value head read together; two
  kernels where a small batch's rows are read in parts (``attention_splits``). A flash kernel's attention, as SDPA's GPU
  kernels are: an online softmax in float32, the probabilities meeting the values in their dtype. In compiled code it
  is the custom op ``hfnative::decode_attention``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .triton_kernels import (_FLOATS, MAX_NORM_DIM, _launch, _norm_rope_dtypes, _rope_tables, _rotates_rounded,
                             _rotation_tables, use_triton_kernels)


def decode_qkv_written_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype | None, float_offset: float | None,
                             tables_dtype: torch.dtype, narrow_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype the training path's kernels write a decode step's rotated query and key heads in (``Attention._rotated``
    with ``TritonRMSNorm`` or ``TritonRope``), or None where they do not rotate them (tables they do not take).
    weight_dtype: the per-head norm's weight (None: no norm, the rotation alone); narrow_dtype: the autocast dtype an
    attention casts the heads to (``narrowing_autocast_dtype``), None without autocast."""
    if weight_dtype is None:  # the rotation alone writes the heads in their dtype
        return x_dtype if tables_dtype in _rope_tables(x_dtype) else None
    normed, tables = _norm_rope_dtypes(x_dtype, weight_dtype, float_offset)
    if tables_dtype not in tables:
        return None
    # float32 heads are written narrow for an attention under autocast (``Attention._rotated``)
    return (narrow_dtype or normed) if tables_dtype == torch.float32 else normed


def decode_qkv_supported(q_BSP: torch.Tensor, k_BSP: torch.Tensor, v_BSP: torch.Tensor, head_dim: int,
                         weights: tuple[torch.Tensor, torch.Tensor] | None, float_offset: float | None,
                         cos_BSd: torch.Tensor, sin_BSd: torch.Tensor, keys_BKLd: torch.Tensor,
                         values_BKLd: torch.Tensor, narrow_dtype: torch.dtype | None) -> bool:
    """Whether ``decode_qkv`` gives what the training path's kernels and the cache's writes give: one token a row
    (S = 1), each projection's heads contiguous, the rotation's tables as those kernels take them, and the heads
    written in the cache's dtype by one rounding where the training path rounds (written in it, or written in float32
    and cast to it)."""
    tensors = (q_BSP, k_BSP, v_BSP, cos_BSd, sin_BSd, keys_BKLd, values_BKLd, *(weights or ()))
    if not use_triton_kernels(*tensors):
        return False
    B, S = q_BSP.shape[:2]
    if S != 1 or k_BSP.dtype != q_BSP.dtype or q_BSP.dtype not in _FLOATS or head_dim % 2 or head_dim > MAX_NORM_DIM:
        return False
    if any(t.stride(-1) != 1 or t.shape[:2] != (B, 1) for t in (q_BSP, k_BSP, v_BSP)):
        return False
    if keys_BKLd.stride() != values_BKLd.stride() or keys_BKLd.stride(-1) != 1 or keys_BKLd.shape[0] != B:
        return False
    if weights is not None and not all(w.shape == (head_dim,) and w.is_contiguous() and w.dtype == weights[0].dtype
                                       for w in weights):
        return False
    if not _rotation_tables(cos_BSd, sin_BSd, (B, 1, head_dim), _FLOATS):
        return False
    written = decode_qkv_written_dtype(q_BSP.dtype, None if weights is None else weights[0].dtype, float_offset,
                                       cos_BSd.dtype, narrow_dtype)
    cache_dtype = keys_BKLd.dtype
    # (heads written in float32 reach attention through autocast's cast to its dtype, the cache's)
    return written == cache_dtype or (written == torch.float32 and narrow_dtype == cache_dtype)


def decode_qkv(q_BSP: torch.Tensor, k_BSP: torch.Tensor, v_BSP: torch.Tensor, heads: int,
               weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float, float_offset: float | None,
               cos_BSd: torch.Tensor, sin_BSd: torch.Tensor, keys_BKLd: torch.Tensor, values_BKLd: torch.Tensor,
               entry_1: torch.Tensor) -> torch.Tensor:
    """A decode step's heads in one kernel (``decode_qkv_supported``): the query heads of q [B, 1, heads * d] per-head
    normed by ``weights[0]`` (None: no norm) and rotated, returned [B, heads, 1, d] in the cache's dtype; the key heads
    (``weights[1]``) likewise, written into ``keys_BKLd`` at entry ``entry_1`` ([1], on the device); the value heads
    copied into ``values_BKLd`` there. Where the training path runs a norm-and-rotation kernel a projection, then a
    cache write each for keys and values: four launches."""
    B = q_BSP.shape[0]
    kv_heads, d = keys_BKLd.shape[1], keys_BKLd.shape[-1]
    q_out = torch.empty(B, heads, 1, d, dtype=keys_BKLd.dtype, device=q_BSP.device)
    block = 1 << (d - 1).bit_length()
    norm = weights is not None
    q_weight, k_weight = weights if norm else (cos_BSd, cos_BSd)
    _launch(
        "decode_qkv", (B, heads + 2 * kv_heads), q_BSP.device,
        q_BSP, k_BSP, v_BSP, q_weight, k_weight, cos_BSd, sin_BSd, q_out, keys_BKLd, values_BKLd, entry_1,
        q_BSP.stride(0), k_BSP.stride(0), v_BSP.stride(0), heads, kv_heads, d, *keys_BKLd.stride()[:3], eps,
        float_offset or 0.0, NORM=norm, LLAMA=float_offset is None, ROUNDED=_rotates_rounded(cos_BSd), BLOCK=block,
        num_warps=1 if block <= 256 else 4,
    )
    return q_out


MAX_ATTENTION_DIM = 256  # the widest head ``decode_attention`` holds in a program
ATTENTION_BLOCK = 32  # cache entries a ``decode_attention`` program reads at once (the grouped decode kernels' choice)
ATTENTION_BLOCK_BYTES = ATTENTION_BLOCK * MAX_ATTENTION_DIM * 2  # at most this many bytes of keys (and of values) a
# block: wider entries, fewer of them (float32 heads of 256: 16), so two stages of key and value blocks fit in 64 KB
# of shared memory (Ampere's consumer GPUs have about 99 KB a block)


def decode_attention_supported(keys_BKLd: torch.Tensor, values_BKLd: torch.Tensor, heads: int) -> bool:
    """Whether ``decode_attention`` serves a decode step's attention to this cache with ``heads`` query heads: where
    the kernels run, heads that share key/value heads evenly, at most MAX_ATTENTION_DIM wide, keys and values laid out
    alike (the query: ``decode_attention_takes``)."""
    if not use_triton_kernels(keys_BKLd, values_BKLd):
        return False
    d = keys_BKLd.shape[-1]
    return (keys_BKLd.dtype in _FLOATS and values_BKLd.dtype == keys_BKLd.dtype and heads % keys_BKLd.shape[1] == 0
            and d <= MAX_ATTENTION_DIM and keys_BKLd.stride() == values_BKLd.stride() and keys_BKLd.stride(-1) == 1)


def decode_attention_takes(q_BH1d: torch.Tensor, keys_BKLd: torch.Tensor) -> bool:
    """Whether ``decode_attention`` takes this query (one token a row, the cache's dtype, heads' columns adjacent)."""
    return (q_BH1d.shape[2] == 1 and q_BH1d.dtype == keys_BKLd.dtype and q_BH1d.stride(-1) == 1
            and q_BH1d.shape[-1] == keys_BKLd.shape[-1])


def _pow2_at_least(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def decode_attention(q_BH1d: torch.Tensor, keys_BKLd: torch.Tensor, values_BKLd: torch.Tensor, pad_B: torch.Tensor,
                     slot_1: torch.Tensor, entry_slot_L: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A decode step's attention in one kernel a layer (``decode_attention_supported`` / ``_takes``): each row's query
    heads [B, H, 1, d] against the cache's entries it may see, returned [B, H, 1, d] in the query's dtype. A buffer
    holding every slot (``entry_slot_L`` None) is read from the row's padding ``pad_B`` [B] to the slot this step
    wrote (``slot_1``, [1] on the device): no entry past it or before the row's first token is read, and no mask is
    made. A ring (``entry_slot_L`` [L]: the slot each entry holds, -1 empty) is read whole, an entry seen where its slot
    is at or after the row's padding. Query heads h of a key/value head k are k * H / K .. (k + 1) * H / K - 1.
    In code torch.compile traces (a compiled decode step) it is the custom op ``hfnative::decode_attention``, which the
    compiler calls as it is."""
    if torch.compiler.is_compiling():
        return _decode_attention_op(q_BH1d, keys_BKLd, values_BKLd, pad_B, slot_1, entry_slot_L, scale)
    return _decode_attention(q_BH1d, keys_BKLd, values_BKLd, pad_B, slot_1, entry_slot_L, scale)


MAX_ATTENTION_SPLITS = 16
MIN_SPLIT_ENTRIES = 4 * ATTENTION_BLOCK  # the shortest part of a cache a program is given alone


def attention_splits(rows: int, kv_heads: int, length: int, device: torch.device) -> int:
    """In how many parts ``decode_attention`` reads each row's cache (a buffer of ``length`` entries): one where the
    grid's rows x key/value heads programs are at least twice the GPU's multiprocessors; else the largest power of two
    that keeps parts x programs within twice them, at most MAX_ATTENTION_SPLITS and at most ``length`` /
    MIN_SPLIT_ENTRIES (a small batch with a long cache: without parts its programs would each walk their whole cache
    while most multiprocessors idle). A step splits the entries a row sees now, so early in a call the parts are
    short and the last ones may be empty. One on a CPU. Chosen by the buffer's shape, so fixed for a captured step."""
    if device.type != "cuda":
        return 1
    wanted = 2 * _multiprocessors(device.index) // max(rows * kv_heads, 1)
    splits = 1
    while 2 * splits <= min(wanted, MAX_ATTENTION_SPLITS, length // MIN_SPLIT_ENTRIES):
        splits *= 2
    return splits


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _decode_attention(q_BH1d: torch.Tensor, keys_BKLd: torch.Tensor, values_BKLd: torch.Tensor, pad_B: torch.Tensor,
                      slot_1: torch.Tensor, entry_slot_L: torch.Tensor | None, scale: float,
                      splits: int | None = None) -> torch.Tensor:
    """``decode_attention``; splits: the parts each row's cache is read in (None: ``attention_splits``)."""
    if q_BH1d.stride(-1) != 1:  # (what ``decode_attention_takes`` asked of a traced query, whatever layout runs)
        q_BH1d = q_BH1d.contiguous()
    B, H, _, d = q_BH1d.shape
    kv_heads, length = keys_BKLd.shape[1], keys_BKLd.shape[2]
    device = q_BH1d.device
    out = torch.empty(B, H, 1, d, dtype=q_BH1d.dtype, device=device)
    block_d = _pow2_at_least(d, 16)  # (tl.dot's smallest tile: 16)
    block_n = max(16, min(ATTENTION_BLOCK, ATTENTION_BLOCK_BYTES // (block_d * keys_BKLd.element_size())))
    group_block = _pow2_at_least(H // kv_heads, 16)
    full = entry_slot_L is None
    splits = attention_splits(B, kv_heads, length, device) if splits is None else splits
    part_acc = part_max = part_sum = out  # (one part: the kernel writes no parts and these are not read)
    if splits > 1:
        parts = B * kv_heads * splits * group_block
        part_max, part_sum = (torch.empty(parts, dtype=torch.float32, device=device) for _ in range(2))
        part_acc = torch.empty(parts * block_d, dtype=torch.float32, device=device)
    _launch(
        "decode_attention", (B, kv_heads, splits), device,
        q_BH1d, keys_BKLd, values_BKLd, out, pad_B, slot_1, slot_1 if full else entry_slot_L, part_acc, part_max,
        part_sum, q_BH1d.stride(0), q_BH1d.stride(1), *keys_BKLd.stride()[:3], out.stride(0), out.stride(1),
        H // kv_heads, d, length, scale, FULL=full, GROUP_BLOCK=group_block, BLOCK_D=block_d, BLOCK_N=block_n,
        IEEE=q_BH1d.dtype == torch.float32, SPLITS=splits, num_warps=4, num_stages=2,
    )
    if splits > 1:
        _launch("decode_attention_combine", (B, kv_heads), device, part_acc, part_max, part_sum, out, out.stride(0),
                out.stride(1), H // kv_heads, d, SPLITS=splits, GROUP_BLOCK=group_block, BLOCK_D=block_d, num_warps=4)
    return out


@torch.library.custom_op("hfnative::decode_attention", mutates_args=())
def _decode_attention_op(q_BH1d: torch.Tensor, keys_BKLd: torch.Tensor, values_BKLd: torch.Tensor,
                         pad_B: torch.Tensor, slot_1: torch.Tensor, entry_slot_L: Optional[torch.Tensor],
                         scale: float) -> torch.Tensor:
    return _decode_attention(q_BH1d, keys_BKLd, values_BKLd, pad_B, slot_1, entry_slot_L, scale)


@_decode_attention_op.register_fake
def _(q_BH1d, keys_BKLd, values_BKLd, pad_B, slot_1, entry_slot_L, scale):
    return torch.empty(q_BH1d.shape, dtype=q_BH1d.dtype, device=q_BH1d.device)


__all__ = ["attention_splits", "decode_attention", "decode_attention_supported", "decode_attention_takes", "decode_qkv",
           "decode_qkv_supported", "decode_qkv_written_dtype"]
