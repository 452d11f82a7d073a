"""A whole, unsharded copy of a parallelized model's weights, for code that calls the model's submodules directly.

The KV-cache decoder (hfnative.generation) runs the blocks' submodules one by one, outside the module calls that
FSDP2's hooks gather the shards in, so it decodes a plain ``Transformer``: each rank gathers the parallelized
policy's full tensors into its replica once per weight version (a collective: every rank calls it, in step) and
then decodes its own prompts on it without further communication.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hfnative.models.decoder import Transformer


def is_parallelized(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (sharded or replicated over a device mesh)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


@torch.no_grad()
def gather_replica(model: Transformer, replica: Transformer | None = None) -> Transformer:
    """``replica`` (a new plain ``Transformer`` of ``model.args`` when None, on this rank's device, frozen, in eval
    mode) holding ``model``'s whole weights; every rank of the model's mesh must call it (the shards are gathered)."""
    state = model.state_dict()
    if replica is None:
        local = next(iter(state.values()))
        device = (local.to_local() if isinstance(local, DTensor) else local).device
        with torch.device("meta"):  # no initialization: every tensor is copied in below, the buffers made here
            replica = Transformer(model.args)
        replica.to_empty(device=device).init_buffers()
        replica.requires_grad_(False).eval()
    own = replica.state_dict()
    missing = sorted(set(own) - set(state))
    if missing or set(state) - set(own):
        raise ValueError(
            f"gather_replica: the model's tensors do not match a plain {type(replica).__name__} of its args "
            f"(missing {missing[:3]}, extra {sorted(set(state) - set(own))[:3]}); adapters and quantized weights "
            "have no plain replica"
        )
    for name, tensor in state.items():
        own[name].copy_(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
    return replica


__all__ = ["gather_replica", "is_parallelized"]
