"""SFTTrainer: TRL's supervised fine-tuning front door (datasets, masks, packing, metrics)."""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken

from hfnative.data import LanguageModelingCollator, pad_token_id_for, prepare_sft_dataset, uses_padding_free
from hfnative.data.formats import has_prompt_and_completion
from hfnative.losses import IGNORE_INDEX
from hfnative.models.head import TokenCrossEntropy, TokenLogprobs

from ..loop.arguments import LIGER_DEPRECATION, SFTConfig
from ..running.construction import config_dict
from ..running.model_card import write_model_card
from ..loop.objective import LanguageModelingObjective, enable_router_loss
from ..loop.trainer import Trainer

logger = logging.getLogger(__name__)


def _check_trainer_arguments(args: SFTConfig, data_collator, compute_loss_func) -> None:
    """TRL's checks of the arguments together with the trainer's own (collator, loss function), and its warnings."""
    args.check_for_trainer()
    if args.loss_type == "dft" and compute_loss_func is not None:
        raise ValueError(
            "You passed a `compute_loss_func` together with `loss_type='dft'`: the DFT loss is the trainer's loss "
            "then. Drop `compute_loss_func`, or use `loss_type='nll'` with it."
        )
    if uses_padding_free(args.padding_free, args.packing, args.packing_strategy):
        if data_collator is not None:
            raise ValueError(
                "Passing a custom data collator is not supported when using padding-free (`padding_free=True`, or "
                "packing with the 'bfd' / 'bfd_split' strategy, which flattens each batch into one sequence)."
            )
        if args.packing and args.packing_strategy == "wrapped":
            logger.warning(  # TRL's text, then why
                "You are passing `padding_free=True` with the 'wrapped' packing strategy, which is not "
                "recommended. Please refer to the documentation to understand why this is not recommended. "
                "(Wrapped rows cut documents at row boundaries, and padding-free attention keeps the pieces apart, so "
                "a document's continuation is trained without its beginning. Prefer packing_strategy='bfd'.)"
            )
        if args.per_device_train_batch_size == 1 and not args.packing:
            logger.warning(  # TRL's text
                "You are using a per_device_train_batch_size of 1 with padding-free training. Using a batch size "
                "of 1 annihilate the benefits of padding-free training. Please consider increasing the batch size "
                "to at least 2."
            )
    if compute_loss_func is not None:
        warnings.warn(  # TRL's text
            "`compute_loss_func` is deprecated and will be removed in v2.0.0. Subclass `SFTTrainer` and override "
            "`compute_loss` instead. Expect slower training meanwhile: the loss needs the full logits, so each "
            "step runs an extra forward pass.",
            FutureWarning,
            stacklevel=3,
        )
    if args.use_liger_kernel:
        warnings.warn(LIGER_DEPRECATION, FutureWarning, stacklevel=3)


class SFTTrainer(Trainer):
    """TRL's SFTTrainer: same constructor and SFTConfig; logs loss, grad_norm, learning_rate,
    entropy, mean_token_accuracy, num_tokens and epoch (eval_* in evaluation)."""

    algorithm_name = "SFT"
    config_class = SFTConfig
    requires_train_dataset = True
    _tag_names = ["trl", "sft"]
    logits_for_metrics_warning = (
        "`return_outputs=True`, and the logits it passes to `compute_metrics` and "
        "`preprocess_logits_for_metrics`, are deprecated and will be removed in v2.0.0. The fused LM head does "
        "not build the logits, so they are recomputed with an extra forward pass."
    )

    def __init__(
        self,
        model,
        args: SFTConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
        formatting_func=None,
    ):
        args = self.resolve_args(args, model)
        _check_trainer_arguments(args, data_collator, compute_loss_func)
        self.formatting_func = formatting_func
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self._sync_router_config()

    def _sync_router_config(self) -> None:
        """As TRL's SFTTrainer: a config with a router coefficient gets ``output_router_logits`` =
        ``aux_loss_enabled`` and the coefficient in use (so a saved config.json says what was trained)."""
        text = getattr(self.native_model, "config", None)
        text = text.get_text_config() if text is not None else None
        if text is None or not hasattr(text, "router_aux_loss_coef"):
            return
        coef = self.args.router_aux_loss_coef
        enabled = self.aux_loss_enabled
        text.output_router_logits = enabled
        text.router_aux_loss_coef = text.router_aux_loss_coef if coef is None else coef

    def _make_objective(self):
        return SFTObjective(self.context, formatting_func=self.formatting_func)

    def _tokenizer_settings(self) -> list[int]:
        check_tokenizer_type(self.context.processing_class, "SFTTrainer")
        return apply_tokenizer_settings(self.context, self.args, resize=self.context.resize_vocabulary)

    def _save_checkpoint(self) -> None:
        write_model_card(self, Path(self.args.output_dir))  # TRL refreshes output_dir's card at every checkpoint
        super()._save_checkpoint()

    # --- data --------------------------------------------------------------------------------



