"""What the trainers accept as ``model`` and ``processing_class``, turned into the model the loop runs: a
native model, or transformers' own module wrapped for the loop where there is none (converters/fallback.py,
converters/fallback_loading.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from hfnative.converters import fallback, fallback_loading
from hfnative.converters.fallback import TransformersCausalLM, warn_fallback
from hfnative.converters.fallback_loading import TransformersModel, load_transformers_model, wrap_transformers_model
from hfnative.converters.hub import resolve_model_dir
from hfnative.converters.loading import ConvertedModel, UnsupportedModelError, load_pretrained
from hfnative.models.decoder import Transformer
from hfnative.peft.settings import is_quantization_requested, quantization_request, quantization_settings

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
    model: Transformer | TransformersCausalLM
    # None for a bare native Transformer (no Hub export possible); a TransformersModel on the fallback
    converted: ConvertedModel | TransformersModel | None
    lora_settings: object | None = None  # when ``model`` was a LoRA adapter folder (native LoRA)
    base_model_name_or_path: str | None = None


def _is_adapter_folder(model) -> bool:
    return isinstance(model, (str, os.PathLike)) and (Path(model) / "adapter_config.json").is_file()


def _check_fallback(config, error: UnsupportedModelError, model_class_name: str | None = None) -> None:
    """Re-raise the native loader's error when transformers' module cannot stand in either."""
    refusal = fallback_loading.fallback_refusal(config, model_class_name)
    if refusal is not None:
        raise UnsupportedModelError(f"{error}; and it cannot train through transformers' modeling code: {refusal}") from error


# model_init_kwargs keys hfnative reads itself, and those that change nothing here (how transformers would place the
# model or which code it would run); every other key is a field of the model's config, set as from_pretrained sets it
LOADING_KEYS = frozenset({"dtype", "torch_dtype", "num_labels", "score_seed", "revision", "cache_dir", "token",
                          "load_in_4bit", "load_in_8bit", "quantization_config", "attn_implementation"})
NO_EFFECT_KEYS = frozenset({
    "device_map", "trust_remote_code", "low_cpu_mem_usage", "use_safetensors", "use_kernels", "max_memory",
    "offload_folder", "offload_buffers", "offload_state_dict", "tp_plan", "tp_size", "distributed_config",
    "device_mesh", "kernel_config", "output_loading_info", "weights_only", "local_files_only", "force_download",
    "proxies", "resume_download", "_fast_init",
})
# from_pretrained options that choose other weights or another way of reading them: not implemented here
REFUSED_KEYS = {
    "subfolder": "a checkpoint in a subfolder: pass the subfolder's path (or download it) as the model",
    "variant": "weight files of a variant: pass a folder holding that variant's files as model.safetensors",
    "gguf_file": "GGUF weights: convert them to a safetensors checkpoint first",
    "key_mapping": "renamed checkpoint keys: save the checkpoint under transformers' names first",
    "from_tf": "TensorFlow weights: convert them to safetensors first",
    "from_flax": "Flax weights: convert them to safetensors first",
    "generation_config": "a generation config given at load: set trainer.model.generation_config after loading",
    "return_unused_kwargs": "drop it",
}


def config_overrides(model_init_kwargs: dict | None) -> dict:
    """The model_init_kwargs that are config fields (``attention_dropout``, ``rope_parameters``, ``use_cache``, ...);
    a from_pretrained option hfnative does not implement (``REFUSED_KEYS``) is refused by name."""
    kwargs = model_init_kwargs or {}
    refused = [f"{key}: {what}" for key, what in REFUSED_KEYS.items() if key in kwargs]
    if refused:
        raise ValueError("model_init_kwargs: from_pretrained options hfnative does not implement: " + "; ".join(refused))
    return {key: value for key, value in kwargs.items() if key not in LOADING_KEYS | NO_EFFECT_KEYS}


def _trainable_natively(converted: ConvertedModel, dropout_fields: tuple[str, ...]) -> ConvertedModel:
    """``converted``, unless its config asks for dropout (one of ``dropout_fields``) that the native decoders would not
    apply while it trains: then the UnsupportedModelError that sends it to transformers' module."""
    from hfnative.converters.families.common import dropout_refusal

    error = dropout_refusal(converted.config, dropout_fields)
    if error is not None:
        raise error
    return converted


