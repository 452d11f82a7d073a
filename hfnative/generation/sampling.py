"""Sampling settings and the logits processing every backend applies before choosing a token.

Shapes: B batch, V vocabulary.

The processing follows transformers' ``generate`` (and TRL, which calls it) step for step:
repetition penalty (greedy and sampling) -> temperature -> top-k -> top-p -> min-p, each with
transformers' definition. The log-probs a rollout returns are ``log_softmax(logits / temperature)``
of the model's own logits, before any of that (what GRPO recomputes as its old log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F


def _token_ids(value, what: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = (value,) if isinstance(value, int) else tuple(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{what}={value!r}: expected a token id (int >= 0) or a list of them")
    return ids


@dataclass
class SamplingParams:
    """How to decode (transformers' ``generate`` argument names and defaults).

    eos_token_id: a token id or a list of them; generation of a sequence stops after one of them or
    one of ``stop_token_ids`` (the stop token is part of the completion). seed: each row of a call draws
    from a stream of its own, keyed by (seed, first_row + its index in the call), so a row's samples depend
    only on the seed, its place and its own logits: not on the other rows, the batch size, or how a generation
    batch is cut over processes (rank r completing rows [r n, (r + 1) n) with ``first_row = r n`` samples what
    one process completing all rows samples). None uses torch's global RNG. ``row_indices``: the place of each
    row of the call in its batch, for a call whose rows are not consecutive (a later turn of a multi-turn
    rollout continues only some rows); it replaces ``first_row + index``.
    Greedy when ``do_sample`` is False (temperature, top-k, top-p and min-p are then ignored; the
    repetition penalty still applies, as in transformers). ``regex``: each completion is constrained to match it
    (vLLM's structured outputs: TRL's vllm_structured_outputs_regex); the vLLM backends decode it, the native
    engine refuses it.
    """

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_id: int | list[int] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    first_row: int = 0
    row_indices: tuple[int, ...] | None = None
    regex: str | None = None
    stop_ids: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected an int >= 1")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: expected > 0 when sampling (use do_sample=False for greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: expected a float in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an int >= 0 (0 keeps every token)")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p}: expected a float in [0, 1]")
        if not isinstance(self.first_row, int) or self.first_row < 0:
            raise ValueError(f"first_row={self.first_row!r}: expected an int >= 0 (the call's first row in its batch)")
        if self.row_indices is not None:
            self.row_indices = tuple(self.row_indices)
            if not all(isinstance(i, int) and i >= 0 for i in self.row_indices):
                raise ValueError(f"row_indices={self.row_indices!r}: expected ints >= 0 (each row's place in its batch)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed={self.seed!r}: expected an int or None")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex={self.regex!r}: expected a non-empty regular expression or None")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty}: expected > 0 (1.0: no penalty)")
        self.stop_ids = tuple(dict.fromkeys(
            _token_ids(self.eos_token_id, "eos_token_id") + _token_ids(self.stop_token_ids, "stop_token_ids")
        ))

    def for_turn(self, turn: int, rows: list[int]) -> "SamplingParams":
        """The settings for a later turn of a multi-turn rollout that continues the call's ``rows`` (their indices
        in this call): each row keeps its place (``row_indices``) and draws from a stream of its own for that turn
        (the turn mixed into the seed), so its samples depend neither on which other rows go on nor on how the batch
        is cut over processes. Unseeded settings are returned as they are."""
        if self.seed is None:
            return self
        places = [self.row_indices[r] for r in rows] if self.row_indices is not None else [self.first_row + r for r in rows]
        seed = mix64_int(mix64_int(self.seed) ^ mix64_int(turn)) & ((1 << 63) - 1)
        return replace(self, seed=seed, first_row=0, row_indices=tuple(places))

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the returned log-probs: 1 for greedy."""
        return self.temperature if self.do_sample else 1.0