def load_chat_template(tokenizer, path: str, config=None, resize=None, generation_config=None,
                       refuse_new_tokens=None) -> list[int]:
    """``chat_template_path``: a .jinja / .j2 file, whose text becomes ``tokenizer``'s template, or a tokenizer folder,
    cloned as TRL's clone_chat_template clones it: its template and EOS (``config``, the model's transformers config,
    and ``generation_config`` get the new eos_token_id), the folder's added tokens the tokenizer lacks, and the model's
    token rows resized to the vocabulary rounded up to a multiple of 64 (``resize(rows)``, the trainer's; rows past the
    end dropped, new ones started at the mean row) with placeholder tokens (``<extra_id_N>``) filling the vocabulary up
    to them. Returns the ids of the tokens added (TRL's ``added_tokens``). Nothing is changed before what refuses has
    spoken: a resize without ``resize`` (the message names what would change), ``resize`` itself, and
    ``refuse_new_tokens(count)`` when tokens would be added."""
    path = Path(path)
    if path.suffix in (".jinja", ".j2") and path.is_file():
        tokenizer.chat_template = path.read_text()
        return []
    if not path.is_dir():
        raise ValueError(f"chat_template_path={str(path)!r}: expected a .jinja / .j2 file or a tokenizer folder")
    source = transformers.AutoTokenizer.from_pretrained(str(path))
    vocab = tokenizer.get_vocab()
    missing = [token for token in source.added_tokens_decoder.values() if token.content not in vocab]
    rows = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    resized = -(-(len(vocab) + len(missing)) // VOCABULARY_MULTIPLE) * VOCABULARY_MULTIPLE
    resizes = resized != rows if rows is not None else bool(missing)
    if resizes and resize is None:
        raise ValueError(
            f"chat_template_path={str(path)!r}: TRL's clone_chat_template would change the vocabulary here ("
            + (f"add the tokens {[t.content for t in missing][:8]} to the tokenizer; " if missing else "")
            + f"resize the model's embeddings from {rows} to {resized} rows), which this run cannot do. Pass the "
            "template as a .jinja file whose special tokens the tokenizer has, or add the tokens and resize the model "
            "yourself (tokenizer.add_tokens, model.resize_token_embeddings) and pass that model and tokenizer"
        )
    target = resized if resizes else rows
    adding = len(missing) + max((target or 0) - len(vocab) - len(missing), 0)  # with the placeholders
    if adding and refuse_new_tokens is not None:
        refuse_new_tokens(adding)
    if resizes:
        resize(resized)
    tokenizer.chat_template = source.get_chat_template()
    tokenizer.add_tokens(missing)
    tokenizer.eos_token = source.eos_token
    if config is not None:
        config.get_text_config().eos_token_id = tokenizer.eos_token_id
    if generation_config is not None:
        generation_config.eos_token_id = tokenizer.eos_token_id
    added = [token.content for token in missing]
    index = 0
    while target is not None and target > len(tokenizer.get_vocab()):  # placeholders up to the rows, as TRL adds them
        placeholder = AddedToken(f"<extra_id_{index}>")
        index += 1
        if tokenizer.add_tokens(placeholder) == 1:
            added.append(placeholder.content)
    return tokenizer.convert_tokens_to_ids(added)


def set_eos_token(tokenizer, eos_token: str, model, processing_class=None) -> None:
    """SFTConfig's ``eos_token`` as TRL's SFTTrainer sets it: the tokenizer's EOS, the model config's eos_token_id,
    and the first of generation_config's EOS ids (the others kept: any of them stops generation)."""
    if eos_token not in tokenizer.get_vocab():
        raise ValueError(
            f"The specified `eos_token` ('{eos_token}') is not found in the vocabulary of the given "
            f"`processing_class` ({type(processing_class or tokenizer).__name__}). Ensure that the `eos_token` exists "
            "in the vocabulary before using it as an EOS token."
        )
    tokenizer.eos_token = eos_token
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    set_token_ids(model, "eos_token_id", tokenizer.eos_token_id,
                  None if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids])


KEEP = object()  # set_token_ids' default: the generation config gets the config's value


