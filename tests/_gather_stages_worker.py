"""Pipeline stages' tensors merged on rank 0, one tensor at a time (``hfnative.parallel.pipeline.gather_stages``), on
4 CPU processes: 2 stages x 2 data-parallel ranks, each stage's float tensors sharded by FSDP2 over its 2 ranks
(DTensors), its other tensors whole (bf16, int64, bool, 0-d: what a model's buffers and low-precision weights are).

usage: torchrun --standalone --nproc_per_node 4 _gather_stages_worker.py OUTPUT_DIR
Writes OUTPUT_DIR/rank<r>.json: on rank 0 whether the merged dict equals every stage's whole tensors (names, dtypes,
shapes, values), elsewhere whether the rank got an empty dict.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from hfnative.parallel.pipeline import gather_stages


def stage_tensors(stage: int) -> dict[str, torch.Tensor]:
    """The whole tensors of one stage, the same on every rank (seeded by the stage)."""
    generator = torch.Generator().manual_seed(100 + stage)
    return {
        f"layers.{stage}.weight": torch.randn(6, 3, generator=generator),
        f"layers.{stage}.odd_rows": torch.randn(5, 4, generator=generator),  # 5 rows over 2 ranks: uneven shards
        f"layers.{stage}.bf16": torch.randn(7, generator=generator).to(torch.bfloat16),
        f"layers.{stage}.steps": torch.arange(3, dtype=torch.int64) + 10 * stage,
        f"layers.{stage}.mask": torch.tensor([True, False, stage == 1]),
        f"layers.{stage}.scale": torch.tensor(0.5 + stage),
    }


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    stage = mesh["pp"].get_local_rank()
    whole = stage_tensors(stage)
    state = {name: distribute_tensor(t, mesh["dp_shard"], [Shard(0)]) if t.dtype == torch.float32 and t.dim() == 2
             else t for name, t in whole.items()}
    merged = gather_stages(state, mesh["pp"].get_group())
    if rank == 0:
        expected = {**stage_tensors(0), **stage_tensors(1)}
        result = {"names": sorted(merged) == sorted(expected),
                  "equal": {name: bool(name in merged and merged[name].dtype == t.dtype and merged[name].shape == t.shape
                                       and merged[name].device.type == "cpu" and torch.equal(merged[name], t))
                            for name, t in expected.items()}}
    else:
        result = {"empty": merged == {}}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except Exception:
        traceback.print_exc()
        sys.exit(1)
