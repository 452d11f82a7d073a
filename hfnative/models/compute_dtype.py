"""Matmul weights in the autocast dtype: what autocast casts a float32 weight to at every use, made once.

Under autocast a linear layer casts its float32 weight to the autocast dtype at every forward (for a weight that
requires no gradient, at every call: autocast caches only the casts of leaves that require one). A frozen model run
under autocast (a reference model, a teacher) can keep those weights in the autocast dtype instead: the same matmul
operands, so the same outputs, without the cast's pass over the weights each forward and with half their memory.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from hfnative.precision import autocast_dtype


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The floating 2-D parameters of ``model``'s nn.Linear modules, LoRA's A and B included. NF4 and DTensor
    weights are not plain tensors, and a DoRA layer takes a norm of its weight outside autocast: those are left
    out."""
    return [p for module in model.modules()
            if isinstance(module, nn.Linear) and getattr(module, "lora_magnitude_vector", None) is None
            for p in module.parameters(recurse=False)
            if p.dim() == 2 and p.is_floating_point() and type(p.data) is torch.Tensor]


def keep_linear_weights_in(model: nn.Module, dtype: torch.dtype) -> int:
    """A frozen model's linear weights (``linear_weights``) wider than ``dtype`` replaced by their ``dtype`` copies,
    the bytes freed returned. Every other parameter (norms, embeddings, the output head) keeps its dtype, so under
    autocast to ``dtype`` the model computes what it computed before. The model's ``linear_weights_dtype`` is set:
    its forward then runs under autocast to that dtype when the caller's does not (``Transformer.forward``)."""
    if any(p.requires_grad for p in model.parameters()):
        raise ValueError("keep_linear_weights_in: the model has parameters that require gradients; only a frozen "
                         "model's weights can be kept in the autocast dtype")
    freed = 0
    for weight in linear_weights(model):
        if torch.finfo(weight.dtype).bits > torch.finfo(dtype).bits:
            freed += weight.numel() * (weight.element_size() - torch.finfo(dtype).bits // 8)
            weight.data = weight.data.to(dtype)
    if freed:
        model.linear_weights_dtype = dtype
    return freed


def autocast_to(device_type: str, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device_type`` where the caller's autocast is not already that; a context that does
    nothing for ``dtype`` None or where it is."""
    if dtype is None or autocast_dtype(device_type) == dtype:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def autocast_for_weights(model: nn.Module, device_type: str):
    """Autocast to the dtype ``model``'s linear weights are kept in (``keep_linear_weights_in``), as ``autocast_to``."""
    return autocast_to(device_type, getattr(model, "linear_weights_dtype", None))


def under_weights_autocast(forward):
    """A model's ``forward(self, input_ids, ...)`` run under autocast to the dtype its linear weights are kept in
    when the caller's autocast is not that; an output with an ``autocast_for`` field records (device type, dtype) for
    what it computes later (``CausalLMOutput.logits``)."""

    @functools.wraps(forward)
    def run(self, input_ids, *args, **kwargs):
        dtype = self.linear_weights_dtype
        if dtype is None:
            return forward(self, input_ids, *args, **kwargs)
        with autocast_to(input_ids.device.type, dtype):
            out = forward(self, input_ids, *args, **kwargs)
        if hasattr(out, "autocast_for"):
            out.autocast_for = (input_ids.device.type, dtype)
        return out

    return run
