"""The rollout interface the trainers generate through, whatever backend runs it.

A backend takes token-id prompts and ``SamplingParams`` and returns ``Rollouts``; after each optimizer
step the trainer calls ``load_weights`` so the next rollouts come from the updated policy.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .sampling import SamplingParams


@dataclass
class Rollouts:
    """One completion per prompt, in the prompts' order.

    completion_ids: the generated tokens (the stop token included when one ended the sequence).
    logprobs: per completion token, its log-prob under log_softmax(logits / temperature) of the model's
    logits, before repetition penalty and top-k/top-p/min-p (temperature 1 for greedy).
    finish_reason: "stop" (a stop token was produced) or "length" (max_new_tokens reached).
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reason: list[str]

    def __len__(self) -> int:
        return len(self.completion_ids)


class RolloutEngine(ABC):
    """Generates completions from the current policy."""

    # True when the engine runs the training model's own parameters, so ``load_weights`` after a step
    # has nothing to copy (a trainer may skip gathering the named tensors)
    reads_live_weights: bool = False
    # True when a seeded call samples each row from its own stream (``SamplingParams.first_row`` / ``row_indices``),
    # so a row's samples do not depend on how a batch is cut over calls or processes
    samples_row_streams: bool = False

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        """prompts: token-id lists, any lengths (each at least one token)."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take updated weights, (name, tensor) pairs under the names the backend documents."""


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """The prompts as lists of ints; a ValueError names the first prompt that is empty or holds a bad id."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: expected a non-empty list of token-id lists (one per prompt, any lengths)")
    checked = []
    for index, prompt in enumerate(prompts):
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise ValueError(f"prompt {index} is empty: every prompt needs at least one token")
        for token in ids:
            if isinstance(token, bool) or not hasattr(token, "__index__") or not 0 <= operator.index(token) < vocab_size:
                raise ValueError(f"prompt {index} holds {token!r}: expected token ids in [0, {vocab_size})")
        checked.append([operator.index(t) for t in ids])
    return checked
