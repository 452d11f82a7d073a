"""SFTTrainer: TRL's supervised fine-tuning front door (datasets, masks, packing, metrics)."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from hfnative.data import LanguageModelingCollator, pad_token_id_for, prepare_sft_dataset, uses_padding_free
from hfnative.losses.cross_entropy import CrossEntropyOutput, label_positions, shift_labels

from .arguments import SFTConfig
from .model_card import write_model_card
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
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._total_train_tokens = 0
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

    def _prepare_datasets(self, train_dataset, eval_dataset):
        if self.processing_class is None:
            raise ValueError("SFTTrainer needs a processing_class (tokenizer) or a model folder that has one")
        if self.args.chat_template_path is not None:
            self._load_chat_template(self.args.chat_template_path)
        tokenizer = self._tokenizer()
        if self.args.pad_token is not None:
            tokenizer.pad_token = self.args.pad_token
        self._pad_token_id = pad_token_id_for(self.processing_class, self.args.eos_token)
        train = self._prepare(train_dataset, self.args.packing)
        eval_packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing
        if isinstance(eval_dataset, dict):
            evaluation = {name: self._prepare(d, eval_packing) for name, d in eval_dataset.items()}
        else:
            evaluation = self._prepare(eval_dataset, eval_packing)
        return train, evaluation

    def _prepare(self, dataset, packing: bool):
        if dataset is None:
            return None
        a = self.args
        return prepare_sft_dataset(
            dataset,
            self.processing_class,
            dataset_text_field=a.dataset_text_field,
            max_length=a.max_length,
            packing=packing,
            packing_strategy=a.packing_strategy,
            padding_free=a.padding_free,
            completion_only_loss=a.completion_only_loss,
            assistant_only_loss=a.assistant_only_loss,
            eos_token=a.eos_token,
            formatting_func=self.formatting_func,
            dataset_num_proc=a.dataset_num_proc,
            dataset_kwargs=_as_dict(a.dataset_kwargs),
            truncation_mode=a.truncation_mode,
            shuffle_dataset=a.shuffle_dataset,
            seed=a.seed,
        )

    def _load_chat_template(self, path: str) -> None:
        path = Path(path)
        if path.is_dir():
            template = transformers.AutoTokenizer.from_pretrained(str(path)).chat_template
        elif path.suffix == ".jinja" and path.exists():
            template = path.read_text()
        else:
            raise ValueError(f"chat_template_path={str(path)!r}: expected a .jinja file or a tokenizer folder")
        self._tokenizer().chat_template = template

    def _default_collator(self):
        a = self.args
        return LanguageModelingCollator(
            pad_token_id=self._pad_token_id,
            padding_free=uses_padding_free(a.padding_free, a.packing, a.packing_strategy),
            pad_to_multiple_of=a.pad_to_multiple_of,
        )

    # --- loss and metrics --------------------------------------------------------------------------

    def _dft_stats(self, model, inputs) -> CrossEntropyOutput:
        """DFT: each token's NLL weighted by its (detached) probability."""
        hidden_BSD = model.hidden_states(inputs["input_ids"], **self._model_inputs(inputs))
        hidden_ND, targets_N = label_positions(hidden_BSD, shift_labels(inputs["labels"]))
        z_NV = (hidden_ND @ model.output_weight.T).float()
        cap = model.args.final_logit_softcap
        if cap is not None:
            z_NV = torch.tanh(z_NV / cap) * cap
        logp_N = -F.cross_entropy(z_NV, targets_N, reduction="none")
        with torch.no_grad():
            logp_NV = torch.log_softmax(z_NV, -1)
            entropy = -(logp_NV.exp() * logp_NV).sum()
            correct = (z_NV.argmax(-1) == targets_N).sum()
        return CrossEntropyOutput((-logp_N * logp_N.exp().detach()).sum(), entropy, correct, targets_N.shape[0])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        if self.compute_loss_func is not None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        stats = self._dft_stats(model, inputs) if self.args.loss_type == "dft" else self.token_cross_entropy(model, inputs)
        denominator = num_items_in_batch if num_items_in_batch is not None else max(stats.num_tokens, 1)
        loss = stats.loss_sum / denominator
        self._record_metrics(mode, stats, inputs)
        return (loss, stats) if return_outputs else loss

    def _record_metrics(self, mode: str, stats: CrossEntropyOutput, inputs: dict) -> None:
        valid = stats.num_tokens
        self._metrics[mode]["entropy"].append(stats.entropy_sum.item() / valid if valid else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(stats.correct_sum.item() / valid if valid else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                self._total_train_tokens += int(inputs["attention_mask"].sum())
            else:
                self._total_train_tokens += inputs["position_ids"].size(1)
        self._metrics[mode]["num_tokens"] = [float(self._total_train_tokens)]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = {key: sum(values) / len(values) for key, values in self._metrics[mode].items() if values}
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        logs.update(metrics)
        super().log(logs, start_time)
        self._metrics[mode].clear()
