"""What the trainers accept as ``model`` and ``processing_class``, turned into native objects."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from hfnative.converters.loading import ConvertedModel, load_pretrained
from hfnative.models.decoder import Transformer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(value) -> torch.dtype | None:
    """TRL's ``model_init_kwargs["dtype"]``: a dtype, one of its names, "auto" or None (-> float32)."""
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    if value == "auto":
        return None  # the checkpoint's own dtype
    if value in _DTYPES:
        return _DTYPES[value]
    raise ValueError(f"model_init_kwargs dtype={value!r}; use 'auto', 'float32', 'bfloat16', 'float16' or a torch.dtype")


@dataclass
class LoadedModel:
    model: Transformer
    converted: ConvertedModel | None  # None for a bare native Transformer (no Hub export possible)
    lora_settings: object | None = None  # when ``model`` was a PEFT adapter folder
    base_model_name_or_path: str | None = None


def _is_adapter_folder(model) -> bool:
    return isinstance(model, (str, os.PathLike)) and (Path(model) / "adapter_config.json").is_file()


def resolve_model(model, device: torch.device, model_init_kwargs: dict) -> LoadedModel:
    """A path / Hub id / PEFT adapter folder / transformers model / ConvertedModel / Transformer -> native model."""
    if isinstance(model, Transformer):
        return LoadedModel(model, None)
    if isinstance(model, ConvertedModel):
        return LoadedModel(model.model, model, base_model_name_or_path=getattr(model.config, "_name_or_path", None))
    if type(model).__name__.startswith("PeftModel"):
        raise TypeError(
            "model is a peft PeftModel: pass the adapter folder instead (model='path/to/adapter', which loads its "
            "base model and continues training the adapter), or the base model together with peft_config="
        )
    kwargs = dict(model_init_kwargs or {})
    dtype = model_dtype(kwargs.pop("dtype", kwargs.pop("torch_dtype", None)))
    if isinstance(model, transformers.PreTrainedModel):
        converted = load_pretrained(model, dtype=dtype or next(model.parameters()).dtype, device=device)
        return LoadedModel(converted.model, converted, base_model_name_or_path=model.config._name_or_path)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model must be a path or Hub id, a transformers PreTrainedModel, a ConvertedModel or an hfnative "
            f"Transformer; got {type(model).__name__}"
        )
    hub = dict(revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token"))
    quantization = dict(load_in_4bit=kwargs.get("load_in_4bit", False), quantization_config=kwargs.get("quantization_config"))
    if _is_adapter_folder(model):
        from hfnative.converters.peft import load_adapter

        base = json.loads((Path(model) / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{model}/adapter_config.json names no base_model_name_or_path to load the adapter onto")
        converted = load_pretrained(base, dtype=dtype, device=device, **hub)
        settings = load_adapter(converted, model, is_trainable=True, **quantization)
        return LoadedModel(converted.model, converted, settings, base)
    converted = load_pretrained(model, dtype=dtype, device=device, **hub)
    return LoadedModel(converted.model, converted, base_model_name_or_path=str(model))


def load_processing_class(converted: ConvertedModel | None):
    """The tokenizer saved beside the checkpoint (None when there is no checkpoint folder).

    Raises ValueError naming the folder when it holds no tokenizer: transformers would then build one
    from config.json alone, with a single token, and every row would be dropped or trained as nothing.
    """
    if converted is None or converted.source_dir is None:
        name = getattr(getattr(converted, "config", None), "_name_or_path", None)
        if not name:
            return None
    else:
        name = str(converted.source_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    if len(tokenizer) <= 1:
        raise ValueError(
            f"model {name!r} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...): copy the base "
            "model's tokenizer files into it, or pass processing_class=AutoTokenizer.from_pretrained(<the base model>)"
        )
    return tokenizer
