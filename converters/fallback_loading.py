"""The fallback model's life outside the loop: the trainer's record of it (``TransformersModel``), loading a
transformers checkpoint or model object into the wrapper (``converters/fallback.py``, which also saves it), PEFT
through peft itself where hfnative has no native adapter, and resuming from a saved Hub-format folder.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .fallback import TransformersCausalLM, TransformersModel, architecture_name, warn_fallback
from .loading import hub_state_dict
from .hub import resolve_model_dir
from .loading import CheckpointError, ConvertedModel, SafetensorsSource

def fallback_refusal(config, model_class_name: str | None = None) -> str | None:
    """Why transformers' module cannot stand in for a native model of ``config`` (None: it can): it must be
    a causal LM transformers knows (its ``architectures``, or the class of a model object given), and not
    a quantized checkpoint (training one needs adapters hfnative applies natively)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    names = [model_class_name] if model_class_name else list(getattr(config, "architectures", None) or [])
    if names and not any(name in causal_lm_classes or name.endswith("ForCausalLM") for name in names):
        return f"{names} is not a causal language model transformers has a class for"
    if not names and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return f"transformers has no causal-LM class for {type(config).__name__}"
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
        return f"the checkpoint is quantized (quant_method={method!r})"
    return None


def load_transformers_model(
    name_or_path, *, dtype: torch.dtype | None, device, revision=None, cache_dir=None, token=None,
    attn_implementation: str | None = None, config_overrides: dict | None = None,
) -> TransformersModel:
    """``AutoModelForCausalLM.from_pretrained`` on a folder or Hub id: weights from safetensors only, every one
    of them (a missing, unexpected or mis-shaped tensor is a CheckpointError naming it), no remote code.
    dtype None: the checkpoint's own. config_overrides: config fields set as from_pretrained sets its kwargs."""
    from transformers import AutoModelForCausalLM

    source_dir = resolve_model_dir(name_or_path, revision=revision, cache_dir=cache_dir, token=token)
    kwargs = {"dtype": dtype or "auto", "use_safetensors": True, "trust_remote_code": False, "output_loading_info": True}
    if config_overrides:
        from .loading import config_with_overrides

        kwargs["config"] = config_with_overrides(source_dir, config_overrides)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if torch.device(device).type != "cpu":
        kwargs["device_map"] = str(device)
    causal_lm, info = AutoModelForCausalLM.from_pretrained(str(source_dir), **kwargs)
    kinds = (("missing", "missing_keys"), ("unexpected", "unexpected_keys"), ("mis-shaped", "mismatched_keys"))
    problems = [f"{label} tensors: {sorted(map(str, info[key]))}" for label, key in kinds if info.get(key)]
    if problems:
        raise CheckpointError(f"{source_dir} does not match its config.json:\n  " + "\n  ".join(problems))
    causal_lm.config._name_or_path = causal_lm.name_or_path = str(name_or_path)  # the name given (a Hub id, not its cache)
    return TransformersModel(TransformersCausalLM(causal_lm), causal_lm.config, source_dir)


def wrap_transformers_model(model, dtype: torch.dtype | None = None) -> TransformersModel:
    """A transformers model object (or PeftModel) trained as it is, in place (cast when ``dtype`` differs)."""
    if dtype is not None and next(model.parameters()).dtype != dtype:
        model.to(dtype)
    wrapper = TransformersCausalLM(model)
    return TransformersModel(wrapper, wrapper.config)


