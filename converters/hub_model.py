"""transformers' model surface on the models hfnative trains.

Code written for TRL and transformers (callbacks, scripts, tests) treats ``trainer.model`` as a
transformers ``PreTrainedModel``: it reads ``config`` and ``generation_config``, adds model tags,
calls ``generate``, ``save_pretrained``, ``push_to_hub``, ``num_parameters``, rebuilds the model as
``type(model)(model.config)`` and loads ``model.state_dict()`` into it (TRL's BEMA callback). With
adapters it calls peft's ``print_trainable_parameters`` and ``disable_adapter()``.

``HubModelMixin`` gives a model those names without changing what trains: parameters, their names
and the forward stay the engine's. ``state_dict()`` / ``named_parameters()`` use hfnative's native
key names (``layers.0.attention.wq.weight``); Hub names appear only in what is written out
(``save_pretrained``, ``hub_state_dict()``). A round trip ``type(model)(model.config)`` +
``load_state_dict(model.state_dict())`` works because both sides use the native names.

``generate`` runs transformers' generation on the current weights: a transformers model is built
over the Hub-format tensors (LoRA merged, views of the live weights where the layouts agree) and
kept until the weights change or a training forward runs.

A model with a transformers config has the class name transformers gives its architecture
(``Qwen3ForCausalLM``, ``LlamaForSequenceClassification``): a subclass of ``NativeCausalLM`` /
``NativeSequenceClassifier`` of that name, defined in this module. transformers reads a model's
class name where it checks what a model is: a ``pipeline`` logs an error for a name not among its
task's models, and its Trainer asks ``_get_name()``.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import tempfile
from pathlib import Path

import torch
from torch import nn

from hfnative.models.args import ModelArgs
from hfnative.models.classifier import SequenceClassifier
from hfnative.models.decoder import Transformer
from hfnative.peft.adapters import disable_adapters, has_adapters

from .families import family_for_config
from .loading import ConvertedModel

logger = logging.getLogger(__name__)


def _weights_version(model: nn.Module) -> tuple:
    """Changes whenever a parameter is replaced or updated in place (an optimizer step, a load)."""
    return tuple((id(p), p._version) for p in model.parameters())


class HubModelMixin(metaclass=abc.ABCMeta):
    """The transformers-facing names of a trainable causal LM (see the module docstring).

    A class using it provides ``config`` and implements ``_generation_model()`` (a transformers
    model on the current weights) and ``_save_hub_folder(directory, max_shard_size)``."""

    config = None
    generation_config = None
    model_tags: list[str] | None = None
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _adapter_settings = None  # LoRA settings when adapters are on
    _base_model_name_or_path: str | None = None

    # --- identity and size ---------------------------------------------------------------------

    @property
    def name_or_path(self) -> str | None:
        return getattr(self.config, "_name_or_path", None)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(p for p in self.parameters() if p.is_floating_point()).dtype

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Tags written into the model card on save (transformers keeps them in ``model_tags``)."""
        tags = [tags] if isinstance(tags, str) else list(tags)
        self.model_tags = list(self.model_tags or [])
        self.model_tags += [tag for tag in tags if tag not in self.model_tags]

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
        unique = {id(p): p for p in self.parameters() if id(p) not in embeddings}.values()
        return sum(p.numel() for p in unique if p.requires_grad or not only_trainable)

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) parameter counts, as peft's PeftModel reports them."""
        return self.num_parameters(only_trainable=True), self.num_parameters()

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}")

    def can_generate(self) -> bool:
        return True

    @property
    def base_model(self) -> nn.Module:
        return self

    @property
    def lm_head(self) -> nn.Module:
        """The vocabulary projection, as transformers' ``model.lm_head``: ``get_output_embeddings()`` (weight
        [vocab, hidden], the input embedding's parameter itself when the model ties them; called on hidden
        states it gives the logits, soft-capped where the model soft-caps them)."""
        head = self.get_output_embeddings()
        if head is None:
            raise AttributeError(f"{type(self).__name__} has no lm_head (its head is not a vocabulary projection)")
        return head

    # --- adapters --------------------------------------------------------------------------------

    @property
    def active_adapters(self) -> list[str]:
        return ["default"] if self._has_adapters() else []

    def _has_adapters(self) -> bool:
        return has_adapters(self)

    @contextlib.contextmanager
    def disable_adapter(self):
        """Run the base model inside the block (peft's ``PeftModel.disable_adapter()``)."""
        if not self._has_adapters():
            raise ValueError("disable_adapter(): the model has no adapters (it was not given a peft_config)")
        with disable_adapters(self):
            yield

    # --- gradient checkpointing (transformers' switches over hfnative's activation checkpointing) --

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self, "checkpointed_layers", ()))

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        from hfnative.parallel import apply_activation_checkpointing

        apply_activation_checkpointing(self, "full")

    def gradient_checkpointing_disable(self) -> None:
        self.checkpointed_layers = frozenset()

    # --- generation ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, *args, **kwargs):
        """transformers' ``generate`` (same arguments and outputs) on the current weights."""
        model = self._generation_model()
        if self.generation_config is not None:  # this model's, as set now (the copy may be older than a change)
            model.generation_config = self.generation_config
        return model.generate(*args, **kwargs)

    @abc.abstractmethod
    def _generation_model(self) -> nn.Module:
        """A transformers model holding the current weights, which ``generate`` runs."""

    # --- saving ----------------------------------------------------------------------------------

    def save_pretrained(self, save_directory, is_main_process: bool = True, push_to_hub: bool = False,
                        max_shard_size: int | str = "5GB", **kwargs) -> None:
        """A Hub-format folder (or a PEFT adapter folder when adapters are on) that transformers / peft load."""
        if kwargs.get("state_dict") is not None:
            raise ValueError("save_pretrained(state_dict=...) is not supported: the model's own weights are written")
        if not is_main_process:
            return
        directory = Path(save_directory)
        self._save_hub_folder(directory, max_shard_size)
        if self.generation_config is not None and not self._has_adapters():
            self.generation_config.save_pretrained(str(directory))
        if push_to_hub:
            self.push_to_hub(kwargs.get("repo_id") or directory.name, token=kwargs.get("token"),
                             private=kwargs.get("private"), commit_message=kwargs.get("commit_message"))

    @abc.abstractmethod
    def _save_hub_folder(self, directory: Path, max_shard_size) -> None:
        """Write the model's Hub-format folder (or adapter folder) into ``directory``."""

    def push_to_hub(self, repo_id: str, commit_message: str | None = None, private: bool | None = None,
                    token: str | bool | None = None, revision: str | None = None, create_pr: bool = False, **kwargs):
        """Upload what ``save_pretrained`` writes to the Hub repository ``repo_id`` (created if needed)."""
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, max_shard_size=kwargs.get("max_shard_size", "5GB"))
            return api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message or "Upload model",
                                     revision=revision, create_pr=create_pr)


