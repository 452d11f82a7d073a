"""Preference data (DPO): rows, tokenization and batches, as TRL 1.16's DPOTrainer prepares them.

Rows: {"prompt", "chosen", "rejected"} (explicit prompt) or {"chosen", "rejected"} (implicit: the prompt
is their longest common prefix), each a string or a list of chat messages (conversational, rendered with
the chat template; optional "tools" and "chat_template_kwargs" columns).

- Text completions get the EOS token appended unless they end with it; conversations end as the
  template ends a turn.
- The prompt ids are the tokens prompt alone and prompt + completion share (usually the whole prompt);
  the completion ids are the rest of prompt + completion.
- Rows whose prompt alone fills ``max_length`` are dropped (with "keep_start" truncation nothing of
  their completions would be left).

Batches (``PreferenceCollator``): B rows -> [2B, T] tensors, the B chosen sequences first, then the B
rejected ones; each sequence is prompt + completion, truncated per sequence, padded on the right.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch
from datasets import Dataset

from .collate import pad_right
from .formats import is_messages
from .tokenize import common_prefix_length

logger = logging.getLogger(__name__)

PREFERENCE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps")
_warned_prefix = False


def is_conversational_preference(row: dict) -> bool:
    """Whether the row's prompt / chosen / rejected are chat messages (judged on the first one present)."""
    for key in ("prompt", "chosen", "rejected"):
        if row.get(key) is not None:
            return is_messages(row[key])
    return False


def extract_prompt(row: dict, index: int = 0) -> dict:
    """An implicit-prompt row split into prompt, chosen and rejected: the prompt is the longest common prefix
    (characters, or whole messages), less a space that ends it (TRL's ``extract_prompt``)."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if not chosen or not rejected:
        raise ValueError(
            f"preference row {index}: expected non-empty 'chosen' and 'rejected' (strings, or lists of chat messages) "
            f"and no 'prompt' column; got {sorted(k for k, v in row.items() if v is not None)}"
        )
    shared = min(len(chosen), len(rejected))
    cut = shared - 1  # where TRL's scan stops when one completion is a prefix of the other
    for position in range(shared):
        if chosen[position] != rejected[position]:
            cut = position - 1 if position > 0 and chosen[position - 1] == " " else position
            break
    return {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}


def _check_row(row: dict, index: int) -> bool:
    """The row's kind (conversational or text); ValueError naming the row when it is in neither."""
    values = [row.get(key) for key in ("prompt", "chosen", "rejected")]
    if all(is_messages(v) for v in values):
        return True
    if all(isinstance(v, str) for v in values):
        return False
    kinds = {key: type(v).__name__ for key, v in zip(("prompt", "chosen", "rejected"), values)}
    raise ValueError(
        f"preference row {index}: 'prompt', 'chosen' and 'rejected' must all be strings or all be lists of chat "
        f"messages ({{'role', 'content'}}); got {kinds}"
    )


def _template_kwargs(row: dict) -> dict:
    tools = row.get("tools")
    return {"tools": json.loads(tools) if isinstance(tools, str) else tools, **(row.get("chat_template_kwargs") or {})}


def warn_if_prompt_not_prefix(processing_class, prompt_ids: list[int], prompt_length: int) -> None:
    """Once per process: the tokenized prompt alone is longer than what it shares with prompt + completion."""
    global _warned_prefix
    if prompt_length < len(prompt_ids) and not _warned_prefix:
        _warned_prefix = True
        logger.warning(
            "The tokenized prompt is not a prefix of the tokenized prompt + completion (the chat template renders the "
            "prompt differently alone, or tokens merge across the boundary); the completion starts where they diverge "
            "and %r is left out of the training sequence.", processing_class.decode(prompt_ids[prompt_length:]),
        )


