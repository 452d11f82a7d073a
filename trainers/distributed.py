"""The trainer as one rank of a distributed run (torchrun, ``accelerate launch``, ``hfnative-train
--num_processes N``).

A process launched with ``WORLD_SIZE`` > 1 joins the process group (gloo on CPU, NCCL on GPU), turns
the launch's settings into one layout (``trainers/parallel_plan.py``: transformers' ``fsdp`` /
``parallelism_config``, accelerate's config) and builds the named device mesh. The trainer then:
  - parallelizes every model it trains or runs frozen through ``hfnative.parallel.parallelize``
    (TP → activation checkpointing → compile → FSDP2), loading each rank's slice straight from the
    checkpoint when it can;
  - reads its data-parallel rank's batches (accelerate's ``BatchSamplerShard`` split);
  - divides each step's summed loss by the label tokens of the whole step over all data-parallel
    ranks (gradients are summed across ranks), so every layout trains the same model;
  - reduces logged losses and metrics over the data-parallel ranks, logs and writes from rank 0.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def launched_world_size() -> int:
    """The number of processes the launcher started (1 when not launched by torchrun / accelerate)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DistributedRun:
    """This process's place in the run: the layout, the mesh and the data-parallel group."""

    plan: object  # trainers.parallel_plan.ParallelPlan
    mesh: object  # DeviceMesh with dims (dp_replicate, dp_shard, tp)
    rank: int
    world_size: int
    local_rank: int
    _dp_mesh: object = field(default=None, repr=False)

    @property
    def dims(self):
        return self.plan.dims

    @property
    def dp_mesh(self):
        if self._dp_mesh is None:
            self._dp_mesh = self.dims.dp_mesh(self.mesh)
        return self._dp_mesh

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.mesh)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the data-parallel ranks (in place; returned). The tp ranks of a
        data-parallel group hold the same values and take no part."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, group=self.dp_mesh.get_group())
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_object(self, value):
        """rank 0's ``value``, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def start_distributed(args, device: torch.device) -> DistributedRun | None:
    """Join the launched run (None for a single process): the process group, the layout, the mesh."""
    from .parallel_plan import resolve_parallel_plan

    world_size = launched_world_size()
    if world_size <= 1:
        resolve_parallel_plan(args, 1)  # refuses what no layout can honour; says when a setting is a no-op here
        return None

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    plan = resolve_parallel_plan(args, world_size)
    mesh = plan.dims.build_mesh(device.type)
    run = DistributedRun(plan, mesh, dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", 0)))
    if run.is_main:
        logger.info("distributed run: %d processes, %s", world_size, plan.describe())
    return run


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's whole tensors under its native names, on the CPU of rank 0 (an empty dict on the other
    ranks); every rank must call it (the shards are gathered)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


__all__ = ["DistributedRun", "full_state_dict", "launched_world_size", "start_distributed"]