def transformers_from_native(converted) -> TransformersModel:
    """A native ``ConvertedModel`` rebuilt as its transformers class over the same weights (for peft): a causal LM, or
    a sequence classifier's ``*ForSequenceClassification``."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )

    from .export import hub_state_dict_pieces, hub_tensor

    native = dict(converted.model.state_dict())
    state = {key: hub_tensor(pieces, native).cpu() for key, pieces in hub_state_dict_pieces(converted).items()}
    classifier = converted.args.num_labels is not None
    model_class = (MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING if classifier else MODEL_FOR_CAUSAL_LM_MAPPING)[type(converted.config)]
    dtype = next(converted.model.parameters()).dtype
    causal_lm, info = model_class.from_pretrained(
        None, config=converted.config, state_dict=state, dtype=dtype, output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise CheckpointError(f"rebuilding {model_class.__name__} from the native weights: {problems}")
    causal_lm.to(next(converted.model.parameters()).device)
    if classifier:
        from .fallback_classifier import TransformersSequenceClassifier

        wrapper = TransformersSequenceClassifier(causal_lm)
        wrapper.args.pad_token_id = converted.args.pad_token_id
        return TransformersModel(wrapper, causal_lm.config, converted.source_dir)
    return TransformersModel(TransformersCausalLM(causal_lm), causal_lm.config, converted.source_dir)


# --- PEFT through peft --------------------------------------------------------------------------------


def native_lora_refusal(peft_config, config=None) -> str | None:
    """Why hfnative's native LoRA cannot carry ``peft_config`` (a peft config or a dict of its fields) on the
    architecture of ``config`` (when given); None when it can."""
    from hfnative.peft import lora_settings

    from .families import UnsupportedModelError, family_for_config

    try:
        lora_settings(peft_config)
        if config is not None:
            family = family_for_config(config)
            args = family.config_to_args(config)
    except (UnsupportedModelError, ValueError) as err:
        return str(err)
    if config is None:
        return None
    from types import SimpleNamespace

    from .lora_targets import expert_targets_refusal, target_parameters_refusal

    described = ConvertedModel(SimpleNamespace(args=args), config, family)  # what the refusals read: no weights
    return expert_targets_refusal(described, peft_config) or target_parameters_refusal(described, peft_config)


def peft_route_reason(model, peft_config) -> str | None:
    """Why ``peft_config`` goes through peft on transformers' module; None when hfnative's native LoRA
    implements it on ``model`` (a native ``ConvertedModel`` and a LoRA config it supports)."""
    if isinstance(model, TransformersModel):
        return f"{architecture_name(model.config)} has no native implementation"
    reason = native_lora_refusal(peft_config)
    if reason is None and isinstance(model, ConvertedModel):
        from .lora_targets import expert_targets_refusal, target_parameters_refusal

        reason = expert_targets_refusal(model, peft_config) or target_parameters_refusal(model, peft_config)
    return reason


def apply_peft(model, peft_config) -> TransformersModel:
    """peft's ``get_peft_model`` on the transformers module of ``model`` (a ``TransformersModel``, or a native
    ``ConvertedModel``, first rebuilt as its transformers class). Only the adapter's parameters train."""
    from peft import get_peft_model

    reason = peft_route_reason(model, peft_config)
    if not isinstance(model, TransformersModel):
        warn_fallback(f"{type(peft_config).__name__} on {architecture_name(model.config)}", reason)
        model = transformers_from_native(model)
    wrapper = model.model
    if wrapper.peft_model is not None:
        raise ValueError("the model already carries a PEFT adapter; merge it first or start from the base model")
    if getattr(peft_config, "task_type", None) is None:  # without it peft's forward skips prompt learning
        peft_config = copy.copy(peft_config)
        peft_config.task_type = "CAUSAL_LM"
    wrapper.attach_peft(get_peft_model(wrapper.hf_model, peft_config))
    return model


def load_peft_adapter(adapter_dir, base: TransformersModel, *, is_trainable: bool = True) -> TransformersModel:
    """A peft adapter folder (adapter_model.safetensors only) on the transformers base ``base``; with
    ``is_trainable`` its adapter (a prompt encoder too, which peft loads frozen only) keeps training."""
    from peft import PeftConfig, PeftModel

    weights = Path(adapter_dir) / "adapter_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{adapter_dir}: no adapter_model.safetensors (adapters load only from safetensors)")
    prompt_learning = PeftConfig.from_pretrained(str(adapter_dir)).is_prompt_learning
    trainable = is_trainable and not prompt_learning
    peft_model = PeftModel.from_pretrained(base.model.hf_model, str(adapter_dir), is_trainable=trainable)
    if is_trainable and prompt_learning:
        peft_model.active_peft_config.inference_mode = False
        peft_model.prompt_encoder.requires_grad_(True)
    base.model.attach_peft(peft_model)
    return base


