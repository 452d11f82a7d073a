"""SFTTrainer: TRL's supervised fine-tuning front door (datasets, masks, packing, metrics)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import transformers

from hfnative.data import LanguageModelingCollator, pad_token_id_for, prepare_sft_dataset, uses_padding_free
from hfnative.losses import IGNORE_INDEX
from hfnative.models.head import TokenCrossEntropy, TokenLogprobs

from .arguments import SFTConfig
from .model_card import write_model_card
from .objective import LanguageModelingObjective
from .trainer import Trainer, as_hfnative_args, set_seed

logger = logging.getLogger(__name__)


def _model_name(model) -> str:
    if isinstance(model, (str, Path)):
        return str(model).rstrip("/").split("/")[-1]
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "model")).rstrip("/").split("/")[-1]


def _as_dict(value) -> dict:
    return json.loads(value) if isinstance(value, str) else dict(value or {})


class SFTTrainer(Trainer):
    """TRL's SFTTrainer: same constructor and SFTConfig; logs loss, grad_norm, learning_rate,
    entropy, mean_token_accuracy, num_tokens and epoch (eval_* in evaluation)."""

    algorithm_name = "SFT"
    _tag_names = ["trl", "sft"]

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
        peft_config=None,
        formatting_func=None,
    ):
        if args is None:
            args = SFTConfig(f"{_model_name(model)}-SFT")
        args = as_hfnative_args(args, SFTConfig)
        set_seed(args.seed)
        model_init_kwargs = _as_dict(args.model_init_kwargs)
        if model_init_kwargs and not isinstance(model, (str, Path)):
            logger.warning("model_init_kwargs are ignored: the model is already instantiated")
            model_init_kwargs = {}
        self.formatting_func = formatting_func
        self.peft_config = peft_config
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
            model_init_kwargs=model_init_kwargs,
        )

    @staticmethod
    def _args_class():
        return SFTConfig

    def _make_objective(self):
        return SFTObjective(self)

    def _add_adapters(self) -> None:
        """LoRA / DoRA (and QLoRA's NF4 base) from ``peft_config``: only adapter parameters train."""
        kwargs = self._model_init_kwargs
        quantization = dict(load_in_4bit=bool(kwargs.get("load_in_4bit")), quantization_config=kwargs.get("quantization_config"))
        if self.peft_config is None:
            if self.lora_settings is None and (quantization["load_in_4bit"] or quantization["quantization_config"]):
                raise ValueError("load_in_4bit / quantization_config (QLoRA) quantizes a frozen base: pass a peft_config too")
            return
        if self.lora_settings is not None:
            raise ValueError("model is already a PEFT adapter folder (its adapter keeps training); drop peft_config")
        if self.converted is None:
            raise ValueError("peft_config needs a Hub-format model: a path, a Hub id or a transformers model")
        from hfnative.converters.peft import apply_lora
        from hfnative.peft import lora_settings

        self.lora_settings = lora_settings(self.peft_config)
        apply_lora(self.converted, self.lora_settings, **quantization)

    def _save_checkpoint(self) -> None:
        write_model_card(self, Path(self.args.output_dir))  # TRL refreshes output_dir's card at every checkpoint
        super()._save_checkpoint()

    # --- data --------------------------------------------------------------------------------

    def _tokenizer(self):
        return getattr(self.processing_class, "tokenizer", self.processing_class)

    def _load_chat_template(self, path: str) -> None:
        path = Path(path)
        if path.is_dir():
            template = transformers.AutoTokenizer.from_pretrained(str(path)).chat_template
        elif path.suffix == ".jinja" and path.exists():
            template = path.read_text()
        else:
            raise ValueError(f"chat_template_path={str(path)!r}: expected a .jinja file or a tokenizer folder")
        self._tokenizer().chat_template = template


class SFTObjective(LanguageModelingObjective):
    """SFT: TRL's dataset preparation and collator; loss "nll" or "dft" over the completion tokens;
    metrics entropy, mean_token_accuracy, num_tokens (and aux_loss for MoE), as TRL logs them."""

    def __init__(self, trainer: SFTTrainer):
        super().__init__(trainer)
        self._total_train_tokens = torch.zeros((), dtype=torch.float64, device=trainer.device)
        self.aux_loss_coef = self._enable_aux_loss(trainer.model, trainer.args.router_aux_loss_coef)

    @staticmethod
    def _enable_aux_loss(model, coef: float | None) -> float:
        """TRL's rule: None takes the model config's coefficient; a non-zero coefficient on a model
        without experts is an error; 0.0 turns the router's load-balancing loss off."""
        moe = getattr(getattr(model, "args", None), "moe", None)
        if coef and moe is None:
            raise ValueError(
                f"`router_aux_loss_coef` is set to {coef} but {type(model).__name__} is not a Mixture-of-Experts model "
                "that returns its router logits, so there is no auxiliary loss to weight."
            )
        if moe is None:
            return 0.0
        moe.aux_loss_coef = moe.aux_loss_coef if coef is None else coef
        model.aux_loss_enabled = moe.aux_loss_coef != 0.0
        return moe.aux_loss_coef

    # --- data -----------------------------------------------------------------------------------
    def prepare_datasets(self, train_dataset, eval_dataset):
        trainer, args = self.trainer, self.trainer.args
        if trainer.processing_class is None:
            raise ValueError("SFTTrainer needs a processing_class (tokenizer) or a model folder that has one")
        if args.chat_template_path is not None:
            trainer._load_chat_template(args.chat_template_path)
        tokenizer = trainer._tokenizer()
        if args.pad_token is not None:
            tokenizer.pad_token = args.pad_token
        self._pad_token_id = pad_token_id_for(trainer.processing_class, args.eos_token)
        train = self._prepare(train_dataset, args.packing)
        eval_packing = args.packing if args.eval_packing is None else args.eval_packing
        if isinstance(eval_dataset, dict):
            evaluation = {name: self._prepare(d, eval_packing) for name, d in eval_dataset.items()}
        else:
            evaluation = self._prepare(eval_dataset, eval_packing)
        return train, evaluation

    def _prepare(self, dataset, packing: bool):
        if dataset is None:
            return None
        a = self.trainer.args
        return prepare_sft_dataset(
            dataset,
            self.trainer.processing_class,
            dataset_text_field=a.dataset_text_field,
            max_length=a.max_length,
            packing=packing,
            packing_strategy=a.packing_strategy,
            padding_free=a.padding_free,
            completion_only_loss=a.completion_only_loss,
            assistant_only_loss=a.assistant_only_loss,
            eos_token=a.eos_token,
            formatting_func=self.trainer.formatting_func,
            dataset_num_proc=a.dataset_num_proc,
            dataset_kwargs=_as_dict(a.dataset_kwargs),
            truncation_mode=a.truncation_mode,
            shuffle_dataset=a.shuffle_dataset,
            seed=a.seed,
        )

    def default_collator(self):
        a = self.trainer.args
        return LanguageModelingCollator(
            pad_token_id=self._pad_token_id,
            padding_free=uses_padding_free(a.padding_free, a.packing, a.packing_strategy),
            pad_to_multiple_of=a.pad_to_multiple_of,
        )

    # --- loss and metrics -------------------------------------------------------------------------
    def loss(self, model, inputs, num_items_in_batch):
        fused = self.trainer.args.fused_loss or self.trainer.args.use_liger_kernel
        targets_BS = inputs["shift_labels"]
        if self.trainer.args.loss_type == "dft":
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
            num_valid = torch.tensor(stats.num_tokens, device=loss_sum.device)
        denominator = num_items_in_batch if num_items_in_batch is not None else num_valid.clamp(min=1)
        loss = loss_sum / denominator
        metrics = {
            "entropy": torch.where(num_valid > 0, entropy_sum / num_valid.clamp(min=1), 0.0),
            "mean_token_accuracy": torch.where(num_valid > 0, correct_sum / num_valid.clamp(min=1), 0.0),
        }
        if outputs.aux_loss is not None:
            # a per-micro-batch mean: with a step-wide normalizer, averaged over the accumulation steps (TRL)
            steps = self.trainer._current_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.aux_loss_coef * outputs.aux_loss / steps
            metrics["aux_loss"] = outputs.aux_loss
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
