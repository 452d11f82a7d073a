"""One rank of a 2-process off-policy GKD run (torchrun, gloo) under FSDP2: the teacher is sharded like the student.
Rank 0 writes the log history and whether each model's parameters were sharded to OUT/result.json."""

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from torch.distributed.tensor import DTensor

import hfnative

ROOT = Path(__file__).resolve().parents[1]
STUDENT, TEACHER = str(ROOT / "examples" / "tiny-qwen3"), str(ROOT / "examples" / "tiny-qwen3-teacher")
STEPS, PER_DEVICE = 3, 2


def rows() -> list[dict]:
    with open(ROOT / "examples" / "data" / "sft_messages.jsonl") as f:
        return [json.loads(line) for line, _ in zip(f, range(12))]


def config(output_dir: str, per_device: int, **extra) -> hfnative.GKDConfig:
    return hfnative.GKDConfig(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                              logging_steps=1, save_strategy="no", max_steps=STEPS, per_device_train_batch_size=per_device,
                              lmbda=0.0, learning_rate=3e-3, beta=0.5, **extra)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    trainer = hfnative.GKDTrainer(model=STUDENT, teacher_model=TEACHER, args=config(str(out), PER_DEVICE, fsdp="full_shard"),
                                  train_dataset=Dataset.from_list(rows()))
    sharded = {name: all(isinstance(p, DTensor) for p in model.parameters())
               for name, model in (("student", trainer.model), ("teacher", trainer.objective.teacher))}
    trainer.train()
    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_text(json.dumps({"sharded": sharded, "log_history": trainer.state.log_history}))
