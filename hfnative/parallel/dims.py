"""ParallelDims: how many ranks each parallelism takes, validated once, and the named DeviceMesh built from it.

The mesh always has the three dims ``("dp_replicate", "dp_shard", "tp")`` (a disabled one has size 1,
so ``mesh["tp"]`` exists in every layout). ``dims.dp_mesh(mesh)`` is their data-parallel part flattened to
1-D (named "dp", dp_replicate x dp_shard ranks): the ranks a global batch is split across, over which the
step's label-token count is all-reduced before the loss is divided.

FSDP2 shards over ``mesh["dp_shard"]``; HSDP replicates over dp_replicate and shards within it, on
``mesh["dp_replicate", "dp_shard"]`` (see ``fsdp_mesh``). Tensor parallelism uses ``mesh["tp"]``.
Ranks are laid out with tp innermost (neighbouring ranks share a tensor-parallel group, which on
GPUs keeps its frequent collectives inside a node).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


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

    def __post_init__(self):
        named = {"dp_replicate": self.dp_replicate, "tp": self.tp, "world_size": self.world_size}
        for name, size in named.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}={size!r}: expected a positive integer")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(f"dp_shard={self.dp_shard!r}: expected a positive integer, or -1 to fill the world size")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.tp
            if self.world_size % others:
                raise ValueError(
                    f"dp_replicate={self.dp_replicate} x tp={self.tp} = {others} does not divide the world size "
                    f"{self.world_size}, so dp_shard=-1 cannot fill it; choose sizes whose product is {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} = {product}, but the "
                f"world size is {self.world_size}; the sizes must multiply to the number of ranks"
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
    def shape(self) -> tuple[int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named DeviceMesh over ranks 0 .. world_size - 1 (dims MESH_DIMS), with its flattened data-parallel
        mesh made too. Every rank calls it (process groups are created collectively)."""
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims(world_size={self.world_size}) but {dist.get_world_size()} processes were launched; "
                "pass world_size=torch.distributed.get_world_size()"
            )
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        self.dp_mesh(mesh)  # its process group is made now, on every rank together
        return mesh

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh of the data-parallel ranks (dp_replicate x dp_shard flattened): the batch split and the
        token-count all-reduce."""
        return mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 shards over: ``dp_shard`` (1-D), or ``(dp_replicate, dp_shard)`` (2-D: HSDP, and plain
        replication when dp_shard is 1)."""
        return mesh["dp_replicate", "dp_shard"] if self.dp_replicate_enabled else mesh["dp_shard"]

    def dp_rank(self, mesh: DeviceMesh) -> int:
        """This rank's data shard: which part of the global batch it reads (tp ranks of a group read the same)."""
        return self.dp_mesh(mesh).get_local_rank()


__all__ = ["MESH_DIMS", "ParallelDims"]
