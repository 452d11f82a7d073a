"""README.md model cards with Hub metadata (base_model, library_name, tags, datasets)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

# the hyperparameters worth showing on a card, in this order
_CARD_ARGS = (
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "warmup_steps",
    "optim",
    "weight_decay",
    "max_grad_norm",
    "seed",
    "bf16",
    "max_length",
    "packing",
    "beta",
)


def hub_base_model(name_or_path: str | None) -> str | None:
    """A Hub id to cite as base_model; local folders are not Hub models."""
    if not name_or_path or os.path.isdir(name_or_path) or name_or_path.startswith((".", "/", "~")):
        return None
    return name_or_path


def card_metadata(base_model: str | None, tags: list[str], datasets: list[str] | None, model_name: str) -> dict:
    metadata = {"library_name": "transformers", "model_name": model_name, "tags": tags}
    if base_model:
        metadata["base_model"] = base_model
    if datasets:
        metadata["datasets"] = datasets
    return metadata


def render_model_card(metadata: dict, *, algorithm: str, hyperparameters: dict, results: dict, adapter: bool = False) -> str:
    base = metadata.get("base_model")
    name = metadata["model_name"]
    lines = ["---", yaml.safe_dump(metadata, sort_keys=True).strip(), "---", "", f"# {name}", ""]
    what = "a LoRA adapter for" if adapter else "a fine-tuned version of"
    lines.append(
        f"This model is {what} [{base}](https://huggingface.co/{base})." if base else f"This model is {what} a local base model."
    )
    lines += ["", f"It was trained with {algorithm} using [hfnative](https://pypi.org/project/hfnative/), a drop-in, "
              "Hugging Face-compatible post-training engine.", ""]
    if adapter and base:
        lines += ["## Quick start", "", "```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
                  f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "{name}")', "```", ""]
    elif not adapter:
        lines += ["## Quick start", "", "```python", "from transformers import pipeline", "",
                  f'generator = pipeline("text-generation", model="{name}")', "```", ""]
    lines += ["## Training hyperparameters", "", "| hyperparameter | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in hyperparameters.items()]
    if results:
        lines += ["", "## Final metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in results.items()]
    lines += ["", "## Framework versions", ""] + [f"- {k}: {v}" for k, v in _versions().items()] + [""]
    return "\n".join(lines)


def _versions() -> dict:
    import torch
    import transformers

    import hfnative

    return {"hfnative": hfnative.__version__, "transformers": transformers.__version__, "torch": torch.__version__}


def _final_metrics(log_history: list[dict]) -> dict:
    results = {}
    for entry in log_history:
        results.update({k: v for k, v in entry.items() if k not in ("step", "epoch") and isinstance(v, (int, float))})
    return {k: results[k] for k in sorted(results) if k in ("train_loss", "eval_loss") or k.startswith(("eval_", "mean_token", "rewards/"))}


def write_model_card(trainer, output_dir: Path, *, adapter: bool = False) -> Path:
    args = trainer.args
    config = getattr(trainer.converted, "config", None)
    base_model = hub_base_model(getattr(config, "_name_or_path", None))
    model_name = (args.hub_model_id or Path(args.output_dir).name).split("/")[-1]
    metadata = card_metadata(base_model, trainer.model_tags(), trainer.dataset_names(), model_name)
    hyperparameters = {k: getattr(args, k) for k in _CARD_ARGS if hasattr(args, k)}
    hyperparameters = {k: str(getattr(v, "value", v)) for k, v in hyperparameters.items()}
    text = render_model_card(
        metadata, algorithm=trainer.algorithm_name, hyperparameters=hyperparameters,
        results=_final_metrics(trainer.state.log_history), adapter=adapter,
    )
    path = Path(output_dir) / "README.md"
    path.write_text(text)
    return path
