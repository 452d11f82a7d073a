"""The Trainer's models: the policy loaded, converted, given its adapters and placed (parallelized in a distributed
run); the objective's frozen models loaded and placed alike; and the model-facing names transformers' and TRL's
trainers have (``model``, ``model_wrapped``, ``accelerator``, ``aux_loss_enabled``).

A transformers model or peft ``PeftModel`` object given as ``model`` trains as a native copy; TRL trains the object
itself, and scripts go on using it (``model.save_pretrained``, ``model.generate``, ``model.push_to_hub`` after
``trainer.train()``). So when ``train()`` ends, the object's parameters get the trained values
(``update_given_model``), if the caller still holds it: the trainer keeps only a weak reference to it."""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch
import transformers

from hfnative.converters import fallback
from hfnative.converters.fallback import TransformersCausalLM
from hfnative.converters.hub_model import attach_hub_surface
from hfnative.converters.loading import ConvertedModel
from hfnative.converters.peft_surface import PeftSurface, peft_surface_or_none
from hfnative.models.decoder import Transformer
from hfnative.parallel import apply_activation_checkpointing, apply_compile
from hfnative.parallel.float8 import apply_float8_training

from ..running.float8_plan import float8_training
from ..running.model_loading import load_meta_model, load_sharded, loading_device, resolve_model
from ..running.parallel_plan import compile_settings

logger = logging.getLogger(__name__)


