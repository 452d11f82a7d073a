"""PEFT adapter folders (adapter_config.json + adapter_model.safetensors) and LoRA by Hub names.

``apply_lora`` puts adapters on a loaded model (which modules: ``lora_targets.plan_lora``);
``save_adapter`` writes what peft's ``save_pretrained`` writes, so ``PeftModel.from_pretrained`` loads
it; ``load_adapter`` / ``load_adapter_weights`` read a peft-saved folder back (to continue training or
to resume). A fused Hub projection's lora_B (and DoRA magnitude) is the row-wise concatenation of the
native projections' parts; their lora_A is one shared tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hfnative.peft import (
    ExpertLoraTarget,
    LoraSettings,
    add_expert_lora,
    add_lora,
    add_token_rows,
    add_trainable_copies,
    expert_lora_modules,
    has_adapters,
    lora_modules,
    lora_settings,
    mark_trainable,
    quantization_settings,
    quantize_base,
    trainable_copies,
    untie_output_head,
)

from hfnative.peft.adapters import ORIGINAL_PREFIX
from hfnative.peft.settings import _enum_value
from hfnative.peft.quantize import quantizable_linears
from hfnative.peft.token_rows import TokenRowsEmbedding

from .export import write_atomically, hub_tensor
from .loading import ConvertedModel
from .sharded_loading import copy_shard
from .lora_targets import (
    fused_expert_parameters,
    hub_modules,
    hub_parameter_pieces,
    plan_lora,
    resolved_target_modules,
    token_layer_paths,
)

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> the transformers model


# --- applying -------------------------------------------------------------------------------------------


def apply_lora(
    converted: ConvertedModel,
    settings,
    *,
    load_in_4bit: bool = False,
    quantization_config=None,
    load_in_8bit: bool = False,
    quantize_on: torch.device | None = None,
) -> list[str]:
    """Put LoRA (or DoRA) adapters on ``converted.model`` in place; returns the Hub paths adapted.

    settings: a peft.LoraConfig, a dict of its fields, or LoraSettings.
    load_in_4bit / load_in_8bit / quantization_config (BitsAndBytesConfig-shaped): a quantized frozen base (QLoRA's
    NF4, or int8 rows) - every linear except the output head, MoE routers and modules_to_save copies (or, with
    ``llm_int8_skip_modules``, every linear its patterns do not name, as transformers chooses) is stored in 4 or 8
    bits before the adapters go on (so DoRA's magnitude starts from the quantized weight, as peft does with
    bitsandbytes); ``quantize_on``: the device the quantized weights go to, each quantized there (None: where the
    model is).
    Afterwards only the adapters, modules_to_save copies and (per ``bias``) biases require grad.
    """
    settings = lora_settings(settings)
    model = converted.model
    if has_adapters(model):
        raise ValueError("the model already has LoRA adapters; merge_lora() it first or start from the base model")
    plan = plan_lora(converted, settings)
    quantization = quantization_settings(load_in_4bit, quantization_config, load_in_8bit)  # refused before any change
    if plan.untie:
        untie_output_head(model)
    add_trainable_copies(model, plan.copies)
    if quantization is not None:
        quantize_base(model, quantization, quantized_linears(converted, quantization.skip_modules), quantize_on)
    add_lora(model, plan.targets, settings)
    if plan.token_rows is not None:
        add_token_rows(model, plan.token_rows.embedding, plan.token_rows.head, plan.token_rows.head_shares,
                       upcast=settings.autocast_adapter_dtype)
    add_expert_lora(model, [ExpertLoraTarget(t.parameter.module, t.parameter.key.rpartition(".")[2],
                                             t.parameter.in_features, t.parameter.out_features,
                                             tuple(t.parameter.parts.items()), t.r, t.lora_alpha)
                            for t in plan.expert_targets], settings)
    mark_trainable(model, settings.bias, trainable=not settings.inference_mode)
    return plan.adapted + [t.parameter.key for t in plan.expert_targets]


def quantized_linears(converted: ConvertedModel, skip_modules: tuple[str, ...] | None) -> list[str] | None:
    """The native linears a quantized base stores in 4 or 8 bits when ``llm_int8_skip_modules`` names transformers'
    modules to leave alone: those whose Hub modules transformers' rule (``should_convert_module``) would convert (a
    native linear made of several Hub modules stays unquantized when any of them does); None (the default rule,
    ``quantizable_linears``) without them. The output head stays in full precision either way (the losses read its
    weight; transformers quantizes an untied lm_head that the list leaves out)."""
    if skip_modules is None:
        return None
    from transformers.quantizers.quantizers_utils import should_convert_module

    skipped = {native for path, module in hub_modules(converted).items()
               if not should_convert_module(path, list(skip_modules)) for native in module.native}
    return [name for name in quantizable_linears(converted.model) if name not in skipped]


def expert_adapter_keys(converted: ConvertedModel) -> dict[str, str]:
    """The adapters on stacked expert tensors: each tensor's key as peft saves it (without ``base_model.model.``) ->
    its native parameter name. peft wraps every targeted parameter of a module in one more ``ParamWrapper``, in the
    order the module registers them, so the first (``gate_up_proj``) lies deepest:
    ``model.layers.0.mlp.experts.base_layer.lora_A.weight`` when ``down_proj`` is adapted too (its own adapter
    ``model.layers.0.mlp.experts.lora_A.weight``)."""
    adapters = expert_lora_modules(converted.model)
    by_module: dict[str, list[tuple[str, str]]] = {}
    for key, parameter in fused_expert_parameters(converted).items():
        native = f"{parameter.module}.lora.{key.rpartition('.')[2]}"
        if native in adapters:
            by_module.setdefault(key.rpartition(".")[0], []).append((key, native))
    keys = {}
    for path, adapted in by_module.items():
        for depth, (_, native) in enumerate(reversed(adapted)):  # the last registered is the outermost wrapper
            prefix = path + ".base_layer" * depth
            for attr in ("lora_A", "lora_B"):
                keys[f"{prefix}.{attr}.weight"] = f"{native}.{attr}"
    return keys


# --- writing and reading PEFT folders ------------------------------------------------------------------


def _peft_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("peft")
    except Exception:  # peft is optional; its version is informative only
        return None


def _auto_mapping(converted: ConvertedModel, settings: LoraSettings) -> dict | None:
    if settings.task_type is not None:  # PeftModelForCausalLM records nothing
        return None
    import transformers

    architecture = (getattr(converted.config, "architectures", None) or [None])[0]
    cls = getattr(transformers, architecture, None) if architecture else None
    return {"base_model_class": architecture, "parent_library": cls.__module__ if cls else None}


def _json_list(value):
    return sorted(value) if isinstance(value, (set, list, tuple)) else value


def adapter_config(converted: ConvertedModel, settings, base_model_name_or_path: str | None = None) -> dict:
    """adapter_config.json's fields, keys and values as peft's save_pretrained writes them: the installed peft's keys
    (an older peft warns of keys it does not know; a newer one's own keys get its defaults), peft 0.22's without
    peft."""
    settings = lora_settings(settings)
    config = {
        "alora_invocation_tokens": None,
        "alpha_pattern": dict(settings.alpha_pattern),
        "arrow_config": None,
        "astra_config": None,
        "auto_mapping": _auto_mapping(converted, settings),
        "base_model_name_or_path": base_model_name_or_path,
        "bias": settings.bias,
        "corda_config": None,
        "ensure_weight_tying": False,
        "eva_config": None,
        "exclude_modules": _json_list(settings.exclude_modules),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": settings.init_lora_weights,
        "kasa_config": None,
        "layer_replication": None,
        "layers_pattern": settings.layers_pattern,
        "layers_to_transform": settings.layers_to_transform,
        "loftq_config": {},
        "lora_alpha": settings.lora_alpha,
        "lora_bias": False,
        "lora_dropout": settings.lora_dropout,
        "lora_ga_config": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": settings.modules_to_save,
        "monteclora_config": None,
        "peft_type": "LORA",
        "peft_version": _peft_version(),
        "qalora_group_size": 16,
        "r": settings.r,
        "rank_pattern": dict(settings.rank_pattern),
        "revision": None,
        "target_modules": _json_list(resolved_target_modules(converted, settings)),
        "target_parameters": _json_list(settings.target_parameters),
        "task_type": settings.task_type,
        "trainable_token_indices": settings.trainable_token_indices,
        "use_bdlora": None,
        "use_dora": settings.use_dora,
        "use_qalora": False,
        "use_rslora": settings.use_rslora,
        "velora_config": None,
    }
    if config["peft_version"] is None:
        del config["peft_version"]
    defaults = _peft_lora_defaults()
    if defaults is not None:  # the installed peft's key set: a key it does not know dropped, one hfnative does not
        # know (a LoRA variant it does not implement, so not used) written with peft's default
        config = {key: value for key, value in config.items() if key in defaults}
        for key, value in defaults.items():
            config.setdefault(key, _json_list(_enum_value(value)))  # an enum as its value, a set as a list
    return config


def _peft_lora_defaults() -> dict | None:
    """What the installed peft writes for a default ``LoraConfig`` (its ``to_dict``); None without peft."""
    try:
        from peft import LoraConfig

        return LoraConfig().to_dict()
    except Exception:  # peft is optional (and one that fails to import is no peft): hfnative's own keys are written
        return None


TOKEN_ADAPTER = ".token_adapter"  # peft's TrainableTokensWrapper: the layer whose token rows train
DELTA = TOKEN_ADAPTER + ".trainable_tokens_delta"


EMBEDDING_ROWS = "tok_embeddings.token_rows.values"  # the native parameters holding trained token rows
HEAD_ROWS = "output.token_rows.values"


def token_rows_names(converted: ConvertedModel) -> dict[str, str | None]:
    """The Hub paths of the token embedding and of the output head -> the native parameter holding the token rows each
    trains (a tied head's may be the embedding's, which it shares), or None."""
    model = converted.model
    embedding_path, head_path = token_layer_paths(converted)
    embedding = EMBEDDING_ROWS if isinstance(model.tok_embeddings, TokenRowsEmbedding) else None
    head = model.output
    head_rows = HEAD_ROWS if "token_rows" in head._modules else embedding if head.token_rows_in_use() is not None else None
    return {embedding_path: embedding, head_path: head_rows}


def _token_layers(converted: ConvertedModel, native: dict[str, torch.Tensor], copies: set[str]) -> list[dict]:
    """The token embedding and the output head as peft holds them: each one's Hub path, the path its weight sits under
    in peft's module tree (``.token_adapter.base_layer`` where its token rows train), its native weight (the trained
    copy's with modules_to_save, else the base's), its base weight (the original behind a copy), and its trained rows
    (``token_rows_names``) and whether they are its own."""
    model = converted.model
    (embedding_path, embedding_rows), (head_path, head_rows) = token_rows_names(converted).items()
    layers = [dict(path=embedding_path, weight="tok_embeddings.weight", rows=embedding_rows, own_rows=True)]
    if converted.args.num_labels is None:  # a classifier's score head is no output embedding (peft saves none)
        weight = "output.weight" if "output.weight" in native else "tok_embeddings.weight"  # tied: the embedding's
        layers.append(dict(path=head_path, weight=weight, rows=head_rows, own_rows=head_rows == HEAD_ROWS))
    for layer in layers:
        layer["inner"] = layer["path"] + (TOKEN_ADAPTER + ".base_layer" if layer["rows"] else "")
        layer["copy"] = layer["weight"] in copies
        module_name, _, attr = layer["weight"].rpartition(".")
        original = getattr(model.get_submodule(module_name), ORIGINAL_PREFIX + attr, None) if layer["copy"] else None
        layer["base"] = original if original is not None else native.get(layer["weight"])
    return layers


def _token_layer_tensors(converted: ConvertedModel, native: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                         vocabulary_changed: bool) -> None:
    """The token rows' tensors under peft's keys, a trained copy of a head whose rows train under its wrapped path,
    and (``vocabulary_changed``) every tensor of the embedding and the output head, as peft saves them then."""
    copies = {name for name, _, _ in trainable_copies(converted.model)}
    for layer in _token_layers(converted, native, copies):
        path, inner = PEFT_PREFIX + layer["path"], PEFT_PREFIX + layer["inner"]
        if layer["copy"] and inner != path:  # the copy's key moves under the wrapper
            tensors[inner + ".weight"] = tensors.pop(path + ".weight")
        if layer["rows"] is not None and (layer["own_rows"] or vocabulary_changed):
            tensors[path + DELTA] = native[layer["rows"]].detach()
        if not vocabulary_changed:
            continue
        if layer["weight"] not in native or layer["base"] is None:
            raise ValueError(f"save_adapter: the vocabulary changed, so peft saves {layer['path']} whole, and the "
                             "gathered tensors lack it: gather with adapter_tensors(model, token_layers=True)")
        tensors[inner + ".weight"] = native[layer["weight"]].detach()
        if layer["copy"]:
            tensors[inner + ".modules_to_save.weight"] = native[layer["weight"]].detach()
            tensors[inner + ".original_module.weight"] = layer["base"].detach()


def hub_adapter_state_dict(converted: ConvertedModel, bias: str = "none",
                           native_state: dict[str, torch.Tensor] | None = None,
                           vocabulary_changed: bool = False) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the keys peft saves (``base_model.model.<hub path>.lora_A.weight``,
    ``.lora_B.weight``, ``.lora_magnitude_vector``, modules_to_save and bias tensors by their Hub keys,
    biases of adapted modules as ``<path>.base_layer.bias``). native_state: the tensors by native name, when not the
    model's own parameters (a sharded model's, gathered: ``adapter_tensors``)."""
    model = converted.model
    native = native_state if native_state is not None else dict(model.named_parameters(remove_duplicate=False))
    loras = lora_modules(model)
    tensors: dict[str, torch.Tensor] = {}
    adapted_paths = set()
    for module in hub_modules(converted).values():
        parts = [loras.get(name) for name in module.native]
        if not any(parts):
            continue
        if not all(parts) or any(p.lora_A is not parts[0].lora_A for p in parts):
            raise ValueError(f"{module.path}: its native modules {module.native} do not carry one shared adapter")
        prefix = PEFT_PREFIX + module.path
        adapted_paths.add(module.path)
        tensors[f"{prefix}.lora_A.weight"] = native[f"{module.native[0]}.lora_A"].detach()
        tensors[f"{prefix}.lora_B.weight"] = torch.cat([native[f"{name}.lora_B"].detach() for name in module.native])
        if parts[0].lora_magnitude_vector is not None:
            tensors[f"{prefix}.lora_magnitude_vector"] = torch.cat(
                [native[f"{name}.lora_magnitude_vector"].detach() for name in module.native])
    for key, name in expert_adapter_keys(converted).items():
        tensors[PEFT_PREFIX + key] = native[name].detach()

    copies = {name for name, _, _ in trainable_copies(model)}
    for hf_key, pieces in hub_parameter_pieces(converted).items():
        natives = [p.native_key for p in pieces]
        if not all(n in native for n in natives):
            continue  # a tied head that was never untied
        is_copy = all(n in copies for n in natives)
        path, _, leaf = hf_key.rpartition(".")
        is_bias = leaf == "bias" and (bias == "all" or (bias == "lora_only" and path in adapted_paths))
        if not (is_copy or is_bias):
            continue
        key = f"{path}.base_layer.{leaf}" if (path in adapted_paths and not is_copy) else hf_key
        tensors[PEFT_PREFIX + key] = hub_tensor(pieces, native)
    _token_layer_tensors(converted, native, tensors, vocabulary_changed)
    saved, seen = {}, set()
    for key, value in tensors.items():
        value = value.to("cpu").contiguous()
        if value.untyped_storage().data_ptr() in seen:  # one tensor under two keys (a copy, and under the wrapper)
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        saved[key] = value
    return saved


