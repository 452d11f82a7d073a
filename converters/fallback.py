"""transformers' own causal LM under hfnative's training loop: the fallback for architectures without a
native implementation, and for PEFT methods hfnative does not implement natively (run by peft itself).

``TransformersCausalLM`` wraps a transformers ``*ForCausalLM`` (or a peft ``PeftModel`` over one) and
answers like the native ``Transformer``: ``forward`` returns a ``CausalLMOutput`` whose hidden states
come from transformers' backbone (``model.base_model``) and whose head is an ``OutputHead`` over
transformers' ``lm_head`` weight, so the chunked losses run through it without [B, S, V] logits.
A multiplicative logit scale (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``, ...) is
folded into the hidden states, ``final_logit_softcapping`` is the head's soft-cap, and an ``lm_head``
bias is a bias column of the head matrix against a hidden column of ones. MoE models whose transformers
forward returns router logits get the family's load-balancing loss (``aux_loss``), as with
``output_router_logits=True``.

Two tiny forwards at construction check what no rule can promise for every architecture: that this
head reproduces transformers' logits (else the losses come from transformers' full logits,
``logits_from_transformers``), and that a packed row (positions restarting, no padding mask) gives
each document what it gives alone; where it does not, packed documents run as rows of their own
(the batch layouts: converters/fallback_packing.py).

Prompt learning (prompt tuning, P-tuning): the virtual tokens' positions are dropped from the hidden
states, so the same tokens are scored as without them. peft / TRL also score a row's first token from
the last virtual token when its label is set (plain-text rows), and leave it out of num_items_in_batch;
rows whose first label is -100 (prompt-completion, assistant-only) give TRL's losses exactly.

The wrapper writes itself as transformers / peft do (``save_hub_folder``). Loading into it, PEFT through
peft, and resuming: converters/fallback_loading.py.

Shapes: B batch, S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch import nn

from hfnative.losses import IGNORE_INDEX, CrossEntropyOutput
from hfnative.losses import shift_labels as shift_labels_of
from hfnative.models.decoder import CausalLMOutput
from hfnative.models.head import OutputHead, TokenCrossEntropy, TokenLogprobs

from .fallback_packing import BatchLayout, masks_separate_documents, plan_batch
from .hub_model import HubModelMixin
from .loading import hub_state_dict

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def warn_fallback(what: str, reason: str) -> None:
    """Log once per process and model kind that it trains through transformers' modeling code, and why."""
    if what in _warned:
        return
    _warned.add(what)
    logger.warning(
        "%s trains through transformers' own modeling code, not hfnative's native engine (slower; no native "
        "parallelism or fused kernels inside the layers), because: %s", what, reason,
    )


# --- the head -------------------------------------------------------------------------------------


def logit_scale(config) -> float:
    """The factor a transformers causal LM multiplies its logits by before any soft-cap (1.0 for most)."""
    text = config.get_text_config()
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(text, name, None) is not None:
            return float(getattr(text, name))
    scaling = getattr(text, "logits_scaling", None)
    if scaling is not None:  # Granite divides by it; HyperCLOVA X multiplies
        return float(scaling) if text.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


class TransformersHead(OutputHead):
    """``OutputHead`` over transformers' ``lm_head``: softcap(hidden @ [W | b].T). The hidden states it is
    given carry the logit scale (and a trailing column of that scale when ``lm_head`` has a bias). It holds
    no parameter: ``lm_head`` is looked up on each call (peft may wrap it after the head was made)."""

    def __init__(self, causal_lm: nn.Module, softcap: float | None):
        nn.Module.__init__(self)
        self.softcap = softcap
        self._causal_lm = (causal_lm,)  # in a tuple: not registered (the wrapper owns it)

    def projection(self) -> torch.Tensor:
        lm_head = self._causal_lm[0].get_output_embeddings()
        bias = getattr(lm_head, "bias", None)
        return lm_head.weight if bias is None else torch.cat([lm_head.weight, bias[:, None]], dim=1)

    base_projection = projection  # no native token rows here (peft's own, inside lm_head, when there are any)


