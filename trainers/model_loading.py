"""What the trainers accept as ``model`` and ``processing_class``, turned into native objects."""

from __future__ import annotations

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


def resolve_model(model, device: torch.device, model_init_kwargs: dict) -> ConvertedModel | Transformer:
    """A path / Hub id / transformers model / ConvertedModel / native Transformer -> native model."""
    if isinstance(model, (ConvertedModel, Transformer)):
        return model
    kwargs = dict(model_init_kwargs or {})
    dtype = model_dtype(kwargs.pop("dtype", kwargs.pop("torch_dtype", None)))
    if isinstance(model, transformers.PreTrainedModel):
        return load_pretrained(model, dtype=dtype or next(model.parameters()).dtype, device=device)
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        return load_pretrained(
            model,
            dtype=dtype,
            device=device,
            revision=kwargs.get("revision"),
            cache_dir=kwargs.get("cache_dir"),
            token=kwargs.get("token"),
        )
    raise TypeError(
        f"model must be a path or Hub id, a transformers PreTrainedModel, a ConvertedModel or an hfnative "
        f"Transformer; got {type(model).__name__}"
    )


def load_processing_class(converted: ConvertedModel | None):
    """The tokenizer saved beside the checkpoint (None when there is no checkpoint folder)."""
    if converted is None or converted.source_dir is None:
        name = getattr(getattr(converted, "config", None), "_name_or_path", None)
        if not name:
            return None
        return transformers.AutoTokenizer.from_pretrained(name)
    return transformers.AutoTokenizer.from_pretrained(str(converted.source_dir))
