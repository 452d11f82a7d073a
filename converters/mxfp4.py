"""MXFP4 checkpoints (``quantization_config.quant_method == "mxfp4"``, e.g. GPT-OSS's experts):
dequantized while loading, so the native model holds ordinary bf16/fp32 parameters.

A quantized Hub tensor ``X`` is stored as two uint8 tensors (the OCP Microscaling format):

- ``X_blocks`` [..., R, G, 16]: G blocks of 32 FP4 (E2M1) codes per row, two codes a byte, the
  element with the even index in the low nibble;
- ``X_scales`` [..., R, G]: one E8M0 scale per block, the power of two 2 ** (s - 127).

Dequantized this is [..., R, G * 32]. As transformers stores the unquantized tensors, ``X`` itself is
its transpose, [..., G * 32, R] (e.g. GPT-OSS's gate_up_proj [E, D, 2I] from blocks [E, 2I, D/32, 16]),
so a family's pieces read the same keys from quantized and unquantized checkpoints.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32  # FP4 values per block (one scale each)
SCALE_BIAS = 127  # E8M0 exponent bias
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def _e2m1_values() -> torch.Tensor:
    """The 16 FP4 E2M1 code points: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    values = []
    for code in range(16):
        sign = -1.0 if code & 0b1000 else 1.0
        exponent, mantissa = (code >> 1) & 0b11, code & 0b1
        magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
        values.append(sign * magnitude)
    return torch.tensor(values, dtype=torch.float32)


E2M1_VALUES = _e2m1_values()  # 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated


def _dequantize_rows(blocks_RG16: torch.Tensor, scales_RG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    table = E2M1_VALUES.to(blocks_RG16.device)
    low, high = table[(blocks_RG16 & 0x0F).long()], table[(blocks_RG16 >> 4).long()]
    values_RG32 = torch.stack((low, high), dim=-1).flatten(-2)  # element 2j: low nibble, 2j + 1: high
    exponents = scales_RG.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values_RG32, exponents[..., None]).flatten(-2).to(dtype)  # exact: a power of two times E2M1


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., R, G, 16] and scales uint8 [..., R, G] -> values [..., R, G * 32] in ``dtype``
    (bf16 holds every MXFP4 value exactly). Works one leading slice (e.g. one expert) at a time."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: expected [..., R, G, 16] and [..., R, G]"
        )
    if blocks.dim() <= 3:
        return _dequantize_rows(blocks, scales, dtype)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * BLOCK_SIZE, dtype=dtype, device=blocks.device)
    for i in range(blocks.shape[0]):
        out[i] = dequantize_mxfp4(blocks[i], scales[i], dtype)
    return out


class Mxfp4Source:
    """A checkpoint source (see ``loading.py``) whose ``X_blocks`` / ``X_scales`` pairs read as the
    dequantized Hub tensor ``X``; every other tensor passes through unchanged."""

    def __init__(self, source, dtype: torch.dtype = torch.bfloat16):
        self.source, self.dtype = source, dtype
        self.shapes = {}
        self.quantized: dict[str, tuple[str, str]] = {}  # X -> (X_blocks, X_scales)
        for key, shape in source.shapes.items():
            base = key.removesuffix(BLOCKS_SUFFIX)
            if key.endswith(BLOCKS_SUFFIX) and base + SCALES_SUFFIX in source.shapes:
                *prefix, rows, groups, _ = shape
                self.shapes[base] = (*prefix, groups * BLOCK_SIZE, rows)
                self.quantized[base] = (key, base + SCALES_SUFFIX)
        paired = {key for pair in self.quantized.values() for key in pair}
        self.shapes.update({key: shape for key, shape in source.shapes.items() if key not in paired})

    def keys(self):
        return self.shapes.keys()

    def iter_tensors(self, wanted: set[str]):
        """Yield (key, tensor); a quantized tensor once both its halves are read, then its halves are dropped."""
        raw = {key for key in wanted if key not in self.quantized}
        halves_of = {half: base for base in wanted & self.quantized.keys() for half in self.quantized[base]}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in self.source.iter_tensors(raw | halves_of.keys()):
            if key not in halves_of:
                yield key, tensor
                continue
            base = halves_of[key]
            pending.setdefault(base, {})[key] = tensor
            if len(pending[base]) == 2:
                halves = pending.pop(base)
                blocks_key, scales_key = self.quantized[base]
                values = dequantize_mxfp4(halves[blocks_key], halves[scales_key], self.dtype)
                del halves
                yield base, values.transpose(-2, -1)


def quant_method(config) -> str | None:
    """The ``quant_method`` of a config's quantization_config (a dict or a transformers config object), or None."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    if isinstance(quantization, dict):
        return quantization.get("quant_method")
    return getattr(quantization, "quant_method", None)
