"""float8 training of the native decoder's linear layers through torchao (``convert_to_float8_training``).

What is converted: each block's attention projections (wq, wk, wv, wo) and MLP projections (w1, w2, w3, the shared
experts' too); their matmuls then run in float8 (e4m3 operands, dynamic scales; gradients e4m3 as well under the
rowwise recipe, e5m2 under tensorwise) with high-precision accumulation and output. Left in their dtype: the embedding
and the output head (the first and last layers, where float8's error costs most), an MoE router (its logits pick the
experts), a routed MoE's experts (torchao's float8 grouped GEMM for them is a CUDA-only prototype,
``torchao.prototype.moe_training``; not used), and any projection a float8 matmul cannot take: ``torch._scaled_mm``
needs both dimensions of a weight divisible by 16 (under tensor parallelism, of each rank's slice). Those are listed
once in the log.

Recipes (torchao's names): "tensorwise" (one scale per tensor; with FSDP2 the weights are cast to float8 before the
all-gather, halving its bytes) and "rowwise" (one scale per row, more accurate, weights gathered in high precision).
``emulate``: the float8 matmuls run as dequantized high-precision matmuls with the same rounding of their operands
(torchao's emulation), chosen automatically where the device has no float8 matmul (CPUs, GPUs before sm89).

Order (``parallelize``): converted first, before tensor parallelism (the float8 layers are split like the linear
layers they replace, their activations gathered in high precision), activation checkpointing, compile and FSDP2. The
parameters keep their names, shapes and dtypes, so checkpoints and Hub exports are unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from hfnative.log_once import warn_once

logger = logging.getLogger(__name__)

FLOAT8_RECIPES = ("tensorwise", "rowwise")
FLOAT8_LAYERS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # the blocks' attention and MLP projections
_ROW_SPLIT = ("wo", "w2")  # split by input features under tensor parallelism; the others by output features


@dataclass(frozen=True)
class Float8Training:
    """How to train in float8.

    recipe: "tensorwise" or "rowwise".
    fsdp_float8_all_gather: under FSDP2 sharding, all-gather the weights in float8 (tensorwise only; accelerate's
        ``fp8_enable_fsdp_float8_all_gather``).
    pad_inner_dim: pad the matmuls' inner dimension to a multiple of 16 (accelerate's ``fp8_pad_inner_dim``). Off, a
        float8 matmul needs it a multiple of 16 already: the weight gradient's is the batch's token count.
    emulate: emulated float8 matmuls; None: where the device has no float8 matmul.
    """

    recipe: str = "tensorwise"
    fsdp_float8_all_gather: bool = True
    pad_inner_dim: bool = True
    emulate: bool | None = None

    def __post_init__(self):
        if self.recipe not in FLOAT8_RECIPES:
            raise ValueError(f"float8 recipe {self.recipe!r}: expected one of {list(FLOAT8_RECIPES)}")


def has_float8_matmul(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies float8 natively (CUDA compute capability 8.9 or newer: Ada, Hopper, Blackwell)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear" and isinstance(module, nn.Linear)


def float8_candidates(model: nn.Module, tp: int = 1) -> tuple[list[str], list[str]]:
    """(names converted, names left with why) among ``model``'s block projections; ``tp``: the tensor-parallel ranks
    each weight is split over."""
    converted, left = [], []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in FLOAT8_LAYERS or is_float8_linear(module):
            continue
        if type(module) is not nn.Linear:
            raise ValueError(
                f"float8 training: {name} is a {type(module).__name__}, not an nn.Linear (LoRA adapters and quantized "
                "bases are not converted); train without float8 (float8_recipe=None, no --mixed_precision fp8), or "
                "without adapters"
            )
        split_in = tp if name.rsplit(".", 1)[-1] in _ROW_SPLIT else 1
        shape = (module.out_features // (tp // split_in), module.in_features // split_in)
        if shape[0] % 16 or shape[1] % 16:
            left.append(f"{name} {list(shape)}")
        else:
            converted.append(name)
    return converted, left


def apply_float8_training(model: nn.Module, settings: Float8Training, device: torch.device | str, *, tp: int = 1,
                          fsdp_sharded: bool = False) -> list[str]:
    """Swap ``model``'s block projections for torchao's ``Float8Linear`` (in place); returns the converted names.

    device: where the model trains (picks emulation when ``settings.emulate`` is None).
    tp: the tensor-parallel ranks the weights will be split over (the divisibility check is on each slice).
    fsdp_sharded: FSDP2 will shard the weights over more than one rank (float8 all-gather applies, tensorwise).
    """
    from hfnative.models.decoder import Transformer

    if not isinstance(model, Transformer):
        raise ValueError(f"float8 training needs hfnative's native model; {type(model).__name__} (transformers' own "
                         "module) trains in its own precision: drop float8_recipe / --mixed_precision fp8")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise ImportError("float8 training needs torchao: pip install hfnative[quant]") from error
    converted, left = float8_candidates(model, tp)
    if not converted:
        raise ValueError(f"float8 training: none of the model's projections can run in float8 (both dimensions must be "
                         f"divisible by 16): {', '.join(left)}; train without float8")
    emulate = settings.emulate if settings.emulate is not None else not has_float8_matmul(device)
    gather_in_float8 = settings.recipe == "tensorwise" and settings.fsdp_float8_all_gather and fsdp_sharded and tp == 1
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(settings.recipe), emulate=emulate,
                                 pad_inner_dim=settings.pad_inner_dim, enable_fsdp_float8_all_gather=gather_in_float8)
    chosen = set(converted)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    warn_once(logger, _describe(settings, emulate, gather_in_float8, fsdp_sharded, tp, converted, left))
    return converted


def plain_weight(tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor inside torchao's float8 all-gather weight wrapper (any other tensor as it is)."""
    return tensor._tensor if type(tensor).__name__ == "WeightWithDynamicFloat8CastTensor" else tensor


def _describe(settings, emulate, gather_in_float8, fsdp_sharded, tp, converted, left) -> str:
    parts = [f"float8 training ({settings.recipe} recipe{', emulated: no float8 matmul on this device' if emulate else ''})"
             f" of {len(converted)} projections"]
    if fsdp_sharded:
        parts.append("FSDP2 all-gathers their weights in float8" if gather_in_float8 else
                     "FSDP2 all-gathers their weights in high precision" + (
                         " (float8 all-gather is for the tensorwise recipe)" if settings.recipe != "tensorwise" else
                         " (float8 all-gather with tensor parallel is not used)" if tp > 1 else ""))
    if left:
        parts.append(f"left in high precision (a dimension not divisible by 16): {', '.join(left)}")
    parts.append("not converted: the embedding, the output head, MoE routers and routed experts")
    return "; ".join(parts)



__all__ = ["FLOAT8_RECIPES", "Float8Training", "apply_float8_training", "float8_candidates", "has_float8_matmul",
           "is_float8_linear", "plain_weight"]