class LogitsHead(nn.Module):
    """For architectures whose logits the chunked head cannot express: the "hidden states" are
    transformers' logits [B, S, V] and the losses are computed from them (no chunking)."""

    softcap = None

    def projection(self) -> torch.Tensor:
        raise ValueError("this model's logits come from transformers' forward: it has no [V, D] head matrix")

    def forward(self, logits_BSV: torch.Tensor, loss=None):
        if loss is None:
            return logits_BSV
        if isinstance(loss, TokenCrossEntropy):
            keep = loss.targets_BS != IGNORE_INDEX
            z_NV, targets_N = logits_BSV[keep].float(), loss.targets_BS[keep]
            log_z_N = torch.logsumexp(z_NV, dim=-1)
            with torch.no_grad():
                probs_NV = torch.exp(z_NV - log_z_N[:, None])
                entropy = (log_z_N - (probs_NV * z_NV).sum(-1)).sum()
                correct = (z_NV.argmax(-1) == targets_N).sum()
            nll = (log_z_N - z_NV.gather(1, targets_N[:, None])[:, 0]).sum()
            return CrossEntropyOutput(nll, entropy, correct, int(targets_N.numel()))
        if isinstance(loss, TokenLogprobs):
            valid_BS = loss.targets_BS != IGNORE_INDEX
            logp_BSV = torch.log_softmax(logits_BSV.float() / loss.temperature, dim=-1)
            logprobs = logp_BSV.gather(-1, loss.targets_BS.clamp(min=0)[..., None])[..., 0]
            entropy = -(logp_BSV.exp() * logp_BSV).sum(-1).detach()
            return torch.where(valid_BS, logprobs, 0.0), torch.where(valid_BS, entropy, 0.0)
        raise ValueError(f"{type(loss).__name__} needs a [V, D] head: this model's logits come from transformers")


# --- the wrapper --------------------------------------------------------------------------------------


@dataclass
class RouterAuxLoss:
    aux_loss_coef: float


@dataclass
class ObjectiveArgs:
    """The fields of the native ``ModelArgs`` that hfnative's objectives read from ``model.args``."""

    vocab_size: int
    moe: RouterAuxLoss | None = None  # MoE models whose transformers forward returns router logits


_PREFIX_AND_CHECKPOINTING = (
    "prefix tuning hands its prefix to the layers as a key/value cache, which transformers' activation checkpointing "
    "drops: set gradient_checkpointing=False (activation_checkpointing=False)"
)


def _is_peft_model(model) -> bool:
    return any(cls.__name__ == "PeftModel" and cls.__module__.startswith("peft") for cls in type(model).__mro__)


