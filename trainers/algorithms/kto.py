"""KTOTrainer: TRL's Kahneman-Tversky Optimization front door on the one loop.

Each batch holds B unpaired rows (prompt, completion, label) as [B, S], and, unless the loss is KL-free, the same
prompts with mismatched completions as "KL_" [B, S'] (each row given the previous row's completion within its
per-device batch, as TRL builds them). The policy's sequence log-probs come from the head's chunked log-prob loss
on the completion positions only (no [B, S, V] logits); the KL estimate ``mean(logp_KL - ref_logp_KL)`` over every
data-parallel rank's rows (clamped at 0) is KTO's reference point. The reference is handled as DPO's
(trainers/algorithms/reference_model.py).
"""

from __future__ import annotations

import logging

import torch
import transformers

from hfnative.data.unpaired_preference import (
    UnpairedPreferenceCollator,
    desirability_warning,
    prepare_unpaired_preference_dataset,
)
from hfnative.losses import IGNORE_INDEX, shift_labels
from hfnative.losses.unpaired_preference import unpaired_preference_losses
from hfnative.models.head import TokenLogprobs

from .kto_config import KTOConfig
from ..loop.objective import Objective, RankSums, enable_router_loss, ratio_if_any, with_transformers_padding
from .reference_model import PREFERENCE_LOGITS_FOR_METRICS_WARNING, ReferenceModel, ReferenceTrainer, router_loss_off
from ..loop.trainer import Trainer
from .sft import mirror_pad_token

logger = logging.getLogger(__name__)


class KTOTrainer(ReferenceTrainer, Trainer):
    """TRL's KTOTrainer: same constructor and KTOConfig; logs loss, grad_norm, learning_rate, kl, entropy,
    num_tokens, logits/chosen, logits/rejected, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen,
    logps/rejected (aux_loss for MoE), eval_* in evaluation."""

    algorithm_name = "KTO"
    config_class = KTOConfig
    requires_train_dataset = True
    refuses_quantization_of_instances = True  # as TRL's KTOTrainer
    _tag_names = ["trl", "kto"]
    logits_for_metrics_warning = PREFERENCE_LOGITS_FOR_METRICS_WARNING

    def __init__(
        self,
        model,
        ref_model=None,
        args: KTOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
    ):
        args = self.resolve_args(args, model)
        self._take_reference_source(args, model, ref_model, peft_config)
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
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

    def _make_objective(self):
        return KTOObjective(self.context, self._reference_for_objective(), reference_given=self._ref_given)


def completion_targets(input_ids_BS: torch.Tensor, completion_mask_BS: torch.Tensor) -> torch.Tensor:
    """Next-token targets [B, S]: the completion tokens, IGNORE_INDEX elsewhere."""
    return shift_labels(input_ids_BS.masked_fill(completion_mask_BS == 0, IGNORE_INDEX))


def _margin_if_both(chosen_sum, chosen_count, rejected_sum, rejected_count) -> float | None:
    """rewards/margins: mean chosen reward - mean rejected reward, when the batch has both."""
    if chosen_count > 0 and rejected_count > 0:
        return chosen_sum / chosen_count - rejected_sum / rejected_count
    return None


