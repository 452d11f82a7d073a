"""README.md model cards: huggingface_hub's ModelCardData holds the Hub metadata (base_model,
library_name, tags, datasets) and ModelCard renders the text below, laid out as TRL's card."""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from hfnative.converters.export import write_atomically
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

# a Jinja template for ModelCard.from_template; base_model and model_name come from the card data
_TEMPLATE = """\
---
{{ card_data }}
---

# Model Card for {{ model_name }}

This model is {{ "a LoRA adapter for" if adapter else "a fine-tuned version of" }} \
{% if base_model %}[{{ base_model }}](https://huggingface.co/{{ base_model }}){% else %}a local base model{% endif %}.

It was trained with {{ algorithm }} using [hfnative](https://pypi.org/project/hfnative/), a drop-in, \
Hugging Face-compatible post-training engine.
{% if adapter and base_model %}
## Quick start

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{{ base_model }}"), "{{ repo_id }}")
```
{% elif not adapter %}
## Quick start

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{{ repo_id }}")
```
{% endif %}
## Training hyperparameters

| hyperparameter | value |
|---|---|
{% for name, value in hyperparameters.items() %}| {{ name }} | {{ value }} |
{% endfor %}{% if results %}
## Final metrics

| metric | value |
|---|---|
{% for name, value in results.items() %}| {{ name }} | {{ value }} |
{% endfor %}{% endif %}
## Framework versions

{% for name, version in versions.items() %}- {{ name }}: {{ version }}
{% endfor %}"""


def hub_id(name_or_path: str | None) -> str | None:
    """``name_or_path`` when it names a Hub repository; None for local files and folders."""
    if not name_or_path or os.path.exists(name_or_path) or not HUB_ID.match(str(name_or_path)):
        return None
    return str(name_or_path)


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
    names = _as_list(dataset_name) + _as_list(dataset) or trainer.dataset_names() or []
    card_data = ModelCardData(
        base_model=hub_id(finetuned_from or getattr(config, "_name_or_path", None)),
        datasets=[name for name in map(hub_id, names) if name] or None,
        language=language,
        library_name="peft" if adapter else "transformers",
        license=license,
        model_name=model_name or (args.hub_model_id or Path(args.output_dir).name).split("/")[-1],
        tags=list(dict.fromkeys(trainer.model_tags() + _as_list(tags))),
    )
    hyperparameters = {k: getattr(args, k) for k in _CARD_ARGS if hasattr(args, k)}
    results = _final_metrics(trainer.state.log_history)
    card = ModelCard.from_template(
        card_data,
        template_str=_TEMPLATE,
        adapter=adapter,
        algorithm=trainer.algorithm_name,
        repo_id=getattr(trainer, "hub_model_id", None) or args.hub_model_id or card_data.model_name,
        hyperparameters={k: str(getattr(v, "value", v)) for k, v in hyperparameters.items()},
        results={k: f"{v:.6g}" if isinstance(v, float) else v for k, v in results.items()},
        versions=_versions(),
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "README.md"
    write_atomically(path, card.save)
    return path