def set_token_ids(model, name: str, value, generation_value=KEEP) -> None:
    """``name`` (eos_token_id, pad_token_id) on the model's config (its text config) and ``generation_value`` (by
    default the same; None: left as it is) on its generation config, where the model has them."""
    config = getattr(model, "config", None)
    if config is not None:
        setattr(config.get_text_config(), name, value)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_value is not None:
        setattr(generation_config, name, value if generation_value is KEEP else generation_value)


def check_tokenizer_type(processing_class, trainer: str) -> None:
    """A tokenizer or processor, as TRL's SFT and GKD trainers require."""
    if processing_class is None:
        raise ValueError(f"{trainer} needs a processing_class (tokenizer) or a model folder that has one")
    if not isinstance(processing_class, (transformers.PreTrainedTokenizerBase, transformers.ProcessorMixin)):
        raise TypeError(
            "The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`, got "
            f"{type(processing_class).__name__}: pass e.g. AutoTokenizer.from_pretrained(<model>)."
        )


def mirror_pad_token(tokenizer, model, pad_token: str | None = None) -> None:
    """The tokenizer's pad token (``pad_token``, else its own, else its EOS) set on it and mirrored onto the model's
    config and generation config, as TRL's trainers do from construction (the saved tokenizer, config.json and
    generation_config.json then carry it)."""
    pad_token = pad_token or tokenizer.pad_token or tokenizer.eos_token
    if pad_token is not None:
        tokenizer.pad_token = pad_token
    set_token_ids(model, "pad_token_id", tokenizer.pad_token_id)


def apply_tokenizer_settings(context, args, resize=None) -> list[int]:
    """TRL's SFTTrainer's own tokenizer settings, in its order: ``eos_token``, then ``chat_template_path``
    (``load_chat_template``; ``resize``: the trainer's, where the vocabulary may change). Returns the tokens added."""
    model = context.model
    if args.eos_token is not None:
        set_eos_token(context.tokenizer, args.eos_token, model, context.processing_class)
    if args.chat_template_path is None:
        return []
    return load_chat_template(context.tokenizer, args.chat_template_path, getattr(model, "config", None), resize=resize,
                              generation_config=getattr(model, "generation_config", None),
                              refuse_new_tokens=functools.partial(refuse_new_tokens_under_lora, context=context))


def refuse_new_tokens_under_lora(count: int, context) -> None:
    """Tokens a cloned chat template would add to a model that already carries its adapter (an adapter folder, or a
    model given with one): TRL makes new tokens trainable only as it adds the adapter (peft's
    trainable_token_indices, ``train_new_tokens``), so it says what to do instead."""
    if count and context.uses_adapters:
        raise ValueError(f"chat_template_path: cloning the template adds {count} tokens to the tokenizer of a model "
                         "that already carries an adapter, whose rows for them would not train: clone the template "
                         "on the base model with a new peft_config (the new rows train through "
                         "trainable_token_indices), or merge the adapter first")


# TRL's clone_chat_template rounds the resized vocabulary up to a multiple of this
VOCABULARY_MULTIPLE = 64


