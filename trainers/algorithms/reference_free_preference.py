"""What ORPO and CPO share on the one loop: paired preference rows tokenized by TRL's rules for these trainers, one
forward of the policy over [2B, S] (chosen rows, then rejected), and the per-token log-probs of every position from the
head's chunked log-prob loss (no [2B, S, V] logits). No reference model: the losses read the policy's own log-probs.

Shapes: B pairs, S positions; position t's target is token t + 1 (the last position's is a placeholder, masked out).
"""

from __future__ import annotations

import logging
import random
from abc import abstractmethod
from dataclasses import replace

import torch
import torch.nn.functional as F
import transformers

from hfnative.data.paired_preference import PairedPreferenceCollator, prepare_paired_preference_dataset
from hfnative.generation.sampling import SamplingParams
from hfnative.log_once import warn_once
from hfnative.losses.preference import sft_loss
from hfnative.models.attention import transformers_padding_plan
from hfnative.models.head import TokenLogprobs

from ..loop.objective import Objective, enable_router_loss
from ..loop.trainer import Trainer
from ..rollout.component import Rollout
from ..rollout.prompts import stop_token_ids

logger = logging.getLogger(__name__)

# transformers 5's generate() values for sampling settings a generation config leaves unset
GENERATE_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0}


class ReferenceFreePreferenceTrainer(Trainer):
    """TRL's experimental ORPOTrainer / CPOTrainer constructor on the one loop (a subclass names its config and
    objective)."""

    requires_train_dataset = True
    objective_class: type[Objective]

    def __init__(
        self,
        model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        compute_metrics=None,
    ):
        args = self.resolve_args(args, model)
        args.check_for_trainer(type(self).__name__)
        if args.max_length is None:  # TRL's warnings, word for word
            logger.warning(f"`max_length` is not set in the {type(args).__name__}'s init it will default to `512` by "
                           "default, but you should do it yourself in the future.")
        if data_collator is None and args.remove_unused_columns:
            args.remove_unused_columns = False  # as TRL sets it: its collator reads the raw columns
            logger.warning("When using DPODataCollatorWithPadding, you should set `remove_unused_columns=False` in your "
                           "TrainingArguments we have set it for you, but you should do it yourself in the future.")
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
            compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics, peft_config=peft_config,
        )

    def _make_objective(self):
        return self.objective_class(self.context)

    def _router_loss_rule(self) -> bool:
        """TRL's rule here: the model config's ``output_router_logits``."""
        return bool(getattr(getattr(self.native_model, "config", None), "output_router_logits", False))


def shift_mask(mask_BS: torch.Tensor) -> torch.Tensor:
    """Whether each position's target (the next token) is in ``mask_BS``: [B, S], 0 at the last position."""
    return F.pad(mask_BS[:, 1:], (0, 1)).to(torch.float32)


