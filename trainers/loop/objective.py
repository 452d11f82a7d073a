"""The objective contract: what one algorithm adds to the one training loop (``Trainer.train``).

An objective is built by its trainer with an ``ObjectiveContext`` (below) and never sees the trainer itself.
The loop calls, once at construction, in this order:
  auxiliary_models                 (read) frozen models to load, by name: a path, Hub id or model object; the
                                   loop replaces each by the loaded, frozen model, placed and sharded as the policy,
                                   and names in ``users_models`` those that are the user's own objects
  auxiliary_models_ready()         every auxiliary model is loaded (e.g. cast a reference to the policy's dtype)
  prepare_datasets(train, eval)    the datasets ready for the collator (``eval`` may be a dict of them)
  default_collator()               when the user gave no data_collator
  the capability check             ``check_supported``: the run's layout and features against ``supports``
then, in ``train()``:
  train_dataloader(dataset, collator)           the train batches (default: the loop's seeded, sharded loader)
  per optimizer step:
    micro_batches(iterator, count)               the step's micro-batches (SFT: the next ``count`` batches;
                                                 GRPO: generate, score, compute advantages)
    normalizer(batches) -> Normalizer | None     what every micro-batch's loss is divided by, and what it counts
    loss(model, inputs, num_items_in_batch)      the micro-batch's loss and metrics (device scalars, no host sync)
    steps_optimizer_after(index)                 whether the optimizer steps after the step's micro-batch ``index``
                                                 too (PPO's epochs x mini-batches in one step); default never
    after_optimizer_step()                       e.g. push new weights to a rollout engine
  end_training()                                 always, when ``train()`` returns or raises
and at checkpoints: checkpoint_state() (JSON files saved in checkpoint-N/), load_checkpoint_state(files) on resume
and in evaluation and logging:
  prepare_eval_dataset(dataset)                  a dataset given to ``evaluate``, prepared as the trainer's own
  eval_batch(batch)                              an evaluation batch before the loss (e.g. generate completions)
  has_eval_loss(inputs) / eval_outputs(...)      whether a batch has a loss; logits and labels for compute_metrics
  samples_in_batch(inputs)                       dataset rows in a batch (a preference row is two sequences)
  evaluation_starts(dataset)                     before an evaluate() / predict() pass over ``dataset`` (the
                                                 evaluation loader's, prepared; None where it has none)
  on_log(logs, mode)                             add to (or act on) each log, e.g. a rollout queue's metrics
  after_log(logs, mode)                          after the log reached the callbacks (W&B, trackio: their runs
                                                 started), e.g. log a table beside the metrics

The loop owns every cross-rank step: it all-reduces the normalizer over the ranks that hold different items (and
divides a micro-batch mean by the number of micro-batches of the step over every rank), sums the logged losses,
and reduces the metrics; an objective that needs a gather (rewards over the ranks' groups) asks the context's
``data_parallel`` group, which evaluation shares. No objective divides by a rank count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hfnative.losses import at_least_one
from hfnative.models.attention import transformers_padding_plan
from hfnative.models.head import TokenCrossEntropy

from .capabilities import FEATURES, UnsupportedLayoutError, check_supported, features_used
from .data_loading import has_length
from .metric_averages import MetricAverages, RankSums, ratio, ratio_if_any
from .normalizers import Normalizer, count_label_tokens
from .objective_context import ObjectiveContext


def enable_router_loss(model, coef: float | None) -> float:
    """Switch the MoE router's load-balancing loss on ``model`` by TRL's rule and return its coefficient: None takes
    the model config's coefficient, 0.0 turns the loss off, and a non-zero coefficient on a model without experts is
    an error (TRL's). A model without experts gets 0.0."""
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


def without_labels(inputs: dict) -> dict:
    """The batch as model inputs for a forward that leaves the loss to the caller."""
    return {key: value for key, value in inputs.items() if key not in ("labels", "shift_labels")}


def with_transformers_padding(inputs: dict) -> dict:
    """The batch with padding queries attending as in transformers' masks, for a forward whose logits compute_metrics
    is handed whole (the padding positions' included, as TRL's trainers hand them)."""
    if inputs.get("attention_mask") is None or inputs.get("attention_plan") is None:
        return inputs
    return {**inputs, "attention_plan": transformers_padding_plan(inputs["attention_plan"], inputs["attention_mask"])}


def _row_lengths(dataset, args, processing_class) -> list[int]:
    """Each row's length as transformers' length-aware samplers read it (through its LengthGroupedSampler: the
    ``length_column_name`` column, else the length of each row's main input, with its error where a row has none)."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    column = getattr(dataset, "column_names", None) or []
    sampler = LengthGroupedSampler(
        1, dataset=dataset, lengths=dataset[args.length_column_name] if args.length_column_name in column else None,
        model_input_name=processing_class.model_input_names[0] if processing_class is not None else None)
    return list(sampler.lengths)


class Objective(ABC):
    """The contract's defaults (see the module docstring): the loop's plain batches, no generation, every
    feature declared in ``supports``. A subclass declares what it supports and changes the pieces it needs."""

    supports: frozenset[str] = frozenset(FEATURES) - {"pipeline_parallel"}
    # the collator's batches are token sequences the loop splits over the context-parallel ranks; False: the
    # objective builds its model inputs later (from generated completions) and splits them with
    # ``context.context_parallel.split``
    split_collated_batches = True
    # a resumed run continues after the batches its checkpoint trained even with ignore_data_skip=True (an objective
    # whose batches stream from elsewhere, which transformers' replay of the epoch does not reach)
    always_skips_trained_batches = False
    # rollouts decode a plain copy of the policy (adapters folded in), made elsewhere than the trained model (async
    # GRPO's actors); the single-process native engine decodes the model itself
    decodes_a_copy = False
    # average_tokens_across_devices=False makes each data-parallel rank divide its token-count normalized loss by its
    # own tokens, as transformers does for a trainer whose loss takes num_items_in_batch; False: the TRL trainer
    # normalizes by the step's tokens over every rank whatever the flag says
    follows_average_tokens_across_devices = True

    def __init__(self, context: ObjectiveContext):
        self.context = context
        # frozen models this algorithm needs, by name: a path, Hub id or model object until the loop replaces each
        # by the loaded, frozen, placed native model
        self.auxiliary_models: dict[str, object] = {}
        # the names among them whose loaded model is the user's own object (a native model given as it is): the
        # loop leaves its weights as given
        self.users_models: set[str] = set()

    @property
    def args(self):
        return self.context.args

    def generates(self) -> bool:
        """Whether this run samples completions from a model (the capability check reads it)."""
        return False

    def auxiliary_models_ready(self) -> None:
        pass

    # --- data -------------------------------------------------------------------------------------------------
    def prepare_datasets(self, train_dataset, eval_dataset):
        """The datasets given at construction, ready for the collator; ``eval_dataset`` may be a dict of them."""
        if self.args.eval_strategy != "no" and eval_dataset is None:  # transformers checks it when the Trainer is built
            raise ValueError(
                f"You have set `args.eval_strategy` to {self.args.eval_strategy} but you didn't pass an `eval_dataset` "
                "to `Trainer`: pass one, or set eval_strategy='no'."
            )
        if isinstance(eval_dataset, dict):
            evaluation = {name: self.prepare_eval_dataset(dataset) for name, dataset in eval_dataset.items()}
        else:
            evaluation = self.prepare_eval_dataset(eval_dataset)
        return self.prepare_train_dataset(train_dataset), evaluation

    def prepare_train_dataset(self, dataset):
        return self.context.drop_unused_columns(dataset)

    def prepare_eval_dataset(self, dataset):
        """One evaluation dataset ready for the collator: used at construction and by ``evaluate`` for a
        dataset given there, so both are prepared alike. A dataset already prepared comes back unchanged."""
        return self.context.drop_unused_columns(dataset)

    def default_collator(self):
        from transformers import DataCollatorForLanguageModeling

        if self.context.processing_class is None:
            raise ValueError("no data_collator and no processing_class to build one from")
        return DataCollatorForLanguageModeling(self.context.processing_class, mlm=False)

    def train_dataloader(self, dataset, collator):
        """This rank's train batches: per_device_train_batch_size rows, a seeded order per epoch;
        ``train_sampling_strategy="group_by_length"``: rows of similar lengths together, as transformers'
        LengthGroupedSampler groups them (its lengths: ``length_column_name``'s column, else each row's
        ``input_ids``), in mega-batches of the step's rows (per-device batch x accumulation);
        ``"batch_rebalance"``: transformers' BatchRebalanceSampler's micro-batches of balanced cost (the same lengths;
        ``data_loading.RebalancedBatchSampler``)."""
        a = self.args
        strategy = getattr(a, "train_sampling_strategy", "random")
        seed = a.data_seed if a.data_seed is not None else a.seed
        grouped = rebalanced = None
        if strategy in ("group_by_length", "batch_rebalance") and has_length(dataset):
            lengths = _row_lengths(dataset, a, self.context.processing_class)
            if strategy == "group_by_length":  # mega-batches of a step's rows
                grouped = (lengths, a.per_device_train_batch_size * a.gradient_accumulation_steps)
            else:
                rebalanced = (lengths, a.gradient_accumulation_steps)
        return self.context.make_dataloader(dataset, a.per_device_train_batch_size, collator, seed=seed,
                                            shuffle=strategy != "sequential", drop_last=a.dataloader_drop_last,
                                            grouped_by_length=grouped, rebalanced=rebalanced)

    def eval_dataloader(self, dataset, collator):
        """This rank's evaluation batches: per_device_eval_batch_size rows, in order."""
        a = self.args
        return self.context.make_dataloader(dataset, a.per_device_eval_batch_size, collator, seed=a.seed, shuffle=False,
                                            drop_last=a.dataloader_drop_last)

    # --- one optimizer step -------------------------------------------------------------------------------------
    def micro_batches(self, epoch_iterator, count: int) -> list[dict]:
        return [batch for _, batch in zip(range(count), epoch_iterator)]

    def normalizer(self, batches: list[dict]) -> Normalizer | None:
        return Normalizer.micro_batches(batches)

    @abstractmethod
    def loss(self, model, inputs: dict, num_items_in_batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss (its share of the step's, given ``num_items_in_batch``, the normalizer's total
        over the ranks; or its own mean when the normalizer counts micro-batches) and its metrics: device tensors,
        (numerator, denominator) tuples for ratios over the ranks' sums, and ``num_tokens`` as a running total."""

    def steps_optimizer_after(self, index: int) -> bool:
        """Whether the optimizer also steps (and the gradients are cleared) after the step's micro-batch ``index``,
        before its last: several optimizer steps in one step of the loop, whose schedule, logs and checkpoints count
        steps (PPO's epochs x mini-batches on one rollout batch). Default: only after the last micro-batch."""
        return False

    def after_optimizer_step(self) -> None:
        pass

    def whole_sequence_inputs(self, batch: dict) -> dict:
        """A collated batch of whole sequences completed with what must be read before a context-parallel split
        cuts them (e.g. shifted targets, positions within a completion): the split hands every [B, S] tensor on in
        chunks. Default: as it is."""
        return batch

    def end_training(self) -> None:
        pass

    def checkpoint_state(self) -> dict[str, dict]:
        """What the objective adds to a checkpoint, to be resumed from it: file name -> a JSON object (numbers and
        strings), written by the first rank into ``checkpoint-N/``. Default: nothing."""
        return {}

    def load_checkpoint_state(self, files: dict[str, dict]) -> None:
        """The ``checkpoint_state`` files found in the checkpoint being resumed (those it has), by name."""

    # --- evaluation and logging -------------------------------------------------------------------------------------
    def eval_batch(self, batch: dict) -> dict:
        return batch

    def has_eval_loss(self, inputs: dict) -> bool:
        return "labels" in inputs

    def eval_outputs(self, model, inputs: dict):
        """(logits, labels) of an evaluation batch for compute_metrics."""
        return model(**without_labels(with_transformers_padding(inputs))).logits, inputs.get("labels")

    def samples_in_batch(self, inputs: dict) -> int:
        return inputs["input_ids"].shape[0]

    def evaluation_starts(self, dataset) -> None:
        pass

    def on_log(self, logs: dict, mode: str) -> None:
        pass

    def after_log(self, logs: dict, mode: str) -> None:
        pass

    # --- helpers ------------------------------------------------------------------------------------------------
    @staticmethod
    def forward(model, inputs: dict, head_loss):
        return model(
            inputs["input_ids"], attention_mask=inputs.get("attention_mask"), position_ids=inputs.get("position_ids"),
            attention_plan=inputs.get("attention_plan"), head_loss=head_loss,
        )


class LanguageModelingObjective(Objective):
    """Next-token cross-entropy over the label tokens, normalized by the step's label-token count
    (transformers' Trainer on a causal LM). Subclasses change the pieces they need."""

    supports = frozenset(FEATURES)  # pipeline parallelism too: the loss reads the policy only through its head

    def normalizer(self, batches: list[dict]) -> Normalizer | None:
        return count_label_tokens(batches)

    def loss(self, model, inputs: dict, num_items_in_batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed token NLL / num_items_in_batch, or the batch's token mean when no count is given."""
        stats = self.cross_entropy(model, inputs)
        denominator = num_items_in_batch if num_items_in_batch is not None else at_least_one(stats.num_tokens)
        return stats.loss_sum / denominator, {}

    def cross_entropy(self, model, inputs: dict):
        """CrossEntropyOutput sums over the batch's label tokens, through the model's head."""
        fused = self.args.fused_loss or self.args.use_liger_kernel
        return self.forward(model, inputs, TokenCrossEntropy(inputs["shift_labels"], fused=fused)).head_output


__all__ = [
    "FEATURES",
    "LanguageModelingObjective",
    "MetricAverages",
    "Normalizer",
    "Objective",
    "ObjectiveContext",
    "RankSums",
    "UnsupportedLayoutError",
    "enable_router_loss",
    "check_supported",
    "count_label_tokens",
    "features_used",
    "ratio",
    "ratio_if_any",
    "with_transformers_padding",
    "without_labels",
]
