"""What every trainer's constructor does with its arguments before the loop is built. ``Trainer.__init__`` calls
these (and sets the seed and turns dropout off where the config asks); a trainer class states only its
``config_class``, ``algorithm_name``, ``requires_train_dataset`` and ``refuses_quantization_of_instances`` (class
attributes of ``Trainer``) and what its own extra arguments are.

TRL's trainers agree on each of these steps, with one exception kept per trainer: its DPOTrainer refuses a
``quantization_config`` with an instantiated model, where the others warn that it is ignored.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import fields

from datasets import Dataset, IterableDataset

from ..loop.arguments import TRLBaseConfig

logger = logging.getLogger(__name__)


def as_hfnative_args(args, cls):
    """Accept transformers' (or TRL's) argument objects: same fields, our class."""
    if isinstance(args, cls):
        return args
    names = {f.name for f in fields(cls) if f.init}
    values = {f.name: getattr(args, f.name) for f in fields(args) if f.init and f.name in names}
    return cls(**values)


def as_config(args, config_class, model, algorithm_name: str):
    """``args`` as a ``config_class``; when None, its defaults with TRL's output_dir "<model name>-<algorithm_name>"
    (transformers' "tmp_trainer" for a config that is not a TRL trainer's)."""
    if args is not None:
        return as_hfnative_args(args, config_class)
    if issubclass(config_class, TRLBaseConfig):
        return config_class(output_dir=f"{model_name(model)}-{algorithm_name}")
    return config_class(output_dir="tmp_trainer")


def is_model_name(model) -> bool:
    """A model given by name (a folder or a Hub id), loaded by the trainer, rather than a model object."""
    return isinstance(model, (str, os.PathLike))


def model_name(model) -> str:
    """The model's last path component (TRL names a run without ``args`` "<this>-<algorithm>"): of the path or Hub
    id, else of the model config's ``_name_or_path``, else "model"."""
    if is_model_name(model):
        name = model
    else:
        name = getattr(getattr(model, "config", None), "_name_or_path", None) or "model"
    return str(name).rstrip("/").split("/")[-1]


def config_dict(value) -> dict:
    """A config field that holds a dict, a JSON string of one, or None, as a new dict."""
    return json.loads(value) if isinstance(value, str) else dict(value or {})


def check_train_dataset(train_dataset, trainer_name: str) -> None:
    """TRL's checks: a train dataset is required, and it is a Dataset or IterableDataset (hfnative also takes a
    list of dicts)."""
    if train_dataset is None:
        raise ValueError(
            f"`train_dataset` is required: pass the rows {trainer_name} trains on (a datasets.Dataset, an "
            "IterableDataset or a list of dicts)"
        )
    if isinstance(train_dataset, (Dataset, IterableDataset)):
        return
    if isinstance(train_dataset, list) and all(isinstance(row, dict) for row in train_dataset):
        return
    raise TypeError(
        f"`train_dataset` must be a `Dataset` or `IterableDataset`, got `{type(train_dataset).__name__}`. "
        "(hfnative also accepts a list of dicts.)"
    )


def check_peft_config(peft_config, model) -> None:
    """TRL requires a peft.PeftConfig; hfnative also takes a dict of LoraConfig's fields (the CLI's) or LoraSettings."""
    from hfnative.peft import LoraSettings

    if peft_config is not None and type(model).__name__.startswith("PeftModel"):
        raise ValueError(
            "You passed a `PeftModel` instance together with a `peft_config`: a model has one adapter here. To keep "
            "training the existing adapter, save it and pass its folder as `model` without `peft_config`; for a new "
            "adapter, merge the old one into the base (merge_and_unload), save that and pass it as `model`."
        )
    if peft_config is None or isinstance(peft_config, (dict, LoraSettings)):
        return
    try:
        from peft import PeftConfig
    except ImportError:
        PeftConfig = ()
    if not isinstance(peft_config, PeftConfig):
        raise TypeError(
            "`peft_config` must be a `peft.PeftConfig` instance (e.g. `peft.LoraConfig`), got "
            f"{type(peft_config).__name__}."
        )


def head_tied_to_embedding(model) -> bool:
    """Whether ``model``'s output head is its token embedding (a native model's ``tie_embeddings``, else its
    transformers config's ``tie_word_embeddings``); never for a sequence classifier, whose head is a score head."""
    if getattr(getattr(model, "args", None), "num_labels", None) is not None:
        return False
    tied = getattr(getattr(model, "args", None), "tie_embeddings", None)
    if tied is None:
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None else None
        tied = getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))
    return bool(tied)


