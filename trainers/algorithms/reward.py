"""RewardTrainer: TRL's outcome reward-model trainer on the one loop.

The model is a native sequence classifier with one score per sequence (``num_labels=1``): a
``*ForSequenceClassification`` checkpoint, or a causal LM whose LM head is replaced by a new score head drawn as
transformers' AutoModelForSequenceClassification draws it under the run's seed. Each batch holds B preference pairs
as [2B, S] (chosen rows, then rejected rows) and runs through the model once; the loss is Bradley-Terry's,
``-log sigmoid(r_chosen - r_rejected - margin)`` averaged over the pairs, plus
``center_rewards_coefficient * mean((r_chosen + r_rejected)^2)`` when set.
"""

from __future__ import annotations

import functools

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import transformers

from hfnative.data.reward import RewardCollator, prepare_reward_dataset
from hfnative.models.decoder import Transformer

from ..running.construction import is_model_name
from ..running.model_card import write_model_card
from ..loop.objective import Objective
from .reward_config import RewardConfig
from .sft import load_chat_template, refuse_new_tokens_under_lora
from ..loop.trainer import Trainer



class RewardTrainer(Trainer):
    """TRL's RewardTrainer: same constructor and RewardConfig; logs loss, grad_norm, learning_rate, accuracy, margin,
    min_reward, mean_reward, max_reward, num_tokens, and eval_* of them in evaluation. Saves a Hub
    ``*ForSequenceClassification`` folder (a PEFT adapter folder with LoRA)."""

    algorithm_name = "Reward"
    config_class = RewardConfig
    requires_train_dataset = True
    _tag_names = ["trl", "reward-trainer"]

    def __init__(
        self,
        model,
        args: RewardConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
    ):
        args = self.resolve_args(args, model)
        if not is_model_name(model):
            num_labels = model.args.num_labels if isinstance(model, Transformer) else getattr(getattr(model, "config", None), "num_labels", None)
            if num_labels != 1:
                raise ValueError(
                    f"The model has `num_labels={num_labels}`, but reward models require `num_labels=1` to output a "
                    "single scalar reward per sequence. Please instantiate your model with `num_labels=1` or pass a "
                    "model name as a string to have it configured automatically."
                )
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

    def _set_model(self, model, before_adapters=None) -> None:
        """The model as a native sequence classifier with one score (a new score head seeded by ``args.seed``)."""
        if not isinstance(model, Transformer):
            self._model_init_kwargs = {**self._model_init_kwargs, "num_labels": 1, "score_seed": self.args.seed}
        super()._set_model(model, before_adapters)
        if getattr(self.native_model.args, "num_labels", None) != 1:
            raise ValueError(
                f"RewardTrainer: the model scores {self.native_model.args.num_labels} labels; a reward model has one "
                "(num_labels=1): pass a *ForSequenceClassification model with num_labels=1 or a model name"
            )

    def _may_load_sharded(self, model) -> bool:
        return False  # every rank loads the whole classifier (its new score head drawn alike), then it is sharded

    def _make_objective(self):
        return RewardObjective(self.context)

    def _tokenizer_settings(self) -> list[int]:
        return reward_tokenizer_settings(self.context, self.args)

    def _save_checkpoint(self) -> None:
        write_model_card(self, Path(self.args.output_dir))  # TRL refreshes output_dir's card at every checkpoint
        super()._save_checkpoint()


def reward_tokenizer_settings(context, args) -> list[int]:
    """RewardConfig's eos_token, then chat_template_path, as TRL applies them before the adapters; returns the
    tokens the template added."""
    tokenizer_types = (transformers.PreTrainedTokenizerBase, transformers.ProcessorMixin)
    if not isinstance(context.processing_class, tokenizer_types):
        raise TypeError("The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`")
    tokenizer = context.tokenizer
    config = getattr(context.model, "config", None)  # None for a bare native model given without one
    if args.eos_token is not None:
        check_in_vocabulary(context.processing_class, args.eos_token, "eos_token")
        tokenizer.eos_token = args.eos_token
        if config is not None:
            config.get_text_config().eos_token_id = tokenizer.eos_token_id
    if args.chat_template_path is None:
        return []
    return load_chat_template(tokenizer, args.chat_template_path, config, resize=context.resize_vocabulary,
                              refuse_new_tokens=functools.partial(refuse_new_tokens_under_lora, context=context))


def check_in_vocabulary(processing_class, token: str, name: str) -> None:
    if token not in processing_class.get_vocab():
        raise ValueError(
            f"The specified `{name}` ('{token}') is not found in the vocabulary of the given `processing_class` "
            f"({type(processing_class).__name__}). Ensure that the `{name}` exists in the vocabulary before using it."
        )