class NativeCausalLM(HubModelMixin, Transformer):
    """hfnative's decoder with transformers' model surface. ``NativeCausalLM(config)`` builds one from a
    transformers config (random initialization), as ``AutoModelForCausalLM.from_config`` does."""

    def __init__(self, config):
        if isinstance(config, ModelArgs):
            Transformer.__init__(self, config)
            return
        family = family_for_config(config)
        Transformer.__init__(self, family.config_to_args(config))
        self.init_weights(std=getattr(config, "initializer_range", 0.02))
        attach_hub_surface(self, ConvertedModel(self, config, family))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok_embeddings

    def get_output_embeddings(self) -> nn.Module:
        """The head (hfnative.models.head.OutputHead): nn.Linear's ``weight`` [V, D], ``bias`` None,
        ``in_features``, ``out_features``; ``head(hidden_BSD)`` is the logits."""
        return self.output

    def forward(self, *args, **kwargs):
        if self.training:  # the weights are about to change: a generation copy would be stale
            self.__dict__.pop("_generation_copy", None)
        return super().forward(*args, **kwargs)

    def hub_state_dict(self, merge_adapters: bool = True) -> dict[str, torch.Tensor]:
        """The weights under their Hub checkpoint names (adapters folded in when ``merge_adapters``);
        tensors that need no reshaping are views of the live parameters."""
        from .export import hub_state_dict_pieces, hub_tensor, merged_native_state

        native = merged_native_state(self) if merge_adapters else dict(self.state_dict())
        converted = self.__dict__.get("_hub_converted")
        if converted is None:
            raise ValueError("this model was given as a bare hfnative Transformer, with no transformers config: it has no Hub layout")
        return {key: hub_tensor(pieces, native) for key, pieces in hub_state_dict_pieces(converted).items()}

    def _generation_model(self) -> nn.Module:
        version = _weights_version(self)
        cached = self.__dict__.get("_generation_copy")
        if cached is not None and cached[0] == version:
            return cached[1]
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = self.config
        if config is None or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"generate(): no transformers causal-LM class for {type(config).__name__}")
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        self.__dict__.pop("_generation_copy", None)
        model = model_class.from_pretrained(None, config=config, state_dict=self.hub_state_dict(), dtype=self.dtype)
        model.to(self.device).eval()
        if self.generation_config is not None:
            model.generation_config = self.generation_config
        self.__dict__["_generation_copy"] = (version, model)  # not a submodule: no parameters of ours
        return model

    def _save_hub_folder(self, directory: Path, max_shard_size) -> None:
        from .export import export_hf

        converted = self.__dict__.get("_hub_converted")
        if converted is None:
            raise ValueError("save_pretrained(): this model was given as a bare hfnative Transformer, with no transformers config")
        if self._has_adapters():
            from .peft import save_adapter

            save_adapter(converted, directory, self._adapter_settings,
                         base_model_name_or_path=self._base_model_name_or_path)
        else:
            export_hf(converted, directory, max_shard_size=max_shard_size)


