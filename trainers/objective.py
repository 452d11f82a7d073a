"""The objective contract: what one algorithm adds to the one training loop (``Trainer.train``).

An objective is built by its trainer with an ``ObjectiveContext`` (below) and never sees the trainer itself.
The loop calls, once at construction, in this order:
  auxiliary_models                 (read) frozen models to load, by name: a path, Hub id or model object; the
                                   loop replaces each by the loaded, frozen model, placed and sharded as the policy
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
  on_log(logs, mode)                             add to (or act on) each log, e.g. a rollout queue's metrics

The loop owns every cross-rank step: it all-reduces the normalizer over the ranks that hold different items (and
divides a micro-batch mean by the number of micro-batches of the step over every rank), sums the logged losses,
and reduces the metrics; an objective that needs a gather (rewards over the ranks' groups) asks the context's
``data_parallel`` group, which evaluation shares. No objective divides by a rank count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hfnative.losses import IGNORE_INDEX
from hfnative.models.head import TokenCrossEntropy

# --- normalizers ----------------------------------------------------------------------------------------------

# what a normalizer may count; token counts are summed over the data-parallel and the context-parallel ranks (each
# cp rank holds other tokens of the same sequences), the others over the data-parallel ranks only
TOKEN_UNITS = ("label_tokens", "completion_tokens")
ITEM_UNITS = TOKEN_UNITS + ("sequences", "pairs")
MEAN_UNIT = "micro_batches"


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


@dataclass(frozen=True)
class Normalizer:
    """A step's normalizer on this rank: ``count`` things of ``unit``.

    An item unit (label_tokens, completion_tokens, sequences, pairs): the loop sums ``count`` over the ranks and
    hands the total to ``loss`` as ``num_items_in_batch``, and the loss is the micro-batch's sum over its items
    divided by it. ``micro_batches``: each micro-batch's loss is its own mean (TRL's DPO and GRPO); the loop passes
    ``num_items_in_batch=None`` and divides each loss by the step's micro-batches over every data-parallel rank.
    """

    count: int | float
    unit: str

    def __post_init__(self):
        if self.unit not in ITEM_UNITS + (MEAN_UNIT,):
            raise ValueError(f"Normalizer unit {self.unit!r}: expected one of {ITEM_UNITS + (MEAN_UNIT,)}")

    @property
    def is_mean(self) -> bool:
        return self.unit == MEAN_UNIT

    @property
    def counts_tokens(self) -> bool:
        return self.unit in TOKEN_UNITS

    @classmethod
    def micro_batches(cls, batches: list) -> Normalizer:
        return cls(len(batches), MEAN_UNIT)


def count_label_tokens(batches: list[dict]) -> Normalizer | None:
    """The (shifted) label tokens of a step's micro-batches; None when they carry no labels."""
    if not batches or "shift_labels" not in batches[0]:
        return None
    return Normalizer(int(sum((b["shift_labels"] != IGNORE_INDEX).sum() for b in batches)), "label_tokens")


