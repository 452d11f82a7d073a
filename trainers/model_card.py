"""README.md model cards with Hub metadata (base_model, library_name, tags, datasets)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from hfnative.converters.hub import HUB_ID

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


def hub_id(name_or_path: str | None) -> str | None:
    """``name_or_path`` when it names a Hub repository; None for local files and folders."""
    if not name_or_path or os.path.exists(name_or_path) or not HUB_ID.match(str(name_or_path)):
        return None
    return str(name_or_path)


def card_metadata(
    base_model: str | None,
    tags: list[str],
    datasets: list[str] | None,
    model_name: str,
    *,
    adapter: bool = False,
    license: str | None = None,
    language: str | list[str] | None = None,
) -> dict:
    """The README's YAML front matter, in the Hub's metadata names."""
    metadata = {"library_name": "peft" if adapter else "transformers", "model_name": model_name, "tags": tags}
    if base_model:
        metadata["base_model"] = base_model
    if datasets:
        metadata["datasets"] = datasets
    if license:
        metadata["license"] = license
    if language:
        metadata["language"] = language
    return metadata


def render_model_card(
    metadata: dict, *, algorithm: str, hyperparameters: dict, results: dict, adapter: bool = False, repo_id: str | None = None
) -> str:
    """The card's text; ``repo_id`` (the Hub repository, when known) is what the quick start loads."""
    base = metadata.get("base_model")
    name = metadata["model_name"]
    repo_id = repo_id or name
    lines = ["---", yaml.safe_dump(metadata, sort_keys=True).strip(), "---", "", f"# {name}", ""]
    what = "a LoRA adapter for" if adapter else "a fine-tuned version of"
    lines.append(
        f"This model is {what} [{base}](https://huggingface.co/{base})." if base else f"This model is {what} a local base model."
    )
    lines += ["", f"It was trained with {algorithm} using [hfnative](https://pypi.org/project/hfnative/), a drop-in, "
              "Hugging Face-compatible post-training engine.", ""]
    if adapter and base:
        lines += ["## Quick start", "", "```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
                  f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "{repo_id}")', "```", ""]
    elif not adapter:
        lines += ["## Quick start", "", "```python", "from transformers import pipeline", "",
                  f'generator = pipeline("text-generation", model="{repo_id}")', "```", ""]
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


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def write_model_card(
    trainer,
    output_dir: Path,
    *,
    adapter: bool | None = None,
    model_name: str | None = None,
    dataset_name: str | list[str] | None = None,
    dataset: str | list[str] | None = None,
    tags: str | list[str] | None = None,
    finetuned_from: str | None = None,
    license: str | None = None,
    language: str | list[str] | None = None,
) -> Path:
    """Write output_dir/README.md: Hub metadata, hyperparameters and final metrics.

    adapter: None -> True when output_dir holds a PEFT adapter (adapter_config.json).
    dataset_name (TRL) / dataset (transformers): defaults to ``trainer.dataset_names()``; local paths
    are left out of the metadata, as are local base models.
    """
    args = trainer.args
    output_dir = Path(output_dir)
    if adapter is None:
        adapter = (output_dir / "adapter_config.json").exists()
    config = getattr(trainer.converted, "config", None)
    base_model = hub_id(finetuned_from or getattr(config, "_name_or_path", None))
    model_name = model_name or (args.hub_model_id or Path(args.output_dir).name).split("/")[-1]
    names = _as_list(dataset_name) + _as_list(dataset) or trainer.dataset_names() or []
    datasets = [name for name in map(hub_id, names) if name]
    all_tags = list(dict.fromkeys(trainer.model_tags() + _as_list(tags)))
    metadata = card_metadata(base_model, all_tags, datasets, model_name, adapter=adapter, license=license, language=language)
    hyperparameters = {k: getattr(args, k) for k in _CARD_ARGS if hasattr(args, k)}
    hyperparameters = {k: str(getattr(v, "value", v)) for k, v in hyperparameters.items()}
    text = render_model_card(
        metadata, algorithm=trainer.algorithm_name, hyperparameters=hyperparameters,
        results=_final_metrics(trainer.state.log_history), adapter=adapter,
        repo_id=getattr(trainer, "hub_model_id", None) or args.hub_model_id,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "README.md"
    path.write_text(text)
    return path
