"""Sequence classifiers (reward models) of architectures without a native implementation: transformers' own
``*ForSequenceClassification`` module driven like hfnative's ``SequenceClassifier`` (its forward returns the
pooled scores [B, L]), with the fallback causal LM's activation checkpointing, peft route and saving."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hfnative.models.classifier import SequenceClassifierOutput

from .fallback import TransformersCausalLM, TransformersModel, _decoder_layers, _is_peft_model, architecture_name, warn_fallback
from .hub import resolve_model_dir
from .loading import CheckpointError


@dataclass
class ClassifierArgs:
    """The fields of the native ``ModelArgs`` that the reward objective reads and sets on ``model.args``."""

    num_labels: int
    pad_token_id: int | None = None
    moe: None = None


class TransformersSequenceClassifier(TransformersCausalLM):
    """A transformers ``*ForSequenceClassification`` (or a peft PeftModel over one) in the loop's place of a native
    SequenceClassifier. ``hf_model`` is the transformers classifier; ``peft_model`` the PeftModel when there is one.
    The pooling pad token is the config's (``args.pad_token_id`` is copied into it before each forward)."""

    def __init__(self, model):
        nn.Module.__init__(self)
        from transformers import PreTrainedModel

        classifier = model.get_base_model() if _is_peft_model(model) else model
        if not isinstance(classifier, PreTrainedModel) or not type(classifier).__name__.endswith("ForSequenceClassification"):
            raise TypeError(f"expected a transformers *ForSequenceClassification model, got {type(classifier).__name__}")
        self.module = model  # the one registered submodule
        self.config = classifier.config
        self.generation_config = None
        text = self.config.get_text_config()
        self.args = ClassifierArgs(self.config.num_labels, getattr(text, "pad_token_id", None))
        self.aux_loss_enabled = False
        self._layers = (_decoder_layers(classifier),)
        self._checkpointed: frozenset[int] = frozenset()

    def _check_peft_head(self) -> None:
        pass  # the score head trains as a modules_to_save copy or not at all; no loss reads its weight

    def get_output_embeddings(self) -> None:
        return None

    def can_generate(self) -> bool:
        return False

    def plan_attention(self, *args, **kwargs) -> None:
        return None  # transformers' module masks the padding itself

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **unused) -> SequenceClassifierOutput:
        """input_ids [B, S] -> the scores at each row's last non-pad token [B, L], as transformers pools them."""
        self.config.get_text_config().pad_token_id = self.args.pad_token_id
        outputs = self.module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False)
        return SequenceClassifierOutput(outputs.logits, hidden_states=None)

    def generate(self, *args, **kwargs):
        raise ValueError("generate(): a sequence-classification model scores sequences and does not generate")


def classifier_refusal(config) -> str | None:
    """Why transformers' module cannot stand in for a native sequence classifier of ``config`` (None: it can)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        return f"transformers has no sequence-classification class for {type(config).__name__}"
    if getattr(config, "quantization_config", None):
        return "the checkpoint is quantized"
    return None


def load_transformers_classifier(name_or_path, *, num_labels: int, score_seed: int | None, dtype, device, reason: str,
                                 revision=None, cache_dir=None, token=None, config_overrides: dict | None = None,
                                 ) -> TransformersModel:
    """``AutoModelForSequenceClassification.from_pretrained`` with ``num_labels`` on a folder or Hub id (safetensors
    only, no remote code): a causal LM's head is dropped and its new score head drawn after seeding torch with
    ``score_seed``, as transformers does; any other missing, unexpected or mis-shaped tensor is a CheckpointError."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    source_dir = resolve_model_dir(name_or_path, revision=revision, cache_dir=cache_dir, token=token)
    refusal = classifier_refusal(AutoConfig.from_pretrained(str(source_dir), trust_remote_code=False))
    if refusal is not None:
        raise CheckpointError(f"{name_or_path}: {reason}; and it cannot score through transformers' modeling code: {refusal}")
    if score_seed is not None:
        torch.manual_seed(score_seed)
    kwargs = {"dtype": dtype or "auto", "use_safetensors": True, "trust_remote_code": False, "output_loading_info": True,
              "num_labels": num_labels}
    if torch.device(device).type != "cpu":
        kwargs["device_map"] = str(device)
    if config_overrides:  # model_init_kwargs' config fields, set as from_pretrained sets them
        from .loading import config_with_overrides

        config = config_with_overrides(source_dir, config_overrides)
        config.num_labels = num_labels
        kwargs["config"] = config
        del kwargs["num_labels"]  # set on the config: from_pretrained would hand it to the model's constructor
    classifier, info = AutoModelForSequenceClassification.from_pretrained(str(source_dir), **kwargs)
    missing = [key for key in info.get("missing_keys", []) if key != "score.weight"]
    unexpected = [key for key in info.get("unexpected_keys", []) if not str(key).startswith(("lm_head.", "embed_out."))]
    problems = [f"{label} tensors: {sorted(map(str, keys))}" for label, keys in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", info.get("mismatched_keys", []))) if keys]
    if problems:
        raise CheckpointError(f"{source_dir} does not match its config.json:\n  " + "\n  ".join(problems))
    classifier.config._name_or_path = classifier.name_or_path = str(name_or_path)
    warn_fallback(architecture_name(classifier.config), reason)
    return TransformersModel(TransformersSequenceClassifier(classifier), classifier.config, source_dir)


def wrap_transformers_classifier(model, dtype: torch.dtype | None, reason: str) -> TransformersModel:
    """A transformers ``*ForSequenceClassification`` object trained as it is, in place (cast when ``dtype`` differs)."""
    if dtype is not None and next(model.parameters()).dtype != dtype:
        model.to(dtype)
    warn_fallback(architecture_name(model.config), reason)
    wrapper = TransformersSequenceClassifier(model)
    return TransformersModel(wrapper, wrapper.config)


__all__ = ["TransformersSequenceClassifier", "classifier_refusal", "load_transformers_classifier",
           "wrap_transformers_classifier"]
