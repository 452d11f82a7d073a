"""DPO, GKD and on-policy distillation as ranks of a torchrun launch, for tests/test_layout_matrix_preference.py.

usage: torchrun --standalone --nproc_per_node N _layout_matrix_preference_worker.py OUTPUT_DIR MODELS_DIR CELL [CELL ...]
Each CELL (a key of CELLS, whose layout runs on N processes) trains its algorithm with that parallelism_config; rank 0 writes OUTPUT_DIR/CELL/log.json
(the log history) and every rank OUTPUT_DIR/CELL/completions-rank<r>.json (the completions it generated, in order).
The test runs the same cell on one process over the same global batches (``trainer_for`` with ``ranks=1``).
"""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

import hfnative
from hfnative.trainers.algorithms import distillation as kd

ROOT = Path(__file__).resolve().parents[1]
DENSE = {"student": str(ROOT / "examples" / "tiny-qwen3"), "teacher": str(ROOT / "examples" / "tiny-qwen3-teacher")}
STEPS = 3
PER_DEVICE = 2

# name -> (parallelism_config sizes, data-parallel ranks, processes); tp is the mesh's innermost dim
LAYOUTS = {
    "ddp": (dict(dp_replicate_size=2, dp_shard_size=1), 2, 2),
    "fsdp2": (dict(dp_shard_size=2), 2, 2),
    "tp2": (dict(dp_shard_size=1, tp_size=2), 1, 2),
    "cp2": (dict(dp_shard_size=1, cp_size=2), 1, 2),
    "ep2": (dict(dp_shard_size=2, ep_size=2), 2, 2),
    "fsdp2xtp2": (dict(dp_shard_size=2, tp_size=2), 2, 4),
}

