"""A rank that ends right after a barrier queued behind collectives on Python-made tensors: the ending that
aborted ranks before ``hfnative.parallel.end_process_group`` (see hfnative/parallel/teardown.py).

usage: torchrun --standalone --nproc_per_node N _exit_race_worker.py OUTPUT_DIR [end|none]
  end   (default) end with end_process_group; each rank writes OUTPUT_DIR/rank<R>.json: the gloo worker
        threads seen, and whether they were idle in time
  none  return right after the barrier, the group left up: what a trainer's rank met before, whose groups
        outlive destroy_process_group (their threads are never joined before finalization; see
        hfnative/parallel/teardown.py). benchmarks/exit_race.py counts the aborts of both."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hfnative.parallel import end_process_group
from hfnative.parallel.teardown import _gloo_workers


def main(output_dir: str, ending: str = "end") -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for _ in range(20):
        works = [dist.all_reduce(torch.ones(256), async_op=True) for _ in range(4)]
        works.append(dist.all_gather_into_tensor(torch.empty(256 * world), torch.ones(256), async_op=True))
        for work in works:
            work.wait()
        del works
        dist.barrier()
    if ending == "none":
        return
    workers = len(_gloo_workers())
    idle = end_process_group()
    Path(output_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps({"gloo_workers": workers, "idle": idle}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
