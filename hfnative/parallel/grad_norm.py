"""The gradient norm (and its clipping) over parameters whose DTensors live on different device meshes: one trained
module sharded on the data-parallel mesh beside another on the expert-parallel one (PPO's value model beside an
expert-parallel policy). torch's ``clip_grad_norm_`` stacks the per-tensor norms, which DTensor refuses across meshes."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _grads_by_mesh(parameters) -> dict:
    groups: dict = {}
    for parameter in parameters:
        if parameter.grad is not None:
            grad = parameter.grad
            groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(parameter)
    return groups


def clip_grad_norm_over_meshes(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` (the 2-norm of all the gradients, each scaled by
    ``max_norm / norm`` when that is below 1) for parameters on any number of device meshes: each mesh's norm over all
    its shards, the total their root sum of squares. Returns the norm (a plain tensor)."""
    groups = _grads_by_mesh(parameters)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        if isinstance(norm, DTensor):  # sharded gradients: the norm over every shard
            norm = norm.full_tensor()
        squares.append(norm.double() ** 2)
    total = torch.stack([s.to(squares[0].device) for s in squares]).sum().sqrt().float()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].device))
    return total


__all__ = ["clip_grad_norm_over_meshes"]