class NativeSequenceClassifier(NativeCausalLM, SequenceClassifier):
    """hfnative's sequence classifier (a reward model) with transformers' model surface; saved as a
    ``*ForSequenceClassification`` folder. ``NativeSequenceClassifier(config)`` builds one from a sequence-
    classification config (random initialization), as ``AutoModelForSequenceClassification.from_config`` does."""

    def __init__(self, config):
        if isinstance(config, ModelArgs):
            SequenceClassifier.__init__(self, config)
            return
        from .loading import classifier_config, model_args

        family = family_for_config(config)
        config = classifier_config(config, family)
        SequenceClassifier.__init__(self, model_args(family, config))
        self.init_weights(std=getattr(config.get_text_config(), "initializer_range", 0.02))
        attach_hub_surface(self, ConvertedModel(self, config, family))

    def forward(self, *args, **kwargs):
        if self.config is not None:  # pooled at config.pad_token_id, which callers set as with transformers' models
            self.args.pad_token_id = self.config.get_text_config().pad_token_id
        return super().forward(*args, **kwargs)

    def can_generate(self) -> bool:
        return False

    def get_output_embeddings(self) -> None:
        return None  # a score head, not a vocabulary projection

    def _generation_model(self) -> nn.Module:
        raise ValueError("generate(): a sequence-classification model scores sequences and does not generate")


def _generation_config_for(converted: ConvertedModel):
    from transformers import GenerationConfig

    source = converted.source_dir
    if source is not None and (Path(source) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(source))
    return GenerationConfig.from_model_config(converted.config)


_NAMED_CLASSES: dict[tuple[type, str], type] = {}


def _named_after_transformers(model: nn.Module, config) -> type:
    """The class ``model`` (a NativeCausalLM or NativeSequenceClassifier, or one of their named subclasses) takes
    for ``config``: a subclass named as transformers' class for the architecture (see the module docstring), made
    once and kept in this module's namespace (so a model pickles by reference, as one of the base class does);
    the base class itself where transformers has no such class (a config registered elsewhere)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    base = NativeSequenceClassifier if isinstance(model, NativeSequenceClassifier) else NativeCausalLM
    names = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES if base is NativeSequenceClassifier else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name = names.get(getattr(config, "model_type", None))
    if not isinstance(name, str):
        return base
    named = _NAMED_CLASSES.get((base, name))
    if named is None:
        named = type(name, (base,), {"__module__": __name__, "__qualname__": name, "__doc__": base.__doc__})
        _NAMED_CLASSES[(base, name)] = globals()[name] = named
    return named


def attach_hub_surface(model: nn.Module, converted: ConvertedModel | None, *, adapter_settings=None,
                       base_model_name_or_path: str | None = None) -> nn.Module:
    """Give a native model transformers' model surface in place (its class becomes NativeCausalLM;
    parameters, names and forward are unchanged). ``converted`` None (a bare Transformer given with no
    config): the surface is there, but ``config`` is None and nothing Hub-format can be written."""
    if type(model) is Transformer:
        model.__class__ = NativeCausalLM
    elif type(model) is SequenceClassifier:
        model.__class__ = NativeSequenceClassifier
    if not isinstance(model, HubModelMixin):
        raise TypeError(f"cannot give {type(model).__name__} transformers' model surface")
    if converted is not None:
        if isinstance(model, NativeCausalLM):  # NativeSequenceClassifier too, and their named subclasses
            model.__class__ = _named_after_transformers(model, converted.config)
        model.__dict__["_hub_converted"] = converted  # a plain attribute (not a submodule)
        model.config = converted.config
        if model.generation_config is None and model.can_generate():
            model.generation_config = _generation_config_for(converted)
    model._adapter_settings = adapter_settings
    model._base_model_name_or_path = base_model_name_or_path
    return model


__all__ = ["HubModelMixin", "NativeCausalLM", "NativeSequenceClassifier", "attach_hub_surface"]
