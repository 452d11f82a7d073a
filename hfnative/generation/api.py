"""``generate``: rollouts from a native model, in one call."""

from __future__ import annotations

from hfnative.models.decoder import Transformer

from .native import NativeRolloutEngine
from .rollouts import Rollouts
from .sampling import SamplingParams


def generate(
    model: Transformer,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
) -> Rollouts:
    """Complete each prompt (token-id lists of any lengths) with the native KV-cache engine.

    model: an hfnative Transformer (its live weights, adapters included) or a model holding one as
    ``.model``, such as the ConvertedModel ``hfnative.load_pretrained`` makes of a checkpoint folder, a Hub
    id or a transformers model. The sampling arguments are transformers' (see ``SamplingParams``). Returns
    ``Rollouts``: completion_ids (the stop token included when produced), logprobs (log_softmax(logits /
    temperature) before filtering; temperature 1 when greedy) and finish_reason ("stop" or "length") per prompt.
    """
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, repetition_penalty=repetition_penalty, eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids, seed=seed,
    )
    return NativeRolloutEngine(model).generate(prompt_ids, sampling)
