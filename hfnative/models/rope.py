"""Rotary position embeddings: inverse frequencies for each scaling type, and their application.

Shapes: B batch, S sequence, H heads, d head_dim, r rotary dim (= d * partial_rotary_factor).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .args import RopeArgs

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3", "yarn")


def _default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_inv_freq(rope: RopeArgs, rotary_dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(rope.theta, rotary_dim)
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by the factor, short ones kept, the band between is blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeArgs, rotary_dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        context = rope.original_max_position_embeddings
        return rotary_dim * math.log(context / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_inv_freq(rope: RopeArgs, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [r/2] (float32) and the factor applied to cos/sin."""
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    if rope.scaling == "default":
        return _default_inv_freq(rope.theta, rotary_dim), 1.0
    if rope.scaling == "linear":
        return _default_inv_freq(rope.theta, rotary_dim) / rope.factor, 1.0
    if rope.scaling == "llama3":
        return _llama3_inv_freq(rope, rotary_dim), 1.0
    if rope.scaling == "yarn":
        return _yarn_inv_freq(rope, rotary_dim)
    raise ValueError(f"unsupported rope scaling {rope.scaling!r}; supported: {', '.join(SUPPORTED_ROPE_SCALING)}")


class RotaryEmbedding(nn.Module):
    """Computes cos/sin [B, S, r] for given position ids; the buffer is rebuilt by ``reset_parameters``."""

    def __init__(self, rope: RopeArgs, head_dim: int):
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.register_buffer("inv_freq", torch.empty(int(head_dim * rope.partial_rotary_factor) // 2), persistent=False)
        self.attention_factor = 1.0

    def reset_parameters(self):
        inv_freq, self.attention_factor = rope_inv_freq(self.rope, self.head_dim)
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq.to(self.inv_freq.device))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_BSr2 = position_ids[..., None].float() * self.inv_freq.float()
        emb_BSr = torch.cat((freqs_BSr2, freqs_BSr2), dim=-1)
        cos = emb_BSr.cos() * self.attention_factor
        sin = emb_BSr.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BHSd: torch.Tensor, cos_BSr: torch.Tensor, sin_BSr: torch.Tensor) -> torch.Tensor:
    """Rotate the first r channels of each head (all of them unless the rotary factor is partial), in
    cos/sin's dtype when it is wider than x's; the result has x's dtype."""
    cos, sin = cos_BSr.unsqueeze(1), sin_BSr.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x_BHSd.shape[-1]:
        if x_BHSd.dtype == cos.dtype == sin.dtype:
            # x * cos + rotate_half(x) * sin with the products and the sum formed in place: one [B, H, S, d] tensor
            # and the rotation's halves made instead of four
            return (x_BHSd * cos).add_(_rotate_half(x_BHSd).mul_(sin))
        return (x_BHSd * cos + _rotate_half(x_BHSd) * sin).to(x_BHSd.dtype)
    x_rot, x_pass = x_BHSd[..., :rotary_dim], x_BHSd[..., rotary_dim:]
    return torch.cat(((x_rot * cos + _rotate_half(x_rot) * sin).to(x_BHSd.dtype), x_pass), dim=-1)
