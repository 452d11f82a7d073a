"""Expert parallelism as ranks of a torchrun launch, for tests/test_expert_parallel.py.

usage: torchrun --standalone --nproc_per_node N _ep_worker.py OUTPUT_DIR MODELS_DIR LAYOUT [LAYOUT ...]
                [--resume-under-fsdp2 LAYOUT ...]
Each LAYOUT (a key of LAYOUTS) trains MODELS_DIR/<its model> with that parallelism_config (ep_size is hfnative's
own key), by SFT or (``trainer="gkd"`` in its settings) by GKD from the shipped dense teacher; rank 0 writes
OUTPUT_DIR/LAYOUT/log.json and the saved model in OUTPUT_DIR/LAYOUT/. On 2 processes, the layouts after
--resume-under-fsdp2 are then resumed from their step-3 checkpoints under plain FSDP2 (OUTPUT_DIR/resumed-under-fsdp2/).
"""

import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from datasets import Dataset

from hfnative import GKDConfig, GKDTrainer, SFTConfig, SFTTrainer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "examples" / "tiny-qwen3")
TEACHER = str(ROOT / "examples" / "tiny-qwen3-teacher")  # dense, the same vocabulary
STEPS = 5
PER_DEVICE = 2
RESUMED = "resumed-under-fsdp2"  # the folder of the runs resumed under plain FSDP2 (see main)

# name -> (model folder, parallelism_config, SFTConfig settings, processes)
LAYOUTS = {
    "ep2-qwen3moe": ("qwen3moe", dict(dp_shard_size=2, ep_size=2), dict(save_strategy="steps", save_steps=3), 2),
    "ep2-mixtral-packed": ("mixtral", dict(dp_shard_size=2, ep_size=2), dict(packing=True, max_length=48), 2),
    # FSDP2 x EP2: experts split over 2 ranks and sharded over the other 2; dense weights sharded over the ep ranks
    # and replicated over the other 2
    "fsdp2xep2-qwen3moe": ("qwen3moe", dict(dp_shard_size=4, ep_size=2),
                           dict(save_strategy="steps", save_steps=5), 4),
    # a dense model in an ep run: sharded by FSDP2 over the whole dp_shard group
    "ep2-dense-qwen3": ("qwen3", dict(dp_shard_size=2, ep_size=2), {}, 2),
    # an MoE student under ep with a dense teacher (the teacher sharded over all dp_shard ranks)
    "gkd-ep2-qwen3moe-dense-teacher": ("qwen3moe", dict(dp_shard_size=2, ep_size=2), dict(trainer="gkd"), 2),
    # TP2 on an MoE model (no ep): each tp rank routes its own part of the sequence through whole experts
    "tp2-qwen3moe": ("qwen3moe", dict(dp_shard_size=1, tp_size=2), {}, 2),
    # HSDP x EP2: 2 replicas of an FSDP2 x EP2 group of 2
    "hsdp2xep2-qwen3moe": ("qwen3moe", dict(dp_replicate_size=2, dp_shard_size=2, ep_size=2), {}, 4),
    # CP2 x EP2: the experts split over 2 dp_shard ranks, each sequence over 2 cp ranks
    "cp2xep2-qwen3moe": ("qwen3moe", dict(dp_shard_size=2, cp_size=2, ep_size=2),
                         dict(save_strategy="steps", save_steps=3), 4),
    # TP2 x EP2: the experts split over 2 dp_shard ranks and kept whole on each tp rank (each routes its own part
    # of the sequence); attention, embedding and head tensor-parallel
    "tp2xep2-qwen3moe": ("qwen3moe", dict(dp_shard_size=2, tp_size=2, ep_size=2), {}, 4),
}


def data_ranks(sizes: dict) -> int:
    """The data-parallel ranks of a layout (the processes reading different rows)."""
    return sizes.get("dp_replicate_size", 1) * sizes["dp_shard_size"]


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


def trainer_for(name: str, output_dir: str, models_dir: str, per_device: int, **parallel):
    """LAYOUTS[name]'s trainer with ``per_device`` rows per device (``parallel``: its parallelism_config, or none for
    the one-process run)."""
    model, _, extra, _ = LAYOUTS[name]
    extra = dict(extra)
    model = str(Path(models_dir) / model)
    if extra.pop("trainer", "sft") == "gkd":
        settings = dict(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                        max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=per_device,
                        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=1, seed=7, max_length=48,
                        beta=0.5, lmbda=0.0, **extra, **parallel)
        with open(ROOT / "examples" / "data" / "sft_messages.jsonl") as f:
            data = [json.loads(line) for line, _ in zip(f, range(40))]
        return GKDTrainer(model=model, teacher_model=TEACHER, args=GKDConfig(**settings),
                          train_dataset=Dataset.from_list(data))
    args = config(output_dir, per_device, **extra, **parallel)
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows()))


def resume_under_fsdp2(output_dir: str, models_dir: str, layouts: list[str]) -> None:
    """Each LAYOUT's run folder under OUTPUT_DIR (a copy of its launched run) resumed from its step-3 checkpoint
    under plain FSDP2 over 2 ranks (no expert or context parallelism); rank 0 writes resumed-log.json there."""
    for name in layouts:
        out = Path(output_dir) / name
        trainer = trainer_for(name, str(out), models_dir, PER_DEVICE, parallelism_config=dict(dp_shard_size=2))
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))
        if dist.get_rank() == 0:
            (out / "resumed-log.json").write_text(json.dumps(trainer.state.log_history))


def main(output_dir: str, models_dir: str, layouts: list[str]) -> None:
    """Trains each LAYOUT; then the layouts after ``--resume-under-fsdp2`` (runs in OUTPUT_DIR: this launch's or an
    earlier one's) are copied to OUTPUT_DIR/RESUMED and resumed there by ``resume_under_fsdp2`` (resumed in place
    when this launch trains no layout)."""
    resumed = []
    if "--resume-under-fsdp2" in layouts:
        at = layouts.index("--resume-under-fsdp2")
        layouts, resumed = layouts[:at], layouts[at + 1 :]
    for name in layouts:
        _, sizes, _, _ = LAYOUTS[name]
        out = Path(output_dir) / name
        trainer = trainer_for(name, str(out), models_dir, PER_DEVICE, parallelism_config=dict(sizes))
        trainer.train()
        trainer.save_model()
        if dist.get_rank() == 0:
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))
    if resumed and not layouts:  # OUTPUT_DIR holds copies of the runs: resumed in place
        resume_under_fsdp2(output_dir, models_dir, resumed)
    elif resumed:
        if dist.get_rank() == 0:  # copies: the launched runs' folders stay as they trained
            for name in resumed:
                shutil.copytree(Path(output_dir) / name, Path(output_dir) / RESUMED / name)
        dist.barrier()
        resume_under_fsdp2(str(Path(output_dir) / RESUMED), models_dir, resumed)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