def adapter_tensors(model, token_layers: bool = False) -> dict[str, torch.Tensor]:
    """What an adapter folder is made of (``hub_adapter_state_dict``'s ``native_state``) from a model whose
    parameters are sharded (DTensors): the adapters' and every trainable tensor (trainable copies, trained biases,
    token rows) gathered whole one at a time, by native name, on the CPU; with ``token_layers`` (the vocabulary
    changed: ``saves_token_layers``) the embedding's and the head's weights too. Every rank calls it, in the same
    order; only the tensors it names are gathered, never the rest of the frozen base."""
    from hfnative.parallel.replica import whole_tensor

    layers = ("tok_embeddings.weight", "output.weight") if token_layers else ()
    return {name: whole_tensor(param.detach()).cpu() for name, param in model.named_parameters(remove_duplicate=False)
            if param.requires_grad or ".lora_" in name or ".token_rows." in name or name in layers}


def saves_token_layers(converted: ConvertedModel, base_model_name_or_path: str | None) -> bool:
    """Whether ``save_adapter`` writes the embedding and the head whole: peft's save_embedding_layers="auto", when the
    model's vocabulary differs from its base model's config.json (``base_model_name_or_path``; None: the folder the
    model came from). The base's config is read from its folder or the local Hub cache; where neither has it, peft
    assumes the vocabulary unchanged, and so does this."""
    if base_model_name_or_path is None and converted.source_dir is not None:
        base_model_name_or_path = str(converted.source_dir)
    if not base_model_name_or_path:
        return False
    path = Path(base_model_name_or_path) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(base_model_name_or_path), "config.json")
        except Exception:  # not a Hub id
            return False
        if not isinstance(cached, str):
            return False
        path = Path(cached)
    try:
        base = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    base = base.get("text_config", base) if "vocab_size" not in base else base
    vocab = getattr(converted.config.get_text_config(), "vocab_size", None)
    return base.get("vocab_size") is not None and vocab is not None and base["vocab_size"] != vocab


