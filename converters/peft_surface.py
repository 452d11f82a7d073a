"""peft's names over a native model with LoRA: what ``trainer.model`` is when a trainer adapts the model.

With ``peft_config``, TRL's ``trainer.model`` is a peft ``PeftModel`` over a transformers model, and code
written for it selects parameters and modules by those names:
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``, ``...q_proj.base_layer.weight``,
``base_model.model.lm_head.modules_to_save.default.weight``. hfnative trains a native module whose own
names are ``layers.0.attention.wq.lora_A``; the engine, its parallel plans and its checkpoints keep those.

``peft_surface(model)`` is a real peft ``PeftModel`` (``isinstance(surface, PeftModel)`` holds; its class, a
subclass of peft's for the task, has peft's class name, ``PeftModelForCausalLM``, which transformers' pipelines
read) built with the model's transformers config on the meta device and the same adapter settings, so its module tree,
``named_modules``, ``named_parameters``, ``get_parameter``, ``get_submodule`` and ``state_dict`` keys are
exactly peft's. Its tensors are the native model's:

- a tensor the Hub stores as the native one is (most weights, every lora_A, the lora_B and magnitude of an
  unfused projection, modules_to_save copies and their originals) is the native ``Parameter`` itself:
  updated in place by training, its ``.grad`` the engine's;
- a tensor the Hub stores fused, stacked or re-laid out (Phi-3's ``qkv_proj``, the lora_B over it,
  transformers 5's fused MoE experts) is assembled from the native tensors whenever it is read through the
  surface after the weights changed: a copy with the current values, which writes do not reach.

Calling the surface runs the native model's forward; ``save_pretrained`` / ``push_to_hub`` write the PEFT
adapter folder, ``generate``, ``disable_adapter()`` and ``merge_and_unload()`` act on the native model, and
any other attribute the native model has (``config``, ``generation_config``, ``lm_head``, ...) is its.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from hfnative.models.classifier import SequenceClassifier
from hfnative.peft import has_adapters, lora_modules
from hfnative.peft.adapters import ORIGINAL_PREFIX

from .export import hub_tensor
from .hub_model import _weights_version
from .lora_targets import hub_modules, hub_parameter_pieces, plan_lora
from .peft import DELTA, PEFT_PREFIX, expert_adapter_keys, peft_module_key, token_rows_names

_LORA_KINDS = ("lora_A", "lora_B", "lora_magnitude_vector")


def _is_plain(pieces) -> bool:
    """One piece that is the native tensor as it is (no row slice, expert slice or re-layout)."""
    if len(pieces) != 1:
        return False
    p = pieces[0]
    return p.hf_rows is None and p.native_index is None and p.interleaved is None and not p.transposed


class _Source:
    """Where one peft tensor comes from: a native tensor (``native``) or a function assembling it."""

    __slots__ = ("native", "assemble", "requires_grad")

    def __init__(self, native=None, assemble=None, requires_grad=False):
        self.native, self.assemble, self.requires_grad = native, assemble, requires_grad


class PeftSurface:
    """The behaviour added to the peft model class (see the module docstring); ``native_model`` is the
    module that trains."""

    # --- the tensors -----------------------------------------------------------------------------

    def _native_tensors(self) -> dict[str, torch.Tensor]:
        model = self.__dict__["native_model"]
        tensors = dict(model.named_buffers(remove_duplicate=False))
        tensors.update(model.named_parameters(remove_duplicate=False))
        return tensors

    def _sync(self) -> None:
        """Put the native tensors (and the assembled ones, recomputed) in the peft modules' places."""
        state = self.__dict__
        version = _weights_version(self.__dict__["native_model"])
        if state.get("_synced_version") == version:
            return
        tensors = self._native_tensors()
        wrapped = state.setdefault("_wrapped", {})  # buffer -> the Parameter sharing its storage
        runtime = {}
        for name, source in state["_sources"].items():
            if source.native is not None:
                value = tensors[source.native] if source.native in tensors else _attribute(self.native_model, source.native)
                if not isinstance(value, nn.Parameter):
                    key = (id(value), value.data_ptr())
                    if key not in wrapped:
                        wrapped[key] = nn.Parameter(value, requires_grad=False)
                    value = wrapped[key]
            else:
                value = nn.Parameter(source.assemble(tensors, runtime), requires_grad=source.requires_grad)
            for module, leaf in state["_slots"][name]:
                module._parameters[leaf] = value
        state["_synced_version"] = version

    # --- nn.Module's name surface, synchronized first --------------------------------------------

    def named_parameters(self, *args, **kwargs):
        self._sync()
        return super().named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        self._sync()
        return super().named_buffers(*args, **kwargs)

    def named_modules(self, *args, **kwargs):
        self._sync()
        return super().named_modules(*args, **kwargs)

    def named_children(self):
        self._sync()
        return super().named_children()

    def get_parameter(self, target: str):
        self._sync()
        return super().get_parameter(target)

    def get_submodule(self, target: str):
        self._sync()
        return super().get_submodule(target)

    def state_dict(self, *args, **kwargs):
        self._sync()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("load_state_dict(assign=True) on a LoRA trainer's model: the tensors are the native "
                             "model's; copy values in (assign=False)")
        self._sync()
        return super().load_state_dict(state_dict, strict=strict)

    # --- what runs: the native model --------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.native_model(*args, **kwargs)

    def train(self, mode: bool = True):
        self.native_model.train(mode)
        nn.Module.train(self, mode)
        return self

    def _apply(self, fn, recurse: bool = True):
        self.native_model._apply(fn, recurse)
        self.__dict__.pop("_synced_version", None)
        return self

    def generate(self, *args, **kwargs):
        return self.native_model.generate(*args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        return self.native_model.save_pretrained(save_directory, *args, **kwargs)

    def push_to_hub(self, repo_id: str, *args, **kwargs):
        return self.native_model.push_to_hub(repo_id, *args, **kwargs)

    @contextlib.contextmanager
    def disable_adapter(self):
        with self.native_model.disable_adapter():
            yield

    def merge_and_unload(self, *args, **kwargs):
        """Fold the adapters into the native model's weights and return it (peft's merge_and_unload);
        this surface has no adapters to show afterwards."""
        from hfnative.peft import merge_lora

        return merge_lora(self.native_model)

    def gradient_checkpointing_enable(self, *args, **kwargs):
        return self.native_model.gradient_checkpointing_enable(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
        native = self.__dict__.get("native_model")
        if native is not None and name not in ("base_model", "peft_config"):
            try:
                return getattr(native, name)
            except AttributeError:
                pass
        return super().__getattr__(name)  # peft: the LoraModel, then the transformers model

    def __repr__(self) -> str:
        return f"{type(self).__name__}(native_model={type(self.native_model).__name__}, names=peft's)"


def _attribute(root: nn.Module, dotted: str):
    module_name, _, leaf = dotted.rpartition(".")
    return getattr(root.get_submodule(module_name) if module_name else root, leaf)


def _peft_config(settings, adapted: list[str], parameters: list[str]):
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.lora_alpha,
        target_modules=list(adapted),  # exact module paths: peft takes them as they are
        target_parameters=list(parameters) or None,  # exact parameter keys likewise
        lora_dropout=settings.lora_dropout,
        bias=settings.bias,
        use_rslora=settings.use_rslora,
        use_dora=settings.use_dora,
        modules_to_save=list(settings.modules_to_save) if settings.modules_to_save else None,
        rank_pattern=dict(settings.rank_pattern),
        alpha_pattern=dict(settings.alpha_pattern),
        task_type=settings.task_type,
        trainable_token_indices=settings.trainable_token_indices,
    )


def _meta_peft_model(converted, settings, adapted: list[str], parameters: list[str]):
    """The transformers model for ``converted.config`` on the meta device, with peft's LoRA on it."""
    import warnings

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    classifier = isinstance(converted.model, SequenceClassifier)
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = auto.from_config(converted.config)
        return get_peft_model(hf_model, _peft_config(settings, adapted, parameters))


def _runtime_parameters(converted):
    """transformers' own parameters (its runtime names, e.g. 5.x's fused MoE experts) built from the native
    model's current unmerged weights."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )

    model = converted.model
    mapping = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING if isinstance(model, SequenceClassifier) else MODEL_FOR_CAUSAL_LM_MAPPING
    config = converted.config
    hf_model = mapping[type(config)].from_pretrained(None, config=config, state_dict=model.hub_state_dict(merge_adapters=False),
                                                     dtype=model.dtype)
    return dict(hf_model.named_parameters(remove_duplicate=False))


def _sources(converted, peft_names: dict[str, torch.Tensor]) -> dict[str, _Source]:
    """peft name -> _Source for every tensor of the peft model."""
    model = converted.model
    pieces_of = hub_parameter_pieces(converted)
    modules = hub_modules(converted)
    loras = lora_modules(model)
    buffers = dict(model.named_buffers(remove_duplicate=False))

    def from_pieces(pieces, originals: bool = False) -> _Source:
        def name_of(piece):
            return _original_name(piece.native_key) if originals else piece.native_key

        if _is_plain(pieces):
            return _Source(native=name_of(pieces[0]))
        renamed = [dataclasses.replace(p, native_key=name_of(p)) for p in pieces]
        return _Source(assemble=lambda tensors, runtime: hub_tensor(renamed, tensors).clone())

    def runtime_tensor(name):
        def assemble(tensors, runtime):
            if not runtime:
                runtime.update(_runtime_parameters(converted))
            return runtime[name].detach().clone()

        return _Source(assemble=assemble)

    expert_keys = expert_adapter_keys(converted)
    rows_of = token_rows_names(converted)
    sources = {}
    for full, meta in peft_names.items():
        name = full.removeprefix(PEFT_PREFIX)
        kind = next((k for k in _LORA_KINDS if f".{k}.default." in name or name.endswith(f".{k}.default")), None)
        if kind is not None and name.replace(f".{kind}.default", f".{kind}") in expert_keys:
            source = _Source(native=expert_keys[name.replace(f".{kind}.default", f".{kind}")])
            source.requires_grad = True
        elif kind is not None:
            path = name.split(f".{kind}.default")[0]
            parts = [loras[n] for n in modules[path].native]
            names = [f"{n}.{kind}" for n in modules[path].native]
            if kind == "lora_A" or len(parts) == 1:
                source = _Source(native=names[0])
            else:
                source = _Source(assemble=lambda tensors, runtime, names=names: torch.cat([tensors[n].detach() for n in names]))
            source.requires_grad = True
        elif DELTA + ".default" in name:  # trained token rows: a layer's own, or the embedding's a tied head shares
            source = _Source(native=rows_of[name.split(DELTA)[0]])
            source.requires_grad = True
        elif ".modules_to_save.default." in name:
            source = from_pieces(pieces_of[peft_module_key(name.replace(".modules_to_save.default.", "."))])
            source.requires_grad = True
        elif ".original_module." in name:
            pieces = pieces_of[peft_module_key(name)]
            has_original = all(_original_name(p.native_key) in buffers for p in pieces)
            source = from_pieces(pieces, originals=has_original)
        else:
            hub_key = peft_module_key(name)  # under nested wrappers too (stacked expert tensors, a head's token rows)
            source = from_pieces(pieces_of[hub_key]) if hub_key in pieces_of else runtime_tensor(hub_key)
            source.requires_grad = bool(meta.requires_grad)
        sources[full] = source
    return sources


def _original_name(native_key: str) -> str:
    """The buffer holding a trainable copy's original tensor (hfnative.peft.adapters.add_trainable_copies)."""
    module_name, _, attr = native_key.rpartition(".")
    return f"{module_name}.{ORIGINAL_PREFIX}{attr}" if module_name else ORIGINAL_PREFIX + attr


def peft_surface(converted, settings) -> nn.Module:
    """The peft-named model over ``converted.model``, a native model that carries the LoRA adapters that
    ``settings`` describes (see the module docstring). Built once per model and kept on it."""
    model = converted.model
    cached = model.__dict__.get("_peft_surface")
    if cached is not None:
        return cached
    if not has_adapters(model):
        raise ValueError("peft_surface(): the model has no LoRA adapters")
    plan = plan_lora(converted, settings)
    skeleton = _meta_peft_model(converted, settings, plan.adapted, [t.parameter.key for t in plan.expert_targets])
    slots: dict[str, list[tuple[nn.Module, str]]] = {}
    peft_names = {}
    for module_name, module in skeleton.named_modules(remove_duplicate=False):
        for leaf, param in list(module._parameters.items()):
            if param is None:
                continue
            full = f"{module_name}.{leaf}" if module_name else leaf
            peft_names.setdefault(full, param)
            slots.setdefault(full, []).append((module, leaf))
    # tied tensors share one source: every name of one meta Parameter fills its slots together
    by_param: dict[int, str] = {}
    for full, param in list(peft_names.items()):
        first = by_param.setdefault(id(param), full)
        if first != full:
            slots[first] += slots.pop(full)
            del peft_names[full]
    cls = type(skeleton)
    skeleton.__class__ = type(cls.__name__, (PeftSurface, cls), {"__module__": __name__, "__qualname__": cls.__name__})
    skeleton.__dict__.update(native_model=model, _sources=_sources(converted, peft_names), _slots=slots)
    skeleton.train(model.training)
    model.__dict__["_peft_surface"] = skeleton
    return skeleton


def peft_surface_or_none(converted, settings) -> nn.Module | None:
    """``peft_surface``, or None where there is none to build: peft is not installed, or the model is a
    pipeline stage (it holds some layers only, so the names of the whole model do not apply)."""
    import importlib.util

    from hfnative.parallel.pipeline import BlockOnAnotherStage

    model = converted.model
    if "_peft_surface" in model.__dict__:
        return model.__dict__["_peft_surface"]
    if importlib.util.find_spec("peft") is None:
        return None

    if any(isinstance(block, BlockOnAnotherStage) for block in model.layers):
        return None
    return peft_surface(converted, settings)


__all__ = ["PeftSurface", "peft_surface", "peft_surface_or_none"]
