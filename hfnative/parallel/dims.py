"""ParallelDims: how many ranks each parallelism takes, validated once, and the named DeviceMesh built from it.

The mesh always has the three dims ``("dp_replicate", "dp_shard", "tp")`` (a disabled one has size 1,
so ``mesh["tp"]`` exists in every layout). ``dims.dp_mesh(mesh)`` is their data-parallel part flattened to
1-D (named "dp", dp_replicate x dp_shard ranks): the ranks a global batch is split across, over which the
step's label-token count is all-reduced before the loss is divided.

FSDP2 shards over ``mesh["dp_shard"]``; HSDP replicates over dp_replicate and shards within it, on
``mesh["dp_replicate", "dp_shard"]`` (see ``fsdp_mesh``). Tensor parallelism uses ``mesh["tp"]``.
Ranks are laid out with tp innermost (neighbouring ranks share a tensor-parallel group, which on
GPUs keeps its frequent collectives inside a node).

Context parallel (cp > 1) adds a ``"cp"`` dim between dp_shard and tp: the cp ranks of a group hold the same
sequences, split along the sequence. Parameters are sharded over dp_shard x cp together (flattened
``"dp_shard_cp"``, as torchtitan does), and the loss's token count is reduced over dp_replicate x dp_shard x cp
(flattened ``"dp_cp"``, see ``loss_mesh``).

Expert parallel (ep > 1) takes its ranks from dp_shard: the dim splits into ``("dp_shard_mod_ep", "ep")``, with
``"cp"`` between them under context parallel (so the ranks outside an ep group are the dims before ``"ep"``). Every
ep rank holds different tokens; so do the ranks outside an ep group, dp_replicate x dp_shard_mod_ep x cp (flattened
``"dp_mod_ep"``). An MoE model's experts are split over ``"ep"`` and sharded by FSDP2 over ``"dp_mod_ep"``; its
other parameters are sharded over ``"ep"`` and replicated over ``"dp_mod_ep"`` (HSDP on the same 2-D mesh), so every
parameter is a DTensor of one mesh and the gradient norm reduces over it as one (with dp_replicate the experts are
sharded across the replicas too: that keeps them on the one mesh). A dense model in such a run (a teacher, a
reference, a dense student) is sharded over the whole dp_shard group, ``("dp_shard_mod_ep", "ep")`` flattened to
``"dp_shard"`` (with cp, ``("dp_shard_mod_ep", "cp", "ep")`` to ``"dp_shard_cp"``), as in a run without ep.
With tensor parallel the experts stay whole on each tp rank (each routes its own part of the sequence), so every
parameter of an MoE model is a DTensor of ``(dp_mod_ep, ep, tp)``.

Pipeline parallel (pp > 1) adds a ``"pp"`` dim outermost: each pp rank holds one stage (a contiguous run of the
blocks, see pipeline.py), and the dims after it lay out each stage's ranks as above (its FSDP2 group, its
data-parallel ranks). Every stage reads the same batches; activations go from stage to stage over ``mesh["pp"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
CP_MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
EP_MESH_DIMS = ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")
EP_CP_MESH_DIMS = ("dp_replicate", "dp_shard_mod_ep", "cp", "ep", "tp")
PP_MESH_DIMS = ("pp", *MESH_DIMS)


@dataclass
class ParallelDims:
    """Sizes of each parallelism; their product must be ``world_size``.

    dp_shard=-1 takes whatever the other sizes leave of the world size (as torchtitan does).
    world_size: the number of ranks the mesh spans (normally ``torch.distributed.get_world_size()``).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    world_size: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self):
        named = {"dp_replicate": self.dp_replicate, "tp": self.tp, "world_size": self.world_size, "cp": self.cp,
                 "ep": self.ep, "pp": self.pp}
        for name, size in named.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}={size!r}: expected a positive integer")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(f"dp_shard={self.dp_shard!r}: expected a positive integer, or -1 to fill the world size")
        for name, size in (("tp", self.tp), ("cp", self.cp), ("ep", self.ep)):
            if self.pp > 1 and size > 1:
                raise ValueError(
                    f"pp={self.pp} with {name}={size}: pipeline parallelism composes with data parallelism (FSDP2, "
                    f"HSDP, DDP) only; set {name}_size=1, or pp_size=1"
                )
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        cp += f" x pp={self.pp}" if self.pp > 1 else ""
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % others:
                raise ValueError(
                    f"dp_replicate={self.dp_replicate}{cp} x tp={self.tp} = {others} does not divide the world size "
                    f"{self.world_size}, so dp_shard=-1 cannot fill it; choose sizes whose product is {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}{cp} x tp={self.tp} = {product}, but the "
                f"world size is {self.world_size}; the sizes must multiply to the number of ranks"
            )
        if self.ep > 1 and self.dp_shard % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard={self.dp_shard}: expert parallelism takes its ranks from the "
                f"FSDP (dp_shard) ranks; choose an ep_size that divides {self.dp_shard}"
            )

    @property
    def dp_size(self) -> int:
        """The number of data shards a global batch is split into."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """MESH_DIMS, or CP_MESH_DIMS with context parallel, or EP_MESH_DIMS (EP_CP_MESH_DIMS) with expert parallel,
        or PP_MESH_DIMS with pipeline parallel."""
        if self.pp_enabled:
            return PP_MESH_DIMS
        if self.ep_enabled:
            return EP_CP_MESH_DIMS if self.cp_enabled else EP_MESH_DIMS
        return CP_MESH_DIMS if self.cp_enabled else MESH_DIMS

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's size along each of ``mesh_dim_names``."""
        if self.pp_enabled:
            return (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        if self.ep_enabled:
            cp = (self.cp,) if self.cp_enabled else ()
            return (self.dp_replicate, self.dp_shard // self.ep, *cp, self.ep, self.tp)
        if self.cp_enabled:
            return (self.dp_replicate, self.dp_shard, self.cp, self.tp)
        return (self.dp_replicate, self.dp_shard, self.tp)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named DeviceMesh over ranks 0 .. world_size - 1 (dims ``mesh_dim_names``), with its flattened
        meshes made too. Every rank calls it (process groups are created collectively)."""
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims(world_size={self.world_size}) but {dist.get_world_size()} processes were launched; "
                "pass world_size=torch.distributed.get_world_size()"
            )
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.mesh_dim_names)
        # their process groups are made now, on every rank together
        self.dp_mesh(mesh)
        if self.ep_enabled:
            mesh[self._shard_dims]._flatten(self._shard_name)
            mesh[("dp_replicate", "dp_shard_mod_ep", *self._cp_dim)]._flatten("dp_mod_ep")
        elif self.cp_enabled:
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if self.cp_enabled:
            self.loss_mesh(mesh)
        return mesh

    @property
    def _cp_dim(self) -> tuple[str, ...]:
        return ("cp",) if self.cp_enabled else ()

    @property
    def _shard_dims(self) -> tuple[str, ...]:
        """The mesh dims a dense model's parameters are sharded over."""
        if self.ep_enabled:
            return ("dp_shard_mod_ep", *self._cp_dim, "ep")
        return ("dp_shard", *self._cp_dim)

    @property
    def _shard_name(self) -> str:
        return "dp_shard_cp" if self.cp_enabled else "dp_shard"

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh of the data-parallel ranks (dp_replicate x dp_shard flattened): the batch split."""
        if self.ep_enabled:
            return mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
        return mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def loss_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh of the ranks holding different tokens (dp x cp): the token-count and loss all-reduce."""
        if not self.cp_enabled:
            return self.dp_mesh(mesh)
        dims = ("dp_shard_mod_ep", "cp", "ep") if self.ep_enabled else ("dp_shard", "cp")
        return mesh[("dp_replicate", *dims)]._flatten("dp_cp")

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 shards a dense model over: ``dp_shard`` (1-D; ``dp_shard_cp`` with context parallel), or
        ``(dp_replicate, dp_shard)`` (2-D: HSDP, and plain replication when dp_shard is 1). With expert parallel
        ``dp_shard`` is ``(dp_shard_mod_ep, ep)`` flattened (an MoE model's meshes are ``expert_fsdp_meshes``)."""
        shard = self._shard_name
        return mesh["dp_replicate", shard] if self.dp_replicate_enabled else mesh[shard]

    def expert_fsdp_meshes(self, mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        """An MoE model's FSDP2 meshes under expert parallel: (its experts', ``dp_mod_ep``: 1-D, the experts being
        split over ``ep`` already; its other parameters', ``(dp_mod_ep, ep)``: 2-D, replicated over the first and
        sharded over ep). Both give parameters of the one mesh ``(dp_mod_ep, ep)``."""
        assert self.ep_enabled, "expert_fsdp_meshes needs ep > 1"
        name = self._dp_mod_ep_dim
        return mesh[name], mesh[name, "ep"]

    @property
    def _dp_mod_ep_dim(self) -> str:
        """The name to slice ``dp_mod_ep`` by: the one mesh dim it spans when the others it flattens have size 1
        (``dp_shard_mod_ep`` when all do), else the flattened name. The same ranks either way; torch 2.11's
        DeviceMesh refuses ``mesh["dp_mod_ep", "ep"]`` when ``dp_mod_ep`` flattens size-1 dims only and tp > 1."""
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard_mod_ep": self.dp_shard // self.ep}
        if self.cp_enabled:
            sizes["cp"] = self.cp
        wide = [name for name, size in sizes.items() if size > 1]
        if len(wide) > 1:
            return "dp_mod_ep"
        return wide[0] if wide else "dp_shard_mod_ep"

    def pp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh of the pipeline stages this rank's activations pass through (one rank per stage)."""
        assert self.pp_enabled, "pp_mesh needs pp > 1"
        return mesh["pp"]

    def dp_rank(self, mesh: DeviceMesh) -> int:
        """This rank's data shard: which part of the global batch it reads (tp ranks of a group read the same)."""
        return self.dp_mesh(mesh).get_local_rank()


__all__ = ["CP_MESH_DIMS", "EP_CP_MESH_DIMS", "EP_MESH_DIMS", "MESH_DIMS", "PP_MESH_DIMS", "ParallelDims"]
