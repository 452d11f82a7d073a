"""Paired preference rows for the reference-free trainers (ORPO, CPO), tokenized by TRL's rules for them.

A row {"prompt", "chosen", "rejected"} (text, or chat messages rendered to text by the chat template first; an implicit
prompt is the common prefix of chosen and rejected) becomes, per side, one token sequence and the length of its prompt:
  - the prompt + completion text is tokenized whole (no special tokens) and cut where the prompt's own tokens end, one
    token earlier when the last prompt token merges with the completion's first;
  - the BOS token is put before the prompt when the tokenizer has one and the prompt does not start with it; the EOS
    token after the completion unless it ends with it;
  - a sequence longer than ``max_length`` loses the end of its completion (the prompt is kept whole).
The collator pads each side to its own longest sequence with the pad token, then both to the longer of the two with
``padding_value``, and stacks chosen rows then rejected rows.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from itertools import takewhile

import torch
from datasets import Dataset

from .preference import extract_prompt, is_conversational_preference

logger = logging.getLogger(__name__)

PAIRED_COLUMNS = ("chosen_input_ids", "chosen_prompt_length", "rejected_input_ids", "rejected_prompt_length")
_warned_empty = False


def _common_prefix(a: str, b: str) -> str:
    return "".join(x for x, _ in takewhile(lambda pair: pair[0] == pair[1], zip(a, b)))


def render_paired_row(row: dict, processing_class, index: int = 0) -> dict:
    """{"prompt", "chosen", "rejected"} as text: an implicit prompt extracted, chat messages rendered by the chat
    template (the prompt with the generation prompt, or continuing its last assistant message; each completion as
    what the template adds after the prompt)."""
    prompt = row.get("prompt")
    if prompt is None or is_conversational_preference({"prompt": prompt}) != is_conversational_preference(
            {"chosen": row.get("chosen")}):
        row = {**row, **extract_prompt({"chosen": row.get("chosen"), "rejected": row.get("rejected")}, index)}
    if not is_conversational_preference(row):
        return {key: row[key] for key in ("prompt", "chosen", "rejected")}
    tools = row.get("tools")
    kwargs = {"tools": json.loads(tools) if isinstance(tools, str) else tools, **(row.get("chat_template_kwargs") or {})}
    last_role = row["prompt"][-1]["role"]
    if last_role not in ("user", "tool", "assistant"):
        raise ValueError(f"preference row {index}: the prompt's last message has role {last_role!r}; expected 'user', "
                         "'tool' or 'assistant'")
    continues = last_role == "assistant"
    prompt = processing_class.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=not continues,
                                                  continue_final_message=continues, **kwargs)
    full = {side: processing_class.apply_chat_template(row["prompt"] + row[side], tokenize=False, **kwargs)
            for side in ("chosen", "rejected")}
    for side in ("chosen", "rejected"):  # a template may render the prompt alone differently (e.g. a generation tag)
        prompt = _common_prefix(prompt, full[side])
    return {"prompt": prompt, "chosen": full["chosen"][len(prompt):], "rejected": full["rejected"][len(prompt):]}


def _split_answer(tokenizer, prompt: str, answer: str, index: int) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of prompt + answer tokenized whole, cut where the prompt's own tokens end (one token
    earlier when the boundary tokens merged)."""
    full_ids = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if len(full_ids) < len(prompt_ids):
        raise ValueError(f"preference row {index}: the prompt tokenizes to more tokens alone than with its completion; "
                         "check the row's prompt / completion boundary")
    start = len(prompt_ids)
    if prompt_ids != full_ids[:start]:
        start -= 1
    return full_ids[:start], full_ids[start:]


