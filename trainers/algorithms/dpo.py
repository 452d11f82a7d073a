"""DPOTrainer: TRL's Direct Preference Optimization front door on the one loop.

Each batch holds B preference pairs as [2B, S] (chosen rows, then rejected rows) and runs through the
policy once; the sequence log-probs come from the head's chunked log-prob loss (no [2B, S, V] logits).
The reference's log-probs come, without a graph, from a frozen copy of the checkpoint, a given
``ref_model``, the policy with its LoRA adapters disabled, or columns precomputed before training.
"""

from __future__ import annotations

import logging

import torch
import transformers

from hfnative.data.preference import PreferenceCollator, prepare_preference_dataset
from hfnative.losses import IGNORE_INDEX, shift_labels
from hfnative.losses.preference import PreferenceLogps, preference_loss
from hfnative.models.head import TokenLogprobs

from .dpo_config import DPOConfig
from ..loop.objective import Objective, enable_router_loss, with_transformers_padding
from .reference_model import PREFERENCE_LOGITS_FOR_METRICS_WARNING, ReferenceModel, ReferenceTrainer
from ..loop.trainer import Trainer
from .sft import mirror_pad_token

logger = logging.getLogger(__name__)


class DPOTrainer(ReferenceTrainer, Trainer):
    """TRL's DPOTrainer: same constructor and DPOConfig; logs loss, grad_norm, learning_rate, rewards/chosen,
    rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, logits/chosen,
    logits/rejected, entropy, mean_token_accuracy, num_tokens (aux_loss for MoE), eval_* in evaluation."""

    algorithm_name = "DPO"
    config_class = DPOConfig
    requires_train_dataset = True
    refuses_quantization_of_instances = True  # as TRL's DPOTrainer (its other trainers warn)
    _tag_names = ["trl", "dpo"]
    logits_for_metrics_warning = PREFERENCE_LOGITS_FOR_METRICS_WARNING

    def __init__(
        self,
        model,
        ref_model=None,
        args: DPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        optimizer_cls_and_kwargs=None,
    ):
        args = self.resolve_args(args, model)
        self._take_reference_source(args, model, ref_model, peft_config)
        if args.padding_free:
            logger.warning(  # TRL's text
                "`padding_free=True` is temporarily unavailable after a refactor and is currently disabled. Falling "
                "back to standard padding (`padding_free=False`). This feature is planned to return in a future "
                "update; for now, please set `padding_free=False` explicitly."
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
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

    def _make_objective(self):
        return DPOObjective(self.context, self._reference_for_objective(), reference_given=self._ref_given)


class DPOObjective(Objective):
    """DPO: preference rows tokenized and collated as TRL does; the configured preference losses on the
    policy's and the reference's sequence log-probs; TRL's DPO metrics."""

    # the sequence log-probs are summed over the head's per-token log-probs (vocabulary-parallel under tensor parallel);
    # under context parallel, over the cp ranks' chunks
    supports = frozenset({"multi_process", "tensor_parallel", "context_parallel", "expert_parallel", "pipeline_parallel",
                          "evaluation"})

    def __init__(self, context, reference, reference_given: bool):
        """``reference``: the reference's source (a path, Hub id or model object), used unless it is the policy with
        its new adapters disabled, or precomputed; ``reference_given``: the user passed it as ``ref_model``."""
        super().__init__(context)
        self._total_train_tokens = torch.zeros((), dtype=torch.float64, device=context.device)
        self.aux_loss_coef = enable_router_loss(context.model, context.args.router_aux_loss_coef)
        self.reference = ReferenceModel(self, reference, reference_given)  # trainers/algorithms/reference_model.py

    def auxiliary_models_ready(self) -> None:
        """The reference in the policy's dtype, dropout off in it too (precomputed log-probs need it ready)."""
        self.reference.ready()

    # --- data -----------------------------------------------------------------------------------
    def prepare_datasets(self, train_dataset, eval_dataset):
        context, args = self.context, self.args
        tokenizer_types = (transformers.PreTrainedTokenizerBase, transformers.ProcessorMixin)
        if not isinstance(context.processing_class, tokenizer_types):
            raise TypeError("The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`")
        tokenizer = context.tokenizer
        mirror_pad_token(tokenizer, context.model)  # TRL's: the EOS pads when the tokenizer has no pad token
        if context.data_collator is None:
            pad_token = args.pad_token or tokenizer.pad_token or tokenizer.eos_token
            if pad_token not in tokenizer.get_vocab():
                raise ValueError(
                    f"The specified `pad_token` ('{pad_token}') is not found in the vocabulary of the given "
                    f"`processing_class` ({type(context.processing_class).__name__}). Ensure that the `pad_token` "
                    "exists in the vocabulary before using it as a padding token."
                )
            mirror_pad_token(tokenizer, context.model, pad_token)
        return super().prepare_datasets(train_dataset, eval_dataset)

    def prepare_train_dataset(self, dataset):
        return self._prepare(dataset, self.args.per_device_train_batch_size)

    def prepare_eval_dataset(self, dataset):
        return self._prepare(dataset, self.args.per_device_eval_batch_size)

    def _prepare(self, dataset, batch_size: int):
        if dataset is None:
            return None
        args = self.args
        first = next(iter(dataset), None)
        if isinstance(first, dict) and ("image" in first or "images" in first):
            raise ValueError("The dataset appears to be vision-related (contains 'image' or 'images' keys): "
                             "hfnative's DPOTrainer trains text models only.")
        dataset = prepare_preference_dataset(
            dataset, self.context.processing_class, max_length=args.max_length, truncation_mode=args.truncation_mode,
            dataset_num_proc=args.dataset_num_proc, remove_unused_columns=args.remove_unused_columns,
        )
        if args.precompute_ref_log_probs and "ref_chosen_logps" not in (dataset.column_names or []):
            dataset = self.reference.precompute(dataset, args.precompute_ref_batch_size or batch_size,
                                                self._reference_columns)
        return dataset

    def _reference_columns(self, inputs) -> dict[str, torch.Tensor]:
        chosen, rejected = self.reference_logps(inputs)
        return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

    def default_collator(self):
        args = self.args
        return PreferenceCollator(
            pad_token_id=self.context.tokenizer.pad_token_id, max_length=args.max_length,
            truncation_mode=args.truncation_mode, pad_to_multiple_of=args.pad_to_multiple_of,
        )

    # --- one optimizer step (each micro-batch's loss is a mean over its pairs: the default normalizer) -----------
    def after_optimizer_step(self) -> None:
        """TR-DPO: every ref_model_sync_steps steps, ref <- alpha * policy + (1 - alpha) * ref."""
        self.reference.after_optimizer_step()

    # --- log-probs ------------------------------------------------------------------------------------
    def whole_sequence_inputs(self, batch: dict) -> dict:
        """The batch with its next-token targets "shift_labels" [2B, S] (the completion tokens, IGNORE_INDEX
        elsewhere) and, with ld_alpha, LD-DPO's weight of each target "ld_weights" [2B, S] (1 up to the shorter
        completion of the pair, ld_alpha past it, 0 off the completion): both read from whole sequences, so a
        context-parallel split cuts chosen and rejected rows alike."""
        if "shift_labels" in batch:
            return batch
        batch = dict(batch)
        targets_BS = shift_labels(batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX))
        batch["shift_labels"] = targets_BS
        alpha = self.args.ld_alpha
        if alpha is not None:
            mask_BS = targets_BS != IGNORE_INDEX
            position_BS = mask_BS.cumsum(dim=1)
            chosen_lengths, rejected_lengths = mask_BS.sum(dim=1).chunk(2, dim=0)
            shared_B2 = torch.minimum(chosen_lengths, rejected_lengths).repeat(2)
            shared_BS = mask_BS & (position_BS <= shared_B2[:, None])
            tail_BS = mask_BS & (position_BS > shared_B2[:, None])
            batch["ld_weights"] = shared_BS.float() + alpha * tail_BS.float()
        return batch

    def _sequence_logps(self, token_logps_BS, inputs) -> torch.Tensor:
        """Summed completion log-probs per row [2B] over this rank's tokens (LD-DPO: weighted by "ld_weights")."""
        weights_BS = inputs.get("ld_weights")
        return token_logps_BS.sum(dim=1) if weights_BS is None else (token_logps_BS * weights_BS).sum(dim=1)

    @torch.no_grad()
    def reference_logps(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen [B], rejected [B]) sequence log-probs under the reference, without a graph; ``inputs`` carry
        ``whole_sequence_inputs``' keys."""
        head_loss = TokenLogprobs(inputs["shift_labels"], fused=self.args.fused_loss, compact=True)
        token_logps_BS, _ = self.reference.head_output(inputs, head_loss)
        # each context-parallel rank holds a chunk of every row: the sequence's sum is over the ranks' chunks
        return self.context.context_parallel.sum(self._sequence_logps(token_logps_BS, inputs)).chunk(2, dim=0)

    def _row_sums(self, token_logps_BS, mask_BS, inputs, log_sum_sq_probs_BS) -> dict[str, torch.Tensor]:
        """Per-row sums [2B] over the whole sequences (this rank's chunk's, summed over the cp ranks): the sequence
        log-probs (differentiable; with ld_alpha also the unweighted ones sft needs), the completion lengths, the
        target tokens and, with use_weighting, WPO's aligned log-probs (no gradient)."""
        args = self.args
        differentiable = {"sequence": self._sequence_logps(token_logps_BS, inputs)}
        if "ld_weights" in inputs and "sft" in args.loss_type:
            differentiable["plain"] = token_logps_BS.sum(dim=1)
        counts = {"completion_lengths": inputs["completion_mask"].sum(dim=1).to(token_logps_BS.dtype),
                  "token_counts": mask_BS.sum(dim=1).to(token_logps_BS.dtype)}
        if args.use_weighting:
            counts["wpo"] = ((token_logps_BS.detach() - log_sum_sq_probs_BS) * mask_BS).sum(dim=1)
        context_parallel = self.context.context_parallel
        summed = context_parallel.sum(torch.stack(list(differentiable.values())))
        with torch.no_grad():
            summed_counts = context_parallel.sum(torch.stack(list(counts.values())))
        return {**dict(zip(differentiable, summed)), **dict(zip(counts, summed_counts))}

    # --- loss and metrics -------------------------------------------------------------------------
    def loss(self, model, inputs, num_items_in_batch):
        args = self.args
        inputs = self.whole_sequence_inputs(inputs)  # made before the split under context parallel
        targets_BS = inputs["shift_labels"]
        mask_BS = targets_BS != IGNORE_INDEX
        statistics = ("mean_logits", "is_top1") + (("log_sum_sq_probs",) if args.use_weighting else ())
        head_loss = TokenLogprobs(targets_BS, fused=args.fused_loss, statistics=statistics, compact=True)
        outputs = self.forward(model, inputs, head_loss)
        token_logps_BS, entropy_BS, stats = outputs.head_output
        sums = self._row_sums(token_logps_BS, mask_BS, inputs, stats.get("log_sum_sq_probs"))
        chosen_logps, rejected_logps = sums["sequence"].chunk(2, dim=0)
        if "ref_chosen_logps" in inputs:
            ref_chosen_logps = inputs["ref_chosen_logps"].to(chosen_logps.dtype)
            ref_rejected_logps = inputs["ref_rejected_logps"].to(chosen_logps.dtype)
        else:
            ref_chosen_logps, ref_rejected_logps = self.reference_logps(inputs)
        logps = PreferenceLogps(
            chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
            completion_lengths_B2=sums["completion_lengths"], plain_logps_B2=sums.get("plain"),
            token_counts_B2=sums["token_counts"], wpo_sums_B2=sums.get("wpo"),
        )
        loss = preference_loss(
            logps, loss_type=args.loss_type, loss_weights=args.loss_weights, beta=args.beta,
            label_smoothing=args.label_smoothing, f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef, discopop_tau=args.discopop_tau,
            use_weighting=args.use_weighting,
        )
        metrics = {}
        if outputs.aux_loss is not None:
            loss = loss + self.aux_loss_coef * self.context.router_loss(outputs.aux_loss, num_items_in_batch)
            metrics["aux_loss"] = self.context.whole_router_loss(outputs.aux_loss)
        metrics.update(self._metrics(logps, entropy_BS, stats, mask_BS))
        if model.training:
            self._total_train_tokens += inputs["attention_mask"].sum()
        metrics["num_tokens"] = self._total_train_tokens
        return loss, metrics

    def _metrics(self, logps: PreferenceLogps, entropy_BS, stats, mask_BS) -> dict:
        """TRL's DPO metrics: per micro-batch means, and (sum, count) pairs for the token-weighted ones."""
        beta = self.args.beta
        chosen_rewards = beta * (logps.chosen_logps - logps.ref_chosen_logps).detach()
        rejected_rewards = beta * (logps.rejected_logps - logps.ref_rejected_logps).detach()
        chosen_mask, rejected_mask = mask_BS.chunk(2, dim=0)
        chosen_mean_logits, rejected_mean_logits = stats["mean_logits"].chunk(2, dim=0)
        chosen_top1, _ = stats["is_top1"].chunk(2, dim=0)
        chosen_tokens, rejected_tokens = chosen_mask.sum(), rejected_mask.sum()
        return {
            "entropy": ((entropy_BS * mask_BS).sum(), mask_BS.sum()),
            "logits/chosen": ((chosen_mean_logits * chosen_mask).sum(), chosen_tokens),
            "logits/rejected": ((rejected_mean_logits * rejected_mask).sum(), rejected_tokens),
            "mean_token_accuracy": ((chosen_top1 & chosen_mask).sum(), chosen_tokens),
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": logps.chosen_logps.detach().mean(),
            "logps/rejected": logps.rejected_logps.detach().mean(),
        }

    # --- evaluation: a preference batch carries no labels; compute_metrics gets a plain forward's logits and the
    # input ids as labels, as TRL returns them ----------------------------------------------------------------------
    def has_eval_loss(self, inputs: dict) -> bool:
        return True

    def eval_outputs(self, model, inputs: dict):
        return self.forward(model, with_transformers_padding(inputs), None).logits, inputs["input_ids"]

    def samples_in_batch(self, inputs: dict) -> int:
        return inputs["input_ids"].shape[0] // 2  # pairs: chosen and rejected rows


def cli_command():
    """``hfnative-train dpo``: TRL's ``trl dpo`` flags (script, DPOConfig and model arguments)."""
    from ..running import cli

    return cli.Command("Direct Preference Optimization (TRL's `trl dpo`)", DPOConfig, DPOTrainer, cli.train_model)
