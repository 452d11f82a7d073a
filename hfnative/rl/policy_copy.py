"""The generator actors' copy of the policy: its ``ModelArgs`` and its weights as safetensors bytes, rebuilt there
as a plain ``Transformer``. Ray carries the copy, a dataclass of numbers and bytes; no module object travels and
nothing is read back with ``torch.load``.

A plain model computes what the policy computes: LoRA / DoRA adapters are folded into their base weights and NF4
weights dequantized (the generator only decodes), so a weight sync sends each adapted linear's folded weight.

A parallelized policy (DTensor parameters: FSDP2, TP, EP) is gathered whole: ``plain_state_dict``, ``policy_copy`` and
``trainable_weights`` are then collectives every rank of the model's mesh calls, in step, each getting the whole tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from hfnative.models.args import ModelArgs
from hfnative.models.decoder import Transformer
from hfnative.peft.adapters import LORA_PARAMETERS, lora_modules
from hfnative.peft.lora import LoraLinear
from hfnative.peft.quantize import NF4Linear, dequantize, is_nf4


@dataclass(frozen=True)
class PolicyCopy:
    """What a generator actor rebuilds the policy from: ``args`` (plain numbers and switches) and ``weights``, the
    plain model's state dict as safetensors bytes."""

    args: ModelArgs
    weights: bytes


def _folded(module: torch.nn.Module, plain_dtype: torch.dtype | None) -> torch.Tensor:
    """An adapted or quantized linear's weight as a plain linear holds it."""
    if isinstance(module, LoraLinear):
        weight = module.merged_weight()
    else:
        weight = dequantize(module.weight)
    if is_nf4(module.weight) and plain_dtype is not None:  # back to the dtype of the unquantized parameters
        weight = weight.to(plain_dtype)
    return weight


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor (gathered from every rank of its mesh); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _plain_dtype(model: torch.nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point() and not is_nf4(p)), None)


@torch.no_grad()
def plain_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The state dict of a plain ``Transformer(model.args)`` that computes what ``model`` computes, on the CPU: LoRA
    adapters folded in, NF4 weights dequantized, a tensor held under two names (an untied view of a tied head) once."""
    special = {name: m for name, m in model.named_modules() if isinstance(m, (LoraLinear, NF4Linear))}
    plain_dtype = _plain_dtype(model)
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        module_name, _, attr = name.rpartition(".")
        if module_name in special and (attr in LORA_PARAMETERS or attr == "weight"):
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        same_tensor = (local.data_ptr(), tuple(tensor.shape), tuple(local.stride()))
        if tensor.numel() > 0 and same_tensor in seen:
            continue
        seen.add(same_tensor)
        state[name] = _whole(tensor.detach()).to("cpu", copy=True).contiguous()
    for name, module in special.items():
        state[f"{name}.weight"] = _whole(_folded(module, plain_dtype).detach()).to("cpu", copy=True).contiguous()
    return state


@torch.no_grad()
def trainable_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors of the plain copy that training changes, on the CPU: every trainable parameter, except that an
    adapted linear sends its folded weight (under the base weight's name) instead of its adapter."""
    adapted = lora_modules(model)
    weights = {}
    for name, parameter in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        if not parameter.requires_grad or (module_name in adapted and attr in LORA_PARAMETERS):
            continue
        weights[name] = _whole(parameter.detach()).to("cpu", copy=True)
    plain_dtype = _plain_dtype(model)
    for name, module in adapted.items():
        weights[f"{name}.weight"] = _whole(_folded(module, plain_dtype)).to("cpu", copy=True)
    return weights


def policy_copy(model: Transformer) -> PolicyCopy:
    """``model`` (a native ``Transformer``, adapters and quantized weights allowed) as a ``PolicyCopy``."""
    if not isinstance(model, Transformer):
        raise ValueError(
            f"the generator actors copy a native hfnative Transformer; the policy is a {type(model).__name__} "
            "(a model without a native implementation): use vLLM for its rollouts (use_vllm=True)"
        )
    return PolicyCopy(model.args, save_safetensors(plain_state_dict(model)))


def load_policy_copy(copy: PolicyCopy, device: torch.device | str = "cpu") -> Transformer:
    """The plain ``Transformer`` a ``PolicyCopy`` describes, on ``device``, frozen and in eval mode."""
    with torch.device("meta"):  # no initialization: every tensor comes from the copy, the buffers are made here
        model = Transformer(copy.args)
    # assign: the parameters are the copy's tensors, in the policy's dtypes
    model.load_state_dict(load_safetensors(copy.weights), strict=True, assign=True)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
    model.init_buffers()
    return model.to(device).requires_grad_(False).eval()


def generator_device() -> torch.device:
    """The device a generator actor decodes on: the GPU Ray assigned to it, else the CPU."""
    if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES"):
        return torch.device("cuda")
    return torch.device("cpu")


__all__ = ["PolicyCopy", "generator_device", "load_policy_copy", "plain_state_dict", "policy_copy", "trainable_weights"]
