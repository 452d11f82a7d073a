"""FSDP2 (``fully_shard``) over the native decoder: one unit per block, one for the embedding, one for the final
norm and the head (the embedding joins that unit when the head is tied to it), and the root.

Each unit all-gathers its parameters just before its forward (and again in backward) and reduce-scatters its
gradients after its backward, so a rank holds whole only the unit being computed. The norm + head unit is
grouped with ``fully_shard([...])``: the decoder calls the norm inside its forward and the head afterwards
(possibly several times, once per loss), and a call to either gathers the unit. With a 2-D mesh
(dp_replicate x dp_shard) the parameters are sharded within a replica group and replicated across groups
(HSDP); gradients are then reduce-scattered within and all-reduced across.

Parameters that are already DTensors on a tensor-parallel mesh (after ``apply_tensor_parallel``) are
sharded further over the data-parallel mesh (both meshes must be slices of one root mesh).

A quantized frozen base (QLoRA's 4-bit NF4, or ``load_in_8bit``'s int8 rows) is not sharded: every rank keeps the
whole quantized base (an eighth or a quarter of its fp32 size), FSDP2 leaves those parameters out of its units (``ignored_params``: no all-gather, no gradient),
and shards everything else — the adapters, norms, embedding and head.

Gradients are summed over the data-parallel ranks, not averaged: each rank's loss is its share of the sum
over the global batch, divided by the global label-token count (all-reduced before the division), so the sum
of the ranks' gradients is the single-process gradient of the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from hfnative.models.decoder import BlockOnAnotherStage


def mixed_precision_policy(mixed_precision: MixedPrecisionPolicy | torch.dtype | str | None) -> MixedPrecisionPolicy:
    """None: parameters and gradient reductions in the parameters' own dtype. A dtype (or its name, "bfloat16" /
    "bf16"): parameters gathered in that dtype for compute, gradients reduced in float32. A policy: as given."""
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if isinstance(mixed_precision, str):
        names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                 "fp32": torch.float32, "float32": torch.float32}
        if mixed_precision not in names:
            raise ValueError(
                f"mixed_precision={mixed_precision!r}: expected one of {sorted(names)}, a torch dtype or None"
            )
        mixed_precision = names[mixed_precision]
    return MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)


def offload_policy(cpu_offload: bool, dp_mesh: DeviceMesh) -> OffloadPolicy:
    """FSDP2's policy: with ``cpu_offload`` the sharded parameters, gradients and optimizer step live in CPU memory
    (pinned when the mesh is on an accelerator: pinning needs one)."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu")


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    mixed_precision: MixedPrecisionPolicy | torch.dtype | str | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard ``model`` (a native Transformer) over ``dp_mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP); in place.

    reshard_after_forward: free each block's gathered parameters after its forward (gathered again in backward);
    False keeps them for backward (more memory, one all-gather less per block). The norm + head unit is never
    resharded between forward and backward when the head is untied (its backward comes first), and the root
    keeps its own parameters (none, in the native decoder) gathered.
    """
    policy = mixed_precision_policy(mixed_precision)
    shard = dict(mesh=dp_mesh, mp_policy=policy, offload_policy=offload_policy(cpu_offload, dp_mesh),
                 ignored_params=quantized_parameters(model))
    for block in model.layers:
        if isinstance(block, BlockOnAnotherStage):  # pipeline parallel: another stage's
            continue
        fully_shard(block, reshard_after_forward=reshard_after_forward, **shard)
    head_group = [module for module in (model.norm, model.output) if module is not None]
    if not head_group or model.tok_embeddings is None:  # a pipeline stage without the head or the embedding
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **shard)
        if head_group:
            fully_shard(head_group, reshard_after_forward=False, **shard)
    elif model.output.base_projection() is model.tok_embeddings.weight:
        # the head uses the embedding's parameter (tied, or untied to one tensor under two names): one unit, so
        # calling either gathers it
        fully_shard([model.tok_embeddings, *head_group], reshard_after_forward=reshard_after_forward, **shard)
    else:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **shard)
        fully_shard(head_group, reshard_after_forward=False, **shard)
    fully_shard(model, **shard)
    _sum_gradients(model)
    return model


def apply_fsdp_per_layer(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    mixed_precision: MixedPrecisionPolicy | torch.dtype | str | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard a model the engine does not know block by block (``model.layers``: transformers' decoder layers
    behind hfnative's fallback wrapper) plus the root, which holds the rest (embedding, final norm, head); in place.
    Gradients are summed over the data-parallel ranks, as in ``apply_fsdp``."""
    shard = dict(mesh=dp_mesh, mp_policy=mixed_precision_policy(mixed_precision),
                 offload_policy=offload_policy(cpu_offload, dp_mesh), ignored_params=quantized_parameters(model))
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **shard)
    fully_shard(model, **shard)
    _sum_gradients(model)
    return model


def quantized_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The frozen quantized (NF4, int8) parameters: kept whole on every rank, outside FSDP2's units."""
    from hfnative.peft.quantize import is_quantized

    return {p for p in model.parameters() if is_quantized(p)}


def _sum_gradients(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # summed, not averaged: the loss is already divided by the step's token count over all ranks
            # (plain SUM collectives: gloo has no pre-multiplied sum)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


__all__ = ["apply_fsdp", "apply_fsdp_per_layer", "mixed_precision_policy", "quantized_parameters"]