class KTOObjective(Objective):
    """KTO: unpaired rows tokenized and collated as TRL does; the KTO / APO-zero-unpaired losses on the policy's and
    the reference's completion log-probs and the batch's KL estimate; TRL's KTO metrics."""

    # the KL estimate is summed over the data-parallel ranks; the mismatched sequences are not split for context
    # parallel (and expert parallel is not tested with them)
    supports = frozenset({"multi_process", "tensor_parallel", "evaluation"})

    def __init__(self, context, reference, reference_given: bool):
        super().__init__(context)
        self._total_train_tokens = torch.zeros((), dtype=torch.float64, device=context.device)
        self.aux_loss_coef = enable_router_loss(context.model, context.args.router_aux_loss_coef)
        self.reference = ReferenceModel(self, reference, reference_given)

    def auxiliary_models_ready(self) -> None:
        self.reference.ready()

    # --- data -----------------------------------------------------------------------------------
    def prepare_datasets(self, train_dataset, eval_dataset):
        context = self.context
        tokenizer_types = (transformers.PreTrainedTokenizerBase, transformers.ProcessorMixin)
        if not isinstance(context.processing_class, tokenizer_types):
            raise TypeError("The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`")
        mirror_pad_token(context.tokenizer, context.model)  # TRL's: the EOS pads when the tokenizer has no pad token
        return super().prepare_datasets(train_dataset, eval_dataset)

    def prepare_train_dataset(self, dataset):
        dataset = self._prepare(dataset, self.args.per_device_train_batch_size)
        if dataset is not None and hasattr(dataset, "__len__"):
            advice = desirability_warning(dataset["label"], self.args.desirable_weight, self.args.undesirable_weight)
            if advice is not None:
                logger.warning(advice)
        return dataset

    def prepare_eval_dataset(self, dataset):
        return self._prepare(dataset, self.args.per_device_eval_batch_size)

    def _prepare(self, dataset, batch_size: int):
        if dataset is None:
            return None
        args = self.args
        first = next(iter(dataset), None)
        if isinstance(first, dict) and ("image" in first or "images" in first):
            raise ValueError("The dataset appears to be vision-related (contains 'image' or 'images' keys): "
                             "hfnative's KTOTrainer trains text models only.")
        # the mismatched completions rotate within runs of the per-device train batch (TRL's, for eval data too)
        dataset = prepare_unpaired_preference_dataset(
            dataset, self.context.processing_class, max_length=args.max_length,
            kl_group_size=args.per_device_train_batch_size if args.uses_kl else None,
            dataset_num_proc=args.dataset_num_proc, remove_unused_columns=args.remove_unused_columns,
        )
        if args.precompute_ref_log_probs and "ref_logps" not in (dataset.column_names or []):
            dataset = self.reference.precompute(dataset, args.precompute_ref_batch_size or batch_size,
                                                self._reference_columns)
        return dataset

    def _reference_columns(self, inputs) -> dict[str, torch.Tensor]:
        columns = {"ref_logps": self.reference_logps(inputs)}
        if self.args.uses_kl:
            columns["ref_KL_logps"] = self.reference_logps(self._kl_inputs(inputs))
        return columns

    def default_collator(self):
        args = self.args
        return UnpairedPreferenceCollator(pad_token_id=self.context.tokenizer.pad_token_id, max_length=args.max_length,
                                          pad_to_multiple_of=args.pad_to_multiple_of)

    def after_optimizer_step(self) -> None:
        self.reference.after_optimizer_step()

    # --- log-probs ------------------------------------------------------------------------------------
    def _kl_inputs(self, inputs: dict) -> dict:
        """The mismatched sequences as model inputs, prepared by the loop as the batch's own (their attention plan,
        padding for tensor parallel)."""
        return self.context.prepare_inputs({"input_ids": inputs["KL_input_ids"],
                                            "attention_mask": inputs["KL_attention_mask"],
                                            "completion_mask": inputs["KL_completion_mask"]})

    def _completion_head(self, inputs, statistics=()) -> TokenLogprobs:
        targets_BS = completion_targets(inputs["input_ids"], inputs["completion_mask"])
        return TokenLogprobs(targets_BS, fused=self.args.fused_loss, statistics=statistics, compact=True)

    def reference_logps(self, inputs) -> torch.Tensor:
        """Summed completion log-probs [B] under the reference, without a graph."""
        token_logps_BS, _ = self.reference.head_output(inputs, self._completion_head(inputs))
        return token_logps_BS.sum(dim=1)

    @torch.no_grad()
    def _policy_kl_logps(self, model, kl_inputs) -> torch.Tensor:
        """Summed mismatched-completion log-probs [B] under the policy, without a graph or a router loss."""
        with router_loss_off(model):
            token_logps_BS, _ = self.forward(model, kl_inputs, self._completion_head(kl_inputs)).head_output
        return token_logps_BS.sum(dim=1)

    def micro_batches(self, epoch_iterator, count):
        """The step's batches, each with its mismatched sequences made model inputs while they are host tensors
        (their attention plan read on the host, not from the device)."""
        batches = super().micro_batches(epoch_iterator, count)
        if self.args.uses_kl:
            batches = [{**batch, "KL_model_inputs": self._kl_inputs(batch)} for batch in batches]
        return batches

    def kl_estimate(self, model, inputs) -> torch.Tensor:
        """mean(logp_KL - ref_logp_KL) over every data-parallel rank's rows, clamped at 0 (0 for a KL-free loss)."""
        if not self.args.uses_kl:
            return torch.zeros((), device=inputs["input_ids"].device)
        kl_inputs = inputs.get("KL_model_inputs") or self._kl_inputs(inputs)
        kl_logps_B = self._policy_kl_logps(model, kl_inputs)
        ref_kl_logps_B = inputs.get("ref_KL_logps")
        ref_kl_logps_B = self.reference_logps(kl_inputs) if ref_kl_logps_B is None else ref_kl_logps_B.to(kl_logps_B.dtype)
        sums = torch.stack([(kl_logps_B - ref_kl_logps_B).sum(), kl_logps_B.new_full((), kl_logps_B.numel())])
        total, count = self.context.data_parallel.sum(sums).to(kl_logps_B.device)
        return (total / count).clamp(min=0)

    # --- loss and metrics -------------------------------------------------------------------------
    def loss(self, model, inputs, num_items_in_batch):
        args = self.args
        kl = self.kl_estimate(model, inputs)
        head = self._completion_head(inputs, statistics=("mean_logits",))
        mask_BS = head.targets_BS != IGNORE_INDEX
        outputs = self.forward(model, inputs, head)
        token_logps_BS, entropy_BS, stats = outputs.head_output
        logps_B = token_logps_BS.sum(dim=1)
        ref_logps_B = inputs.get("ref_logps")
        ref_logps_B = self.reference_logps(inputs) if ref_logps_B is None else ref_logps_B.to(logps_B.dtype)
        # the desirable and undesirable rows by masks, not by boolean indexing (whose sizes the host would read)
        chosen_B = inputs["label"].to(torch.bool)
        rejected_B = ~chosen_B
        logratios_B = logps_B - ref_logps_B
        # every row's loss of both kinds, each row keeping its own kind's (the mean is the same, in another order)
        desirable_B, undesirable_B = unpaired_preference_losses(
            logratios_B, logratios_B, kl, args.beta, loss_type=args.loss_type,
            desirable_weight=args.desirable_weight, undesirable_weight=args.undesirable_weight,
        ).chunk(2)
        loss = torch.where(chosen_B, desirable_B, undesirable_B).nanmean()
        metrics = {"kl": kl.detach()}
        if outputs.aux_loss is not None:
            loss = loss + self.aux_loss_coef * self.context.router_loss(outputs.aux_loss, num_items_in_batch)
            metrics["aux_loss"] = self.context.whole_router_loss(outputs.aux_loss)
        rewards_B = args.beta * logratios_B.detach()
        num_chosen, num_rejected = chosen_B.sum(), rejected_B.sum()
        chosen_mask, rejected_mask = mask_BS & chosen_B[:, None], mask_BS & rejected_B[:, None]
        mean_logits_BS = stats["mean_logits"]

        def rows_sum(values_B, rows_B):  # the nan-sum over the rows of one kind
            return torch.where(rows_B, values_B, 0.0).nansum()

        chosen_rewards, rejected_rewards = rows_sum(rewards_B, chosen_B), rows_sum(rewards_B, rejected_B)
        metrics.update({
            "entropy": ((entropy_BS.detach() * mask_BS).sum(), mask_BS.sum()),
            "logits/chosen": RankSums(((mean_logits_BS * chosen_mask).sum(), chosen_mask.sum()), ratio_if_any),
            "logits/rejected": RankSums(((mean_logits_BS * rejected_mask).sum(), rejected_mask.sum()), ratio_if_any),
            "rewards/chosen": RankSums((chosen_rewards, num_chosen), ratio_if_any),
            "logps/chosen": RankSums((rows_sum(logps_B.detach(), chosen_B), num_chosen), ratio_if_any),
            "rewards/rejected": RankSums((rejected_rewards, num_rejected), ratio_if_any),
            "logps/rejected": RankSums((rows_sum(logps_B.detach(), rejected_B), num_rejected), ratio_if_any),
            "rewards/margins": RankSums((chosen_rewards, num_chosen, rejected_rewards, num_rejected), _margin_if_both),
        })
        if model.training:
            self._total_train_tokens += inputs["attention_mask"].sum()
        metrics["num_tokens"] = self._total_train_tokens
        return loss, metrics

    # --- evaluation: a batch carries no labels; compute_metrics gets a plain forward's logits and the input ids as
    # labels, as TRL returns them ----------------------------------------------------------------------------------
    def has_eval_loss(self, inputs: dict) -> bool:
        return True

    def eval_outputs(self, model, inputs: dict):
        return self.forward(model, with_transformers_padding(inputs), None).logits, inputs["input_ids"]


def cli_command():
    """``hfnative-train kto``: TRL's ``trl kto`` flags (script, KTOConfig and model arguments)."""
    from ..running import cli

    return cli.Command("Kahneman-Tversky Optimization (TRL's `trl kto`)", KTOConfig, KTOTrainer, cli.train_model)