def tokenize_preference_row(row: dict, processing_class, eos_token: str, index: int = 0) -> dict:
    """{"prompt_ids", "chosen_ids", "rejected_ids"} of one explicit-prompt row (EOS added to text completions)."""
    if _check_row(row, index):
        kwargs = _template_kwargs(row)

        def ids(messages, **extra):
            return processing_class.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs, **extra)["input_ids"]

        prompt_ids = ids(row["prompt"], add_generation_prompt=True)
        chosen_full, rejected_full = ids(row["prompt"] + row["chosen"]), ids(row["prompt"] + row["rejected"])
    else:
        chosen = row["chosen"] if row["chosen"].endswith(eos_token) else row["chosen"] + eos_token
        rejected = row["rejected"] if row["rejected"].endswith(eos_token) else row["rejected"] + eos_token
        prompt_ids = processing_class(text=row["prompt"])["input_ids"]
        chosen_full = processing_class(text=row["prompt"] + chosen)["input_ids"]
        rejected_full = processing_class(text=row["prompt"] + rejected)["input_ids"]
    prompt_length = min(common_prefix_length(prompt_ids, chosen_full), common_prefix_length(prompt_ids, rejected_full))
    warn_if_prompt_not_prefix(processing_class, prompt_ids, prompt_length)
    return {
        "prompt_ids": prompt_ids[:prompt_length],
        "chosen_ids": chosen_full[prompt_length:],
        "rejected_ids": rejected_full[prompt_length:],
    }


def is_tokenized_preference(dataset) -> bool:
    columns = getattr(dataset, "column_names", None) or []
    return {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(columns)


def prepare_preference_dataset(
    dataset,
    processing_class,
    max_length: int | None = 1024,
    truncation_mode: str = "keep_start",
    dataset_num_proc: int | None = None,
    remove_unused_columns: bool = True,
):
    """Rows -> {"prompt_ids", "chosen_ids", "rejected_ids"} (and any precomputed "ref_*_logps"); a dataset
    already tokenized is only filtered. A list of dicts becomes a ``datasets.Dataset``."""
    if dataset is None:
        return None
    if isinstance(dataset, list):
        dataset = Dataset.from_list(dataset)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    map_kwargs = {"num_proc": dataset_num_proc} if isinstance(dataset, Dataset) else {}
    if not is_tokenized_preference(dataset):
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError("the preference dataset is empty: give rows with 'chosen' and 'rejected'")
        explicit = first.get("prompt") is not None

        def tokenize(row, index):
            row = dict(row) if explicit else {**row, **extract_prompt(row, index)}
            return tokenize_preference_row(row, processing_class, tokenizer.eos_token, index)

        dataset = dataset.map(tokenize, with_indices=True, **map_kwargs)
    if max_length is not None and truncation_mode == "keep_start":
        dataset = dataset.filter(lambda row: len(row["prompt_ids"]) < max_length, **map_kwargs)
    if remove_unused_columns and isinstance(dataset, Dataset):
        unused = [c for c in dataset.column_names if c not in PREFERENCE_COLUMNS]
        dataset = dataset.remove_columns(unused) if unused else dataset
    return dataset


@dataclass
class PreferenceCollator:
    """Rows {"prompt_ids", "chosen_ids", "rejected_ids"} -> input_ids, attention_mask, completion_mask
    [2B, T] (chosen rows, then rejected rows; padded on the right), plus ref_chosen_logps /
    ref_rejected_logps [B] when the rows carry them. ``max_length`` truncates each sequence first."""

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"Unsupported truncation mode: {self.truncation_mode}, expected 'keep_start' or 'keep_end'")
        sequences, masks = [], []
        for side in ("chosen_ids", "rejected_ids"):
            for row in rows:
                ids = list(row["prompt_ids"]) + list(row[side])
                mask = [0] * len(row["prompt_ids"]) + [1] * len(row[side])
                if self.max_length is not None:
                    keep = slice(None, self.max_length) if self.truncation_mode == "keep_start" else slice(-self.max_length, None)
                    ids, mask = ids[keep], mask[keep]
                sequences.append(torch.tensor(ids, dtype=torch.long))
                masks.append(torch.tensor(mask, dtype=torch.long))
        batch = {
            "input_ids": pad_right(sequences, self.pad_token_id, self.pad_to_multiple_of),
            "attention_mask": pad_right([torch.ones_like(s) for s in sequences], 0, self.pad_to_multiple_of),
            "completion_mask": pad_right(masks, 0, self.pad_to_multiple_of),
        }
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows])
        return batch
