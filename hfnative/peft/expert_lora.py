"""LoRA on a stacked MoE expert tensor: peft's ``target_parameters`` (its ``ParamWrapper`` over a 3-D parameter).

transformers 5 keeps a layer's experts as stacked tensors (``experts.gate_up_proj``, ``experts.down_proj``), and peft
adapts such a tensor with one low-rank pair for all its experts:

    A: [E * r, in]     expert e's rows e*r .. e*r + r - 1                     (A reshaped [E, r, in])
    B: [out, E * r]    expert e's columns e, E + e, 2E + e, ...              (B reshaped [out, r, E])
    W_e + scaling * B_e A_e

``in`` / ``out`` are the linear map's input and output features whichever way the Hub stores the tensor. Here the
native experts hold one weight per projection (``w1`` gate, ``w3`` up, ``w2`` down, each [E, out, in]), so a Hub
``gate_up_proj`` adapter folds into ``w1`` and ``w3``, each taking its rows of B (the first and second half, or every
other row where the Hub interleaves gate and up). The fold runs as peft's does: one ``baddbmm`` per weight in the
weight's dtype (the factors cast to it), outside autocast, once per forward of the experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .lora import _init_lora_A


class ExpertLora(nn.Module):
    """One adapter on a stacked expert tensor; ``parts`` maps each native expert weight it changes (``"w1"``) to the
    rows of B (the Hub tensor's output features) that weight holds, as a slice."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, r: int, scaling: float,
                 parts: dict[str, slice], *, init: bool | str = True, dtype: torch.dtype | None = None,
                 device: torch.device | None = None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.r, self.scaling = r, scaling
        self.parts = dict(parts)
        self.adapter_enabled = True
        self.lora_A = nn.Parameter(torch.empty(num_experts * r, in_features, dtype=dtype, device=device))
        _init_lora_A(self.lora_A, r, init)
        self.lora_B = nn.Parameter(torch.zeros(out_features, num_experts * r, dtype=dtype, device=device))
        if init is False:  # peft leaves both at nn.Linear's default init
            nn.init.kaiming_uniform_(self.lora_B, a=math.sqrt(5))

    def fold(self, name: str, weight: torch.Tensor, lora_A: torch.Tensor | None = None,
             lora_B: torch.Tensor | None = None) -> torch.Tensor:
        """The native expert weight ``name`` ([E, out, in]) with this adapter added (as it trains: gradients reach A
        and B). lora_A / lora_B: other values of the factors (a sharded adapter's, gathered whole)."""
        lora_A = self.lora_A if lora_A is None else lora_A
        lora_B = (self.lora_B if lora_B is None else lora_B)[self.parts[name]]
        lhs = lora_B.reshape(lora_B.shape[0], self.r, self.num_experts).permute(2, 0, 1).to(weight.dtype)
        rhs = lora_A.reshape(self.num_experts, self.r, self.in_features).to(weight.dtype)
        with torch.autocast(device_type=weight.device.type, enabled=False):
            return torch.baddbmm(weight, lhs, rhs, alpha=self.scaling)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, r={self.r}, "
                f"scaling={self.scaling:g}, parts={sorted(self.parts)}")


__all__ = ["ExpertLora"]