def _decoder_layers(causal_lm: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers: the shallowest one as long as the config's layer count."""
    count = getattr(causal_lm.config.get_text_config(), "num_hidden_layers", None)
    modules = causal_lm.base_model.named_modules()
    lists = [(name.count("."), name, m) for name, m in modules if isinstance(m, nn.ModuleList)]
    matching = [entry for entry in lists if len(entry[2]) == count] or sorted(lists, key=lambda e: -len(e[2]))[:1]
    if not matching:
        raise ValueError(f"{type(causal_lm).__name__}: found no list of decoder layers")
    return min(matching, key=lambda entry: entry[:2])[2]


class TransformersCausalLM(HubModelMixin, nn.Module):
    """A transformers causal LM (or a peft PeftModel over one) driven like hfnative's ``Transformer``.

    ``TransformersCausalLM(config)`` builds a randomly initialised ``AutoModelForCausalLM`` from a
    transformers config; ``TransformersCausalLM(model)`` wraps a ``PreTrainedModel`` or ``PeftModel``.
    ``hf_model`` is the transformers ``*ForCausalLM``; ``peft_model`` the PeftModel when there is one.
    """

    def __init__(self, model_or_config):
        super().__init__()
        from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

        if isinstance(model_or_config, PretrainedConfig):
            model_or_config = AutoModelForCausalLM.from_config(model_or_config)
        causal_lm = model_or_config.get_base_model() if _is_peft_model(model_or_config) else model_or_config
        if not isinstance(causal_lm, PreTrainedModel) or causal_lm.get_output_embeddings() is None:
            raise TypeError(f"expected a transformers causal LM or a peft PeftModel over one, got {type(causal_lm).__name__}")
        self.module = model_or_config  # the one registered submodule: state_dict keys are module.<its keys>
        self.config = causal_lm.config
        self.generation_config = getattr(causal_lm, "generation_config", None)
        text = self.config.get_text_config()
        coef = getattr(text, "router_aux_loss_coef", None)
        routed = hasattr(text, "output_router_logits") and coef is not None
        self.args = ObjectiveArgs(text.vocab_size, RouterAuxLoss(coef) if routed else None)
        self.aux_loss_enabled = False  # the objective turns the router's load-balancing loss on
        self.logit_scale = logit_scale(self.config)
        self.output = TransformersHead(causal_lm, getattr(text, "final_logit_softcapping", None))
        self.masks_separate_documents = masks_separate_documents(causal_lm)
        self._layers = (_decoder_layers(causal_lm),)  # not registered a second time
        self._checkpointed: frozenset[int] = frozenset()
        self._check_peft_head()
        self.logits_from_transformers = False
        self._check_against_transformers()

    # --- what the trainer and objectives use ----------------------------------------------------------

    @property
    def hf_model(self) -> nn.Module:
        return self.module.get_base_model() if _is_peft_model(self.module) else self.module

    @property
    def peft_model(self):
        return self.module if _is_peft_model(self.module) else None

    @property
    def layers(self) -> nn.ModuleList:
        return self._layers[0]

    def get_input_embeddings(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    @property
    def checkpointed_layers(self) -> frozenset[int]:
        """Decoder layers recomputed in backward (set by ``apply_activation_checkpointing``), through
        transformers' per-layer switch with non-reentrant ``torch.utils.checkpoint``."""
        return self._checkpointed

    @checkpointed_layers.setter
    def checkpointed_layers(self, layer_ids) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layer_ids = frozenset(layer_ids)
        if layer_ids and self._prefix_in_cache():
            raise ValueError(_PREFIX_AND_CHECKPOINTING)
        for index, layer in enumerate(self.layers):
            if not isinstance(layer, GradientCheckpointingLayer):
                if index in layer_ids:
                    raise ValueError(f"{type(layer).__name__} has no activation checkpointing switch in transformers")
                continue
            layer.gradient_checkpointing = index in layer_ids
            layer._gradient_checkpointing_func = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        self._checkpointed = layer_ids

    def attach_peft(self, peft_model) -> None:
        """Train through ``peft_model`` (made by peft over this wrapper's transformers model)."""
        if peft_model.get_base_model() is not self.hf_model:
            raise ValueError("attach_peft: the PeftModel does not wrap this model's transformers module")
        previous, self.module = self.module, peft_model
        try:
            self._check_peft_head()
            if self._checkpointed and self._prefix_in_cache():
                raise ValueError(_PREFIX_AND_CHECKPOINTING)
        except ValueError:
            self.module = previous
            raise

    def _prompt_learning(self) -> bool:
        peft = self.peft_model
        return peft is not None and peft.active_peft_config.is_prompt_learning

    def _prefix_in_cache(self) -> bool:
        peft_type = None if self.peft_model is None else self.peft_model.active_peft_config.peft_type
        return getattr(peft_type, "value", peft_type) in ("PREFIX_TUNING", "CARTRIDGE")

    def _check_peft_head(self) -> None:
        head = self.get_output_embeddings()
        if hasattr(head, "get_base_layer") and not hasattr(head, "modules_to_save"):
            raise ValueError(
                "a PEFT adapter on the output layer (lm_head) is not supported: the losses read lm_head's weight "
                "directly, so the adapter would not train; remove lm_head from target_modules (modules_to_save works)"
            )

    @torch.no_grad()
    def _check_against_transformers(self) -> None:
        """Two tiny forwards (eval mode) decide what the folding and the masks cannot promise for every
        architecture: does the head on the scaled backbone states give transformers' logits (else the losses
        use transformers' logits), and does a packed row give each document what it gives alone (else
        packed documents run as rows)? Skipped for a model on the meta device."""
        causal_lm = self.hf_model
        param = next(causal_lm.parameters(), None)
        if param is None or param.device.type == "meta":
            return
        tolerance = 1e-4 if param.dtype == torch.float32 else 3e-2

        def close(actual, expected) -> bool:
            scale = expected.float().abs().max().clamp(min=1e-3)
            return bool((actual.float() - expected.float()).abs().max() <= tolerance * scale)

        ids = ((torch.arange(8, device=param.device) * 7 + 3) % self.args.vocab_size)[None]
        positions = torch.arange(4, device=param.device).repeat(2)[None]
        was_training = causal_lm.training
        causal_lm.eval()
        run = partial(self._run, router=False, through_peft=False)  # the transformers model itself (prompts aside)
        try:
            if not close(self.output(run(ids, None, None)[0]), causal_lm(input_ids=ids, use_cache=False).logits):
                self.logits_from_transformers = True
                self.output = LogitsHead()
            if self.masks_separate_documents:
                packed, alone = run(ids, None, positions)[0][:, 4:], run(ids[:, 4:], None, positions[:, 4:])[0]
                self.masks_separate_documents = close(packed, alone)
        finally:
            causal_lm.train(was_training)

    def plan_attention(self, input_ids_BS, attention_mask_BS=None, position_ids_BS=None, device=None) -> BatchLayout:
        """How this batch runs (see ``plan_batch``); call it on host tensors to avoid a device sync."""
        separate = self.masks_separate_documents and not self._prompt_learning()
        return plan_batch(input_ids_BS, attention_mask_BS, position_ids_BS, separate, device or input_ids_BS.device)

    # --- forward ----------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        attention_plan: BatchLayout | None = None,
        head_loss=None,
        **unused,
    ) -> CausalLMOutput:
        """As ``Transformer.forward``: input_ids [B, S]; labels (or shift_labels, already shifted) -> ``.loss``
        as transformers' causal LMs compute it (plus the router aux loss when on); head_loss: a loss spec
        computed through the head (``head_output``). Other keyword arguments are accepted and not needed."""
        if not isinstance(attention_plan, BatchLayout):
            attention_plan = self.plan_attention(input_ids, attention_mask, position_ids)
        hidden_BSD, aux_loss = self._head_inputs(input_ids, attention_mask, position_ids, attention_plan)
        out = CausalLMOutput(hidden_BSD, self.output, aux_loss=aux_loss)
        if head_loss is not None:
            out.head_output = self.output(hidden_BSD, loss=head_loss)
        if labels is not None or shift_labels is not None:
            targets_BS = shift_labels if shift_labels is not None else shift_labels_of(labels)
            stats = self.output(hidden_BSD, loss=TokenCrossEntropy(targets_BS))
            denominator = num_items_in_batch if num_items_in_batch is not None else max(stats.num_tokens, 1)
            out.loss = stats.loss_sum / denominator
            if aux_loss is not None:
                out.loss = out.loss + self.args.moe.aux_loss_coef * aux_loss
        return out

    def _head_inputs(self, input_ids_BS, attention_mask_BS, position_ids_BS, layout: BatchLayout):
        """What the head reads [B, S, D] (scaled as the logits are; see the module docstring), and the router
        load-balancing loss when it is on (else None)."""
        router = self.aux_loss_enabled and self.args.moe is not None
        rows = layout.rows
        if rows is None:
            mask = None if layout.drop_mask else attention_mask_BS
            hidden, router_logits = self._run(input_ids_BS, mask, position_ids_BS, router)
        else:
            mask = rows.valid_KL.long()
            ids = input_ids_BS.reshape(-1)[rows.gather_KL]
            positions = position_ids_BS
            if positions is not None:
                positions = positions.expand_as(input_ids_BS).reshape(-1)[rows.gather_KL]
            hidden_KLD, router_logits = self._run(ids, mask, positions, router)
            hidden = hidden_KLD.flatten(0, 1)[rows.scatter_N].view(*input_ids_BS.shape, -1)
        aux_loss = self._load_balancing_loss(router_logits, mask) if router and router_logits else None
        return hidden, aux_loss

    def _run(self, input_ids, attention_mask, position_ids, router: bool, through_peft: bool = True):
        """transformers' backbone (through peft's forward when there is a PeftModel and ``through_peft``)
        -> (head input, router logits)."""
        causal_lm, peft = self.hf_model, self.peft_model if through_peft else None
        kwargs = {"attention_mask": attention_mask, "use_cache": False}
        if router:
            kwargs["output_router_logits"] = True
        if position_ids is not None and not (peft is not None and self._prompt_learning()):
            kwargs["position_ids"] = position_ids  # (prompt learning: peft drops or shifts them itself)
        if self.logits_from_transformers:
            outputs = (causal_lm if peft is None else peft)(input_ids=input_ids, **kwargs)
            head_input = outputs.logits
        elif peft is None:
            outputs = causal_lm.base_model(input_ids=input_ids, **kwargs)
            head_input = outputs[0]
        else:  # peft's forward builds the prompt / adapter inputs; the backbone's output is taken on the way
            captured = []
            hook = causal_lm.base_model.register_forward_hook(lambda module, args, output: captured.append(output))
            if "logits_to_keep" in inspect.signature(type(causal_lm).forward).parameters:
                kwargs["logits_to_keep"] = 1  # the logits transformers computes here are not used
            try:
                peft(input_ids=input_ids, **kwargs)
            finally:
                hook.remove()
            outputs = captured[-1]
            head_input = outputs[0]
        head_input = head_input[:, head_input.shape[1] - input_ids.shape[1]:]  # prompt-learning virtual tokens
        router_logits = getattr(outputs, "router_logits", None)
        if not self.logits_from_transformers:
            if self.logit_scale != 1.0:
                head_input = head_input * self.logit_scale
            if getattr(causal_lm.get_output_embeddings(), "bias", None) is not None:
                ones = torch.full_like(head_input[..., :1], self.logit_scale)
                head_input = torch.cat([head_input, ones], dim=-1)
        return head_input, router_logits

    def _load_balancing_loss(self, router_logits, attention_mask):
        """The model family's own load-balancing loss (Mixtral's when its module defines none), as its
        transformers forward computes it with output_router_logits."""
        causal_lm = self.hf_model
        loss_fn = getattr(sys.modules[type(causal_lm).__module__], "load_balancing_loss_func", None)
        if loss_fn is None:
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as loss_fn
        text = self.config.get_text_config()
        num_experts = getattr(causal_lm, "num_experts", None) or getattr(text, "num_experts", None)
        num_experts = num_experts or text.num_local_experts
        top_k = getattr(causal_lm, "num_experts_per_tok", None) or text.num_experts_per_tok
        return loss_fn(router_logits, num_experts, top_k, attention_mask)

    # --- Hub layout and transformers' model surface ----------------------------------------------------

    def hub_state_dict(self) -> dict[str, torch.Tensor]:
        """The transformers model's tensors under their Hub checkpoint names, as ``save_pretrained`` writes
        them (tied copies left out). With peft adapters injected: the base model's tensors only."""
        return hub_state_dict(self.hf_model, set(self.peft_model.peft_config) if self.peft_model is not None else ())

    def _has_adapters(self) -> bool:
        return self.peft_model is not None

    @contextlib.contextmanager
    def disable_adapter(self):
        if self.peft_model is None:
            raise ValueError("disable_adapter(): the model has no adapters (it was not given a peft_config)")
        with self.peft_model.disable_adapter():
            yield

    def generate(self, *args, **kwargs):
        """transformers' (or peft's) ``generate`` on the live weights, in eval mode."""
        was_training = self.training
        self.eval()
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.train(was_training)

    def _generation_model(self) -> nn.Module:
        return self.hf_model if self.peft_model is None else self.peft_model

    def _save_hub_folder(self, directory: Path, max_shard_size) -> None:
        save_hub_folder(self, directory, max_shard_size)


def save_hub_folder(wrapper: TransformersCausalLM, out_dir: os.PathLike, max_shard_size="5GB",
                    wrapper_state: dict[str, torch.Tensor] | None = None) -> None:
    """The model as transformers' ``save_pretrained`` writes it (safetensors + config.json +
    generation_config.json), or the adapter as peft's ``save_pretrained`` writes it.
    wrapper_state: the wrapper's whole tensors (``wrapper.state_dict()`` names, gathered from a sharded model)
    to write instead of the live ones."""
    state = None
    if wrapper_state is not None:  # the wrapper's keys are its one submodule's, prefixed "module."
        state = {key.removeprefix("module."): value for key, value in wrapper_state.items()}
    if wrapper.peft_model is not None:
        wrapper.peft_model.save_pretrained(str(out_dir), state_dict=state)
    else:
        wrapper.hf_model.save_pretrained(str(out_dir), max_shard_size=max_shard_size, state_dict=state)


@dataclass
class TransformersModel:
    """The trainer's record of a fallback model, in the place of a native ``ConvertedModel``: the wrapper,
    its transformers config and the folder it came from; ``family`` is None (no native layout)."""

    model: TransformersCausalLM
    config: object
    source_dir: Path | None = None
    family: None = None


def architecture_name(config) -> str:
    """The architecture a transformers config names (its first ``architectures`` entry, else its class name)."""
    return (getattr(config, "architectures", None) or [type(config).__name__])[0]



__all__ = ["TransformersCausalLM", "TransformersHead", "TransformersModel", "architecture_name", "save_hub_folder",
           "warn_fallback"]
