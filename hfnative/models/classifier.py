"""The decoder as a sequence classifier: one score vector per row, read at its last token (a reward model).

Shapes: B batch, S sequence, D model dim, L labels.

The blocks and the final norm are the decoder's; the head is a [L, D] score projection (no bias), applied to the
normed hidden state of each row's last token that is not ``args.pad_token_id`` (the rightmost one, so left and
right padding both work). Without a pad token only a batch of one row can be pooled (its last position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from .args import ModelArgs
from .attention import AttentionPlan
from .compute_dtype import under_weights_autocast
from .decoder import Transformer
from .moe import RouterLogits, load_balancing_loss


@dataclass
class SequenceClassifierOutput:
    """What ``SequenceClassifier.forward`` returns, with transformers' names.

    logits: [B, L] scores at each row's last non-pad token (or at the positions asked for; [B, S, L] for every
    position); hidden_states: final normed states [B, S, D];
    aux_loss: the MoE router's load-balancing loss when it is on (None otherwise)."""

    logits: torch.Tensor
    hidden_states: torch.Tensor
    aux_loss: torch.Tensor | None = None
    loss: torch.Tensor | None = None

    def __getitem__(self, key: str):  # outputs["logits"], as with transformers' ModelOutput
        return getattr(self, key)


def last_token_positions(input_ids_BS: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Each row's rightmost position whose token is not ``pad_token_id`` [B] (0 for a row of pad tokens only)."""
    B, S = input_ids_BS.shape
    if pad_token_id is None:
        if B != 1:
            raise ValueError(
                "Cannot handle batch sizes > 1 if no padding token is defined: set the model's pad_token_id "
                "(config.pad_token_id, e.g. the tokenizer's pad_token_id) or score one row at a time"
            )
        return torch.full((1,), S - 1, dtype=torch.long, device=input_ids_BS.device)
    not_pad_BS = (input_ids_BS != pad_token_id).to(torch.int32)
    positions_S = torch.arange(S, device=input_ids_BS.device, dtype=torch.int32)
    return (positions_S * not_pad_BS).argmax(dim=-1)


class SequenceClassifier(Transformer):
    """A decoder whose head scores ``args.num_labels`` classes at each row's last non-pad token."""

    def __init__(self, args: ModelArgs):
        if args.num_labels is None:
            raise ValueError("SequenceClassifier needs ModelArgs.num_labels (the number of scores per row)")
        super().__init__(args)

    @property
    def pad_token_id(self) -> int | None:
        return self.args.pad_token_id

    @pad_token_id.setter
    def pad_token_id(self, value: int | None) -> None:
        self.args.pad_token_id = value

    @under_weights_autocast  # a frozen scorer kept in the autocast dtype (hfnative.models.compute_dtype)
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_plan: AttentionPlan | None = None,
        labels: torch.Tensor | None = None,
        score_positions: torch.Tensor | None = None,
        every_position: bool = False,
        **unused,
    ) -> SequenceClassifierOutput:
        """input_ids [B, S] -> logits [B, L]. Other transformers keyword arguments (use_cache, ...) are accepted and
        not needed; ``labels`` are refused (the caller computes its loss from the scores). ``score_positions`` [B]:
        read each row's scores there instead of at its last non-pad token; ``every_position``: the scores of every
        position, logits [B, S, L] (a value model's per-token values)."""
        if labels is not None:
            raise ValueError("SequenceClassifier computes no loss from labels: compute it from the returned logits [B, L]")
        router_logits = RouterLogits() if self.aux_loss_enabled and self.args.moe is not None else None
        hidden_BSD = self.hidden_states(input_ids, attention_mask, position_ids, attention_plan, router_logits)
        if isinstance(hidden_BSD, DTensor):  # split over the sequence (tensor parallel): whole rows, as every rank's
            hidden_BSD = hidden_BSD.redistribute(placements=(Replicate(),) * hidden_BSD.device_mesh.ndim).to_local()
        if every_position:
            logits = self.output(hidden_BSD)
        else:
            last_B = last_token_positions(input_ids, self.args.pad_token_id) if score_positions is None else score_positions
            rows_B = torch.arange(hidden_BSD.shape[0], device=hidden_BSD.device)
            logits = self.output(hidden_BSD[rows_B, last_B])
        out = SequenceClassifierOutput(logits, hidden_BSD)
        if router_logits:
            out.aux_loss = load_balancing_loss(router_logits, self.args.moe.num_experts, self.args.moe.top_k, attention_mask)
        return out


def build_model(args: ModelArgs) -> Transformer:
    """The native model ``args`` describe: a SequenceClassifier when ``num_labels`` is set, else the causal LM."""
    return SequenceClassifier(args) if args.num_labels is not None else Transformer(args)


__all__ = ["SequenceClassifier", "SequenceClassifierOutput", "build_model", "last_token_positions"]