def native_lora_from_peft_model(peft_model, *, dtype: torch.dtype | None, device):
    """A LoRA ``PeftModel`` as a native model with hfnative's LoRA: (ConvertedModel, LoraSettings), the base
    weights and the adapter copied (check ``native_lora_refusal`` first)."""
    import tempfile

    from hfnative.models.decoder import Transformer

    from .families import family_for_config, model_pieces
    from .loading import ConvertedModel, StateDictSource, check_checkpoint, copy_into_model
    from .peft import load_adapter

    config = peft_model.get_base_model().config
    family = family_for_config(config)
    args = family.config_to_args(config)
    base = hub_state_dict(peft_model.get_base_model(), set(peft_model.peft_config))
    dtype = dtype or next(iter(base.values())).dtype
    pieces = model_pieces(family, args)
    with torch.device("meta"):
        native = Transformer(args)
    check_checkpoint(StateDictSource(base), pieces, native, f"the {type(peft_model).__name__}'s base model")
    native = native.to(dtype=dtype).to_empty(device=device)
    copy_into_model(StateDictSource(base), pieces, native)
    native.init_buffers()
    converted = ConvertedModel(native, config, family, None)
    active = peft_model.active_adapter
    with tempfile.TemporaryDirectory() as tmp:
        peft_model.save_pretrained(tmp, selected_adapters=[active])  # peft's own names; read back strictly
        # peft writes an adapter other than "default" into a folder of its name
        settings = load_adapter(converted, tmp if active == "default" else f"{tmp}/{active}", is_trainable=True)
    return converted, settings


# --- resuming -----------------------------------------------------------------------------------------


def load_checkpoint_weights(wrapper: TransformersCausalLM, checkpoint: Path) -> None:
    """Resume: the weights (or the adapter) saved in ``checkpoint`` back into the live model, from
    safetensors only. Raises CheckpointError naming every missing, unexpected or mis-shaped tensor."""
    from safetensors.torch import load_file

    if wrapper.peft_model is not None:
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        path = checkpoint / "adapter_model.safetensors"
        if not path.is_file():
            raise CheckpointError(f"{checkpoint}: no adapter_model.safetensors (adapters load only from safetensors)")
        found = load_file(str(path))
        expected = get_peft_model_state_dict(wrapper.peft_model)
        _check_tensors(_shapes(found), _shapes(expected), path)
        set_peft_model_state_dict(wrapper.peft_model, found)
        return
    _check_tensors(SafetensorsSource(checkpoint).shapes, _shapes(wrapper.hub_state_dict()), checkpoint)
    causal_lm = wrapper.hf_model
    saved = type(causal_lm).from_pretrained(
        str(checkpoint), config=copy.deepcopy(causal_lm.config), dtype=next(causal_lm.parameters()).dtype,
        use_safetensors=True, trust_remote_code=False,
    )
    causal_lm.load_state_dict(saved.state_dict(), strict=True)


def _shapes(tensors: dict) -> dict:
    return {key: tuple(value.shape) for key, value in tensors.items()}


def _check_tensors(found: dict, expected: dict, where) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(f"{k}: file {list(found[k])}, model {list(v)}" for k, v in expected.items() if k in found and found[k] != v)
    kinds = (("missing tensors", missing), ("unexpected tensors", unexpected), ("tensors with the wrong shape", wrong))
    problems = [f"{label} ({len(keys)}): {keys}" for label, keys in kinds if keys]
    if problems:
        raise CheckpointError(f"{where} does not match the model:\n  " + "\n  ".join(problems))


__all__ = [
    "TransformersModel",
    "apply_peft",
    "fallback_refusal",
    "load_checkpoint_weights",
    "load_peft_adapter",
    "load_transformers_model",
    "native_lora_from_peft_model",
    "native_lora_refusal",
    "peft_route_reason",
    "wrap_transformers_model",
]