def tokenize_paired_row(row: dict, tokenizer, max_length: int, index: int = 0) -> dict:
    """A text row -> {"chosen_input_ids", "chosen_prompt_length", "rejected_input_ids", "rejected_prompt_length"}."""
    global _warned_empty
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(row[key], str):
            raise ValueError(f"preference row {index}: {key} should be a str (or chat messages) but got "
                             f"{type(row[key]).__name__}")
    sides = {side: _split_answer(tokenizer, row["prompt"], row[side], index) for side in ("chosen", "rejected")}
    chosen_prompt, rejected_prompt = sides["chosen"][0], sides["rejected"][0]
    differing = sum(a != b for a, b in zip(chosen_prompt, rejected_prompt))
    if differing > 1 or abs(len(chosen_prompt) - len(rejected_prompt)) > 1:
        raise ValueError(f"preference row {index}: the chosen and rejected prompt tokens may only differ on the last "
                         "token (a tokenizer merge at the boundary); give both completions the same prompt")
    out = {}
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for side, (prompt_ids, answer_ids) in sides.items():
        if bos is not None and (not prompt_ids or prompt_ids[0] != bos):
            prompt_ids = [bos] + prompt_ids
        if not answer_ids or answer_ids[-1] != eos:
            answer_ids = answer_ids + [eos]
        if len(prompt_ids) + len(answer_ids) > max_length:
            answer_ids = answer_ids[: max(0, max_length - len(prompt_ids))]
        if not answer_ids and not _warned_empty:
            _warned_empty = True
            logger.warning("The prompt alone fills `max_length`, so truncation leaves an empty completion. Consider "
                           "increasing `max_length` or filtering out long prompts.")
        out[f"{side}_input_ids"] = prompt_ids + answer_ids
        out[f"{side}_prompt_length"] = len(prompt_ids)
    return out


def prepare_paired_preference_dataset(dataset, processing_class, max_length: int, dataset_num_proc: int | None = None):
    """Rows -> the dataset with PAIRED_COLUMNS added (a dataset that has them is returned as it is)."""
    if dataset is None:
        return None
    if isinstance(dataset, list):
        dataset = Dataset.from_list(dataset)
    if set(PAIRED_COLUMNS) <= set(dataset.column_names or []):
        return dataset
    first = next(iter(dataset), None)
    if first is None:
        raise ValueError("the preference dataset is empty: give rows with 'chosen' and 'rejected'")
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    map_kwargs = {"num_proc": dataset_num_proc} if isinstance(dataset, Dataset) else {}

    def tokenize(row, index):
        return tokenize_paired_row(render_paired_row(row, processing_class, index), tokenizer, max_length, index)

    return dataset.map(tokenize, with_indices=True, **map_kwargs)


@dataclass
class PairedPreferenceCollator:
    """Rows with PAIRED_COLUMNS -> input_ids, attention_mask, completion_mask [2B, T] (chosen rows, then rejected;
    right-padded: each side with ``pad_token_id`` to its longest row, then to T with ``padding_value``)."""

    pad_token_id: int
    padding_value: int | None = None

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.pad_token_id is None:
            raise ValueError("Padding is enabled, but the tokenizer is not configured with a padding token: set "
                             "`tokenizer.pad_token` (e.g. `tokenizer.pad_token = tokenizer.eos_token`) before training.")
        fill = self.pad_token_id if self.padding_value is None else self.padding_value
        total = max(len(row[f"{side}_input_ids"]) for row in rows for side in ("chosen", "rejected"))
        input_ids, attention, completion = [], [], []
        for side in ("chosen", "rejected"):
            longest = max(len(row[f"{side}_input_ids"]) for row in rows)
            for row in rows:
                ids, prompt_length = list(row[f"{side}_input_ids"]), row[f"{side}_prompt_length"]
                n = len(ids)
                input_ids.append(ids + [self.pad_token_id] * (longest - n) + [fill] * (total - longest))
                attention.append([1] * n + [0] * (total - n))
                completion.append([0] * prompt_length + [1] * (n - prompt_length) + [0] * (total - n))
        as_tensor = lambda rows_: torch.tensor(rows_, dtype=torch.long)  # noqa: E731
        return {"input_ids": as_tensor(input_ids), "attention_mask": as_tensor(attention),
                "completion_mask": as_tensor(completion)}


__all__ = ["PAIRED_COLUMNS", "PairedPreferenceCollator", "prepare_paired_preference_dataset", "render_paired_row",
           "tokenize_paired_row"]
