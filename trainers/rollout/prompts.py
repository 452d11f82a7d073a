"""Prompts and sampling settings as TRL's on-policy trainers take them: prompts to token ids (a conversation through the
chat template with the generation prompt, text as it is), TRL's stop tokens, and TRL's sampling argument names as the
native engine's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import fields

from hfnative.generation import SamplingParams


def is_conversational(prompt) -> bool:
    """A prompt given as chat messages ({"role", "content"} dicts) rather than text."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def tokenize_prompts(processing_class, prompts: list, chat_template_kwargs: dict | None = None,
                     add_special_tokens: bool = True, tools: list | None = None,
                     chat_template: str | None = None) -> list[list[int]]:
    """Token ids of each prompt: a conversation rendered by the chat template (``chat_template`` in place of the
    tokenizer's when given) with the generation prompt and the ``tools``' schemas, text tokenized as it is (with the
    tokenizer's special tokens unless ``add_special_tokens`` is False)."""
    if not prompts:
        return []
    if is_conversational(prompts[0]):
        extra = {} if tools is None and chat_template is None else {"tools": tools or None, "chat_template": chat_template}
        encoded = processing_class.apply_chat_template(
            prompts, add_generation_prompt=True, tokenize=True, return_dict=True, **extra, **(chat_template_kwargs or {})
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


# the SamplingParams fields a config's generation_kwargs may set (the stop tokens, the seed, the regex and the rows'
# places are the run's)
GENERATION_KWARGS = tuple(f.name for f in fields(SamplingParams)
                          if f.init and f.name not in ("seed", "regex", "first_row", "row_indices"))
# generation_kwargs keys that change no sampled token (transformers' cache and output switches, ids the run sets)
NO_EFFECT_GENERATION_KWARGS = frozenset({"use_cache", "pad_token_id", "bos_token_id", "disable_compile",
                                         "return_dict_in_generate", "output_scores", "output_logits"})


def sampling_params(args, max_new_tokens: int, stop_ids: list[int], *, generation_kwargs=None, strict: bool = False,
                    **overrides) -> SamplingParams:
    """Sampling from TRL's argument names (temperature, top_p, top_k, min_p, repetition_penalty), then
    ``overrides``, then ``generation_kwargs`` (its keys outside ``GENERATION_KWARGS`` are ignored, or refused when
    ``strict``)."""
    settings = dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=args.temperature,
                    top_p=getattr(args, "top_p", 1.0), top_k=getattr(args, "top_k", 0),
                    min_p=getattr(args, "min_p", None) or 0.0, repetition_penalty=getattr(args, "repetition_penalty", 1.0))
    regex = getattr(args, "vllm_structured_outputs_regex", None)
    if regex is not None:  # TRL's structured outputs: vLLM's engines decode them (the native engine refuses)
        settings["regex"] = regex
    settings.update(overrides, eos_token_id=list(stop_ids))
    for key, value in (generation_kwargs or {}).items():
        if key in GENERATION_KWARGS:
            settings[key] = value
        elif strict and key not in NO_EFFECT_GENERATION_KWARGS:
            engine = "the vLLM backend" if getattr(args, "use_vllm", False) else "the native generation engine"
            raise ValueError(
                f"generation_kwargs[{key!r}] is not a setting hfnative passes to {engine}; it takes "
                f"{', '.join(sorted(GENERATION_KWARGS))} (and ignores {', '.join(sorted(NO_EFFECT_GENERATION_KWARGS))})"
            )
    return SamplingParams(**settings)


__all__ = [
    "GENERATION_KWARGS",
    "generation_eos_ids",
    "is_conversational",
    "sampling_params",
    "stop_token_ids",
    "tokenize_prompts",
]