class ReferenceFreePreferenceObjective(Objective):
    """The shared pieces; a subclass's ``preference_loss(sums, inputs)`` returns the micro-batch loss and metrics.
    Each micro-batch's loss is its own mean (the default normalizer), as TRL's."""

    # the logged mean logit runs over every position of the padded batch (pads included, as TRL's): a layout that
    # pads or splits the sequences (tensor, context parallel) would change it
    supports = frozenset({"multi_process", "multi_process_generation", "evaluation"})
    pads_with_eos = False  # CPO sets a missing pad token to EOS; ORPO requires one

    def __init__(self, context):
        super().__init__(context)
        model = context.model
        # TRL adds the router's load-balancing loss when the model config asks for router logits
        wants_router_loss = getattr(getattr(model, "config", None), "output_router_logits", False)
        if wants_router_loss and getattr(model.config, "router_aux_loss_coef", 0.0) == 0.0:
            logger.warning(  # TRL's text
                "You set `output_router_logits` to `True` in the model config, but `router_aux_loss_coef` is set to "
                "`0.0`, meaning the auxiliary loss will not be used. Either set `router_aux_loss_coef` to a value "
                "greater than `0.0`, or set `output_router_logits` to `False` if you don't want to use the auxiliary "
                "loss."
            )
        self.aux_loss_coef = enable_router_loss(model, None if wants_router_loss else 0.0)

    def generates(self) -> bool:
        return bool(self.args.generate_during_eval)

    # --- generate_during_eval -----------------------------------------------------------------------------
    def evaluation_starts(self, dataset) -> None:
        """TRL's generate_during_eval: ``eval_batch_size`` rows drawn from the evaluated ``dataset`` (the same rows on
        every rank: drawn from the run's seed and step), each prompt completed by the policy with sampling (its
        generation config's temperature, top-k and top-p, as transformers' ``generate(do_sample=True)`` reads them,
        up to ``max_length`` tokens with the longest prompt), and the table ``game_log`` (Prompt, Policy: the texts
        without special tokens) logged to W&B and Comet when ``report_to`` names them (by the first rank)."""
        args, context = self.args, self.context
        if not args.generate_during_eval or dataset is None:
            return
        if not hasattr(dataset, "__len__") or "chosen_prompt_length" not in (getattr(dataset, "column_names", None) or []):
            warn_once(logger, "generate_during_eval: this evaluation's dataset is not the prepared rows the trainer "
                             f"draws prompts from ({type(dataset).__name__}: a stream, or a loader of your own); "
                             "game_log is logged for prepared map-style eval datasets only")
            return
        if len(dataset) == 0:
            return
        step = context.state.global_step
        indices = random.Random(args.seed * 1_000_003 + step).sample(range(len(dataset)), min(args.eval_batch_size,
                                                                                             len(dataset)))
        rows = [dataset[i] for i in indices]
        prompts = [list(row["chosen_input_ids"][: row["chosen_prompt_length"]]) for row in rows]
        new_tokens = max(1, args.sequence_length_limit - max(len(p) for p in prompts))
        # a sampler for this table alone: its engine, caches and (for a sharded policy) whole replica are let go with
        # it, not kept through training as a trainer that generates every step keeps them
        rollout = Rollout(context, self._sampling())
        sampling = replace(rollout.sampling, max_new_tokens=new_tokens,
                           **rollout.row_streams((1 << 42) + step, len(prompts)))
        completions = rollout.sample(prompts, sampling).completion_ids
        del rollout
        if not context.state.is_world_process_zero:
            return
        import pandas as pd

        decode = context.tokenizer.decode
        table = pd.DataFrame({"Prompt": [decode(p, skip_special_tokens=True) for p in prompts],
                              "Policy": [decode(c, skip_special_tokens=True) for c in completions]})
        report_to = args.report_to or []
        if "wandb" in report_to:
            import wandb

            wandb.log({"game_log": wandb.Table(dataframe=table)})
        if "comet_ml" in report_to:
            import comet_ml

            experiment = comet_ml.get_running_experiment()
            if experiment is not None:
                experiment.log_table(tabular_data=table, filename="game_log.csv")

    def _sampling(self) -> SamplingParams:
        """transformers' sampling settings for ``generate(do_sample=True)``: the policy's generation config (its
        defaults where it has none), stopping at the tokenizer's and the config's EOS tokens."""
        config = getattr(self.context.model, "generation_config", None) or transformers.GenerationConfig()
        defaults = {**GENERATE_DEFAULTS, **getattr(transformers.GenerationConfig, "_get_default_generation_params",
                                                     dict)()}  # what generate() fills in

        def setting(name):
            value = getattr(config, name, None)
            return defaults.get(name) if value is None else value

        return SamplingParams(max_new_tokens=1, do_sample=True, temperature=setting("temperature"),
                              top_k=setting("top_k"), top_p=setting("top_p"), min_p=setting("min_p") or 0.0,
                              repetition_penalty=setting("repetition_penalty"),
                              eos_token_id=stop_token_ids(self.context.tokenizer, self.context.model))

    # --- data -------------------------------------------------------------------------------------------
    def prepare_datasets(self, train_dataset, eval_dataset):
        context = self.context
        tokenizer_types = (transformers.PreTrainedTokenizerBase, transformers.ProcessorMixin)
        if not isinstance(context.processing_class, tokenizer_types):
            raise TypeError("The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`")
        tokenizer = context.tokenizer
        if tokenizer.pad_token is None and self.pads_with_eos:
            tokenizer.pad_token = tokenizer.eos_token
        if context.data_collator is None and tokenizer.pad_token_id is None:
            raise ValueError("Padding is enabled, but the tokenizer is not configured with a padding token: set "
                             "`tokenizer.pad_token` (e.g. `tokenizer.pad_token = tokenizer.eos_token`) before training.")
        return super().prepare_datasets(train_dataset, eval_dataset)

    def prepare_train_dataset(self, dataset):
        return self._prepare(dataset)

    def prepare_eval_dataset(self, dataset):
        return self._prepare(dataset)

    def _prepare(self, dataset):
        args = self.args
        return prepare_paired_preference_dataset(dataset, self.context.processing_class, args.sequence_length_limit,
                                                 args.dataset_num_proc)

    @property
    def padding_value(self) -> int | None:
        return None

    def default_collator(self):
        return PairedPreferenceCollator(self.context.tokenizer.pad_token_id, self.padding_value)

    # --- log-probs and the loss -------------------------------------------------------------------------
    def loss(self, model, inputs, num_items_in_batch):
        input_ids_BS = inputs["input_ids"]
        targets_BS = F.pad(input_ids_BS[:, 1:], (0, 1))  # every position projected: the mean logit runs over them all
        head_loss = TokenLogprobs(targets_BS, fused=self.args.fused_loss, statistics=("mean_logits",))
        inputs = {**inputs, "attention_plan": transformers_padding_plan(inputs["attention_plan"], inputs["attention_mask"])}
        outputs = self.forward(model, inputs, head_loss)
        token_logps_BS, _, stats = outputs.head_output
        completion_BS = shift_mask(inputs["completion_mask"])
        sums = {
            "token_logps": token_logps_BS,
            "mean_logits": stats["mean_logits"],
            "completion": completion_BS,
            "attended": shift_mask(inputs["attention_mask"]),
            "logps": (token_logps_BS * completion_BS).sum(dim=1),
            "lengths": completion_BS.sum(dim=1),
        }
        loss, metrics = self.preference_loss(sums)
        if outputs.aux_loss is not None:
            loss = loss + self.aux_loss_coef * self.context.router_loss(outputs.aux_loss, num_items_in_batch)
        return loss, metrics

    @staticmethod
    def chosen_nll(token_logps_BS, mask_BS) -> torch.Tensor:
        """The chosen rows' mean token NLL over ``mask_BS``'s targets (DPO's sft term)."""
        chosen_sums_B, _ = (token_logps_BS * mask_BS).sum(dim=1).chunk(2, dim=0)
        chosen_tokens_B, _ = mask_BS.sum(dim=1).chunk(2, dim=0)
        return sft_loss(chosen_sums_B, chosen_tokens_B)[0]

    @staticmethod
    def reward_metrics(chosen_logps, rejected_logps, chosen_rewards, rejected_rewards, mean_logits_BS) -> dict:
        """TRL's metrics shared by ORPO and CPO (per micro-batch; the logits' mean over ``mean_logits_BS``'s
        positions, pads included)."""
        chosen_logits, rejected_logits = mean_logits_BS.chunk(2, dim=0)
        return {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/rejected": rejected_logps.detach().mean(),
            "logps/chosen": chosen_logps.detach().mean(),
            "logits/rejected": rejected_logits.mean(),
            "logits/chosen": chosen_logits.mean(),
        }

    @abstractmethod
    def preference_loss(self, sums: dict) -> tuple[torch.Tensor, dict]:
        """The micro-batch's loss and metrics from ``sums`` (per row [2B]: logps, lengths; per position [2B, S]:
        token_logps, mean_logits, completion and attended target masks)."""

    # --- evaluation: the loss and TRL's metrics under eval_; compute_metrics gets the logged mean logits -----------------------------------------------
    def has_eval_loss(self, inputs: dict) -> bool:
        return True

    def eval_outputs(self, model, inputs: dict):
        """What TRL's prediction_step hands compute_metrics: the batch's logged mean logits [chosen, rejected] as
        the "logits" and zeros as the labels."""
        _, metrics = self.loss(model, inputs, None)
        logits = torch.stack([metrics["logits/chosen"], metrics["logits/rejected"]]).float()
        return logits, torch.zeros_like(logits)

    def samples_in_batch(self, inputs: dict) -> int:
        return inputs["input_ids"].shape[0] // 2  # pairs: chosen and rejected rows


__all__ = ["ReferenceFreePreferenceObjective", "ReferenceFreePreferenceTrainer", "shift_mask", "transformers_padding_plan"]