def save_adapter(
    converted: ConvertedModel,
    out_dir: str | os.PathLike,
    settings,
    base_model_name_or_path: str | None = None,
    native_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a PEFT adapter folder that ``PeftModel.from_pretrained(base, out_dir)`` loads.

    base_model_name_or_path: recorded in adapter_config.json; None -> the folder the model came from.
    native_state: a sharded model's adapter tensors, gathered (``adapter_tensors``); None: the model's parameters.
    """
    from safetensors.torch import save_file

    settings = lora_settings(settings)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if base_model_name_or_path is None and converted.source_dir is not None:
        base_model_name_or_path = str(converted.source_dir)
    loras = lora_modules(converted.model)
    if not has_adapters(converted.model):
        raise ValueError("the model has no LoRA adapters to save; call apply_lora() first")
    plan = plan_lora(converted, settings)
    planned = {n for target in plan.targets for n in target.modules}
    planned_experts = {f"{t.parameter.module}.lora.{t.parameter.key.rpartition('.')[2]}" for t in plan.expert_targets}
    if planned_experts != set(expert_lora_modules(converted.model)):
        raise ValueError(
            "save_adapter: the settings' target_parameters do not describe the model's adapters on stacked experts "
            f"({sorted(planned_experts)[:3]} against {sorted(expert_lora_modules(converted.model))[:3]}); pass the "
            "settings given to apply_lora")
    if planned != set(loras):
        raise ValueError(
            "save_adapter: the settings do not describe the model's adapters (they would target "
            f"{sorted(planned - set(loras))[:5]} and leave out {sorted(set(loras) - planned)[:5]}); "
            "pass the settings given to apply_lora"
        )
    config = adapter_config(converted, settings, base_model_name_or_path)
    tensors = hub_adapter_state_dict(converted, settings.bias, native_state,
                                     saves_token_layers(converted, base_model_name_or_path))
    write_atomically(out_dir / ADAPTER_WEIGHTS_NAME, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    write_atomically(out_dir / ADAPTER_CONFIG_NAME, lambda tmp: tmp.write_text(text))
    return out_dir


def peft_module_key(key: str) -> str:
    """A key of peft's module tree as the Hub model's: the wrappers' segments dropped (``.base_layer``,
    ``.token_adapter``, ``.modules_to_save``, ``.original_module``), nested ones too."""
    while True:
        plain = key
        for wrapper in (".base_layer.", TOKEN_ADAPTER + ".", ".modules_to_save.", ".original_module."):
            plain = plain.replace(wrapper, ".")
        if plain == key:
            return key
        key = plain


def saved_vocabulary(converted: ConvertedModel, adapter_dir: str | os.PathLike) -> int | None:
    """The rows of the token embedding an adapter folder holds whole (peft saves it so when training changed the
    vocabulary), or None."""
    from safetensors import safe_open

    path = Path(adapter_dir) / ADAPTER_WEIGHTS_NAME
    if not path.is_file():
        return None
    embedding = token_layer_paths(converted)[0] + ".weight"
    with safe_open(str(path), "pt") as saved:
        for key in saved.keys():
            if peft_module_key(key.removeprefix(PEFT_PREFIX)) == embedding:
                return saved.get_slice(key).get_shape()[0]
    return None


def read_adapter_config(adapter_dir: str | os.PathLike) -> LoraSettings:
    path = Path(adapter_dir) / ADAPTER_CONFIG_NAME
    if not path.exists():
        raise FileNotFoundError(f"{adapter_dir}: no {ADAPTER_CONFIG_NAME}; is this a PEFT adapter folder?")
    return lora_settings(json.loads(path.read_text()))


def load_adapter_weights(converted: ConvertedModel, adapter_dir: str | os.PathLike) -> None:
    """Copy a PEFT adapter's tensors into a model that already carries the matching adapters (e.g. on
    resume; a sharded model's adapters each take their own rows). Raises ValueError naming any key that maps nowhere
    or any adapter tensor left unset."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / ADAPTER_WEIGHTS_NAME
    if not path.exists():
        raise FileNotFoundError(f"{adapter_dir}: no {ADAPTER_WEIGHTS_NAME} (hfnative reads adapters only from safetensors)")
    state = load_file(str(path))
    model = converted.model
    modules = hub_modules(converted)
    pieces_of = hub_parameter_pieces(converted)
    loras = lora_modules(model)
    expert_keys = expert_adapter_keys(converted)
    params = dict(model.named_parameters(remove_duplicate=False))
    written, unexpected, wrong_shape = set(), [], []
    copies = {name: (module, attr) for name, module, attr in trainable_copies(model)}
    rows_of = token_rows_names(converted)

    def put(native_name: str, value: torch.Tensor, key: str, original: bool = False):
        if original and native_name in copies:  # the weight behind a trained copy (peft's original_module)
            module, attr = copies[native_name]
            target = getattr(module, ORIGINAL_PREFIX + attr)
            if tuple(target.shape) != tuple(value.shape):
                wrong_shape.append(f"{key}: adapter {list(value.shape)}, model {list(target.shape)}")
            else:
                target.copy_(value)
            return
        target = params.get(native_name)
        if target is None and native_name == "output.weight" and model.output.is_tied:
            return  # a tied head's weight: the embedding's, which its own key sets
        if target is None:
            unexpected.append(key)
        elif tuple(target.shape) != tuple(value.shape):
            wrong_shape.append(f"{key}: adapter {list(value.shape)}, model {list(target.shape)}")
        else:
            copy_shard(target, value)  # a sharded adapter (DTensor) takes its rows only
            written.add(native_name)

    with torch.no_grad():
        for key, value in state.items():
            hub_key = key.removeprefix(PEFT_PREFIX)
            if hub_key in expert_keys:
                put(expert_keys[hub_key], value, key)
                continue
            lora_kind = next((k for k in (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector") if hub_key.endswith(k)), None)
            if lora_kind is not None:
                module = modules.get(hub_key[: -len(lora_kind)])
                if module is None or not all(n in loras for n in module.native):
                    unexpected.append(key)
                    continue
                attr = lora_kind.split(".")[1]
                for name, rows in zip(module.native, module.rows):
                    part = value if attr == "lora_A" or rows is None else value[rows[0] : rows[1]]
                    put(f"{name}.{attr}", part, key)
                continue
            if hub_key.endswith(DELTA):  # trained token rows: a layer's own, or the embedding's a tied head shares
                native_name = rows_of.get(hub_key[: -len(DELTA)])
                if native_name is None:
                    unexpected.append(key)
                else:
                    put(native_name, value, key)
                continue
            original = ".original_module." in hub_key
            hub_key = peft_module_key(hub_key)
            pieces = pieces_of.get(hub_key)
            if pieces is None or any(p.native_index is not None for p in pieces):
                unexpected.append(key)
                continue
            for piece in pieces:
                rows = piece.hf_rows
                put(piece.native_key, value if rows is None else value[rows[0] : rows[1]], key, original)
    expected = {f"{name}.{attr}" for name, m in loras.items() for attr in ("lora_A", "lora_B", "lora_magnitude_vector") if getattr(m, attr) is not None}
    expected |= set(copies) | set(expert_keys.values()) | {name for name in params if ".token_rows." in name}
    missing = sorted(expected - written)
    problems = []
    if unexpected:
        problems.append(f"tensors that match no adapted module ({len(unexpected)}): {sorted(unexpected)[:10]}")
    if wrong_shape:
        problems.append(f"tensors with the wrong shape ({len(wrong_shape)}): {wrong_shape[:10]}")
    if missing:
        problems.append(f"adapter tensors the file does not set ({len(missing)}): {missing[:10]}")
    if problems:
        raise ValueError(f"{path} does not match the model's adapters:\n  " + "\n  ".join(problems))


def load_adapter(
    converted: ConvertedModel,
    adapter_dir: str | os.PathLike,
    *,
    is_trainable: bool = True,
    load_in_4bit: bool = False,
    quantization_config=None,
    load_in_8bit: bool = False,
    quantize_on: torch.device | None = None,
) -> LoraSettings:
    """Apply the adapter described by a PEFT folder's adapter_config.json and load its weights; returns
    its settings (to continue training with, and to save with). is_trainable=False freezes it (peft's
    default for PeftModel.from_pretrained)."""
    settings = read_adapter_config(adapter_dir)
    settings.inference_mode = not is_trainable
    rows = saved_vocabulary(converted, adapter_dir)
    if rows is not None and rows != converted.model.tok_embeddings.weight.shape[0]:
        # the folder holds the resized embedding (a cloned chat template added tokens): the base takes its rows
        from hfnative.models.vocabulary import resize_vocabulary

        resize_vocabulary(converted.model, rows)
        converted.config.get_text_config().vocab_size = rows
    apply_lora(converted, settings, load_in_4bit=load_in_4bit, quantization_config=quantization_config,
               load_in_8bit=load_in_8bit, quantize_on=quantize_on)
    load_adapter_weights(converted, adapter_dir)
    return settings


__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "adapter_config",
    "apply_lora",
    "expert_adapter_keys",
    "hub_adapter_state_dict",
    "load_adapter",
    "load_adapter_weights",
    "read_adapter_config",
    "save_adapter",
    "saves_token_layers",
    "token_rows_names",
]
