"""The rollout component every on-policy objective shares: GRPO, RLOO, async GRPO, on-policy distillation and GKD.

Prompts become token ids (a conversation through the chat template with the generation prompt, text as it is),
TRL's stop tokens and sampling settings become one ``SamplingParams``, completions come from a rollout engine
(the policy's: native on the live weights or vLLM, as the config asks; another model's: native), are padded into
tensors with their masks, decoded back to text or assistant messages, and measured (TRL's completions/* metrics).
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from hfnative.generation import NativeRolloutEngine, Rollouts, SamplingParams


def is_conversational(prompt) -> bool:
    """A prompt given as chat messages ({"role", "content"} dicts) rather than text."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def tokenize_prompts(processing_class, prompts: list, chat_template_kwargs: dict | None = None,
                     add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each prompt: a conversation rendered by the chat template with the generation prompt, text
    tokenized as it is (with the tokenizer's special tokens unless ``add_special_tokens`` is False)."""
    if not prompts:
        return []
    if is_conversational(prompts[0]):
        encoded = processing_class.apply_chat_template(
            prompts, add_generation_prompt=True, tokenize=True, return_dict=True, **(chat_template_kwargs or {})
        )
        return [list(ids) for ids in encoded["input_ids"]]
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {index} is {prompt!r}: expected a string or a list of chat messages (role, content)")
    return [list(ids) for ids in processing_class(text=prompts, add_special_tokens=add_special_tokens)["input_ids"]]


def generation_eos_ids(model) -> list[int]:
    """The EOS ids of ``model``'s generation_config (none when it has none)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def stop_token_ids(tokenizer, model) -> list[int]:
    """TRL's stop tokens: the tokenizer's EOS first, then the model's generation_config EOS ids."""
    ids = generation_eos_ids(model)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    if not ids:
        raise ValueError("the tokenizer has no eos_token and the model no generation_config.eos_token_id: set one")
    return ids


# the SamplingParams fields a config's generation_kwargs may set (the stop tokens and the seed are the run's)
GENERATION_KWARGS = tuple(f.name for f in fields(SamplingParams) if f.init and f.name != "seed")


def sampling_params(args, max_new_tokens: int, stop_ids: list[int], *, generation_kwargs=None, strict: bool = False,
                    **overrides) -> SamplingParams:
    """Sampling from TRL's argument names (temperature, top_p, top_k, min_p, repetition_penalty), then
    ``overrides``, then ``generation_kwargs`` (its keys outside ``GENERATION_KWARGS`` are ignored, or refused when
    ``strict``)."""
    settings = dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=args.temperature,
                    top_p=getattr(args, "top_p", 1.0), top_k=getattr(args, "top_k", 0),
                    min_p=getattr(args, "min_p", None) or 0.0, repetition_penalty=getattr(args, "repetition_penalty", 1.0))
    settings.update(overrides, eos_token_id=list(stop_ids))
    for key, value in (generation_kwargs or {}).items():
        if key in GENERATION_KWARGS:
            settings[key] = value
        elif strict:
            raise ValueError(
                f"generation_kwargs[{key!r}] is not a setting of the native generation engine; it takes "
                f"{', '.join(sorted(GENERATION_KWARGS))}"
            )
    return SamplingParams(**settings)


def pad_token_lists(sequences: list[list], value, side: str = "right", dtype=torch.long) -> torch.Tensor:
    """[N, T] from N lists of up to T values, ``value`` filling the ``side`` ("left" or "right")."""
    width = max(len(s) for s in sequences)
    if side == "left":
        return torch.tensor([[value] * (width - len(s)) + list(s) for s in sequences], dtype=dtype)
    return torch.tensor([list(s) + [value] * (width - len(s)) for s in sequences], dtype=dtype)


def completion_length_metrics(lengths_N: torch.Tensor, clipped_N: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's completions/* metrics from N completion lengths and whether each was cut at the length limit (no stop
    token at its end): lengths, the clipped share, and the lengths of those that ended on a stop token (0 if none)."""
    lengths_N = lengths_N.double()
    clipped_N = clipped_N.bool()
    terminated = lengths_N[~clipped_N] if (~clipped_N).any() else torch.zeros(1, dtype=torch.float64)
    return {
        "completions/mean_length": lengths_N.mean(), "completions/min_length": lengths_N.min(),
        "completions/max_length": lengths_N.max(), "completions/clipped_ratio": clipped_N.double().mean(),
        "completions/mean_terminated_length": terminated.mean(), "completions/min_terminated_length": terminated.min(),
        "completions/max_terminated_length": terminated.max(),
    }


class Rollout:
    """One trainer's rollouts: tokenization, sampling settings, engines, padding, decoding and length metrics.

    ``engine``: the policy's rollout engine (default: the native engine on the policy's live weights); any other
    model given to ``generate`` (a teacher) gets a native engine of its own. ``sampling``: the run's
    SamplingParams; ``chat_template_kwargs``: passed to the chat template; ``add_special_tokens``: for text
    prompts (TRL's async trainer tokenizes them without).
    """

    def __init__(self, context, sampling: SamplingParams, *, engine=None, chat_template_kwargs: dict | None = None,
                 add_special_tokens: bool = True):
        self.context = context
        self.tokenizer = context.tokenizer
        self.sampling = sampling
        self.stop_ids = list(sampling.stop_ids)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.add_special_tokens = add_special_tokens
        self.engine = engine
        self._other_engines: dict[int, NativeRolloutEngine] = {}

    def tokenize(self, prompts: list) -> list[list[int]]:
        return tokenize_prompts(self.context.processing_class, prompts, self.chat_template_kwargs, self.add_special_tokens)

    def engine_for(self, model=None):
        """The policy's engine (``model`` None or the policy), else a native engine on ``model``'s weights."""
        if model is None or model is self.context.model:
            if self.engine is None:
                self.engine = NativeRolloutEngine(self.context.model)
            return self.engine
        engine = self._other_engines.get(id(model))
        if engine is None:
            engine = self._other_engines[id(model)] = NativeRolloutEngine(model)
        return engine

    def generate(self, prompt_ids: list[list[int]], model=None, seed: int | None = None) -> Rollouts:
        """Completions of ``prompt_ids`` (each cut after its first stop token) with their sampling log-probs, from
        ``model`` (default: the policy); ``seed`` replaces the run's sampling seed."""
        sampling = self.sampling if seed is None else replace(self.sampling, seed=seed)
        with self.context.autocast():
            return self.engine_for(model).generate(prompt_ids, sampling)

    def is_truncated(self, completion_ids: list[int]) -> bool:
        """Cut at the length limit: the completion does not end on a stop (or the padding) token."""
        return bool(completion_ids) and completion_ids[-1] not in (*self.stop_ids, self.pad_token_id)

    def decode(self, prompts: list, completion_ids: list[list[int]]) -> list:
        """Completions as text, or as one assistant message each for conversational prompts (TRL's)."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if prompts and is_conversational(prompts[0]):
            return [[{"role": "assistant", "content": text}] for text in texts]
        return texts

    def lengths(self, completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(lengths [N] float64, cut at the length limit [N] bool) of the completions."""
        return (torch.tensor([len(c) for c in completion_ids], dtype=torch.float64),
                torch.tensor([self.is_truncated(c) for c in completion_ids], dtype=torch.bool))


__all__ = [
    "GENERATION_KWARGS",
    "Rollout",
    "completion_length_metrics",
    "is_conversational",
    "pad_token_lists",
    "sampling_params",
    "stop_token_ids",
    "tokenize_prompts",
]
