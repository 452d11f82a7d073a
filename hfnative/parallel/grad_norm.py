"""The gradient norm (and its clipping) over parameters whose DTensors live on different device meshes: one trained
module sharded on the data-parallel mesh beside another on the expert-parallel one (PPO's value model beside an
expert-parallel policy). torch's ``clip_grad_norm_`` stacks the per-tensor norms, which DTensor refuses across meshes.
The pipeline's clipping (``pipeline.clip_grad_norm_over_stages``) takes each stage's norm from here too.
``replicate_partial_gradients`` sums, once, the gradients still pending a sum over ranks before any of this reads them."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def replicate_partial_gradients(parameters) -> None:
    """Replace each gradient that is a DTensor still pending a sum over ranks (a ``Partial`` placement: a parameter
    replicated over the tensor-parallel ranks whose inputs differ there, as the norms' under sequence parallelism)
    by that sum (``Replicate``), reduced once. Left partial, DTensor reduces it again in each op that reads it (the
    norm, the loss scale's unscaling, each of the optimizer's), and torch 2.11 runs no in-place foreach op on a
    partial DTensor at all: the clipping's scaling left such gradients unclipped."""
    for parameter in parameters:
        grad = parameter.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            parameter.grad = grad.redistribute(
                placements=[Replicate() if placement.is_partial() else placement for placement in grad.placements]
            )


def _by_mesh(parameters) -> list[list[torch.Tensor]]:
    """The parameters that have a gradient, grouped by their gradient's device mesh (plain tensors together)."""
    groups: dict = {}
    for parameter in parameters:
        if parameter.grad is not None:
            grad = parameter.grad
            groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(parameter)
    return list(groups.values())


def total_grad_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the gradients of ``parameters`` over every shard, whatever meshes they are on (a plain tensor;
    zero when none has a gradient)."""
    norms = []
    for group in _by_mesh(parameters):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # sharded: over every shard
    if not norms:
        return torch.zeros((), device=parameters[0].device if parameters else None)
    if len(norms) == 1:
        return norms[0]
    return torch.stack([n.double().to(norms[0].device) ** 2 for n in norms]).sum().sqrt().float()


def clip_grads_to(parameters: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by ``max_norm / total`` when that is below 1 (``clip_grads_with_norm_``, mesh by mesh)."""
    for group in _by_mesh(parameters):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].device))


def clip_grad_norm_over_meshes(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` (the 2-norm of all the gradients, each scaled by
    ``max_norm / norm`` when that is below 1) for parameters on any number of device meshes: each mesh's norm over all
    its shards, the total their root sum of squares. Returns the norm (a plain tensor)."""
    if len(_by_mesh(parameters)) <= 1:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    total = total_grad_norm(parameters)
    clip_grads_to(parameters, max_norm, total)
    return total


__all__ = ["clip_grad_norm_over_meshes", "clip_grads_to", "replicate_partial_gradients", "total_grad_norm"]