# --- per-row random streams (splitmix64, on int64 tensors: multiplication wraps, shifts are made logical) ---------

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer of int64 ``x`` (each value's bits taken as an unsigned 64-bit word)."""
    x = (x ^ _shift_right(x, 30)) * _signed(_MIX1)
    x = (x ^ _shift_right(x, 27)) * _signed(_MIX2)
    return x ^ _shift_right(x, 31)


def mix64_int(value: int) -> int:
    """``mix64`` of one Python int, exactly (the oracle the tensor version is checked against)."""
    x = value & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return _signed(x ^ (x >> 31))


def row_keys(seed: int, first_row: int, rows: int, device=None, row_indices=None) -> torch.Tensor:
    """The stream keys [rows] of rows first_row .. first_row + rows - 1 under ``seed`` (int64); of the rows
    ``row_indices[first_row : first_row + rows]`` when those are given."""
    if row_indices is None:
        index = torch.arange(first_row, first_row + rows, dtype=torch.int64, device=device)
    else:
        if first_row + rows > len(row_indices):
            raise ValueError(f"row_indices has {len(row_indices)} entries: a call of {first_row + rows} rows needs one each")
        index = torch.tensor(row_indices[first_row : first_row + rows], dtype=torch.int64, device=device)
    return mix64(mix64_int(seed) ^ mix64(index * _signed(_GAMMA) + 1))


def call_row_keys(sampling: "SamplingParams", offset: int, rows: int, device=None) -> torch.Tensor:
    """The stream keys [rows] of a call's rows ``offset`` .. ``offset + rows - 1`` (``first_row`` onwards, or their
    ``row_indices``)."""
    if sampling.row_indices is not None:
        return row_keys(sampling.seed, offset, rows, device, sampling.row_indices)
    return row_keys(sampling.seed, sampling.first_row + offset, rows, device)


def row_seeds(sampling: "SamplingParams", rows: int) -> list[int]:
    """Per-row seeds (ints in [0, 2^63)) of a call's ``rows`` rows, for a backend that takes a seed per request."""
    return [int(key) & ((1 << 63) - 1) for key in call_row_keys(sampling, 0, rows).tolist()]


def row_uniforms(keys_B: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One uniform draw in [0, 1) per row [B] (float64, 53 bits) at decode step ``step`` of each row's stream (an int,
    or a 0-d long tensor on the device: the same draw, int64 products wrapping as the int's are reduced)."""
    if isinstance(step, torch.Tensor):
        bits = mix64(keys_B + (step + 1) * _signed(_GAMMA))
    else:
        bits = mix64(keys_B + _signed(_GAMMA * (step + 1)))
    return _shift_right(bits, 11).double() * 2.0**-53


def apply_repetition_penalty(scores_BV: torch.Tensor, seen_BV: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' definition: a token already in the sequence (prompt or completion) has its logit
    divided by ``penalty`` when positive and multiplied by it when negative. seen_BV: boolean."""
    if penalty == 1.0:
        return scores_BV
    penalized = torch.where(scores_BV < 0, scores_BV * penalty, scores_BV / penalty)
    return torch.where(seen_BV, penalized, scores_BV)


def filter_top_k(scores_BV: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the tokens whose logit is at least the k-th largest (ties with it included); 0: all."""
    if top_k == 0 or top_k >= scores_BV.shape[-1]:
        return scores_BV
    kth_B1 = torch.topk(scores_BV, top_k, dim=-1).values[:, -1:]
    return scores_BV.masked_fill(scores_BV < kth_B1, float("-inf"))


def filter_top_p(scores_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus: keep the most likely tokens whose cumulative probability reaches ``top_p``. As
    transformers computes it: in ascending order, drop a token while the mass up to and including it
    is <= 1 - top_p; the most likely token always stays."""
    if top_p >= 1.0:
        return scores_BV
    sorted_scores, order = torch.sort(scores_BV, dim=-1)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return scores_BV.masked_fill(drop, float("-inf"))


def filter_min_p(scores_BV: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's; the most likely stays."""
    if min_p == 0.0:
        return scores_BV
    probs_BV = scores_BV.softmax(dim=-1)
    drop = probs_BV < min_p * probs_BV.amax(dim=-1, keepdim=True)
    drop.scatter_(-1, probs_BV.argmax(dim=-1, keepdim=True), False)
    return scores_BV.masked_fill(drop, float("-inf"))


def processed_scores(logits_BV: torch.Tensor, sampling: SamplingParams, seen_BV: torch.Tensor | None = None) -> torch.Tensor:
    """The scores tokens are chosen from (float32): penalty, then (when sampling) temperature, top-k,
    top-p, min-p. Filtered tokens are -inf. seen_BV: tokens already in each sequence (for the penalty)."""
    scores_BV = logits_BV.float()
    if sampling.repetition_penalty != 1.0:
        if seen_BV is None:
            raise ValueError("a repetition penalty needs the tokens each sequence has seen (seen_BV)")
        scores_BV = apply_repetition_penalty(scores_BV, seen_BV, sampling.repetition_penalty)
    if not sampling.do_sample:
        return scores_BV
    if sampling.temperature != 1.0:
        scores_BV = scores_BV / sampling.temperature
    scores_BV = filter_top_k(scores_BV, sampling.top_k)
    scores_BV = filter_top_p(scores_BV, sampling.top_p)
    return filter_min_p(scores_BV, sampling.min_p)


def sampling_distribution(logits_BV: torch.Tensor, sampling: SamplingParams, seen_BV: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution the next token is drawn from [B, V] (float32; greedy: one-hot on the argmax)."""
    scores_BV = processed_scores(logits_BV, sampling, seen_BV)
    if not sampling.do_sample:
        return F.one_hot(scores_BV.argmax(dim=-1), scores_BV.shape[-1]).float()
    return scores_BV.softmax(dim=-1)


def choose_tokens(
    logits_BV: torch.Tensor,
    sampling: SamplingParams,
    seen_BV: torch.Tensor | None = None,
    row_keys_B: torch.Tensor | None = None,
    step: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each sequence [B] and its log-prob [B] under log_softmax(logits / temperature).
    Sampled from each row's own stream (``row_keys``) at decode ``step`` (an int or a 0-d long tensor) when keys are
    given (inverse CDF of one uniform draw), else from torch's global RNG."""
    logits_BV = logits_BV.float()
    scores_BV = processed_scores(logits_BV, sampling, seen_BV)
    if sampling.do_sample and row_keys_B is not None:
        cdf_BV = scores_BV.softmax(dim=-1).double().cumsum(dim=-1)
        draw_B1 = (row_uniforms(row_keys_B, step) * cdf_BV[:, -1])[:, None]
        # the first token whose cumulative probability exceeds the draw: a token of probability 0 is never chosen
        tokens_B = torch.searchsorted(cdf_BV, draw_B1, right=True)[:, 0].clamp(max=cdf_BV.shape[-1] - 1)
    elif sampling.do_sample:
        tokens_B = torch.multinomial(scores_BV.softmax(dim=-1), 1)[:, 0]
    else:
        tokens_B = scores_BV.argmax(dim=-1)
    if sampling.logprob_temperature != 1.0:
        logits_BV = logits_BV / sampling.logprob_temperature
    return tokens_B, F.log_softmax(logits_BV, dim=-1).gather(-1, tokens_B[:, None])[:, 0]