def resolve_model(model, device: torch.device, model_init_kwargs: dict, dropout_fields: tuple[str, ...] = (),
                  quantize_on: torch.device | None = None) -> LoadedModel:
    """A path / Hub id / PEFT adapter folder / transformers model / peft PeftModel / ConvertedModel /
    Transformer -> the model the trainer runs. An architecture without a native implementation (or a
    PEFT method other than LoRA) runs transformers' own module in a ``TransformersCausalLM``. ``quantize_on``: where an
    adapter folder's quantized base goes, each weight quantized there (None: ``device``)."""
    from hfnative.converters.peft_surface import PeftSurface

    if isinstance(model, PeftSurface):  # a LoRA trainer's trainer.model: the native model under peft's names
        model = model.native_model
    if isinstance(model, Transformer):  # with its Hub record when it came from a trainer (trainer.model)
        converted = model.__dict__.get("_hub_converted")
        name = getattr(converted.config, "_name_or_path", None) if converted is not None else None
        return LoadedModel(model, converted, base_model_name_or_path=name)
    if isinstance(model, TransformersCausalLM):
        return LoadedModel(model, TransformersModel(model, model.config), base_model_name_or_path=model.name_or_path)
    if isinstance(model, (ConvertedModel, TransformersModel)):
        return LoadedModel(model.model, model, base_model_name_or_path=getattr(model.config, "_name_or_path", None))
    kwargs = dict(model_init_kwargs or {})
    dtype = model_dtype(kwargs.pop("dtype", kwargs.pop("torch_dtype", None)))
    classifier = dict(num_labels=kwargs.pop("num_labels", None), score_seed=kwargs.pop("score_seed", None))
    if classifier["num_labels"] is not None:
        return _sequence_classifier(model, device, dtype, kwargs, **classifier, dropout_fields=dropout_fields)
    if fallback._is_peft_model(model):
        return _from_peft_model(model, device, dtype)
    if isinstance(model, transformers.PreTrainedModel):
        name = model.config._name_or_path
        try:
            converted = _trainable_natively(_causal(load_pretrained(model, dtype=dtype or next(model.parameters()).dtype,
                                                                    device=device)), dropout_fields)
        except UnsupportedModelError as error:  # transformers' module itself trains, in place
            _check_fallback(model.config, error, type(model).__name__)
            loaded = wrap_transformers_model(model)
            warn_fallback(fallback.architecture_name(loaded.config), str(error))
            return LoadedModel(loaded.model, loaded, base_model_name_or_path=name)
        return LoadedModel(converted.model, converted, base_model_name_or_path=name)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model must be a path or Hub id, a transformers PreTrainedModel, a peft PeftModel, a ConvertedModel or "
            f"an hfnative Transformer; got {type(model).__name__}"
        )
    hub = dict(revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token"))
    quantization = quantization_request(kwargs)
    overrides = config_overrides(kwargs)
    if _is_adapter_folder(model):
        if overrides:
            raise ValueError(f"model_init_kwargs {sorted(overrides)} with an adapter folder as the model: its base loads "
                             "as the adapter was trained on it; load the base with them and pass a peft_config")
        return _from_adapter_folder(model, device, dtype, hub, quantization, kwargs.get("attn_implementation"),
                                    quantize_on)
    try:
        converted = _trainable_natively(_causal(load_pretrained(model, dtype=dtype, device=device,
                                                                config_overrides=overrides, **hub)), dropout_fields)
    except UnsupportedModelError as error:
        _check_fallback(_config_of(model, hub), error)
        _refuse_quantization(quantization)
        attn_implementation = kwargs.get("attn_implementation")
        loaded = load_transformers_model(model, dtype=dtype, device=device, attn_implementation=attn_implementation,
                                         config_overrides=overrides, **hub)
        warn_fallback(fallback.architecture_name(loaded.config), str(error))
        return LoadedModel(loaded.model, loaded, base_model_name_or_path=str(model))
    return LoadedModel(converted.model, converted, base_model_name_or_path=str(model))


def _sequence_classifier(model, device, dtype, kwargs: dict, num_labels: int, score_seed: int | None,
                         dropout_fields: tuple[str, ...] = ()) -> LoadedModel:
    """A model folder, Hub id or transformers model as a native sequence classifier with ``num_labels`` scores (a
    causal LM's decoder gets a new score head drawn from ``score_seed``, as AutoModelForSequenceClassification)."""
    if _is_adapter_folder(model) or fallback._is_peft_model(model):
        return _adapter_sequence_classifier(model, device, dtype, kwargs, num_labels, score_seed)
    if not isinstance(model, (str, os.PathLike, transformers.PreTrainedModel)):
        raise TypeError(f"a sequence classifier is loaded from a path, Hub id or transformers model; got {type(model).__name__}")
    _refuse_quantization(quantization_request(kwargs))
    if isinstance(model, transformers.PreTrainedModel):
        name = model.config._name_or_path
        source, options = model, dict(dtype=dtype or next(model.parameters()).dtype)
    else:
        name = str(model)
        source, options = model, dict(dtype=dtype, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"),
                                      token=kwargs.get("token"), config_overrides=config_overrides(kwargs))
    try:
        converted = _trainable_natively(load_pretrained(source, device=device, num_labels=num_labels,
                                                        score_seed=score_seed, **options), dropout_fields)
    except UnsupportedModelError as error:  # transformers' own *ForSequenceClassification module trains instead
        from hfnative.converters.fallback_classifier import (
            classifier_refusal,
            load_transformers_classifier,
            wrap_transformers_classifier,
        )

        if not isinstance(model, transformers.PreTrainedModel):
            loaded = load_transformers_classifier(model, num_labels=num_labels, score_seed=score_seed, reason=str(error),
                                                  device=device, **options)
            return LoadedModel(loaded.model, loaded, base_model_name_or_path=name)
        refusal = classifier_refusal(model.config)
        if not type(model).__name__.endswith("ForSequenceClassification"):
            refusal = f"{type(model).__name__} is not a sequence-classification model (pass its folder or Hub id instead)"
        if refusal is not None:
            raise UnsupportedModelError(f"{error}; and it cannot score through transformers' modeling code: {refusal}") from error
        loaded = wrap_transformers_classifier(model, options["dtype"], str(error))
        return LoadedModel(loaded.model, loaded, base_model_name_or_path=name)
    return LoadedModel(converted.model, converted, base_model_name_or_path=name)


def _adapter_sequence_classifier(model, device, dtype, kwargs: dict, num_labels: int, score_seed: int | None) -> LoadedModel:
    """A peft adapter over a classifier (a PeftModel, or an adapter folder whose base is a causal LM or a classifier),
    trained as TRL trains it, its adapter training on: LoRA on a native architecture becomes the native classifier with
    hfnative's LoRA (the score head peft saves as modules_to_save loaded with it); anything else trains through peft
    on transformers' own classifier."""
    import tempfile

    from hfnative.converters.fallback_classifier import load_transformers_classifier, wrap_transformers_classifier
    from hfnative.converters.peft import load_adapter

    hub = dict(revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token"))
    _refuse_quantization(quantization_request(kwargs))
    is_object = fallback._is_peft_model(model)
    if is_object:  # its base: a transformers classifier with the adapters injected (loaded without them)
        peft_config, base = model.active_peft_config, model.get_base_model()
        base_name, base_config, base_hub = getattr(peft_config, "base_model_name_or_path", None), base.config, {}
        dtype = dtype or next(base.parameters()).dtype
    else:
        peft_config = json.loads((Path(model) / "adapter_config.json").read_text())
        base = base_name = peft_config.get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{model}/adapter_config.json names no base_model_name_or_path to load the adapter onto")
        base_config, base_hub = _config_of(base, hub), hub
    reason = fallback_loading.native_lora_refusal(peft_config, base_config)
    if reason is None:
        converted = load_pretrained(base, dtype=dtype, device=device, num_labels=num_labels, score_seed=score_seed,
                                    **base_hub)
        if is_object:
            with tempfile.TemporaryDirectory() as folder:
                model.save_pretrained(folder)  # peft's own names, read back strictly
                settings = load_adapter(converted, folder, is_trainable=True)
        else:
            settings = load_adapter(converted, model, is_trainable=True)
        return LoadedModel(converted.model, converted, settings, base_name)
    if is_object:  # the PeftModel itself trains, in place
        loaded = wrap_transformers_classifier(model, dtype, reason)
    else:
        loaded = load_transformers_classifier(base, num_labels=num_labels, score_seed=score_seed, dtype=dtype,
                                              device=device, reason=reason, **hub)
        loaded = fallback_loading.load_peft_adapter(model, loaded, is_trainable=True)
    return LoadedModel(loaded.model, loaded, base_model_name_or_path=base_name)


def _causal(converted: ConvertedModel) -> ConvertedModel:
    """``converted`` when it is a causal LM; a sequence classifier is refused (its head scores, it predicts no tokens)."""
    if converted.args.num_labels is not None:
        architecture = (getattr(converted.config, "architectures", None) or ["a sequence classifier"])[0]
        raise ValueError(
            f"{getattr(converted.config, '_name_or_path', None) or 'the model'} is {architecture}: a sequence-classification "
            "model scores sequences and predicts no tokens, so this trainer cannot train it; pass a *ForCausalLM "
            "checkpoint (RewardTrainer trains sequence classifiers)"
        )
    return converted


def _config_of(name_or_path, hub: dict):
    return transformers.AutoConfig.from_pretrained(str(resolve_model_dir(name_or_path, **hub)), trust_remote_code=False)


def loading_device(kwargs: dict, device: torch.device) -> torch.device:
    """Where a model with ``kwargs`` loads before it is placed on ``device``: the host when they ask for a quantized
    base (each weight is then quantized on ``device``, which never holds the full-precision model), else ``device``."""
    return torch.device("cpu") if is_quantization_requested(kwargs) else device


def quantize_frozen_model(loaded, kwargs: dict, role: str, device: torch.device | None = None) -> None:
    """A frozen model (a teacher, a reward model) loaded with ``load_in_4bit`` / ``load_in_8bit`` /
    ``quantization_config`` in its kwargs: its linears stored in 4 or 8 bits as a LoRA policy's base would be (TRL loads
    such a model quantized by bitsandbytes), in place, each weight quantized on ``device`` (None: where it is).
    ``loaded``: its ConvertedModel (or anything with ``converted``); a model on transformers' modeling code is
    refused, naming ``role``."""
    settings = quantization_settings(**quantization_request(kwargs))
    if settings is None:
        return
    converted = getattr(loaded, "converted", loaded)
    if not isinstance(converted, ConvertedModel):
        raise ValueError(f"the {role}'s model_init_kwargs ask for a quantized model (load_in_4bit / load_in_8bit / "
                         "quantization_config), which is implemented for hfnative's native models only; this one runs "
                         "through transformers' modeling code: drop the quantization")
    from hfnative.converters.peft import quantized_linears
    from hfnative.peft.quantize import quantize_base

    quantize_base(converted.model, settings, quantized_linears(converted, settings.skip_modules), device)


def _refuse_quantization(quantization: dict) -> None:
    if is_quantization_requested(quantization):
        raise ValueError(
            "load_in_4bit / load_in_8bit / quantization_config (a quantized base for LoRA) is implemented for "
            "hfnative's native models only; this model trains through transformers' modeling code: drop the "
            "quantization"
        )


def _from_adapter_folder(adapter_dir, device, dtype, hub: dict, quantization: dict, attn_implementation,
                         quantize_on: torch.device | None = None) -> LoadedModel:
    """A PEFT adapter folder: native LoRA when hfnative implements the adapter on a native base, else peft's
    ``PeftModel.from_pretrained`` on transformers' base model. Its adapter keeps training."""
    from hfnative.converters.peft import load_adapter

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{adapter_dir}/adapter_config.json names no base_model_name_or_path to load the adapter onto")
    reason = fallback_loading.native_lora_refusal(config, _config_of(base, hub))  # before any weight is loaded
    if reason is None:
        try:
            converted = load_pretrained(base, dtype=dtype, device=device, **hub)
        except UnsupportedModelError as error:
            reason = str(error)
        else:
            settings = load_adapter(converted, adapter_dir, is_trainable=True, **quantization, quantize_on=quantize_on)
            return LoadedModel(converted.model, converted, settings, base)
    _refuse_quantization(quantization)
    refusal = fallback_loading.fallback_refusal(_config_of(base, hub))
    if refusal is not None:
        raise UnsupportedModelError(f"the adapter in {adapter_dir} cannot train: {reason}; and through transformers: {refusal}")
    loaded = load_transformers_model(base, dtype=dtype, device=device, attn_implementation=attn_implementation, **hub)
    warn_fallback(f"the {config.get('peft_type', 'LORA')} adapter on {fallback.architecture_name(loaded.config)}", reason)
    loaded = fallback_loading.load_peft_adapter(adapter_dir, loaded, is_trainable=True)
    return LoadedModel(loaded.model, loaded, base_model_name_or_path=base)


def _from_peft_model(peft_model, device, dtype) -> LoadedModel:
    """A peft PeftModel object: LoRA that hfnative implements on a native architecture becomes native LoRA (a
    copy, as a transformers model given as ``model`` is); anything else trains through peft, the object itself."""
    peft_config = peft_model.active_peft_config
    base_name = getattr(peft_config, "base_model_name_or_path", None)
    reason = fallback_loading.native_lora_refusal(peft_config, peft_model.get_base_model().config)
    if reason is None:
        converted, settings = fallback_loading.native_lora_from_peft_model(peft_model, dtype=dtype, device=device)
        return LoadedModel(converted.model, converted, settings, base_name)
    loaded = wrap_transformers_model(peft_model)
    warn_fallback(f"the {peft_config.peft_type} PeftModel on {fallback.architecture_name(loaded.config)}", reason)
    return LoadedModel(loaded.model, loaded, base_model_name_or_path=base_name)


def load_meta_model(model, model_init_kwargs: dict, dropout_fields: tuple[str, ...] = ()) -> LoadedModel | None:
    """A native model of the Hub-format folder or id ``model`` built on the meta device, for a distributed run to
    parallelize and then load rank by rank (``load_sharded``); None when it cannot be (a PEFT adapter folder, an
    architecture without a native implementation)."""
    from hfnative.converters.sharded_loading import meta_model

    if _is_adapter_folder(model):
        return None
    kwargs = dict(model_init_kwargs or {})
    dtype = model_dtype(kwargs.pop("dtype", kwargs.pop("torch_dtype", None)))
    try:
        converted = _trainable_natively(meta_model(
            model, dtype=dtype, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"),
            token=kwargs.get("token"), config_overrides=config_overrides(kwargs)), dropout_fields)
    except UnsupportedModelError:
        return None
    return LoadedModel(_causal(converted).model, converted, base_model_name_or_path=str(model))


def load_sharded(converted: ConvertedModel, device: torch.device) -> None:
    """Materialize a parallelized meta model on ``device`` with this rank's slice of every checkpoint tensor."""
    from hfnative.converters.sharded_loading import load_sharded as load_rank_slices

    load_rank_slices(converted, device)


def load_processing_class(converted: ConvertedModel | TransformersModel | None, **tokenizer_kwargs):
    """The tokenizer saved beside the checkpoint (None when there is no checkpoint folder); ``tokenizer_kwargs`` go to
    ``from_pretrained`` (the sides TRL's RL trainers load theirs with).

    Raises ValueError naming the folder when it holds no tokenizer: transformers would then build one
    from config.json alone, with a single token, and every row would be dropped or trained as nothing.
    """
    if converted is None or converted.source_dir is None:
        name = getattr(getattr(converted, "config", None), "_name_or_path", None)
        if not name:
            return None
    else:
        name = str(converted.source_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(name, **tokenizer_kwargs)
    if len(tokenizer) <= 1:
        raise ValueError(
            f"model {name!r} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...): copy the base "
            "model's tokenizer files into it, or pass processing_class=AutoTokenizer.from_pretrained(<the base model>)"
        )
    return tokenizer


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout layer of ``model`` set to p = 0 (TRL's ``disable_dropout``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
