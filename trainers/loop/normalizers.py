"""What a step's losses are divided by: the objective's ``Normalizer`` says what it counts, the loop reduces it over
the ranks and divides (trainers/running/distributed.py ``DistributedMixin._step_normalizer``). No objective divides by a rank
count or all-reduces a count itself (tests/test_objective_contract.py scans for it)."""

from __future__ import annotations

from dataclasses import dataclass

from hfnative.losses import IGNORE_INDEX

# what a normalizer may count; token counts are summed over the data-parallel and the context-parallel ranks (each
# cp rank holds other tokens of the same sequences), the others over the data-parallel ranks only
TOKEN_UNITS = ("label_tokens", "completion_tokens")
ITEM_UNITS = TOKEN_UNITS + ("sequences", "pairs")
MEAN_UNIT = "micro_batches"
# one count per micro-batch: the completion tokens of whole sequences (before a context-parallel split), averaged over
# the data-parallel ranks
PER_MICRO_BATCH_UNIT = "completion_tokens_per_micro_batch"
SUM_UNIT = "summed_micro_batches"
UNITS = ITEM_UNITS + (MEAN_UNIT, PER_MICRO_BATCH_UNIT, SUM_UNIT)


@dataclass(frozen=True)
class Normalizer:
    """A step's normalizer on this rank: ``count`` things of ``unit``; the loop reduces it over the ranks and divides.

    - an item unit (label_tokens, completion_tokens, sequences, pairs): the loop sums ``count`` over the ranks and
      hands the total to ``loss`` as ``num_items_in_batch``; the loss is the micro-batch's sum over its items divided
      by it, and the loop divides nothing more.
    - ``micro_batches``: each micro-batch's loss is its own mean (TRL's DPO and GRPO); the loop passes
      ``num_items_in_batch=None`` and divides each loss by the step's micro-batches over every data-parallel rank.
    - ``completion_tokens_per_micro_batch`` (``Normalizer.tokens_per_micro_batch``): ``count`` is a tuple, one
      completion-token count per micro-batch (of whole sequences, this rank's); the loop hands micro-batch i the mean
      of its count over the data-parallel ranks as ``num_items_in_batch``, and divides the loss, its token sum divided
      by that, as a micro-batch mean (TRL's DAPO-style GRPO losses: the generation batch's tokens per micro-batch;
      async GRPO: each micro-batch's own tokens). ``means_over``: the micro-batches that mean is over on each rank
      when it is not the step's (PPO: accelerate's accumulation steps, several optimizer steps in one step).
    - ``summed_micro_batches``: each micro-batch's loss is its own mean and the step trains on their sum, averaged
      over the ranks, while the logged loss is their mean (TRL's online DPO backpropagates each micro-batch's mean as
      it is).
    """

    count: int | float | tuple
    unit: str
    means_over: int | None = None

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"Normalizer unit {self.unit!r}: expected one of {UNITS}")

    @property
    def is_mean(self) -> bool:
        """The loop divides each micro-batch's loss as a mean over the step's micro-batches on every rank."""
        return self.unit in (MEAN_UNIT, PER_MICRO_BATCH_UNIT)

    @property
    def counts_tokens(self) -> bool:
        return self.unit in TOKEN_UNITS

    @property
    def per_micro_batch(self) -> bool:
        return self.unit == PER_MICRO_BATCH_UNIT

    @classmethod
    def micro_batches(cls, batches: list) -> Normalizer:
        return cls(len(batches), MEAN_UNIT)

    @classmethod
    def summed_micro_batches(cls, batches: list) -> Normalizer:
        return cls(len(batches), SUM_UNIT)

    @classmethod
    def tokens_per_micro_batch(cls, counts, means_over: int | None = None) -> Normalizer:
        return cls(tuple(float(count) for count in counts), PER_MICRO_BATCH_UNIT, means_over)


def count_label_tokens(batches: list[dict]) -> Normalizer | None:
    """The (shifted) label tokens of a step's micro-batches; None when they carry no labels."""
    if not batches or "shift_labels" not in batches[0]:
        return None
    return Normalizer(int(sum((b["shift_labels"] != IGNORE_INDEX).sum() for b in batches)), "label_tokens")


__all__ = ["ITEM_UNITS", "MEAN_UNIT", "Normalizer", "PER_MICRO_BATCH_UNIT", "SUM_UNIT", "TOKEN_UNITS", "UNITS",
           "count_label_tokens"]
