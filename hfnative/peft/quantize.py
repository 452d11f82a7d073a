"""QLoRA's frozen base: linear weights stored as torchao NF4 tensors, computed in a chosen dtype.

torchao (>= 0.14) is imported only when quantizing. NF4 runs on CPU as well as GPU: the weight is
dequantized block by block for each matmul and never receives a gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NF4_BLOCK_SIZE = 64  # weights per absmax scale (QLoRA's value)
NF4_SCALER_BLOCK_SIZE = 256  # scales per second-level (double-quantization) scale


def _torchao_nf4():
    try:
        from torchao.quantization import NF4Tensor, to_nf4
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4
    except ImportError:
        try:  # torchao < 0.15 kept NF4 under dtypes
            from torchao.dtypes.nf4tensor import NF4Tensor, linear_nf4, to_nf4
        except ImportError as err:
            raise ImportError("QLoRA (load_in_4bit) needs torchao: pip install 'hfnative[quant]'") from err
    return NF4Tensor, to_nf4, linear_nf4


def is_nf4(tensor: torch.Tensor) -> bool:
    # by class name, so that checking a plain weight never imports torchao
    return type(tensor).__name__ == "NF4Tensor"


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, except that an NF4 weight is applied in its own (compute) dtype and the result cast back."""
    if not is_nf4(weight):
        return F.linear(x, weight, bias)
    _, _, linear_nf4 = _torchao_nf4()
    out = linear_nf4(x.to(weight.dtype), weight)  # saves only the NF4 weight for backward
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype)


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the weight's values (NF4 -> its compute dtype)."""
    return weight.get_original_weight() if is_nf4(weight) else weight


def _scaler_block_size(n_blocks: int) -> int:
    # torchao needs the number of scales divisible by the scaler block; small layers get a smaller one
    size = NF4_SCALER_BLOCK_SIZE
    while n_blocks % size:
        size //= 2
    return size


def to_nf4_parameter(weight: torch.Tensor, compute_dtype: torch.dtype, name: str = "weight") -> nn.Parameter:
    """A frozen NF4 copy of ``weight`` (cast to ``compute_dtype`` first, which is then its matmul dtype)."""
    _, to_nf4, _ = _torchao_nf4()
    if weight.dim() != 2 or weight.numel() % NF4_BLOCK_SIZE:
        raise ValueError(
            f"{name}: shape {list(weight.shape)} cannot be stored as NF4 (needs a 2-D weight whose size is a multiple "
            f"of {NF4_BLOCK_SIZE}); leave this layer unquantized"
        )
    value = weight.detach().to(compute_dtype).contiguous()
    nf4 = to_nf4(value, NF4_BLOCK_SIZE, _scaler_block_size(value.numel() // NF4_BLOCK_SIZE))
    return nn.Parameter(nf4, requires_grad=False)


class FrozenLinear(nn.Linear):
    """An nn.Linear computed through ``frozen_linear``, so its weight may be plain or NF4.

    quantize_base_nf4 swaps the weight of such a layer in place (a LoraLinear keeps its adapter) and
    replaces any other nn.Linear by an NF4Linear.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)


class NF4Linear(FrozenLinear):
    """A frozen nn.Linear whose weight is NF4 (the same ``weight``/``bias`` names, so key maps still apply)."""

    def __init__(self, base: nn.Linear, compute_dtype: torch.dtype, name: str = "weight"):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = to_nf4_parameter(base.weight, compute_dtype, name)
        self.bias = base.bias


def quantize_base_nf4(
    model: nn.Module,
    compute_dtype: torch.dtype = torch.bfloat16,
    module_names: list[str] | None = None,
    skip: tuple[str, ...] = ("output",),
) -> list[str]:
    """Store frozen nn.Linear weights as NF4 in place; returns the native module names quantized.

    module_names: which linears (native names); None -> every nn.Linear except those named in ``skip``
    (the output head, as bitsandbytes skips lm_head), MoE routers (transformers 5 does not implement them
    as nn.Linear, so bitsandbytes never quantizes them either) and linears whose weight is a trainable
    copy (modules_to_save). A LoRA layer keeps its adapter and gets an NF4 base. Stacked expert weights
    ([E, ...]) are not quantized. A quantized weight is frozen.
    """
    if module_names is None:
        module_names = [
            name
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
            and name not in skip
            and not name.endswith(".router")
            and not hasattr(module, "original_weight")  # a trainable copy (adapters.ORIGINAL_PREFIX)
        ]
    done = []
    for name in module_names:
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name} is a {type(module).__name__}, not an nn.Linear: it cannot be quantized to NF4")
        if is_nf4(module.weight):
            continue
        if isinstance(module, FrozenLinear):
            module.weight = to_nf4_parameter(module.weight, compute_dtype, f"{name}.weight")
        else:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, NF4Linear(module, compute_dtype, f"{name}.weight"))
        done.append(name)
    return done