# --- metrics ----------------------------------------------------------------------------------------------------


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, 0.0 over nothing (TRL's entropy and mean_token_accuracy)."""
    return numerator / denominator if denominator > 0 else 0.0


def ratio_if_any(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, no value over nothing (TRL's KTO rewards and logits, left out when a batch has none)."""
    return numerator / denominator if denominator > 0 else None


@dataclass(frozen=True)
class RankSums:
    """A micro-batch's metric made from sums over every data-parallel rank: ``combine(*parts summed over the ranks)``
    is its value, or None for none (the micro-batch is left out of the mean; a metric with no value is not logged)."""

    parts: tuple
    combine: Callable[..., float | None] = ratio


class MetricAverages:
    """Metrics kept on the device between logging steps and read with one host sync when logged.

    ``add``: one value per micro-batch, logged as their mean (as TRL averages its per-micro-batch values);
    ``add_ratio``: one (numerator, denominator) per micro-batch, logged as the mean of the ratios, each
    ratio taken over every data-parallel rank's sums (TRL's entropy and mean_token_accuracy: gathered sums
    divided); ``add_rank_sums``: the same for any ``RankSums``; ``set``: logged as the last value set (running
    totals such as num_tokens, summed over ranks).
    """

    def __init__(self):
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._latest: dict[str, torch.Tensor] = {}
        self._combined: dict[str, list[RankSums]] = {}
        self._missing: set[str] = set()

    def add(self, name: str, value) -> None:
        value = torch.as_tensor(value).detach().double()
        self._sums[name] = self._sums[name] + value.to(self._sums[name].device) if name in self._sums else value
        self._counts[name] = self._counts.get(name, 0) + 1

    def add_ratio(self, name: str, numerator, denominator) -> None:
        self.add_rank_sums(name, RankSums((numerator, denominator)))

    def add_rank_sums(self, name: str, metric: RankSums) -> None:
        parts = tuple(torch.as_tensor(part).detach().double() for part in metric.parts)
        self._combined.setdefault(name, []).append(RankSums(parts, metric.combine))

    def set(self, name: str, value) -> None:
        self._latest[name] = torch.as_tensor(value).detach().double()

    def mark_missing(self, name: str) -> None:
        """A metric that had no value this time (a reward function that scored nothing): logged as None when no
        value of it is added before the next pop (TRL logs such a metric as None)."""
        self._missing.add(name)

    def record(self, metrics: dict) -> None:
        """An objective's metrics dict: (numerator, denominator) tuples are ratios, ``RankSums`` combined sums,
        num_tokens a running total."""
        for name, value in metrics.items():
            if isinstance(value, RankSums):
                self.add_rank_sums(name, value)
            elif isinstance(value, tuple):
                self.add_ratio(name, *value)
            elif name == "num_tokens":
                self.set(name, value)
            else:
                self.add(name, value)

    def pop(self, reduce=None) -> dict[str, float]:
        """The values since the last pop (cleared), as floats. ``reduce(values, summed)``: combines the stacked
        values over data-parallel ranks (``summed[i]``: summed over ranks; else averaged)."""
        names = list(self._sums) + list(self._latest)
        values = [self._sums[n] / self._counts[n] for n in self._sums] + list(self._latest.values())
        summed = [False] * len(self._sums) + [True] * len(self._latest)
        entries = [(name, metric) for name, metrics in self._combined.items() for metric in metrics]
        for _, metric in entries:
            values += [part.reshape(()) for part in metric.parts]
            summed += [True] * len(metric.parts)
        missing = {name: None for name in self._missing if name not in self._sums and name not in self._latest}
        self._sums.clear()
        self._counts.clear()
        self._latest.clear()
        self._combined.clear()
        self._missing.clear()
        if not values:
            return missing
        stacked = torch.stack([v.to(values[0].device) for v in values])
        if reduce is not None:
            stacked = reduce(stacked, summed)
        flat = stacked.tolist()
        result = dict(zip(names, flat[: len(names)]))
        combined: dict[str, list[float]] = {}
        offset = len(names)
        for name, metric in entries:
            value = metric.combine(*flat[offset : offset + len(metric.parts)])
            offset += len(metric.parts)
            if value is not None:
                combined.setdefault(name, []).append(value)
        result.update({name: sum(v) / len(v) for name, v in combined.items()})
        return {**missing, **result}


# --- the context the loop hands an objective ------------------------------------------------------------------


class ObjectiveContext:
    """What an objective may use of its run, handed to it by the loop (the trainer stays private).

    ``args`` (the run's config, TRL's names), ``device``, ``model`` (the policy), ``processing_class`` and
    ``tokenizer``, ``state`` (transformers' TrainerState: global_step, num_input_tokens_seen), ``data_collator``
    (the user's, or None before the default is made), ``rank`` (this process in the run), ``broadcast(tensor)``
    (the first rank's tensor on every rank), ``layout`` (the run's ParallelDims, None on one process),
    ``data_parallel`` (gathers and reductions over the data-parallel ranks);
    ``autocast()``, ``prepare_inputs(batch)`` (the loop's own batch preparation: shifted labels, padding for the
    layout, the attention plan, the device), ``metrics(mode)`` (the sink logged at the next log), ``record_generation``
    (a generation call's time and tokens, for the perf/ metrics), ``data_shard()``
    and ``make_dataloader(...)`` (this rank's share of a dataset), ``micro_batches_in_step`` (this rank's, in the
    step being trained), ``uses_adapters`` / ``trains_new_adapters`` (LoRA on the policy; a peft_config given).
    """

    def __init__(self, trainer):
        self._trainer = trainer

    # --- the run -----------------------------------------------------------------------------------------
    @property
    def args(self):
        return self._trainer.args

    @property
    def device(self) -> torch.device:
        return self._trainer.device

    @property
    def model(self):
        return self._trainer.native_model

    @property
    def processing_class(self):
        return self._trainer.processing_class

    @property
    def tokenizer(self):
        processing_class = self._trainer.processing_class
        return getattr(processing_class, "tokenizer", processing_class)

    @property
    def state(self):
        """transformers' TrainerState (None while the trainer is being built)."""
        return getattr(self._trainer, "state", None)

    @property
    def data_collator(self):
        return self._trainer.data_collator

    @property
    def rank(self) -> int:
        run = self._trainer.distributed
        return 0 if run is None else run.rank

    @property
    def world_size(self) -> int:
        run = self._trainer.distributed
        return 1 if run is None else run.world_size

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The first rank's ``tensor`` on every rank of the run (each passes one of the same shape and dtype), on
        ``tensor``'s device; the tensor itself on one process."""
        run = self._trainer.distributed
        if run is None:
            return tensor
        return run.broadcast(tensor.to(self.device).contiguous()).to(tensor.device)

    @property
    def layout(self):
        run = self._trainer.distributed
        return None if run is None else run.dims

    @property
    def data_parallel(self):
        return self._trainer.data_parallel

    @property
    def uses_adapters(self) -> bool:
        model = self._trainer.native_model
        return self._trainer.lora_settings is not None or getattr(model, "_has_adapters", lambda: False)()

    @property
    def trains_new_adapters(self) -> bool:
        return getattr(self._trainer, "peft_config", None) is not None

    @property
    def micro_batches_in_step(self) -> int:
        return self._trainer._current_accumulation_steps

    @property
    def context_parallel(self):
        """The ranks splitting each sequence (trainers.distributed.ContextParallelGroup): ``size``, a differentiable
        ``sum`` over their chunks, and ``split`` for a batch made after the collator (e.g. generated completions)."""
        return self._trainer.context_parallel

    # --- the router's load-balancing loss (MoE) -----------------------------------------------------------------
    @property
    def router_loss_ranks(self) -> int:
        """How many ranks' tokens one router load-balancing loss is taken over (their MoE layers' ``token_group``,
        set for every data- and context-parallel layout): each rank's loss is its share of theirs; 1 otherwise."""
        for module in self._trainer.native_model.modules():
            group = getattr(module, "token_group", None)
            if group is not None:
                return torch.distributed.get_world_size(group)
        return 1

    def router_loss(self, aux_loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """The term a micro-batch adds to its loss for the router's load-balancing loss ``aux_loss`` (the model's:
        this rank's share of the whole batch's when ``router_loss_ranks`` > 1), so that the step trains, and logs,
        the mean over its micro-batches of the whole batch's router loss, as one process: the loop divides a loss
        given no item count by the step's micro-batches over the ranks (a micro-batch mean), divides nothing
        otherwise, and sums the ranks' losses; evaluation averages its data-parallel ranks' losses (a micro-batch
        mean's also divided by the cp ranks, whose summed losses it takes)."""
        ranks = self.router_loss_ranks
        if not self._trainer.native_model.training:  # an item-normalized loss is summed over the cp ranks
            return aux_loss * (ranks if num_items_in_batch is None else ranks // self.context_parallel.size)
        steps = self.micro_batches_in_step
        if num_items_in_batch is not None:
            return aux_loss / steps
        return aux_loss * (self._trainer._loss_divisor / steps) if ranks > 1 else aux_loss

    def whole_router_loss(self, aux_loss: torch.Tensor) -> torch.Tensor:
        """The whole batch's router loss for the logs: the metrics average the ranks' values."""
        return aux_loss.detach() * self.router_loss_ranks

    # --- what the loop does for every objective ---------------------------------------------------------------
    def autocast(self):
        return self._trainer._autocast()

    def prepare_inputs(self, batch: dict) -> dict:
        return self._trainer._prepare_inputs(batch)

    def metrics(self, mode: str = "train") -> MetricAverages:
        return self._trainer._metrics[mode]

    def record_generation(self, seconds: float, tokens: int) -> None:
        """One generation call's wall time and the tokens it generated on this rank, for the step's perf/ metrics."""
        self._trainer._performance.record_generation(seconds, tokens)

    def data_shard(self) -> dict:
        return self._trainer._data_shard()

    def make_dataloader(self, dataset, batch_size: int, collate_fn, *, seed: int, shuffle: bool, drop_last: bool = False):
        from .data_loading import make_dataloader

        return make_dataloader(dataset, batch_size, collate_fn, seed=seed, shuffle=shuffle, drop_last=drop_last,
                               num_workers=self.args.dataloader_num_workers, **self.data_shard())

    def drop_unused_columns(self, dataset):
        return self._trainer._drop_unused_columns(dataset)


# --- capabilities -----------------------------------------------------------------------------------------------

# a feature a run may use -> (what it is, what to do instead)
FEATURES = {
    "multi_process": ("a multi-process run (torchrun / accelerate launch)", "launch it as one process"),
    "tensor_parallel": ("tensor parallelism (tp_size > 1)", "set tp_size=1 (data-parallel and FSDP2 layouts remain)"),
    "context_parallel": ("context parallelism (cp_size > 1)", "set cp_size=1"),
    "expert_parallel": ("expert parallelism (ep_size > 1)", "set ep_size=1"),
    "multi_process_generation": (
        "generating completions in a multi-process run (the native engine decodes one process's whole model)",
        "run on one process",
    ),
    "evaluation": ("evaluation (eval_strategy / evaluate())", "set eval_strategy='no'"),
}


class UnsupportedLayoutError(ValueError):
    """A run asks its objective for a layout or feature the objective does not declare in ``supports``."""


def features_used(objective, context, evaluating: bool = False) -> list[str]:
    """The features of ``FEATURES`` the run asks of ``objective``."""
    layout = context.layout
    used = []
    if context.world_size > 1:
        used.append("multi_process")
        if objective.generates():
            used.append("multi_process_generation")
    if layout is not None:
        used += [name for name, on in (("tensor_parallel", layout.tp_enabled), ("context_parallel", layout.cp_enabled),
                                       ("expert_parallel", layout.ep_enabled)) if on]
    if evaluating or context.args.eval_strategy != "no":
        used.append("evaluation")
    return used


def check_supported(objective, context, evaluating: bool = False, algorithm: str | None = None) -> None:
    """Refuse, in one message, every feature the run uses that ``objective.supports`` does not name."""
    missing = [name for name in features_used(objective, context, evaluating) if name not in objective.supports]
    if not missing:
        return
    who = algorithm or type(objective).__name__
    lines = [f"{FEATURES[name][0]}: {FEATURES[name][1]}" for name in missing]
    raise UnsupportedLayoutError(f"{who} does not support " + "; ".join(lines))


# --- the objectives' base ---------------------------------------------------------------------------------------


def without_labels(inputs: dict) -> dict:
    """The batch as model inputs for a forward that leaves the loss to the caller."""
    return {key: value for key, value in inputs.items() if key not in ("labels", "shift_labels")}


class Objective(ABC):
    """The contract's defaults (see the module docstring): the loop's plain batches, no generation, every
    feature declared in ``supports``. A subclass declares what it supports and changes the pieces it needs."""

    supports: frozenset[str] = frozenset(FEATURES)
    # the collator's batches are token sequences the loop splits over the context-parallel ranks; False: the
    # objective builds its model inputs later (from generated completions) and splits them with
    # ``context.context_parallel.split``
    split_collated_batches = True

    def __init__(self, context: ObjectiveContext):
        self.context = context
        # frozen models this algorithm needs, by name: a path, Hub id or model object until the loop replaces each
        # by the loaded, frozen, placed native model
        self.auxiliary_models: dict[str, object] = {}

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
        """This rank's train batches: per_device_train_batch_size rows, a seeded order per epoch."""
        a = self.args
        shuffle = a.train_sampling_strategy != "sequential" if hasattr(a, "train_sampling_strategy") else True
        seed = a.data_seed if a.data_seed is not None else a.seed
        return self.context.make_dataloader(dataset, a.per_device_train_batch_size, collator, seed=seed,
                                            shuffle=shuffle, drop_last=a.dataloader_drop_last)

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
        return model(**without_labels(inputs)).logits, inputs.get("labels")

    def samples_in_batch(self, inputs: dict) -> int:
        return inputs["input_ids"].shape[0]

    def on_log(self, logs: dict, mode: str) -> None:
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

    def normalizer(self, batches: list[dict]) -> Normalizer | None:
        return count_label_tokens(batches)

    def loss(self, model, inputs: dict, num_items_in_batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed token NLL / num_items_in_batch, or the batch's token mean when no count is given."""
        stats = self.cross_entropy(model, inputs)
        denominator = num_items_in_batch if num_items_in_batch is not None else max(stats.num_tokens, 1)
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
    "check_supported",
    "count_label_tokens",
    "features_used",
    "ratio",
    "ratio_if_any",
    "without_labels",
]
