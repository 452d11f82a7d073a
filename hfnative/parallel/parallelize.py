"""The one place that applies parallelism and the memory/speed transforms to a native model, in this order:

0. pipeline parallel (``mesh["pp"]``): each pp rank keeps its stage's blocks (see pipeline.py), and the steps below
   apply to what it kept; then float8 training (the blocks' projections become torchao's float8 layers, see
   float8.py), so the steps below split, checkpoint, compile and shard them as the linear layers they replace;
1. tensor + sequence parallel (``mesh["tp"]``), with the vocabulary-parallel embedding and loss-parallel head;
   expert parallel (``mesh["ep"]``: each MoE layer's experts split over the ep ranks, see expert_parallel.py);
   context parallel needs no change to the model (its batches carry the ring-attention plan);
2. activation checkpointing (which blocks recompute their activations in backward);
3. torch.compile, block by block (compiled after TP so the graphs see the split shapes, before FSDP so its
   hooks stay outside the graphs; under TP with static shapes, see compile.py);
4. FSDP2 over the data-parallel ranks (``mesh["dp_shard"]``, or ``mesh["dp_replicate", "dp_shard"]`` for HSDP;
   ``"dp_shard_cp"`` with context parallel), last, so it shards the (TP/EP-split) parameters that the steps above
   left in place; with expert parallel an MoE model's experts are their own units over ``mesh["dp_mod_ep"]`` and its
   other parameters are sharded over ``mesh["ep"]`` (``ParallelDims.expert_fsdp_meshes``), a dense model's over the
   whole dp_shard group.

Build the model on the meta device, call ``parallelize``, then materialize it (``model.to_empty(device=...)``)
and load each rank's slice of the checkpoint (``hfnative.converters.sharded_loading.load_sharded``), or
``init_weights`` for training from scratch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from hfnative.models.decoder import Transformer

from .activation_checkpoint import apply_activation_checkpointing
from .compile import CompileSettings, apply_compile
from .dims import ParallelDims
from .float8 import Float8Training, apply_float8_training
from .fsdp import apply_fsdp, apply_fsdp_per_layer
from .tensor_parallel import apply_tensor_parallel


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    activation_checkpointing: str | None = None,
    checkpoint_keeps: str | None = None,
    compile: bool | CompileSettings = False,
    mixed_precision: MixedPrecisionPolicy | torch.dtype | str | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    float8: Float8Training | None = None,
) -> nn.Module:
    """Apply float8 -> TP/SP -> activation checkpointing -> compile -> FSDP2 to ``model`` (a native Transformer); in place.

    dims, mesh: the layout and the mesh ``dims.build_mesh`` made.
    activation_checkpointing: None, "full" or "selective" (see ``apply_activation_checkpointing``).
    checkpoint_keeps: what a checkpointed block keeps (``apply_activation_checkpointing``'s ``keep``).
    compile: compile each block (``apply_compile``): True, or the backend and mode to compile with.
    mixed_precision: FSDP2's policy, or a dtype for "parameters in that dtype, gradients reduced in float32"
        (see ``mixed_precision_policy``); with a single data-parallel rank FSDP2 is still applied, over that one
        rank, to carry the policy.
    reshard_after_forward: FSDP2's choice for the blocks (see ``apply_fsdp``).
    cpu_offload: FSDP2 keeps the sharded parameters, gradients and optimizer step in CPU memory.
    float8: train the blocks' projections in float8 (``apply_float8_training``); None: as they are.
    Returns the model.
    """
    if not isinstance(model, Transformer):
        if float8 is not None:
            apply_float8_training(model, float8, mesh.device_type)  # refuses: float8 is for the native model
        if dims.pp_enabled:
            from .pipeline import check_pipeline_model

            check_pipeline_model(model)
        return _parallelize_foreign(model, dims, mesh, activation_checkpointing, compile, mixed_precision,
                                    reshard_after_forward, cpu_offload)
    if mesh.mesh_dim_names != dims.mesh_dim_names or tuple(mesh.shape) != dims.shape:
        raise ValueError(
            f"the mesh has dims {mesh.mesh_dim_names} of sizes {tuple(mesh.shape)}, the ParallelDims "
            f"{dims.mesh_dim_names} of "
            f"sizes {dims.shape}; pass the mesh dims.build_mesh(device_type) returns"
        )
    if dims.pp_enabled:
        from .pipeline import split_into_stage

        split_into_stage(model, dims.pp_mesh(mesh).get_local_rank(), dims.pp)
    if float8 is not None:
        apply_float8_training(model, float8, mesh.device_type, tp=dims.tp, fsdp_sharded=dims.fsdp_mesh(mesh).size() > 1)
    if dims.tp_enabled:
        apply_tensor_parallel(model, mesh["tp"])
    # a dense model in an expert-parallel run (a teacher, a reference) is sharded like any other, over all dp_shard
    expert_parallel = dims.ep_enabled and model.args.moe is not None
    if model.args.moe is not None and (dims.dp_enabled or dims.cp_enabled):
        from .expert_parallel import apply_expert_parallel, set_router_loss_group

        # the router's loss over every rank's tokens, as one process takes it over the whole batch (the tp ranks of
        # a group share theirs: MoE.sequence_group)
        set_router_loss_group(model, dims.loss_mesh(mesh).get_group())
        if expert_parallel:
            apply_expert_parallel(model, mesh["ep", "tp"] if dims.tp_enabled else mesh["ep"])
    if activation_checkpointing is not None:
        apply_activation_checkpointing(model, activation_checkpointing, checkpoint_keeps)
    if compile:
        # under TP with static shapes and no compile caches (compile.py says why)
        apply_compile(model, tensor_parallel=dims.tp_enabled, device=mesh.device_type, settings=_settings(compile))
    if dims.dp_enabled or dims.cp_enabled or mixed_precision is not None or cpu_offload:
        fsdp_mesh = dims.fsdp_mesh(mesh)
        if expert_parallel:
            from .expert_parallel import shard_experts

            experts_mesh, fsdp_mesh = dims.expert_fsdp_meshes(mesh)
            shard_experts(model, experts_mesh, mixed_precision=mixed_precision,
                          reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
        apply_fsdp(
            model, fsdp_mesh, mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
        )
    return model


def _parallelize_foreign(model, dims, mesh, activation_checkpointing, compile, mixed_precision, reshard_after_forward,
                         cpu_offload):
    """A model the engine has no native implementation of (hfnative's wrapper around transformers' module, which
    lists its decoder layers as ``model.layers``): activation checkpointing -> compile -> FSDP2 per decoder layer.
    Tensor parallelism needs the native layers' plans and is refused."""
    if not hasattr(model, "layers"):
        raise ValueError(f"parallelize: {type(model).__name__} lists no decoder layers (model.layers) to shard")
    for name, size in (("context", dims.cp), ("expert", dims.ep)):
        if size > 1:
            raise ValueError(
                f"{name} parallelism ({name[0]}p={size}) needs hfnative's native model; {type(model).__name__} "
                f"(transformers' own module) can only be sharded with FSDP2 per decoder layer: set {name[0]}p_size=1"
            )
    if dims.tp_enabled:
        raise ValueError(
            f"tensor parallelism (tp={dims.tp}) needs hfnative's native model; {type(model).__name__} (transformers' "
            "own module) can only be sharded with FSDP2 per decoder layer: set tp_size=1"
        )
    if activation_checkpointing is not None:
        apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        apply_compile(model, device=mesh.device_type, settings=_settings(compile))
    if dims.dp_enabled or mixed_precision is not None or cpu_offload:
        apply_fsdp_per_layer(model, dims.fsdp_mesh(mesh), mixed_precision=mixed_precision,
                             reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
    return model


def _settings(compile: bool | CompileSettings) -> CompileSettings | None:
    return compile if isinstance(compile, CompileSettings) else None


__all__ = ["parallelize"]