class SFTObjective(LanguageModelingObjective):
    """SFT: TRL's dataset preparation and collator; loss "nll" or "dft" over the completion tokens;
    metrics entropy, mean_token_accuracy, num_tokens (and aux_loss for MoE), as TRL logs them."""

    def __init__(self, context, formatting_func=None):
        super().__init__(context)
        self.formatting_func = formatting_func
        self._total_train_tokens = torch.zeros((), dtype=torch.float64, device=context.device)
        self.aux_loss_coef = enable_router_loss(context.model, context.args.router_aux_loss_coef)


    # --- data -----------------------------------------------------------------------------------
    def prepare_datasets(self, train_dataset, eval_dataset):
        context, args = self.context, self.args
        tokenizer = context.tokenizer  # eos_token and chat_template_path are set (SFTTrainer._tokenizer_settings)
        if context.data_collator is None:  # the padding token is the default collator's (TRL checks it only then)
            pad_token = args.pad_token or tokenizer.pad_token or args.eos_token or tokenizer.eos_token
            if pad_token not in tokenizer.get_vocab():
                raise ValueError(
                    f"The specified `pad_token` ('{pad_token}') is not found in the vocabulary of the given "
                    f"`processing_class` ({type(context.processing_class).__name__}): set `tokenizer.pad_token` to a "
                    "token it has."
                )
            mirror_pad_token(tokenizer, context.model, pad_token)
            self._pad_token_id = pad_token_id_for(context.processing_class, args.eos_token)
        self._completion_only_loss = args.completion_only_loss
        if self._completion_only_loss is None:  # as TRL: decided once, by the train dataset's rows, for every dataset
            self._completion_only_loss = has_prompt_and_completion(next(iter(train_dataset), None))
        return super().prepare_datasets(train_dataset, eval_dataset)

    def prepare_train_dataset(self, dataset):
        return self._prepare(dataset, self.args.packing)

    def prepare_eval_dataset(self, dataset):
        """Tokenized, masked, truncated (and packed with eval_packing) as the train dataset. A dataset already
        packed (it has "seq_lengths") is returned as it is; anything else already prepared comes back the same,
        so a prepared dataset may be passed again (e.g. ``evaluate(trainer.eval_dataset)``)."""
        if dataset is None or "seq_lengths" in (getattr(dataset, "column_names", None) or []):
            return dataset
        args = self.args
        return self._prepare(dataset, args.packing if args.eval_packing is None else args.eval_packing)

    def _prepare(self, dataset, packing: bool):
        if dataset is None:
            return None
        a = self.args
        return prepare_sft_dataset(
            dataset,
            self.context.processing_class,
            dataset_text_field=a.dataset_text_field,
            max_length=a.max_length,
            packing=packing,
            packing_strategy=a.packing_strategy,
            padding_free=a.padding_free,
            completion_only_loss=self._completion_only_loss,
            assistant_only_loss=a.assistant_only_loss,
            eos_token=a.eos_token,
            formatting_func=self.formatting_func,
            dataset_num_proc=a.dataset_num_proc,
            dataset_kwargs=config_dict(a.dataset_kwargs),
            truncation_mode=a.truncation_mode,
            shuffle_dataset=a.shuffle_dataset,
            seed=a.seed,
        )

    def default_collator(self):
        a = self.args
        return LanguageModelingCollator(
            pad_token_id=self._pad_token_id,
            padding_free=uses_padding_free(a.padding_free, a.packing, a.packing_strategy),
            pad_to_multiple_of=a.pad_to_multiple_of,
        )

    # --- loss and metrics -------------------------------------------------------------------------
    def loss(self, model, inputs, num_items_in_batch):
        fused = self.args.fused_loss or self.args.use_liger_kernel
        targets_BS = inputs["shift_labels"]
        if self.args.loss_type == "dft":
            outputs = self.forward(model, inputs, TokenLogprobs(targets_BS, fused=fused))
            logprobs_BS, entropy_BS = outputs.head_output
            # DFT: each token's NLL weighted by its (detached) probability
            loss_sum = -(logprobs_BS * logprobs_BS.exp().detach()).sum()
            num_valid = (targets_BS != IGNORE_INDEX).sum()
            entropy_sum = entropy_BS.sum()
            correct_sum = self._top1_hits(model, outputs.hidden_states, targets_BS)
        else:
            outputs = self.forward(model, inputs, TokenCrossEntropy(targets_BS, fused=fused))
            stats = outputs.head_output
            loss_sum, entropy_sum, correct_sum = stats.loss_sum, stats.entropy_sum, stats.correct_sum
            num_valid = torch.as_tensor(stats.num_tokens, device=loss_sum.device)
        denominator = num_items_in_batch if num_items_in_batch is not None else num_valid.clamp(min=1)
        loss = loss_sum / denominator
        # (sum, count) pairs: each micro-batch's ratio is taken over every data-parallel rank's sums, as TRL does
        metrics = {"entropy": (entropy_sum, num_valid), "mean_token_accuracy": (correct_sum, num_valid)}
        if outputs.aux_loss is not None:
            # a per-micro-batch mean (TRL), each rank's loss its share of the whole batch's: logged as the whole
            loss = loss + self.aux_loss_coef * self.context.router_loss(outputs.aux_loss, num_items_in_batch)
            metrics["aux_loss"] = self.context.whole_router_loss(outputs.aux_loss)
        if model.training:
            if "attention_mask" in inputs:
                self._total_train_tokens += inputs["attention_mask"].sum()
            else:
                self._total_train_tokens += inputs["position_ids"].size(1)
        metrics["num_tokens"] = self._total_train_tokens
        return loss, metrics

    @staticmethod
    @torch.no_grad()
    def _top1_hits(model, hidden_BSD, targets_BS) -> torch.Tensor:
        """Label tokens whose target is the argmax (a chunked pass through the head, no gradient)."""
        return model.output(hidden_BSD.detach(), loss=TokenCrossEntropy(targets_BS)).correct_sum
