"""What one algorithm adds to the one training loop (``Trainer.train``): an objective.

The loop asks its objective, in this order, for each optimizer step:
  micro_batches(iterator, count)  the step's micro-batches (SFT: the next ``count`` batches)
  normalizer(batches)             what every micro-batch's loss is divided by (label tokens)
  loss(model, inputs, n)          the loss and the metrics to log (device scalars, no host sync)
  after_optimizer_step()          e.g. push new weights to a rollout engine
and once, before training, for ``prepare_datasets`` and ``default_collator`` (and ``prepare_eval_dataset``
for a dataset given to ``evaluate``). Frozen auxiliary models (a reference, a teacher) are listed in
``auxiliary_models`` so the trainer builds, places and shards them with the same code as the policy.
"""

from __future__ import annotations

import torch

from hfnative.losses import IGNORE_INDEX
from hfnative.models.head import TokenCrossEntropy


class MetricAverages:
    """Metrics kept on the device between logging steps and read with one host sync when logged.

    ``add``: one value per micro-batch, logged as their mean (as TRL averages its per-micro-batch values);
    ``add_ratio``: one (numerator, denominator) per micro-batch, logged as the mean of the ratios, each
    ratio taken over every data-parallel rank's sums (TRL's entropy and mean_token_accuracy: gathered sums
    divided); ``set``: logged as the last value set (running totals such as num_tokens, summed over ranks).
    """

    def __init__(self):
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._latest: dict[str, torch.Tensor] = {}
        self._ratios: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self._sums[name] = self._sums[name] + value if name in self._sums else value
        self._counts[name] = self._counts.get(name, 0) + 1

    def add_ratio(self, name: str, numerator: torch.Tensor, denominator: torch.Tensor) -> None:
        pair = (torch.as_tensor(numerator).detach().double(), torch.as_tensor(denominator).detach().double())
        self._ratios.setdefault(name, []).append(pair)

    def set(self, name: str, value: torch.Tensor) -> None:
        self._latest[name] = value.detach().double()

    def pop(self, reduce=None) -> dict[str, float]:
        """The values since the last pop (cleared), as floats. ``reduce(values, summed)``: combines the stacked
        values over data-parallel ranks (``summed[i]``: summed over ranks; else averaged)."""
        names = list(self._sums) + list(self._latest)
        values = [self._sums[n] / self._counts[n] for n in self._sums] + list(self._latest.values())
        summed = [False] * len(self._sums) + [True] * len(self._latest)
        pairs = [(name, pair) for name, entries in self._ratios.items() for pair in entries]
        for _, (numerator, denominator) in pairs:
            values += [numerator, denominator]
            summed += [True, True]
        self._sums.clear()
        self._counts.clear()
        self._latest.clear()
        self._ratios.clear()
        if not values:
            return {}
        stacked = torch.stack([v.to(values[0].device) for v in values])
        if reduce is not None:
            stacked = reduce(stacked, summed)
        flat = stacked.tolist()
        result = dict(zip(names, flat[: len(names)]))
        ratios: dict[str, list[float]] = {}
        for index, (name, _) in enumerate(pairs):
            numerator, denominator = flat[len(names) + 2 * index], flat[len(names) + 2 * index + 1]
            ratios.setdefault(name, []).append(numerator / denominator if denominator > 0 else 0.0)
        result.update({name: sum(r) / len(r) for name, r in ratios.items()})
        return result


def without_labels(inputs: dict) -> dict:
    """The batch as model inputs for a forward that leaves the loss to the caller."""
    return {key: value for key, value in inputs.items() if key not in ("labels", "shift_labels")}


def count_label_tokens(batches: list[dict]) -> int | None:
    """The number of (shifted) label tokens in a step's micro-batches; None when they carry no labels."""
    if not batches or "shift_labels" not in batches[0]:
        return None
    return int(sum((b["shift_labels"] != IGNORE_INDEX).sum() for b in batches))


class LanguageModelingObjective:
    """Next-token cross-entropy over the label tokens, normalized by the step's label-token count
    (transformers' Trainer on a causal LM). Subclasses change the pieces they need."""

    def __init__(self, trainer):
        self.trainer = trainer
        # frozen models this algorithm needs, by name: a path, Hub id or model object until the trainer
        # replaces each by the loaded, frozen, placed native model
        self.auxiliary_models: dict[str, object] = {}

    # --- data -------------------------------------------------------------------------------------
    def prepare_datasets(self, train_dataset, eval_dataset):
        """The datasets given at construction, ready for the collator; ``eval_dataset`` may be a dict of them."""
        args = self.trainer.args
        if args.eval_strategy != "no" and eval_dataset is None:  # transformers checks it when the Trainer is built
            raise ValueError(
                f"You have set `args.eval_strategy` to {args.eval_strategy} but you didn't pass an `eval_dataset` to "
                "`Trainer`: pass one, or set eval_strategy='no'."
            )
        if isinstance(eval_dataset, dict):
            evaluation = {name: self.prepare_eval_dataset(dataset) for name, dataset in eval_dataset.items()}
        else:
            evaluation = self.prepare_eval_dataset(eval_dataset)
        return self.prepare_train_dataset(train_dataset), evaluation

    def prepare_train_dataset(self, dataset):
        return self.trainer._drop_unused_columns(dataset)

    def prepare_eval_dataset(self, dataset):
        """One evaluation dataset ready for the collator: used at construction and by ``evaluate`` for a
        dataset given there, so both are prepared alike. A dataset already prepared comes back unchanged."""
        return self.trainer._drop_unused_columns(dataset)

    def default_collator(self):
        from transformers import DataCollatorForLanguageModeling

        if self.trainer.processing_class is None:
            raise ValueError("no data_collator and no processing_class to build one from")
        return DataCollatorForLanguageModeling(self.trainer.processing_class, mlm=False)

    # --- one optimizer step -------------------------------------------------------------------------
    def micro_batches(self, epoch_iterator, count: int) -> list[dict]:
        return [batch for _, batch in zip(range(count), epoch_iterator)]

    def normalizer(self, batches: list[dict]) -> int | None:
        return count_label_tokens(batches)

    def loss(self, model, inputs: dict, num_items_in_batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed token NLL / num_items_in_batch, or the batch's token mean when no count is given."""
        stats = self.cross_entropy(model, inputs)
        denominator = num_items_in_batch if num_items_in_batch is not None else max(stats.num_tokens, 1)
        return stats.loss_sum / denominator, {}

    def after_optimizer_step(self) -> None:
        pass

    # --- helpers ------------------------------------------------------------------------------------
    def cross_entropy(self, model, inputs: dict):
        """CrossEntropyOutput sums over the batch's label tokens, through the model's head."""
        fused = self.trainer.args.fused_loss or self.trainer.args.use_liger_kernel
        return self.forward(model, inputs, TokenCrossEntropy(inputs["shift_labels"], fused=fused)).head_output

    @staticmethod
    def forward(model, inputs: dict, head_loss):
        return model(
            inputs["input_ids"], attention_mask=inputs.get("attention_mask"), position_ids=inputs.get("position_ids"),
            attention_plan=inputs.get("attention_plan"), head_loss=head_loss,
        )
