"""A quantized base's weights made whole in one Triton kernel each, run where the block's kernels run
(``triton_kernels.use_triton_kernels``: the GPU policy, an NVIDIA GPU of compute capability 8.0 or later, or Triton's
interpreter), sources in ``triton_kernel_sources``:

- ``int8_values``: LLM.int8's rows (``hfnative.peft.quantize.Int8Weight``) as the weight they stand for. torch's op
  sequence writes a float32 product, multiplies it in place and casts it: about 19 bytes an element (to bf16) where
  the kernel reads one and the row's scale and writes the result (2 bytes in bf16).
- ``nf4_values``: torchao's NF4 tensor as its values. Its ``get_original_weight`` runs a dozen kernels over the
  weight, two of them writing 64-bit indices (about 30 bytes an element); the kernel reads half a byte and writes the
  result.

Each gives the op sequence's values to the bit (every rounding where it rounds), in the dtype asked for: under autocast
the matmul's dtype directly, where the op sequence makes the weight's dtype and autocast casts it again. A quantized
weight is made whole for every matmul (forward, backward and each recompute), so on a GPU these passes are a QLoRA
step's main work outside the matmuls.
"""

from __future__ import annotations

import torch

from .triton_kernels import _FLOATS, _cdiv, _launch, use_triton_kernels

BLOCK = 1024  # elements (int8: of a row) or bytes of two elements (NF4) a program
MAX_COLUMN_BLOCKS = 65535  # a grid's second axis


def int8_supported(data: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> bool:
    """int8 rows [out, in] laid out whole, one float32 maximum a row, a floating dtype asked for; not while compiling
    (the compiler fuses the op sequence; inside ``hfnative::int8_linear``, opaque to it, the kernel still runs)."""
    if not use_triton_kernels(data, absmax):  # (False while compiling)
        return False
    return (dtype in _FLOATS and data.dtype == torch.int8 and data.dim() == 2 and data.numel() > 0
            and data.shape[1] <= MAX_COLUMN_BLOCKS * BLOCK and data.is_contiguous() and absmax.is_contiguous()
            and absmax.dtype == torch.float32 and absmax.shape == data.shape[:1])


def int8_values(data: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype, inv_max: float) -> torch.Tensor:
    """``(data * absmax[:, None]) * inv_max`` in float32, rounded once to ``dtype`` (``int8_supported`` first)."""
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    rows, cols = data.shape
    block = min(BLOCK, 1 << (cols - 1).bit_length())
    _launch("int8_dequantize", (rows, _cdiv(cols, block)), data.device, data, absmax, out, cols, inv_max,
            BLOCK=block)
    return out


def _nf4_parts(weight) -> tuple[torch.Tensor, ...]:
    return (weight.quantized_data, weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean,
            weight.nf4)


def nf4_supported(weight, dtype: torch.dtype) -> bool:
    """A whole NF4 tensor laid out as torchao makes it (not a view of one), blocks of an even size."""
    parts = data, scalers, factors, mean, table = _nf4_parts(weight)
    if not use_triton_kernels(*parts):  # (False while compiling: the compiler fuses torchao's op sequence itself)
        return False
    if dtype not in _FLOATS or weight.dtype not in _FLOATS or weight.block_size % 2:
        return False
    if not weight.is_contiguous() or weight.storage_offset() or not all(t.is_contiguous() for t in parts):
        return False
    if (data.dtype != torch.uint8 or scalers.dtype != torch.int8 or data.numel() * 2 != weight.numel()
            or scalers.numel() != weight.n_blocks or weight.n_blocks * weight.block_size != weight.numel()
            or factors.numel() * weight.scaler_block_size != scalers.numel() or table.numel() != 16
            or mean.numel() != 1):
        return False
    return all(t.dtype == weight.dtype for t in (factors, mean, table))


def nf4_values(weight, dtype: torch.dtype) -> torch.Tensor:
    """``weight.get_original_weight().to(dtype)`` in one kernel (``nf4_supported`` first)."""
    data, scalers, factors, mean, table = _nf4_parts(weight)
    out = torch.empty(weight.shape, dtype=dtype, device=data.device)
    _launch("nf4_dequantize", _cdiv(data.numel(), BLOCK), data.device, data, scalers, factors, mean, table, out,
            data.numel(), HALF_BLOCK=weight.block_size // 2, SCALER_BLOCK=weight.scaler_block_size, BLOCK=BLOCK)
    return out
