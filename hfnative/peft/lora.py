"""The LoRA layer: an nn.Linear whose frozen ``weight``/``bias`` keep their names, plus an adapter.

    y = x W^T + b + dropout(x) A^T B^T * scaling                                  (LoRA)
    y = x W^T + b + (m / |W + s B A|_row - 1) (x W^T) + (m / |W + s B A|_row) s x A^T B^T   (DoRA)

computed as peft 0.21 computes them (tuners/lora/layer.py, dora.py): the adapter runs in its own
dtype (float32 when the base is bf16/fp16), and DoRA's weight norm is detached from the graph
(DoRA paper, section 4.3). LoRA's up-projection, scale and sum run as one matmul (``addmm``), which
rounds once where peft rounds the product, the scaled product and the sum; under autocast without
dropout the adapter reads the input autocast casts, not a float32 copy of it (the same values).
Shapes: A is [r, in], B is [out, r], the DoRA magnitude m is [out].
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hfnative.precision import autocast_dtype

from .quantize import FrozenLinear, dequantize, is_nf4


class LoraLinear(FrozenLinear):
    """A frozen linear with a low-rank adapter; ``adapter_enabled = False`` runs the base alone.

    lora_A: pass an existing parameter to share it (a fused Hub projection such as Phi-3's qkv_proj
    is one A and one B whose row blocks are this model's separate wq / wk / wv).
    """

    def __init__(
        self,
        base: nn.Linear,
        r: int,
        scaling: float,
        *,
        dropout: float = 0.0,
        use_dora: bool = False,
        init: bool | str = True,
        adapter_dtype: torch.dtype | None = None,
        lora_A: nn.Parameter | None = None,
    ):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same parameters: names and key maps unchanged
        self.r, self.scaling = r, scaling
        self.adapter_enabled = True
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        dtype = adapter_dtype or base.weight.dtype
        device = base.weight.device
        if lora_A is None:
            lora_A = nn.Parameter(torch.empty(r, self.in_features, dtype=dtype, device=device))
            _init_lora_A(lora_A, r, init)
        elif tuple(lora_A.shape) != (r, self.in_features):
            raise ValueError(f"shared lora_A has shape {list(lora_A.shape)}, expected {[r, self.in_features]}")
        self.lora_A = lora_A
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, dtype=dtype, device=device))
        if init is False:  # peft leaves both at nn.Linear's default init
            nn.init.kaiming_uniform_(self.lora_B, a=math.sqrt(5))
        self.lora_magnitude_vector = None
        if use_dora:  # m starts as |W + s B A|_row, computed in the base dtype as peft does
            with torch.no_grad():
                weight = dequantize(self.weight)
                magnitude = self.weight_norm(weight, self.delta_weight().to(weight.dtype))
            self.lora_magnitude_vector = nn.Parameter(magnitude.to(dtype))

    # --- the pieces of the computation ----------------------------------------------------------

    def delta_weight(self) -> torch.Tensor:
        """s B A: the [out, in] update the adapter adds to W."""
        return (self.lora_B @ self.lora_A) * self.scaling

    @staticmethod
    def weight_norm(weight: torch.Tensor, delta_weight: torch.Tensor) -> torch.Tensor:
        """|W + dW| per output row (peft's get_weight_norm), in the promoted dtype of the sum."""
        merged = weight + delta_weight
        return torch.linalg.norm(merged, dim=1).to(merged.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            return super().forward(x)  # the frozen base, plain or quantized
        if self.lora_magnitude_vector is not None:
            result = super().forward(x)
            return (result + self._dora_extra(x.to(self.lora_A.dtype), result)).to(result.dtype)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        narrow = autocast_dtype(x.device.type)
        if (narrow is not None and x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled())
                and self.narrow_input_without_grad):
            # an input that needs no gradient (rollouts, a reference's forward, the first block's projections in
            # training): cast once for the base's matmul and the adapter's, which autocast casts it for each (an input
            # that needs one keeps autocast's two casts: their gradients summed in float32)
            x = x.to(narrow)
        result = super().forward(x)
        result_dtype = result.dtype
        if self._no_dropout() and narrow is not None:
            adapter_input = x  # autocast casts it for the matmul, as it would cast x in the adapter's dtype
        else:
            adapter_input = self.lora_dropout(x.to(self.lora_A.dtype))
        hidden = F.linear(adapter_input, self.lora_A)
        if hidden.dtype == result.dtype:
            # the up-projection, the scale and the sum in one matmul (alpha s, the base's output its addend), where
            # separate ops write and read two more [tokens, out] tensors
            result = torch.addmm(result, hidden, self.lora_B.t(), alpha=self.scaling)
        else:  # the sum in the wider dtype, then back to the base's
            result = (result + F.linear(hidden, self.lora_B) * self.scaling).to(result_dtype)
        return result.view(*shape[:-1], self.out_features)

    def _dora_extra(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """What DoRA adds to the base output (peft's DoraLinearLayer.forward)."""
        weight = dequantize(self.weight).to(x.dtype)
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            base_result = result if self.bias is None else result - self.bias
        else:  # dropout applies to the input of the whole rescaled layer
            x = self.lora_dropout(x)
            base_result = F.linear(x, weight)
        lora_weight = (self.lora_B @ self.lora_A).to(x.dtype)
        # the norm is treated as a constant: no gradient flows through it (DoRA section 4.3)
        weight_norm = self.weight_norm(weight, self.scaling * lora_weight.detach()).detach()
        mag_norm_scale = (self.lora_magnitude_vector / weight_norm).view(1, -1)
        lora_result = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * self.scaling

    def _no_dropout(self) -> bool:
        return isinstance(self.lora_dropout, nn.Identity) or not self.lora_dropout.training

    @property
    def narrow_input_without_grad(self) -> bool:
        """Whether, without a gradient under autocast, this layer's output is the same from its input in the autocast
        dtype as from the input in float32 (``FrozenLinear.narrow_input_without_grad``): its base alone where the
        adapter is switched off; else a LoRA layer (not DoRA) without dropout or with it in eval mode, which casts a
        float32 input once itself for the base and the adapter."""
        if not super().narrow_input_without_grad:
            return False
        return not self.adapter_enabled or (self.lora_magnitude_vector is None and self._no_dropout())

    def sums_in_matmul(self, autocast: bool) -> bool:
        """Whether ``forward`` adds the update inside its up-projection's matmul (its base product that matmul's
        addend), told before it runs, under ``autocast`` or not: a LoRA (not DoRA) layer over a plain or int8 base (whose
        product comes out in the activations' dtype, as a plain one's), under autocast or with the base weight in the
        adapter's dtype (where the two products come out in one dtype; an NF4 base's may too, which this does not count
        on)."""
        return (self.adapter_enabled and self.lora_magnitude_vector is None and not is_nf4(self.weight)
                and (autocast or self.weight.dtype == self.lora_A.dtype))

    @property
    def product_addend_unread(self) -> bool:
        """Whether ``forward`` reads its base product only as the addend of its last ``addmm`` (a LoRA layer, not
        DoRA): a selectively checkpointed block keeps that ``addmm``'s result and not the addend, which its recompute,
        handed the result back, never reads (``hfnative.models.selective_checkpoint``)."""
        return self.adapter_enabled and self.lora_magnitude_vector is None

    # --- folding back ---------------------------------------------------------------------------

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W with the adapter folded in (peft's merge), in the base compute dtype."""
        weight = dequantize(self.weight)
        delta = self.delta_weight()  # in the adapter dtype; the sum promotes, then rounds once to W's dtype
        if self.lora_magnitude_vector is None:
            return (weight + delta).to(weight.dtype)
        factor = (self.lora_magnitude_vector / self.weight_norm(weight, delta)).view(-1, 1)
        return (factor * (weight + delta)).to(weight.dtype)

    def extra_repr(self) -> str:
        dora = ", dora" if self.lora_magnitude_vector is not None else ""
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling:g}{dora}"


def _init_lora_A(lora_A: nn.Parameter, r: int, init: bool | str) -> None:
    with torch.no_grad():
        if init == "gaussian":
            nn.init.normal_(lora_A, std=1 / r)
        else:  # True and False both: nn.Linear's default (kaiming-uniform, a = sqrt 5)
            nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5))
