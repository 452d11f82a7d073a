"""The generator actors' copy of the policy: its ``ModelArgs`` and its weights as safetensors bytes, rebuilt there
as a plain ``Transformer``. Ray carries the copy, a dataclass of numbers and bytes; no module object travels and
nothing is read back with ``torch.load``.

A plain model computes what the policy computes: LoRA / DoRA adapters are folded into their base weights and quantized
(NF4, int8) weights dequantized (the generator only decodes), so a weight sync sends each adapted linear's folded weight.

A parallelized policy (DTensor parameters: FSDP2, TP, EP) is gathered whole: ``plain_state_dict``, ``policy_copy`` and
``trainable_weights`` are then collectives every rank of the model's mesh calls, in step, each getting the whole tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from hfnative.models.args import ModelArgs
from hfnative.models.decoder import Transformer
from hfnative.parallel.replica import plain_tensors, trainable_tensors


@dataclass(frozen=True)
class PolicyCopy:
    """What a generator actor rebuilds the policy from: ``args`` (plain numbers and switches) and ``weights``, the
    plain model's state dict as safetensors bytes."""

    args: ModelArgs
    weights: bytes


@torch.no_grad()
def plain_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The state dict of a plain ``Transformer(model.args)`` that computes what ``model`` computes, on the CPU
    (``hfnative.parallel.replica.plain_tensors``: adapters folded in, NF4 dequantized, shards gathered)."""
    return {name: tensor.to("cpu", copy=True).contiguous() for name, tensor in plain_tensors(model)}


@torch.no_grad()
def trainable_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors of the plain copy that training changes, on the CPU (``replica.trainable_tensors``)."""
    return {name: tensor.to("cpu", copy=True) for name, tensor in trainable_tensors(model)}


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
    """The device a generator actor decodes on: the GPU Ray assigned to it, else the CPU. Read from Ray's assignment,
    not from CUDA_VISIBLE_DEVICES: an actor given no GPU may still see the driver's (Ray leaves the variable alone
    when told to, RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0), and would decode beside the training's first rank."""
    try:
        import ray

        assigned = ray.get_gpu_ids() if ray.is_initialized() else None
    except ImportError:
        assigned = None
    if assigned is None:  # not inside a Ray worker: what this process sees
        assigned = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_available() and assigned:
        return torch.device("cuda")
    return torch.device("cpu")


__all__ = ["PolicyCopy", "generator_device", "load_policy_copy", "plain_state_dict", "policy_copy", "trainable_weights"]
