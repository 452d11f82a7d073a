"""Expert parallelism as ranks of a torchrun launch, for tests/test_expert_parallel.py.

usage: torchrun --standalone --nproc_per_node N _ep_worker.py OUTPUT_DIR MODELS_DIR LAYOUT [LAYOUT ...]
Each LAYOUT (a key of LAYOUTS) trains MODELS_DIR/<its model> with that parallelism_config (ep_size is hfnative's
own key); rank 0 writes OUTPUT_DIR/LAYOUT/log.json and the saved model in OUTPUT_DIR/LAYOUT/.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from datasets import Dataset

from hfnative import SFTConfig, SFTTrainer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "examples" / "tiny-qwen3")
STEPS = 5
PER_DEVICE = 2

# name -> (model folder, parallelism_config, SFTConfig settings, processes)
LAYOUTS = {
    "ep2-qwen3moe": ("qwen3moe", dict(dp_shard_size=2, ep_size=2), {}, 2),
    "ep2-mixtral-packed": ("mixtral", dict(dp_shard_size=2, ep_size=2), dict(packing=True, max_length=48), 2),
    # FSDP2 x EP2: experts split over 2 ranks and sharded over the other 2; dense weights sharded over the ep ranks
    # and replicated over the other 2
    "fsdp2xep2-qwen3moe": ("qwen3moe", dict(dp_shard_size=4, ep_size=2),
                           dict(save_strategy="steps", save_steps=5), 4),
}


def rows(n: int = 200) -> list[dict]:
    with open(ROOT / "examples" / "data" / "sft_prompt_completion.jsonl") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def config(output_dir: str, per_device: int, **extra) -> SFTConfig:
    settings = dict(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=per_device, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.01, max_length=64, seed=7,
    )
    settings.update(extra)
    return SFTConfig(**settings)


def main(output_dir: str, models_dir: str, layouts: list[str]) -> None:
    for name in layouts:
        model, sizes, extra, _ = LAYOUTS[name]
        out = Path(output_dir) / name
        args = config(str(out), PER_DEVICE, parallelism_config=dict(sizes), **extra)
        trainer = SFTTrainer(model=str(Path(models_dir) / model), args=args, train_dataset=Dataset.from_list(rows()))
        trainer.train()
        trainer.save_model()
        if dist.get_rank() == 0:
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