class ModelMixin:
    """The policy and the frozen models of a Trainer (see the module docstring)."""

    @property
    def model(self):
        """The model as TRL's trainer shows it: ``native_model`` (the module that trains), or, when native LoRA
        adapters are on, peft's ``PeftModel`` names over it (``hfnative.converters.peft_surface``: the same
        tensors under ``base_model.model.<transformers path>.lora_A.default.weight`` and the like); on the
        transformers fallback with peft, the ``PeftModel`` that trains."""
        native = self.native_model
        if isinstance(native, TransformersCausalLM) and native.peft_model is not None:
            return native.peft_model  # transformers' module trains through peft: its own PeftModel
        if self.lora_settings is not None and isinstance(self.converted, ConvertedModel) and self.converted.model is native:
            surface = peft_surface_or_none(self.converted, self.lora_settings)
            if surface is not None:
                return surface
        return native

    @model.setter
    def model(self, model) -> None:
        self.native_model = model.native_model if isinstance(model, PeftSurface) else model

    def _set_model(self, model, before_adapters=None) -> None:
        """The policy from ``model`` (loaded, converted, adapters added from ``peft_config``, placed).
        ``before_adapters()`` runs once the weights are loaded and before the adapters go on: the tokenizer's settings
        there, as TRL clones a chat template (which may resize the token rows and make new tokens trainable) before
        it adds the adapters."""
        self._policy_source = model if isinstance(model, (str, os.PathLike)) else None
        loaded = None
        dropout = self._trained_dropout_fields()
        if self.distributed is not None and self._may_load_sharded(model):
            # built on the meta device; each rank loads its slice of the checkpoint once parallelized
            loaded = load_meta_model(model, self._model_init_kwargs, dropout)
        sharded = loaded is not None
        if loaded is None:
            # a base to quantize loads on the host, each weight quantized on the device (``_add_adapters``)
            loaded = resolve_model(model, loading_device(self._model_init_kwargs, self.device), self._model_init_kwargs,
                                   dropout, quantize_on=self.device)
        self.converted: ConvertedModel | None = loaded.converted
        self.native_model: Transformer = loaded.model
        given = isinstance(model, transformers.PreTrainedModel) or fallback._is_peft_model(model)
        # a native copy of a transformers / peft object: the object gets the trained weights at the end of train()
        self._given_model = weakref.ref(model) if given and isinstance(loaded.converted, ConvertedModel) else None
        self.lora_settings = loaded.lora_settings  # set when `model` is a PEFT adapter folder
        self.base_model_name_or_path = loaded.base_model_name_or_path
        route = self._adapter_route()  # what refuses the peft_config speaks before the tokenizer settings change anything
        if before_adapters is not None:
            self._attach_surface()  # the tokenizer settings read the model as transformers' (config, embeddings)
            before_adapters()
        self._add_adapters(route)
        self._attach_surface()
        if hasattr(self.native_model, "add_model_tags"):
            self.native_model.add_model_tags(self._tag_names)
        # counted whole, before a pipeline stage keeps its part
        embedding_params = self.native_model.get_input_embeddings().weight.numel()
        self._non_embedding_params = sum(p.numel() for p in self.native_model.parameters()) - embedding_params
        self._place(self.native_model)
        if sharded:
            load_sharded(self.converted, self.device)

    def _attach_surface(self) -> None:
        """transformers' model surface on a native policy, for callbacks and user code."""
        if isinstance(self.native_model, Transformer):
            attach_hub_surface(self.native_model, self.converted, adapter_settings=self.lora_settings,
                               base_model_name_or_path=self.base_model_name_or_path)

    def update_given_model(self) -> None:
        """Copy the trained weights into the transformers model or ``PeftModel`` object given as ``model`` (see the
        module docstring): by name, transformers' (``hub_state_dict``) or peft's (the ``PeftModel`` surface; its
        trainable parameters only, the adapters). In a distributed run each rank holds a part of the weights:
        the object is not updated, and the log says so."""
        given = self._given_model() if self._given_model is not None else None
        if given is None:
            return
        if self.distributed is not None:
            if self.is_world_process_zero():
                logger.warning("the %s object given as `model` was copied for training and is not updated in a "
                               "distributed run: trainer.model and trainer.save_model() hold the trained weights",
                               type(given).__name__)
            return
        surface = self.model
        adapters = isinstance(surface, PeftSurface)
        if adapters and not fallback._is_peft_model(given):  # adapters added by peft_config: its weights are frozen
            return
        trained = surface.state_dict() if adapters else self.native_model.hub_state_dict()
        missed = []
        with torch.no_grad():
            for name, parameter in given.named_parameters():
                if adapters and not parameter.requires_grad:
                    continue
                if name in trained and trained[name].shape == parameter.shape:
                    parameter.copy_(trained[name])
                else:
                    missed.append(name)
        if missed:
            logger.warning("the %s object given as `model` did not get the trained values of %d parameters whose "
                           "layout differs from the checkpoint's (%s): trainer.model and trainer.save_model() hold "
                           "them", type(given).__name__, len(missed), ", ".join(missed[:3]) + (", ..." if len(missed) > 3 else ""))

    def _place(self, model) -> None:
        """Put a model on the device with the run's engine options (the policy and, frozen, every
        auxiliary model go through here, so they are laid out alike). In a distributed run:
        ``hfnative.parallel.parallelize`` with the run's layout."""
        self.args.check_checkpointing()
        if self.distributed is not None:
            self._parallelize(model)
            return
        model.to(self.device)
        float8 = float8_training(self.args) if any(p.requires_grad for p in model.parameters()) else None
        if float8 is not None:
            apply_float8_training(model, float8, self.device)
        if self.args.checkpoint_activations and any(p.requires_grad for p in model.parameters()):
            apply_activation_checkpointing(model, self.args.activation_checkpointing_mode, self.args.checkpoint_keeps)
        if self._compile_settings is not None:
            apply_compile(model, settings=self._compile_settings)

    @functools.cached_property
    def _compile_settings(self):
        """How this run compiles the blocks of every model it places (``compile_settings``: None, not at all),
        resolved once: the layout's in a distributed run."""
        run = self.distributed
        return run.plan.compile if run is not None else compile_settings(self.args)

    def _build_auxiliary_models(self) -> None:
        """The objective's frozen models (a reference, a teacher): given as a path, Hub id or model
        object, loaded like the policy, frozen, in eval mode, placed like the policy."""
        for name, source in list(self.objective.auxiliary_models.items()):
            kwargs = self._auxiliary_init_kwargs(name, source)
            # the reference made from the policy's name runs where the policy runs (its batches are laid out alike)
            dropout = self._trained_dropout_fields() if kwargs else ()
            loaded = resolve_model(source, self.device, kwargs, dropout)
            model = loaded.model
            if model is source or model is getattr(source, "model", None):
                self.objective.users_models.add(name)
            if isinstance(model, Transformer):
                attach_hub_surface(model, loaded.converted, base_model_name_or_path=loaded.base_model_name_or_path)
            model.requires_grad_(False).eval()
            self._place(model)
            self.objective.auxiliary_models[name] = model

    def _trained_dropout_fields(self) -> tuple[str, ...]:
        """The config fields whose dropout the policy would train with under TRL and the native decoders do not apply
        (a policy that asks for it trains in transformers' module): the attention's, and the dropout layers' unless
        ``disable_dropout`` zeroes them."""
        from hfnative.converters.families.common import ATTENTION_DROPOUT_FIELDS, LAYER_DROPOUT_FIELDS

        if getattr(self.args, "disable_dropout", False):
            return ATTENTION_DROPOUT_FIELDS
        return ATTENTION_DROPOUT_FIELDS + LAYER_DROPOUT_FIELDS

    def _auxiliary_init_kwargs(self, name: str, source) -> dict:
        """How a frozen model is loaded: the reference made from the policy's own name (no ref_model given) is loaded
        as TRL loads it, with the policy's model_init_kwargs (revision, dtype, config fields), less what only a
        trained policy takes (quantization: hfnative's QLoRA trains adapters, and with adapters the reference is the
        base with them off); any other (a teacher, even of the policy's name: TRL loads it with its own kwargs) as it
        is."""
        policy = getattr(self, "_policy_source", None)
        if (name != "ref_model" or policy is None or not isinstance(source, (str, os.PathLike))
                or os.fspath(source) != os.fspath(policy)):
            return {}
        from hfnative.peft.settings import QUANTIZATION_KWARGS

        return {key: value for key, value in self._model_init_kwargs.items() if key not in QUANTIZATION_KWARGS}

    def _adapter_route(self) -> str | None:
        """Where ``peft_config``'s adapters go ("native", "peft": peft itself on transformers' module; None without
        one), after what refuses the request: checked before the tokenizer settings change anything (the template
        cloned, the model resized). A native config is planned on the model as it is (its target modules,
        modules_to_save, token rows; not their ids, which may name tokens the template adds); ``apply_lora`` plans
        it again on the model the adapters go on."""
        from hfnative.peft.settings import is_quantization_requested, quantization_request

        kwargs = self._model_init_kwargs
        quantized = is_quantization_requested(kwargs)
        if self.peft_config is None:
            if self.lora_settings is None and quantized:
                raise ValueError("load_in_4bit / load_in_8bit / quantization_config quantizes a frozen base for LoRA: "
                                 "pass a peft_config too")
            return None
        if self.lora_settings is not None:
            raise ValueError("model is already a PEFT adapter folder (its adapter keeps training); drop peft_config")
        if self.converted is None:
            raise ValueError("peft_config needs a Hub-format model: a path, a Hub id or a transformers model")
        from hfnative.converters.fallback_loading import peft_route_reason

        if peft_route_reason(self.converted, self.peft_config) is not None:
            if quantized:
                raise ValueError("load_in_4bit / load_in_8bit / quantization_config (a quantized base) is implemented "
                                 "for hfnative's native LoRA only; this peft_config trains through peft: drop the "
                                 "quantization")
            return "peft"
        from hfnative.converters.lora_targets import plan_lora
        from hfnative.peft import lora_settings, quantization_settings

        quantization_settings(**quantization_request(kwargs))
        plan_lora(self.converted, lora_settings(self.peft_config), check_token_ids=False)
        return "native"

    def _add_adapters(self, route: str | None) -> None:
        """LoRA / DoRA (and a quantized base: QLoRA's NF4, or int8) from ``peft_config`` by ``route`` (``_adapter_route``): only adapter
        parameters train."""
        if route is None:
            return
        if route == "peft":  # peft itself, on transformers' module
            from hfnative.converters.fallback_loading import apply_peft

            self.converted = apply_peft(self.converted, self.peft_config)
            self.native_model = self.converted.model
            return
        from hfnative.converters.peft import apply_lora
        from hfnative.peft import lora_settings
        from hfnative.peft.settings import quantization_request

        self.lora_settings = lora_settings(self.peft_config)
        apply_lora(self.converted, self.lora_settings, **quantization_request(self._model_init_kwargs),
                   quantize_on=self.device)

    def _resize_vocabulary(self, rows: int) -> None:
        """The policy's token rows resized to ``rows``, as TRL's clone_chat_template resizes its model
        (``hfnative.models.vocabulary``; transformers' resize_token_embeddings for a model on the transformers
        fallback), with the config's vocab_size; a transformers object given as ``model`` is resized too, so the
        trained weights can be copied back into it. In a distributed run (the model is loaded whole for it:
        ``_may_load_sharded``) the new rows are rank 0's on every rank. Refused where the weights are already sharded
        or adapted."""
        current = self.native_model.get_input_embeddings().weight.shape[0]
        if rows == current:
            return
        what = f"chat_template_path: cloning the template resizes the model's token rows from {current} to {rows}"
        if self.distributed is not None and any(p.is_meta or type(p.data) is not torch.Tensor
                                                for p in self.native_model.parameters()):
            raise ValueError(f"{what}, which a distributed run cannot do once its weights are sharded: clone the template "
                             "on one process (trl's clone_chat_template, or an hfnative run's save_model), and train "
                             "from the saved model and tokenizer")
        if self.context.uses_adapters:  # a peft_config's adapters go on after this (``before_adapters``)
            raise ValueError(f"{what}, under the adapter this model already carries: clone the template on the base "
                             "model with a new peft_config, or merge the adapter first")
        if isinstance(self.converted, ConvertedModel):
            from hfnative.models.vocabulary import resize_vocabulary

            resize_vocabulary(self.native_model, rows)
            self.converted.config.get_text_config().vocab_size = rows
        else:
            hf_model = getattr(self.native_model, "hf_model", None)
            if hf_model is None:
                raise ValueError(f"{what}; this model has no transformers config or module to resize")
            hf_model.resize_token_embeddings(rows, mean_resizing=True)
            if hasattr(getattr(self.native_model, "args", None), "vocab_size"):
                self.native_model.args.vocab_size = rows
        if self.distributed is not None:  # every rank drew its new rows: rank 0's are the ones trained, everywhere
            with torch.no_grad():
                tables = [self.native_model.get_input_embeddings().weight]
                head = self.native_model.get_output_embeddings()
                if head is not None and head.weight is not tables[0]:
                    tables.append(head.weight)
                for table in tables:  # through the run's device (NCCL takes no host tensor: a base to quantize is
                    # still on the host here)
                    table.data.copy_(self.distributed.broadcast(table.data.to(self.device)))
        given = self._given_model() if self._given_model is not None else None
        if given is not None:  # the object given as `model` holds the same rows now (the trained ones after train())
            given.resize_token_embeddings(rows, mean_resizing=False)
            with torch.no_grad():
                pairs = [(given.get_input_embeddings(), self.native_model.get_input_embeddings())]
                head = given.get_output_embeddings()
                if head is not None and head.weight is not pairs[0][0].weight:
                    pairs.append((head, self.native_model.get_output_embeddings()))
                for theirs, ours in pairs:
                    theirs.weight.copy_(ours.weight)
        embedding_params = self.native_model.get_input_embeddings().weight.numel()
        self._non_embedding_params = sum(p.numel() for p in self.native_model.parameters()) - embedding_params

    # --- what code written for transformers' Trainer reads -------------------------------------------------
    @property
    def accelerator(self):
        """accelerate's ``Accelerator`` for this process, as transformers' Trainer has one: rank and device
        (``is_main_process``, ``num_processes``, ``process_index``, ``device``), ``gather``, ``gather_for_metrics``,
        ``reduce``, ``split_between_processes``, ``unwrap_model``, ``wait_for_everyone``, over the process group the
        trainer started. Created on first use; the training loop itself does not go through it. Assigning one
        (``trainer.accelerator = ...``) keeps what is assigned, for the code that reads it."""
        accelerator = self.__dict__.get("_accelerator")
        if accelerator is None:
            from accelerate import Accelerator

            accelerator = self._accelerator = Accelerator(cpu=self.device.type == "cpu" and self.args.use_cpu)
        return accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:
        self._accelerator = accelerator

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's ``aux_loss_enabled``: the model's config has ``output_router_logits`` (a Mixture-of-Experts model)
        and the router's load-balancing coefficient (``router_aux_loss_coef``, else the config's) is not 0.0. Where
        the objective adds that loss (SFT, DPO, KTO), setting it turns the term and its ``aux_loss`` metric on or off."""
        return self._aux_loss_enabled

    @aux_loss_enabled.setter
    def aux_loss_enabled(self, enabled: bool) -> None:
        self._aux_loss_enabled = bool(enabled)
        if hasattr(self.objective, "aux_loss_coef"):  # the objectives that add the model's router loss
            self.native_model.aux_loss_enabled = bool(enabled)

    def _router_loss_rule(self) -> bool:
        """TRL's rule for ``aux_loss_enabled`` (a trainer where TRL decides it otherwise overrides this)."""
        coef = getattr(self.args, "router_aux_loss_coef", None)
        config = getattr(self.native_model, "config", None)
        if config is None:  # a bare native model: its MoE settings say the same
            moe = getattr(getattr(self.native_model, "args", None), "moe", None)
            return moe is not None and (moe.aux_loss_coef if coef is None else coef) != 0.0
        text = config.get_text_config()
        coef = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
        return hasattr(text, "output_router_logits") and coef != 0.0

    @property
    def model_wrapped(self):
        """The model the loop runs (transformers' Trainer keeps a wrapped copy here; hfnative wraps in place)."""
        return self.native_model

    def is_world_process_zero(self) -> bool:
        return self.state.is_world_process_zero

    def is_local_process_zero(self) -> bool:
        return self.state.is_local_process_zero


__all__ = ["ModelMixin"]
