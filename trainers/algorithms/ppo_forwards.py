"""The forwards of TRL 0.29's PPO on rows of prompt + response tokens: the policy's log-probs and entropies (the fused
log-prob head, no [tokens, vocab] logits), the reference's log-probs, the value model's value at every response
position and the reward model's score at a given position (the sequence-classification head over the native decoder).

Shapes: B rows, P prompt tokens (left-padded), T response tokens (right-padded), S = P + T.

Every forward reads the rows as TRL's does: pad tokens masked out and fed as id 0, positions counted over the real
tokens, and a padding query attending to the real keys before it (transformers' masks), so that the statistics TRL
takes over padded positions (the entropy) are its numbers too. Under context parallelism each rank reads its chunks
of every row with the ring-attention plan (padding keys masked; a padding query attends itself, so the entropy at
padded positions is not TRL's there) and the per-position outputs are gathered back into whole rows.
"""

from __future__ import annotations

import torch

from hfnative.losses import IGNORE_INDEX
from hfnative.models.head import TokenLogprobs
from hfnative.models.attention import transformers_padding_plan

from .reference_model import router_loss_off
from ..rollout.batches import completion_logprobs_of


def trl_inputs(query_responses_BS: torch.Tensor, pad_token_id: int) -> dict:
    """TRL's forward inputs: pad tokens masked out and fed as id 0, positions counted over the real tokens."""
    attention_mask_BS = query_responses_BS != pad_token_id
    return {
        "input_ids": query_responses_BS.masked_fill(~attention_mask_BS, 0),
        "attention_mask": attention_mask_BS.long(),
        "position_ids": attention_mask_BS.cumsum(1) - attention_mask_BS.long(),
    }


def with_trl_plan(inputs: dict) -> dict:
    """Prepared inputs with the attention plan of TRL's padded forwards (a context-parallel split keeps its ring plan)."""
    if inputs["attention_plan"].kind == "context_parallel":
        return inputs
    return {**inputs, "attention_plan": transformers_padding_plan(inputs["attention_plan"], inputs["attention_mask"])}


class PPOForwards:
    """The PPO forwards of one run: ``context`` (the loop's batch preparation and autocast), the tokenizer's pad id and
    the log-prob temperature (TRL's ``temperature + 1e-7``)."""

    def __init__(self, context, pad_token_id: int, temperature: float):
        self.context, self.pad_token_id, self.temperature = context, pad_token_id, temperature

    def batch(self, query_responses_BS: torch.Tensor, T: int) -> dict:
        """Host tensors for rows of prompt + response tokens: TRL's inputs, the response tokens as the targets of the
        positions that predict them (every response position, padding included), and the prompt width."""
        S = query_responses_BS.shape[1]
        P = S - T
        targets_BS = torch.full_like(query_responses_BS, IGNORE_INDEX)
        targets_BS[:, P - 1 : S - 1] = query_responses_BS[:, P:]
        return {**trl_inputs(query_responses_BS, self.pad_token_id), "shift_labels": targets_BS, "prompt_length": P,
                "completion_mask": torch.ones_like(query_responses_BS[:, P:])}

    def split(self, batch: dict) -> dict:
        """A ``batch`` of whole rows as this rank's share under context parallelism (as it is otherwise)."""
        return self.context.context_parallel.split(batch)

    def prepare(self, batch: dict) -> dict:
        """A ``batch`` of whole rows on the device (this rank's chunks under context parallelism) with TRL's attention
        plan."""
        return with_trl_plan(self.context.prepare_inputs(self.split(batch)))

    def logprobs(self, model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies [B, T] of every response position under ``model`` at the temperature."""
        with self.context.autocast(), router_loss_off(model):
            logprobs_BT, entropy_BT, _ = completion_logprobs_of(model, inputs, self.temperature, self.context)
        return logprobs_BT, entropy_BT

    def reference_logprobs(self, reference, inputs: dict) -> torch.Tensor:
        """Log-probs [B, T] under the reference (``ReferenceModel``: a frozen copy, or the policy's adapters off)."""
        head = TokenLogprobs(inputs["shift_labels"], self.temperature, compact=True)
        with self.context.autocast():
            logprobs_BS, _ = reference.head_output(inputs, head)
        P, T = inputs["prompt_length"], inputs["completion_mask"].shape[1]
        return self.context.context_parallel.gather_sequence(logprobs_BS)[:, P - 1 : P - 1 + T]

    def values(self, value_model, inputs: dict) -> torch.Tensor:
        """The value model's score at every position that predicts a response token [B, T]."""
        P, T = inputs["prompt_length"], inputs["completion_mask"].shape[1]
        with self.context.autocast():
            values_BS1 = value_model(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                     position_ids=inputs["position_ids"], attention_plan=inputs["attention_plan"],
                                     every_position=True).logits
        return self.context.context_parallel.gather_sequence(values_BS1)[:, P - 1 : P - 1 + T, 0]

    def scores(self, reward_model, inputs: dict, positions_B: torch.Tensor) -> torch.Tensor:
        """The reward model's score of each row at ``positions_B`` [B] (under context parallelism: the scores of every
        position gathered into whole rows, then read there)."""
        context_parallel = self.context.context_parallel
        positions_B = positions_B.to(inputs["input_ids"].device)
        read = {"every_position": True} if context_parallel.enabled else {"score_positions": positions_B}
        with self.context.autocast():
            scores = reward_model(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                  position_ids=inputs["position_ids"], attention_plan=inputs["attention_plan"],
                                  **read).logits
        if context_parallel.enabled:  # [B, S/cp, 1] -> whole rows [B, S, 1], read at the positions
            whole_BS1 = context_parallel.gather_sequence(scores)
            return whole_BS1[torch.arange(whole_BS1.shape[0], device=whole_BS1.device), positions_B, 0]
        return scores[:, 0]


__all__ = ["PPOForwards", "trl_inputs", "with_trl_plan"]
