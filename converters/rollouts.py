"""A Hub-format model handed to the rollout engines of ``hfnative.generation``, which take only what is
plain: a native decoder, a model folder and its dtype, weights as (name, tensor) pairs.

``native_model`` gives the decoder the native engine runs; ``hub_named_tensors`` the live weights under
their Hub names (adapters merged), which a vLLM engine's ``load_weights`` takes; ``vllm_model_folder`` and
``vllm_dtype`` the folder and dtype a colocated vLLM starts from.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from hfnative.models.decoder import Transformer

from .export import export_hf, hub_state_dict_pieces, hub_tensor, merged_native_state
from .loading import ConvertedModel, load_pretrained


def native_model(model) -> Transformer:
    """The native decoder of ``model``: a Transformer (a trainer's model too) as is, a ConvertedModel's
    ``.model``; a checkpoint folder, a Hub id or a transformers PreTrainedModel loaded by ``load_pretrained``."""
    if isinstance(model, Transformer):
        return model
    if isinstance(getattr(model, "model", None), Transformer):  # a ConvertedModel
        return model.model
    from transformers import PreTrainedModel

    if isinstance(model, (str, os.PathLike, PreTrainedModel)):
        return load_pretrained(model).model
    raise ValueError(
        f"model is a {type(model).__name__}; expected a checkpoint folder or Hub id, a transformers "
        "PreTrainedModel, a ConvertedModel or an hfnative Transformer"
    )


def converted_model(model) -> ConvertedModel:
    """The ConvertedModel behind ``model``: itself, or the one a trainer's model (NativeCausalLM) carries."""
    converted = model.__dict__.get("_hub_converted", model) if hasattr(model, "__dict__") else model
    if not hasattr(converted, "family"):
        raise ValueError(
            f"expected a ConvertedModel (hfnative.converters.loading.load_pretrained) or a model loaded from a "
            f"Hub checkpoint, got {type(model).__name__} without a Hub config: its weights have no Hub names"
        )
    return converted


def hub_named_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hub key, tensor) for every weight of ``model`` (a ConvertedModel, or a trainer's model loaded from
    a Hub checkpoint), re-fused per the family's pieces, adapters merged; what a vLLM engine's
    ``load_weights`` takes."""
    converted = converted_model(model)
    native = merged_native_state(converted.model)
    with torch.no_grad():
        for key, pieces in hub_state_dict_pieces(converted).items():
            yield key, hub_tensor(pieces, native)


def vllm_model_folder(model) -> str:
    """A Hub-format folder (or Hub id) vLLM can load ``model`` from: a path or id as given; the folder a
    model was loaded from (``name_or_path`` / ``source_dir``) when it still exists; else the model is
    exported (adapters merged) to a new temporary folder. Its live weights then go in by ``load_weights``."""
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    carried = getattr(model, "_hub_converted", None)  # a trainer's model carries its ConvertedModel
    for candidate in (getattr(model, "name_or_path", None), getattr(carried, "source_dir", None),
                      getattr(model, "source_dir", None)):
        if candidate and (Path(candidate) / "config.json").is_file():
            return str(candidate)
    converted = converted_model(model)
    folder = tempfile.mkdtemp(prefix="hfnative-vllm-model-")
    export_hf(converted, folder, native_state=merged_native_state(converted.model))
    return folder


def vllm_dtype(model) -> str:
    """The dtype vLLM should run ``model`` in: its parameters' (a model object) or its config's (a folder);
    "auto" otherwise. (vLLM's own "auto" runs a float32 checkpoint in bfloat16 on CPU.)"""
    if isinstance(model, (str, os.PathLike)):
        config_path = Path(model) / "config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            dtype = config.get("dtype") or config.get("torch_dtype")
            return dtype if isinstance(dtype, str) else "auto"
        return "auto"
    module = model.model if hasattr(model, "family") else model  # a ConvertedModel holds the module
    parameters = module.parameters() if hasattr(module, "parameters") else ()
    parameter = next((p for p in parameters if p.is_floating_point()), None)
    return str(parameter.dtype).removeprefix("torch.") if parameter is not None else "auto"


__all__ = ["converted_model", "hub_named_tensors", "native_model", "vllm_dtype", "vllm_model_folder"]
