"""KTO as ranks of a torchrun launch, for tests/test_kto.py.

usage: torchrun --standalone --nproc_per_node 2 _kto_layout_worker.py OUTPUT_DIR MODELS_DIR CELL [CELL ...]
Each CELL (a key of CELLS) trains with its layout's parallelism_config; rank 0 writes OUTPUT_DIR/CELL/log.json (the
log history). The test runs the same cell on one process over the same global batches (``trainer_for`` with
``ranks`` the layout's data-parallel ranks: their rows in one per-device batch).

The mismatched KL completions rotate within each per-device batch (TRL's rule), so a layout's run and the one process
(whose per-device batch is both ranks') would pair different completions from raw rows: the "kto" cells hand both the
same rows prepared with the layout's per-device rotation, and the KL estimate is then the mean over the same rows.
"""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer

import hfnative
from hfnative.data.unpaired_preference import prepare_unpaired_preference_dataset

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = str(ROOT / "examples" / "tiny-qwen3")
STEPS = 2  # the first step, and one after an update
PER_DEVICE = 2
MAX_LENGTH = 48

# name -> (parallelism_config sizes, data-parallel ranks)
LAYOUTS = {
    "ddp": (dict(dp_replicate_size=2, dp_shard_size=1), 2),
    "fsdp2": (dict(dp_shard_size=2), 2),
    "tp2": (dict(dp_shard_size=1, tp_size=2), 1),
}

# name -> (layout, model ("dense": MODELS_DIR/policy against MODELS_DIR/reference as ref_model; "moe": MODELS_DIR/moe
# against a frozen copy of itself; "lora": MODELS_DIR/policy with new LoRA adapters against its base, the adapters
# off), settings)
CELLS = {
    "kto-fsdp2": ("fsdp2", "dense", dict(loss_type="kto", gradient_accumulation_steps=2)),
    "apo-zero-ddp-moe": ("ddp", "moe", dict(loss_type="apo_zero_unpaired", undesirable_weight=1.5)),
    "kto-tp2": ("tp2", "dense", dict(loss_type="kto")),
    # the adapters split with their weights (both splits), the reference read through the same split modules
    "kto-lora-tp2": ("tp2", "lora", dict(loss_type="kto")),
}


def rows(n: int) -> list[dict]:
    """Unpaired rows from the shipped pairs, desirable and undesirable alternating in runs."""
    with open(ROOT / "examples" / "data" / "preference.jsonl") as f:
        pairs = [json.loads(line) for line, _ in zip(f, range(n))]
    return [{"prompt": p["prompt"], "completion": p["chosen"] if i % 3 else p["rejected"], "label": bool(i % 3)}
            for i, p in enumerate(pairs)]


def trainer_for(cell: str, output_dir: str, models_dir: str, ranks: int, layout: dict | None = None):
    """The cell's trainer: ``ranks`` data-parallel ranks' worth of rows per device on one process (``layout`` None),
    or PER_DEVICE rows per device under ``layout``."""
    _, kind, settings = CELLS[cell]
    common = dict(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                  max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=PER_DEVICE * ranks,
                  learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.01, seed=7,
                  max_length=MAX_LENGTH, beta=0.1, gradient_checkpointing=False)
    if layout is not None:
        common["parallelism_config"] = dict(layout)
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    data = rows(32)  # more than the 3 steps take: no short last batch
    if settings["loss_type"] == "kto":
        data = prepare_unpaired_preference_dataset(data, tokenizer, max_length=MAX_LENGTH, kl_group_size=PER_DEVICE)
    else:
        data = Dataset.from_list(data)
    model, ref_model = (str(Path(models_dir) / "policy"), str(Path(models_dir) / "reference")) if kind == "dense" else (str(Path(models_dir) / "moe"), None)
    peft_config = None
    if kind == "lora":
        from peft import LoraConfig

        model, ref_model = str(Path(models_dir) / "policy"), None
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    return hfnative.KTOTrainer(model=model, ref_model=ref_model, args=hfnative.KTOConfig(**common, **settings),
                               train_dataset=data, processing_class=tokenizer, peft_config=peft_config)


def main(output_dir: str, models_dir: str, cells: list[str]) -> None:
    for cell in cells:
        layout, _, _ = CELLS[cell]
        out = Path(output_dir) / cell
        trainer = trainer_for(cell, str(out), models_dir, 1, LAYOUTS[layout][0])
        trainer.train()
        if os.environ["RANK"] == "0":
            out.mkdir(parents=True, exist_ok=True)
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