# name -> (algorithm, layout, models ("dense" or "moe", see ``models``), settings)
CELLS = {
    # DPO: the reference a frozen copy of the checkpoint; under cp the LD-DPO weights, the sft / ipo terms and WPO's
    # weights read the whole sequences, and evaluation reports one process's loss
    "dpo-ddp": ("dpo", "ddp", "dense", {}),
    "dpo-fsdp2": ("dpo", "fsdp2", "dense", {}),
    "dpo-tp2": ("dpo", "tp2", "dense", dict(loss_type=["sigmoid", "sft"], use_weighting=True, eval_strategy="steps",
                                             eval_steps=3)),
    "dpo-fsdp2xtp2": ("dpo", "fsdp2xtp2", "dense", {}),
    # LoRA under TP: the adapters split with their weights, the reference the base with the adapters off
    "dpo-lora-tp2": ("dpo", "tp2", "dense", dict(peft=dict(r=4, lora_alpha=8, target_modules=[
        "q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]))),
    "dpo-cp2": ("dpo", "cp2", "dense", dict(loss_type=["sigmoid", "sft", "ipo"], loss_weights=[1.0, 0.5, 0.1],
                                             ld_alpha=0.5, use_weighting=True, eval_strategy="steps", eval_steps=3)),
    # the shipped model as the reference: rewards at the first step are not fp32 noise around 0 (policy = reference)
    "dpo-cp2-precomputed": ("dpo", "cp2", "dense", dict(precompute_ref_log_probs=True, max_length=37,
                                                         ref_model="shipped")),
    # the router's load-balancing loss: the whole batch's under every layout (each rank's loss its share)
    "dpo-ep2-moe": ("dpo", "ep2", "moe", dict(gradient_accumulation_steps=2)),
    "dpo-ddp-moe": ("dpo", "ddp", "moe", {}),
    "dpo-fsdp2-moe": ("dpo", "fsdp2", "moe", {}),
    "dpo-cp2-moe": ("dpo", "cp2", "moe", {}),
    # GKD off-policy (the dataset's completions), and on-policy (the student's sampled completions, lmbda=1)
    "gkd-ddp": ("gkd", "ddp", "dense", {}),
    "gkd-fsdp2": ("gkd", "fsdp2", "dense", {}),
    "gkd-tp2": ("gkd", "tp2", "dense", {}),
    "gkd-fsdp2xtp2": ("gkd", "fsdp2xtp2", "dense", {}),
    "gkd-cp2": ("gkd", "cp2", "dense", {}),
    "gkd-ep2-moe": ("gkd", "ep2", "moe", {}),
    "gkd-on-policy-ddp": ("gkd", "ddp", "dense", dict(lmbda=1.0)),
    "gkd-on-policy-fsdp2": ("gkd", "fsdp2", "dense", dict(lmbda=0.5, seq_kd=True)),
    "gkd-on-policy-cp2": ("gkd", "cp2", "dense", dict(lmbda=1.0)),
    "gkd-on-policy-tp2": ("gkd", "tp2", "dense", dict(lmbda=1.0)),
    # on-policy distillation: sampled, and greedy with evaluation
    "distillation-ddp": ("distillation", "ddp", "dense", {}),
    "distillation-fsdp2": ("distillation", "fsdp2", "dense", dict(generation_kwargs={"do_sample": False},
                                                                   eval_strategy="steps", eval_steps=3)),
    "distillation-tp2": ("distillation", "tp2", "dense", dict(eval_strategy="steps", eval_steps=3)),
    "distillation-fsdp2xtp2": ("distillation", "fsdp2xtp2", "dense", {}),
    "distillation-cp2": ("distillation", "cp2", "dense", dict(eval_strategy="steps", eval_steps=3)),
    "distillation-ep2-moe": ("distillation", "ep2", "moe", {}),
}


def rows(name: str, n: int) -> list[dict]:
    with open(ROOT / "examples" / "data" / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def models(algorithm: str, kind: str, models_dir: str) -> tuple[str, str]:
    """(policy or student, teacher): the shipped tiny pair; for DPO its policy with sharper next-token distributions
    (MODELS_DIR/dpo-policy); or MODELS_DIR's Qwen3-MoE pair."""
    if kind == "moe":
        return str(Path(models_dir) / "moe"), str(Path(models_dir) / "moe-teacher")
    if algorithm == "dpo":
        return str(Path(models_dir) / "dpo-policy"), DENSE["teacher"]
    return DENSE["student"], DENSE["teacher"]


def trainer_for(cell: str, output_dir: str, models_dir: str, ranks: int, layout: dict | None = None):
    """The cell's trainer: ``ranks`` data-parallel ranks' worth of rows per device on one process (``layout`` None),
    or PER_DEVICE rows per device under ``layout``."""
    algorithm, _, kind, settings = CELLS[cell]
    student, teacher = models(algorithm, kind, models_dir)
    common = dict(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                  max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=PER_DEVICE * ranks,
                  per_device_eval_batch_size=PER_DEVICE * ranks, learning_rate=3e-3, lr_scheduler_type="cosine",
                  warmup_steps=1, weight_decay=0.01, seed=7)
    if layout is not None:
        common["parallelism_config"] = dict(layout)
    settings = dict(settings)
    evaluating = settings.get("eval_strategy", "no") != "no"
    if algorithm == "dpo":
        ref_model = DENSE["student"] if settings.pop("ref_model", None) == "shipped" else None
        peft = settings.pop("peft", None)
        args = hfnative.DPOConfig(**common, max_length=settings.pop("max_length", 48), beta=0.1, **settings)
        data = rows("preference.jsonl", 40)
        return hfnative.DPOTrainer(model=student, ref_model=ref_model, args=args, peft_config=peft,
                                   train_dataset=Dataset.from_list(data[:32]),
                                   eval_dataset=Dataset.from_list(data[32:]) if evaluating else None)
    if algorithm == "gkd":
        args = hfnative.GKDConfig(**common, max_length=48, beta=0.5, lmbda=settings.pop("lmbda", 0.0), max_new_tokens=6,
                                  **settings)
        return hfnative.GKDTrainer(model=student, teacher_model=teacher, args=args,
                                   train_dataset=Dataset.from_list(rows("sft_messages.jsonl", 32)))
    args = hfnative.DistillationConfig(**common, max_completion_length=6, beta=0.5, **settings)
    data = rows("sft_prompt_completion.jsonl", 40)
    return hfnative.DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                        train_dataset=Dataset.from_list(data[:32]),
                                        eval_dataset=Dataset.from_list(data[32:]) if evaluating else None)


def record_completions(objective, sink: list) -> None:
    """Keep every completion the objective generates (a spy: the real generation runs)."""
    generate = objective.generate

    def recorded(model, prompts, sampling):
        completions = generate(model, prompts, sampling)
        sink.append({"teacher": model is not objective.context.model, "prompts": prompts, "completions": completions})
        return completions

    objective.generate = recorded


def count_partial_gradients(counts: list) -> None:
    """Before each optimizer step, append how many of its gradients are still pending a sum over ranks (a ``Partial``
    DTensor placement): the trainer sums them before the clipping and the step read them."""

    def count(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        counts.append(sum(isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements) for g in grads))

    register_optimizer_step_pre_hook(count)


def main(output_dir: str, models_dir: str, cells: list[str]) -> None:
    rank = int(os.environ["RANK"])
    partial_counts: list[int] = []
    count_partial_gradients(partial_counts)
    for cell in cells:
        _, layout_name, _, _ = CELLS[cell]
        sizes, _, _ = LAYOUTS[layout_name]
        out = Path(output_dir) / cell
        trainer = trainer_for(cell, str(out), models_dir, 1, sizes)
        generated = []
        if isinstance(trainer.objective, kd._DistillationObjective):
            record_completions(trainer.objective, generated)
        partial_counts.clear()
        trainer.train()
        out.mkdir(parents=True, exist_ok=True)
        (out / f"completions-rank{rank}.json").write_text(json.dumps(generated))
        (out / f"partial-gradients-rank{rank}.json").write_text(json.dumps(partial_counts))
        if rank == 0:
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