class RewardObjective(Objective):
    """Reward modeling: TRL's tokenization and batches of preference pairs, the Bradley-Terry loss with margins and
    centering, TRL's reward metrics (min / mean / max_reward over every data-parallel rank's rewards)."""

    # data parallel (DDP, FSDP2); the score head is not split by tensor parallelism, nor the pooled row by context
    # parallelism
    supports = frozenset({"multi_process", "evaluation"})

    def __init__(self, context):
        super().__init__(context)
        self._total_train_tokens = torch.zeros((), dtype=torch.float64, device=context.device)

    # --- data -----------------------------------------------------------------------------------
    def prepare_datasets(self, train_dataset, eval_dataset):
        """The tokenizer's EOS, chat template and pad token set as TRL sets them (the model pools at that pad
        token), then the datasets tokenized."""
        context, args = self.context, self.args
        tokenizer = context.tokenizer  # eos_token and chat_template_path are set (``tokenizer_settings``)
        config = getattr(context.model, "config", None)  # None for a bare native model given without one
        text_config = config.get_text_config() if config is not None else SimpleNamespace()
        pad_token = args.pad_token or tokenizer.pad_token or tokenizer.eos_token
        check_in_vocabulary(context.processing_class, pad_token, "pad_token")
        tokenizer.pad_token = pad_token
        text_config.pad_token_id = tokenizer.pad_token_id  # where the score is read: the last token that is not this
        context.model.args.pad_token_id = tokenizer.pad_token_id
        return super().prepare_datasets(train_dataset, eval_dataset)

    def prepare_train_dataset(self, dataset):
        return self._prepare(dataset)

    def prepare_eval_dataset(self, dataset):
        return self._prepare(dataset)

    def _prepare(self, dataset):
        args = self.args
        return prepare_reward_dataset(dataset, self.context.processing_class, max_length=args.max_length,
                                      dataset_num_proc=args.dataset_num_proc,
                                      remove_unused_columns=args.remove_unused_columns)

    def default_collator(self):
        return RewardCollator(pad_token_id=self.context.tokenizer.pad_token_id,
                              pad_to_multiple_of=self.args.pad_to_multiple_of)

    # --- loss and metrics (each micro-batch's loss is its mean over its pairs: the default normalizer) -----------
    def loss(self, model, inputs, num_items_in_batch):
        rewards_B2L = model(inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                            position_ids=inputs.get("position_ids"), attention_plan=inputs.get("attention_plan")).logits
        chosen_B, rejected_B = rewards_B2L.squeeze(-1).chunk(2, dim=0)
        difference_B = chosen_B - rejected_B
        if "margin" in inputs:
            difference_B = difference_B - inputs["margin"]
        loss = -F.logsigmoid(difference_B).mean()
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * ((chosen_B + rejected_B) ** 2).mean()
        if model.training:
            self._total_train_tokens += inputs["attention_mask"].sum()
        rewards = rewards_B2L.detach().float()
        chosen_B, rejected_B = chosen_B.detach(), rejected_B.detach()
        data_parallel = self.context.data_parallel  # the whole batch's rewards, as TRL gathers them
        count = rewards.new_full((), float(rewards.numel()))  # made on the device: no copy from the host
        return loss, {
            "num_tokens": self._total_train_tokens,
            "min_reward": -data_parallel.max(-rewards.min()),
            "mean_reward": data_parallel.sum(rewards.sum()) / data_parallel.sum(count),
            "max_reward": data_parallel.max(rewards.max()),
            "accuracy": (chosen_B > rejected_B).float().mean(),
            "margin": (chosen_B - rejected_B).mean(),
        }

    # --- evaluation: a batch of pairs carries no labels; its loss is the pairs' mean; compute_metrics gets the
    # rewards [2B, 1] (chosen rows, then rejected) and label_ids=(), as TRL (no label names) hands them ----------
    def has_eval_loss(self, inputs: dict) -> bool:
        return True

    def eval_outputs(self, model, inputs: dict):
        return model(inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                     position_ids=inputs.get("position_ids"), attention_plan=inputs.get("attention_plan")).logits, ()

    def samples_in_batch(self, inputs: dict) -> int:
        return inputs["input_ids"].shape[0] // 2  # pairs: chosen and rejected rows


def cli_command():
    """``hfnative-train reward``: TRL's ``trl reward`` flags (script, RewardConfig and model arguments)."""
    from ..running import cli

    return cli.Command("Reward modeling (TRL's `trl reward`)", RewardConfig, RewardTrainer, cli.train_model)
