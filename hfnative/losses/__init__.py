"""Losses over the output head: fused (chunked, no [tokens, vocab] tensor kept) and plain references."""

from hfnative.losses._chunks import ReplacedRows
from hfnative.losses.cross_entropy import (
    IGNORE_INDEX,
    CrossEntropyOutput,
    at_least_one,
    fused_linear_cross_entropy,
    label_positions,
    linear_cross_entropy,
    shift_labels,
)
from hfnative.losses.distillation import DistillationOutput, fused_linear_generalized_jsd, generalized_jsd_terms
from hfnative.losses.logprobs import fused_linear_token_logprobs, linear_token_logprobs

__all__ = [
    "IGNORE_INDEX",
    "CrossEntropyOutput",
    "DistillationOutput",
    "ReplacedRows",
    "at_least_one",
    "fused_linear_cross_entropy",
    "fused_linear_generalized_jsd",
    "fused_linear_token_logprobs",
    "generalized_jsd_terms",
    "label_positions",
    "linear_cross_entropy",
    "linear_token_logprobs",
    "shift_labels",
]
