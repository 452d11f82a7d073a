"""Tokenize one SFT row and build its labels, exactly as TRL 1.16's SFTTrainer does.

- Text (language modeling and prompt-completion) gets `eos_token` appended to the text / completion
  unless it already ends with it, and is tokenized with the tokenizer's special tokens (a BOS if the
  tokenizer adds one). Conversations get no EOS: the chat template decides how a turn ends, and
  `apply_chat_template` tokenizes without special tokens.
- Prompt-completion: the completion starts where the tokens of the prompt alone and of
  prompt + completion first differ (usually the prompt's length).
- Labels are the input ids with -100 where a mask that applies is 0.
"""

import json
import logging

from .formats import CONVERSATIONAL, CONVERSATIONAL_PROMPT_COMPLETION, LANGUAGE_MODELING, PROMPT_COMPLETION

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # label of a token that is not trained on
_warned_prefix = False


def chat_template_kwargs(row: dict, eos_token: str | None, chat_template: str | None = None) -> dict:
    """Keyword arguments for `apply_chat_template` from the row's optional "tools" (a list, or JSON text)
    and "chat_template_kwargs" columns. An `eos_token` override is passed as the template's variable,
    as the tokenizer's own eos_token would be; `chat_template` (a template text) replaces the tokenizer's."""
    tools = row.get("tools")
    kwargs = {"tools": json.loads(tools) if isinstance(tools, str) else tools}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if eos_token is not None:
        kwargs["eos_token"] = eos_token
    kwargs.update(row.get("chat_template_kwargs") or {})
    return kwargs


def render_chat(processing_class, messages: list[dict], **kwargs) -> dict:
    """`apply_chat_template` tokenized, as a dict with "input_ids" (and "assistant_masks" when asked)."""
    return processing_class.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)


def common_prefix_length(ids: list[int], other_ids: list[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other_ids):
        if token != other_token:
            break
        length += 1
    return length


def completion_mask_for(processing_class, prompt_ids: list[int], full_ids: list[int]) -> list[int]:
    """1 on the completion tokens of `full_ids` (prompt + completion), 0 on the prompt."""
    global _warned_prefix
    prompt_length = common_prefix_length(prompt_ids, full_ids)
    if prompt_length < len(prompt_ids) and not _warned_prefix:
        _warned_prefix = True
        logger.warning(
            "The tokenized prompt is not a prefix of the tokenized prompt + completion (the chat template renders "
            "the prompt differently alone, or tokens merge across the boundary); the completion starts where they "
            "diverge and %r is left out of the training sequence.",
            processing_class.decode(prompt_ids[prompt_length:]),
        )
    return [0] * prompt_length + [1] * (len(full_ids) - prompt_length)


def with_eos(text: str, eos_token: str) -> str:
    return text if text.endswith(eos_token) else text + eos_token


def tokenize_row(
    row: dict,
    row_format: str,
    processing_class,
    *,
    text_field: str,
    eos_token: str,
    eos_override: str | None,
    assistant_only_loss: bool,
    chat_template: str | None = None,
) -> dict:
    """The columns tokenization adds or changes for one row, in TRL's column order: the text or
    completion with EOS appended (text formats), "input_ids", then "completion_mask" (prompt-completion)
    and "assistant_masks" (conversational, when `assistant_only_loss`). Conversations are rendered with
    `chat_template` when given (a training version of the tokenizer's template), else the tokenizer's."""
    if row_format == LANGUAGE_MODELING:
        text = with_eos(row[text_field], eos_token)
        return {text_field: text, "input_ids": processing_class(text=text)["input_ids"]}

    if row_format == PROMPT_COMPLETION:
        completion = with_eos(row["completion"], eos_token)
        prompt_ids = processing_class(text=row["prompt"])["input_ids"]
        full_ids = processing_class(text=row["prompt"] + completion)["input_ids"]
        return {
            "completion": completion,
            "input_ids": full_ids,
            "completion_mask": completion_mask_for(processing_class, prompt_ids, full_ids),
        }

    kwargs = chat_template_kwargs(row, eos_override, chat_template)
    if row_format == CONVERSATIONAL:
        rendered = render_chat(
            processing_class, row["messages"], return_assistant_tokens_mask=assistant_only_loss, **kwargs
        )
        output = {"input_ids": rendered["input_ids"]}
        if assistant_only_loss:
            output["assistant_masks"] = rendered["assistant_masks"]
        return output

    if row_format == CONVERSATIONAL_PROMPT_COMPLETION:
        prompt_ids = render_chat(processing_class, row["prompt"], add_generation_prompt=True, **kwargs)["input_ids"]
        rendered = render_chat(
            processing_class,
            row["prompt"] + row["completion"],
            return_assistant_tokens_mask=assistant_only_loss,
            **kwargs,
        )
        output = {"assistant_masks": rendered["assistant_masks"]} if assistant_only_loss else {}
        output["input_ids"] = rendered["input_ids"]
        output["completion_mask"] = completion_mask_for(processing_class, prompt_ids, rendered["input_ids"])
        return output

    raise AssertionError(f"tokenize_row got format {row_format!r}")


def labels_from_masks(input_ids: list[int], masks: list[list[int]]) -> list[int]:
    """Each token id where every mask is 1, else -100. With no masks, a copy of `input_ids`."""
    return [token if all(bits) else IGNORE_INDEX for token, *bits in zip(input_ids, *masks)]


def truncate(ids: list, max_length: int, truncation_mode: str) -> list:
    """Keep the first (`keep_start`) or last (`keep_end`) `max_length` items."""
    return ids[:max_length] if truncation_mode == "keep_start" else ids[-max_length:]


def has_label_token(labels: list[int]) -> bool:
    return any(label != IGNORE_INDEX for label in labels)
