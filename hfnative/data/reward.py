"""Reward-model data: preference rows, tokenization and batches, as TRL 1.16's RewardTrainer prepares them.

Rows: {"prompt", "chosen", "rejected"} (explicit prompt) or {"chosen", "rejected"} (implicit: the prompt is already
part of each), each a string or a list of chat messages (rendered with the chat template; optional "tools" and
"chat_template_kwargs" columns), and an optional "margin" (a float per pair). A scored sequence is the prompt
followed by a completion, tokenized whole; text completions get the EOS token appended unless they end with it.
Pairs where either sequence is longer than ``max_length`` are dropped. A dataset that already has "chosen_ids" and
"rejected_ids" columns is only filtered.

Batches (``RewardCollator``): B pairs -> input_ids, attention_mask [2B, T] (the B chosen sequences first, then the B
rejected ones, padded on the right) and margin [B] when the rows carry one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from datasets import Dataset

from .collate import pad_right
from .formats import is_messages
from .preference import _template_kwargs

REWARD_COLUMNS = ("chosen_ids", "rejected_ids", "margin")


def _is_conversational(row: dict, index: int) -> bool:
    """Whether the row's sequences are chat messages; ValueError naming the row when they are neither that nor text."""
    keys = [key for key in ("prompt", "chosen", "rejected") if key in row and row[key] is not None]
    if "chosen" not in keys or "rejected" not in keys:
        raise ValueError(f"reward row {index}: expected 'chosen' and 'rejected' (and optionally 'prompt' and 'margin'); "
                         f"got the columns {sorted(row)}")
    values = [row[key] for key in keys]
    if all(is_messages(value) for value in values):
        return True
    if all(isinstance(value, str) for value in values):
        return False
    kinds = {key: type(row[key]).__name__ for key in keys}
    raise ValueError(f"reward row {index}: {', '.join(keys)} must all be strings or all be lists of chat messages "
                     f"({{'role', 'content'}}); got {kinds}")


def tokenize_reward_row(row: dict, processing_class, eos_token: str, index: int = 0) -> dict:
    """{"chosen_ids", "rejected_ids"} of one row: prompt + completion tokenized whole (EOS added to text)."""
    prompt = row.get("prompt")
    if _is_conversational(row, index):
        kwargs = _template_kwargs(row)
        prompt = prompt or []

        def ids(messages):
            return processing_class.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]

        return {"chosen_ids": ids(prompt + row["chosen"]), "rejected_ids": ids(prompt + row["rejected"])}
    prompt = prompt or ""

    def text_ids(completion: str):
        completion = completion if completion.endswith(eos_token) else completion + eos_token
        return processing_class(text=prompt + completion)["input_ids"]

    return {"chosen_ids": text_ids(row["chosen"]), "rejected_ids": text_ids(row["rejected"])}


def prepare_reward_dataset(dataset, processing_class, max_length: int | None = 1024, dataset_num_proc: int | None = None,
                           remove_unused_columns: bool = True):
    """Rows -> {"chosen_ids", "rejected_ids"} (and "margin" when given). A list of dicts becomes a ``datasets.Dataset``;
    a dataset already tokenized (TRL's legacy "chosen_input_ids" / "rejected_input_ids" too) is only filtered."""
    if dataset is None:
        return None
    if isinstance(dataset, list):
        dataset = Dataset.from_list(dataset)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    columns = list(getattr(dataset, "column_names", None) or [])
    tokenized = {"chosen_ids", "rejected_ids"} <= set(columns)
    if not tokenized and {"chosen_input_ids", "rejected_input_ids"} <= set(columns):
        warnings.warn("Detected legacy dataset columns `chosen_input_ids`/`rejected_input_ids`; they are deprecated and "
                      "will not be supported in v1. Please migrate to `chosen_ids`/`rejected_ids`.", FutureWarning,
                      stacklevel=2)  # TRL's text, word for word
        dataset = dataset.rename_column("chosen_input_ids", "chosen_ids").rename_column("rejected_input_ids", "rejected_ids")
        tokenized = True
    map_kwargs = {"num_proc": dataset_num_proc} if isinstance(dataset, Dataset) else {}
    if not tokenized:
        if next(iter(dataset), None) is None:
            raise ValueError("the reward dataset is empty: give rows with 'chosen' and 'rejected'")
        dataset = dataset.map(lambda row, index: tokenize_reward_row(row, processing_class, tokenizer.eos_token, index),
                              with_indices=True, **map_kwargs)
    if max_length is not None:
        dataset = dataset.filter(lambda row: len(row["chosen_ids"]) <= max_length and len(row["rejected_ids"]) <= max_length,
                                 **map_kwargs)
    if remove_unused_columns and isinstance(dataset, Dataset):
        unused = [column for column in dataset.column_names if column not in REWARD_COLUMNS]
        dataset = dataset.remove_columns(unused) if unused else dataset
    return dataset


@dataclass
class RewardCollator:
    """Rows {"chosen_ids", "rejected_ids"[, "margin"]} -> input_ids, attention_mask [2B, T] (chosen rows, then rejected
    rows, padded on the right to a multiple of ``pad_to_multiple_of``) and margin [B] (float32)."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [torch.tensor(row[side], dtype=torch.long) for side in ("chosen_ids", "rejected_ids") for row in rows]
        batch = {
            "input_ids": pad_right(sequences, self.pad_token_id, self.pad_to_multiple_of),
            "attention_mask": pad_right([torch.ones_like(s) for s in sequences], 0, self.pad_to_multiple_of),
        }
        if "margin" in rows[0]:
            batch["margin"] = torch.tensor([row["margin"] for row in rows], dtype=torch.float)
        return batch


__all__ = ["REWARD_COLUMNS", "RewardCollator", "prepare_reward_dataset", "tokenize_reward_row"]