def train_new_tokens(peft_config, token_ids: list[int], tied_head: bool) -> None:
    """Tokens a cloned chat template added, made trainable under ``peft_config`` (changed in place) as TRL's SFT and
    reward trainers make them: their embedding rows through peft's ``trainable_token_indices`` (under
    ``"embed_tokens"``, joined to any the config names), and an untied output head in full (``"lm_head"`` added to
    ``modules_to_save``, with TRL's warning when the config did not list it). A head tied to the embedding
    (``tied_head``) trains those rows with the embedding's (peft ties the two token adapters); TRL adds it to
    modules_to_save there too, which makes an adapter neither TRL's fused head nor peft's forward can run, so it is
    left out, and the log says so."""
    if isinstance(peft_config, dict):
        get, set_ = peft_config.get, peft_config.__setitem__
    else:
        get, set_ = (lambda name: getattr(peft_config, name, None)), (lambda name, value: setattr(peft_config, name, value))
    indices = get("trainable_token_indices")
    if indices is None:
        set_("trainable_token_indices", {"embed_tokens": list(token_ids)})
    elif isinstance(indices, dict):
        listed = list(indices.get("embed_tokens", []))  # ids listed already (a config used twice) are not repeated
        indices["embed_tokens"] = listed + [i for i in token_ids if i not in listed]
    else:  # a list names rows of the input embedding, as the dict's "embed_tokens" does
        set_("trainable_token_indices", {"embed_tokens": list(indices) + [i for i in token_ids if i not in indices]})
    modules_to_save = get("modules_to_save")
    if tied_head:
        if modules_to_save is None or "lm_head" not in modules_to_save:
            logger.warning("Cloning chat template added new tokens to the tokenizer; the model's output head is tied to "
                           "its embedding, so the head's rows for them train with the embedding's "
                           "(trainable_token_indices), and 'lm_head' is not added to PEFT's `modules_to_save` (a trained "
                           "copy of a tied head makes an adapter peft cannot run).")
        return
    if modules_to_save is None or "lm_head" not in modules_to_save:
        logger.warning(
            "Cloning chat template added new tokens to the tokenizer, but 'lm_head' is not in PEFT's `modules_to_save`. "
            "As a result, the model may not learn to generate outputs with these new tokens, leading to degraded "
            "generation quality. To fix this, add `modules_to_save=['lm_head']` to your PEFT configuration."
        )
        set_("modules_to_save", list(modules_to_save or []) + ["lm_head"])


def model_init_kwargs(model, args, quantization_config=None, refuse_quantization_of_instances: bool = False) -> dict:
    """How a model given by name is loaded: a copy of ``args.model_init_kwargs`` with the config's ``dtype`` (where it
    has one) and the trainer's ``quantization_config`` added (set in both places, it is an error). A model object is used as it is, so both
    are ignored, with TRL's warning; ``refuse_quantization_of_instances``: a ``quantization_config`` with a model
    object is an error instead (TRL's DPOTrainer)."""
    given = getattr(args, "model_init_kwargs", None)
    if not is_model_name(model):
        if given is not None:
            logger.warning(  # TRL's text
                f"You passed `model_init_kwargs` to the `{type(args).__name__}`, but your model is already instantiated. "
                "The `model_init_kwargs` will be ignored."
            )
        if quantization_config is not None and refuse_quantization_of_instances:
            raise ValueError(
                "You passed `quantization_config` to the trainer, but your model is already instantiated: pass the "
                "model as a path or Hub id, or omit `quantization_config`."
            )
        if quantization_config is not None:
            logger.warning(  # TRL's text
                "You passed `quantization_config` to the trainer, but your model is already instantiated. The "
                "`quantization_config` will be ignored."
            )
        return {}
    kwargs = config_dict(given)
    if getattr(args, "dtype", None) is not None and not {"dtype", "torch_dtype"} & set(kwargs):
        kwargs["dtype"] = args.dtype  # a config's own dtype field (AsyncGRPOConfig's); model_init_kwargs' wins
    if quantization_config is not None:
        if "quantization_config" in kwargs:
            raise ValueError(
                "You set `quantization_config` both as a trainer argument and in `args.model_init_kwargs`: keep one "
                "of them (the trainer argument, say)."
            )
        kwargs["quantization_config"] = quantization_config
    return kwargs
