"""Whole, unsharded weights of a parallelized model: the one gather every copy of the policy goes through.

``whole_tensor`` gathers one tensor (a DTensor's full tensor: a collective every rank of its mesh calls, in step);
``plain_tensors`` walks a native model's tensors as a plain ``Transformer`` of its args holds them, whole: LoRA / DoRA
adapters folded into their base weights and quantized (NF4, int8) weights dequantized (a copy only decodes), a tensor
held under two names (an untied view of a tied head) once. Its users:
  - ``gather_replica``: the KV-cache decoder (hfnative.generation) runs the blocks' submodules one by one, outside the
    module calls that FSDP2's hooks gather the shards in, so it decodes a plain replica on each rank, refreshed from
    the policy once per weight version, each rank then decoding its own prompts without further communication;
  - hfnative.rl.policy_copy: the generator actors' copy of the policy (and its weight syncs);
  - the transformers fallback's replica of a module (hfnative.converters.fallback_generation);
  - saves that gather one tensor at a time: a pipeline-parallel model's stages (``pipeline.gather_stages``) and a
    sharded model's LoRA adapters (hfnative.converters.peft ``adapter_tensors``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hfnative.models.decoder import Transformer
from hfnative.peft.adapters import LORA_PARAMETERS, adapted_experts, folded_expert_weights, lora_modules
from hfnative.peft.token_rows import rows_weights
from hfnative.peft.lora import LoraLinear
from hfnative.peft.quantize import QuantizedLinear, dequantize, is_quantized

from .float8 import plain_weight


def is_parallelized(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (sharded or replicated over a device mesh)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor (gathered from every rank of its mesh, on the mesh's device: shards offloaded to the
    CPU are moved there first, as torch's own full state dict does, so the gather runs on the device's backend); any
    other tensor as it is (a float8 all-gather weight as the high-precision tensor it wraps)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to(tensor.device_mesh.device_type).full_tensor()
    return plain_weight(tensor)


def plain_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of ``model``'s unquantized floating-point parameters."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point() and not is_quantized(p)), None)


def folded_weight(module: nn.Module, dtype: torch.dtype | None) -> torch.Tensor:
    """An adapted (LoRA / DoRA) or quantized (NF4, int8) linear's weight as a plain linear holds it (``dtype``: the
    unquantized parameters', for a dequantized weight)."""
    weight = module.merged_weight() if isinstance(module, LoraLinear) else dequantize(module.weight)
    if is_quantized(module.weight) and dtype is not None:
        weight = weight.to(dtype)
    return weight


@torch.no_grad()
def plain_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of each tensor of a plain ``Transformer(model.args)`` computing what ``model`` computes,
    one at a time (each gathered as it is reached: every rank of the model's mesh iterates in step)."""
    special = {name: m for name, m in model.named_modules() if isinstance(m, (LoraLinear, QuantizedLinear))}
    experts = _expert_adapter_names(model)
    rows = rows_weights(model, gather=whole_tensor)
    dtype = plain_dtype(model)
    seen = set()
    for name, tensor in model.state_dict().items():
        module_name, _, attr = name.rpartition(".")
        if (module_name in special and (attr in LORA_PARAMETERS or attr == "weight") or name in experts or name in rows
                or ".token_rows." in name):
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        same_tensor = (local.data_ptr(), tuple(tensor.shape), tuple(local.stride()))
        if tensor.numel() > 0 and same_tensor in seen:
            continue
        seen.add(same_tensor)
        yield name, whole_tensor(tensor.detach())
    for name, module in special.items():
        yield f"{name}.weight", whole_tensor(folded_weight(module, dtype).detach())
    yield from folded_expert_weights(model, gather=whole_tensor).items()
    yield from rows.items()


def _expert_adapter_names(model: nn.Module) -> set[str]:
    """The state-dict names of the adapters on stacked experts and of the expert weights they fold into."""
    names = set()
    for name, experts in adapted_experts(model).items():
        for key, adapter in experts.lora.items():
            names |= {f"{name}.lora.{key}.{attr}" for attr in ("lora_A", "lora_B")}
            names |= {f"{name}.{attr}" for attr in adapter.parts}
    return names


@torch.no_grad()
def trainable_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of the plain copy's tensors that training changes: every trainable parameter, except that
    an adapted linear gives its folded weight (under the base weight's name) instead of its adapter."""
    adapted = lora_modules(model)
    experts = _expert_adapter_names(model)
    rows = rows_weights(model, gather=whole_tensor)
    for name, parameter in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        if (parameter.requires_grad and not (module_name in adapted and attr in LORA_PARAMETERS) and name not in experts
                and ".token_rows." not in name and name not in rows):
            yield name, whole_tensor(parameter.detach())
    dtype = plain_dtype(model)
    for name, module in adapted.items():
        yield f"{name}.weight", whole_tensor(folded_weight(module, dtype).detach())
    yield from folded_expert_weights(model, gather=whole_tensor).items()
    yield from rows.items()  # the matrices whose rows trained


@torch.no_grad()
def gather_replica(model: Transformer, replica: Transformer | None = None) -> Transformer:
    """``replica`` (a new plain ``Transformer`` of ``model.args`` when None, on this rank's device, frozen, in eval
    mode) holding ``model``'s whole weights (adapters folded in); every rank of the model's mesh must call it."""
    if replica is None:
        local = next(iter(model.state_dict().values()))
        device = (local.to_local() if isinstance(local, DTensor) else local).device
        with torch.device("meta"):  # no initialization: every tensor is copied in below, the buffers made here
            replica = Transformer(model.args)
        replica.to_empty(device=device).init_buffers()
        replica.requires_grad_(False).eval()
    own = replica.state_dict()
    copied = set()
    for name, tensor in plain_tensors(model):
        if name not in own:
            raise ValueError(
                f"gather_replica: the model's tensor {name!r} is not one of a plain {type(replica).__name__} of its "
                "args (a pipeline stage holds only some blocks: gather from every stage)"
            )
        own[name].copy_(tensor)
        copied.add(name)
    missing = sorted(set(own) - copied - _tied_views(replica))
    if missing:
        raise ValueError(
            f"gather_replica: the model holds no {missing[:3]} of a plain {type(replica).__name__} of its args (a "
            "pipeline stage holds only some blocks: gather from every stage)"
        )
    return replica


def _tied_views(model: nn.Module) -> set[str]:
    """The state-dict names of ``model`` that hold a tensor already held under an earlier name (a tied head)."""
    names, seen = set(), set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() > 0 and key in seen:
            names.add(name)
        seen.add(key)
    return names


__all__ = ["folded_weight", "gather_replica", "is_parallelized", "plain_dtype", "plain_tensors", "trainable_tensors",
           "whole_tensor"]
