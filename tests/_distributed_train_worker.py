"""SFTTrainer as one rank of a torchrun launch, for tests/test_distributed_trainer.py.

usage: torchrun --standalone --nproc_per_node 4 _distributed_train_worker.py OUTPUT_DIR LAYOUT [LAYOUT ...]
Each LAYOUT (a key of LAYOUTS) trains the tiny model with that parallelism_config and writes, from rank 0,
OUTPUT_DIR/LAYOUT/log.json (the log history), the saved model in OUTPUT_DIR/LAYOUT/ and the model saved before
training in OUTPUT_DIR/LAYOUT/before-training/.
"""

import json
import os
import sys
from pathlib import Path

from accelerate.parallelism_config import ParallelismConfig
from datasets import Dataset

from hfnative import SFTConfig, SFTTrainer

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
STEPS = 5
PER_DEVICE = 2

# name -> (ParallelismConfig sizes, SFTConfig settings): every layout trains on 4 processes
LAYOUTS = {
    "fsdp4-in-backward": (dict(dp_shard_size=4), dict(optimizer_in_backward=True, max_grad_norm=0.0)),
    "hsdp2x2-packed": (dict(dp_replicate_size=2, dp_shard_size=2), dict(packing=True, max_length=48)),
    # compiled under TP: static shapes, so the batches are padded to one length
    "fsdp2xtp2-accumulation-compiled": (dict(dp_shard_size=2, tp_size=2), dict(
        gradient_accumulation_steps=2, torch_compile=True, pad_to_multiple_of=64)),
    "ddp4": (dict(dp_replicate_size=4, dp_shard_size=1), {}),
    # transformers' BatchRebalanceSampler: each step's 16 rows over the 4 ranks in micro-batches of balanced cost
    # (3 to 5 rows a rank here); the step's rows are the one process's, so are its loss and gradient
    "ddp4-rebalance": (dict(dp_replicate_size=4, dp_shard_size=1), dict(train_sampling_strategy="batch_rebalance",
                                                                        per_device_train_batch_size=4)),
    # the rows as a stream (an IterableDataset): each rank its slice of every 4 x per-device rows, as accelerate
    "ddp4-stream": (dict(dp_replicate_size=4, dp_shard_size=1), dict(stream=True)),
    # transformers' own module (no native implementation): FSDP2 per decoder layer. SGD: GPT-NeoX's key bias has
    # a zero gradient up to round-off, which AdamW would blow up to learning-rate-sized differences in the weights
    # transformers' own fsdp argument (no parallelism_config), with CPU offload of the sharded state
    "fsdp4-offload-from-fsdp-argument": ({}, dict(fsdp="full_shard offload")),
    # transformers' deepspeed argument, a ZeRO-3 config as TRL / transformers users write it ("auto" filled from the
    # training arguments, an AdamW section that is theirs), run as FSDP2 without DeepSpeed
    "zero3-from-deepspeed-argument": ({}, dict(deepspeed={
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_gather_16bit_weights_on_model_save": True},
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    })),
    # LoRA: the frozen base and the adapters sharded alike by FSDP2; the adapter saved from its gathered tensors
    "fsdp4-lora": (dict(dp_shard_size=4), dict(peft=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))),
    # LoRA under tensor parallel: each adapter split with its weight (column-split layers: lora_B by rows; row-split
    # o_proj / down_proj: lora_A by columns), eager and compiled
    "fsdp2xtp2-lora": (dict(dp_shard_size=2, tp_size=2), dict(peft=dict(r=4, lora_alpha=8, target_modules=[
        "q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]))),
    "fsdp2xtp2-lora-compiled": (dict(dp_shard_size=2, tp_size=2), dict(peft=dict(r=4, lora_alpha=8, target_modules=[
        "q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]), torch_compile=True, pad_to_multiple_of=64)),
    # LoRA with trainable token rows (peft's trainable_token_indices): the rows sharded with the embedding's group
    "fsdp4-lora-tokens": (dict(dp_shard_size=4), dict(peft=dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                                trainable_token_indices=list(range(3, 40))))),
    # an adapter folder whose run cloned a template that added tokens (test_distributed_trainer.cloned_adapter): the
    # base resized to its rows, its token rows trained on; saved with the resized embedding whole (gathered)
    "fsdp4-cloned-template-adapter": (dict(dp_shard_size=4), dict(model="CLONED_ADAPTER")),
    # a chat template (a tokenizer folder, $TEMPLATE_FOLDER) whose cloning adds a token: the model loaded whole,
    # resized before it is sharded, the drawn rows rank 0's
    "fsdp4-cloned-template": (dict(dp_shard_size=4), dict(chat_template_path="TEMPLATE_FOLDER")),
    # load_best_model_at_end: the best checkpoint's adapter read back into the sharded adapters, each rank its rows
    # ("best" is the highest eval loss, so an earlier checkpoint than the last step's weights)
    "fsdp4-lora-best": (dict(dp_shard_size=4), dict(
        peft=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), eval=True, eval_strategy="steps",
        eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
        metric_for_best_model="eval_loss", greater_is_better=True)),
    # QLoRA: the NF4 base kept whole on every rank, the adapters (and norms, embedding) sharded
    "fsdp4-qlora": (dict(dp_shard_size=4), dict(peft=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
                                               model_init_kwargs=dict(load_in_4bit=True))),
    # an 8-bit base (load_in_8bit: int8 rows) kept whole on every rank in the same way
    "fsdp4-int8-lora": (dict(dp_shard_size=4), dict(peft=dict(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]),
                                                   model_init_kwargs=dict(load_in_8bit=True))),
    "fallback-fsdp4": (dict(dp_shard_size=4), dict(model="FALLBACK_MODEL", optim="sgd", learning_rate=0.3)),
    # bitsandbytes' AdEMAMix with 8-bit states: each shard's rows quantized in the blocks one process gives them
    "fsdp4-ademamix-8bit": (dict(dp_shard_size=4), dict(optim="ademamix_8bit")),
    # the schedulefree package's AdamW on the shards (foreach ops over DTensors), switched to train() every step
    "fsdp4-schedule-free": (dict(dp_shard_size=4), dict(optim="schedule_free_adamw", lr_scheduler_type="constant")),
}


def model_of(extra: dict) -> tuple[str, dict, dict]:
    """The model a layout trains (the fallback layout's from $FALLBACK_MODEL, the adapter folder's from
    $CLONED_ADAPTER), the trainer's other keyword
    arguments (peft_config) and the config's settings."""
    extra = dict(extra)
    model = extra.pop("model", MODEL)
    peft = extra.pop("peft", None)
    extra.pop("stream", None)  # a property of the dataset (train_dataset)
    extra.pop("eval", None)  # likewise (eval_dataset)
    if extra.get("chat_template_path") == "TEMPLATE_FOLDER":
        extra["chat_template_path"] = os.environ["TEMPLATE_FOLDER"]
    trainer_kwargs = {}
    if peft is not None:
        from peft import LoraConfig

        trainer_kwargs["peft_config"] = LoraConfig(task_type="CAUSAL_LM", **peft)
    return (os.environ[model] if model in ("FALLBACK_MODEL", "CLONED_ADAPTER") else model), trainer_kwargs, extra


def train_dataset(layout_extra: dict):
    """The layout's training rows: a Dataset, or the same rows as a stream for a layout with ``stream``."""
    dataset = Dataset.from_list(rows())
    return dataset.to_iterable_dataset() if layout_extra.get("stream") else dataset


def eval_dataset(layout_extra: dict):
    """Rows to evaluate on for a layout with ``eval`` (the file's first 16), else None."""
    return Dataset.from_list(rows(16)) if layout_extra.get("eval") else None


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


def main(output_dir: str, layouts: list[str]) -> None:
    rank = int(os.environ["RANK"])
    for name in layouts:
        sizes, extra = LAYOUTS[name]
        model, trainer_kwargs, extra = model_of(extra)
        out = Path(output_dir) / name
        layout = dict(parallelism_config=ParallelismConfig(**sizes)) if sizes else {}
        args = config(str(out), PER_DEVICE, **layout, **extra)
        trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset(LAYOUTS[name][1]),
                             eval_dataset=eval_dataset(LAYOUTS[name][1]), **trainer_kwargs)
        trainer.save_model(str(out / "before-training"))  # gathered from the shards, before any step
        if args.deepspeed:  # the config's ZeRO-3 is what shards the model (the comparison alone would pass plain DDP)
            plan = trainer.distributed.plan
            assert (plan.dims.dp_shard, plan.reshard_after_forward) == (4, True) and "DeepSpeed ZeRO-3" in plan.source
        if args.torch_compile:  # the split blocks are the compiled ones
            assert all("_compiled_forward" in vars(block) for block in trainer.native_model.layers)
        accelerator = trainer.accelerator  # rank-aware, as under transformers' Trainer
        assert (accelerator.num_processes, accelerator.process_index) == (int(os.environ["WORLD_SIZE"]), rank)
        assert accelerator.is_main_process == (rank == 0) == trainer.is_world_process_zero()
        trainer.train()
        trainer.save_model()
        names = surface_names(trainer) if "peft_config" in trainer_kwargs else None  # collectives: every rank
        if rank == 0:
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))
            if names is not None:
                (out / "peft_names.json").write_text(json.dumps(names))


def surface_names(trainer) -> dict:
    """``trainer.model.named_parameters()`` under LoRA (peft's names): each tensor's global shape, requires_grad
    and the sum of its whole value (sharded tensors gathered)."""
    from torch.distributed.tensor import DTensor

    names = {}
    for name, param in trainer.model.named_parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        names[name] = [list(param.shape), param.requires_grad, whole.detach().double().sum().item()]
    return names


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
