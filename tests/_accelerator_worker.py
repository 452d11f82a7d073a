"""Two processes (gloo): ``trainer.accelerator`` against torch.distributed on the trainer's process group.

Each rank writes what it read to <out>/rank<r>.json; the test compares the ranks' readings."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import AutoTokenizer

from hfnative import SFTConfig, SFTTrainer

MODEL = str(Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3")


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    args = SFTConfig(output_dir=out, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=1,
                     save_strategy="no", per_device_train_batch_size=1, max_length=16)
    trainer = SFTTrainer(model=MODEL, args=args, train_dataset=Dataset.from_list([{"text": "a b c"}] * 4),
                         processing_class=AutoTokenizer.from_pretrained(MODEL))
    accelerator = trainer.accelerator
    mine = torch.full((2,), float(rank + 1))
    expected = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(expected, mine)
    ragged = torch.ones(1, rank + 1)  # a different length per rank, padded to the longest
    with accelerator.split_between_processes(["a", "b", "c", "d"]) as share:
        split = list(share)
    accelerator.wait_for_everyone()
    reading = {
        "ranks": [accelerator.is_main_process, accelerator.is_local_main_process, accelerator.process_index,
                  accelerator.local_process_index, accelerator.num_processes],
        "torch_ranks": [dist.get_rank() == 0, dist.get_rank() == 0, dist.get_rank(), int(os.environ["LOCAL_RANK"]),
                        dist.get_world_size()],
        "world_process_zero": trainer.is_world_process_zero(),
        "device": str(accelerator.device),
        "gather": accelerator.gather(mine).tolist(),
        "all_gather": torch.cat(expected).tolist(),
        "gather_for_metrics": accelerator.gather_for_metrics(mine).tolist(),
        "reduce_sum": accelerator.reduce(mine, reduction="sum").tolist(),
        "padded": accelerator.pad_across_processes(ragged, dim=1).shape[1],
        "split": split,
        "unwrap_is_model": accelerator.unwrap_model(trainer.model) is trainer.model,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(reading))


if __name__ == "__main__":
    main(sys.argv[1])
