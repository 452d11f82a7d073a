"""Unpaired preference data (KTO): rows, tokenization and batches, as TRL 1.16's KTOTrainer prepares them.

Rows: {"prompt", "completion", "label"} (label True: a desirable completion), each prompt / completion a string
or a list of chat messages (conversational, rendered with the chat template; optional "tools" and
"chat_template_kwargs" columns). Paired rows ({"prompt", "chosen", "rejected"}, or implicit-prompt
{"chosen", "rejected"}) are unpaired first: in each map batch of 1,000 rows, the chosen completions (label True),
then the rejected ones (label False), every other column repeated.

- Text completions get the EOS token appended unless they end with it; conversations end as the template ends a turn.
- The prompt ids are the tokens prompt alone and prompt + completion share; the completion ids are the rest.
- Rows whose prompt alone fills ``max_length`` are dropped.
- The KL estimate's mismatched completions ("KL_completion_ids"): within each run of ``kl_group_size`` rows (the
  per-device train batch), row i is given row i-1's completion, the first row the last one's:
  (x_1, y_1), ..., (x_n, y_n) -> (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}).

Batches (``UnpairedPreferenceCollator``): B rows -> input_ids, attention_mask, completion_mask [B, T] (prompt +
completion, truncated per sequence, padded on the right), the same three under "KL_" for prompt + mismatched
completion when the rows carry one, "label" [B] (bool), and "ref_logps" / "ref_KL_logps" [B] when precomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from datasets import Dataset

from .collate import pad_right
from .formats import is_messages
from .preference import _template_kwargs, extract_prompt, warn_if_prompt_not_prefix
from .tokenize import common_prefix_length

UNPAIRED_COLUMNS = ("prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps")


def _unpair_batch(batch: dict[str, list]) -> dict[str, list]:
    size = len(batch["chosen"])
    out = {"completion": batch["chosen"] + batch["rejected"], "label": [True] * size + [False] * size}
    for key, values in batch.items():
        if key not in ("chosen", "rejected"):
            out[key] = values + values
    return out


def unpair_preference_dataset(dataset, **map_kwargs):
    """Paired rows {"prompt"?, "chosen", "rejected", ...} -> unpaired {"prompt"?, "completion", "label", ...}."""
    columns = dataset.column_names or list(next(iter(dataset)).keys())
    return dataset.map(_unpair_batch, batched=True, remove_columns=columns, **map_kwargs)


def _check_row(row: dict, index: int) -> bool:
    """The row's kind (conversational or text); ValueError naming the row when it is in neither."""
    if row.get("label") not in (True, False):  # a bool, or 0 / 1
        raise ValueError(
            f"unpaired preference row {index}: expected a boolean 'label' (True for a desirable completion); "
            f"got {row.get('label')!r}. Give rows {{'prompt', 'completion', 'label'}}, or paired rows "
            "{'prompt', 'chosen', 'rejected'}."
        )
    prompt, completion = row.get("prompt"), row.get("completion")
    if is_messages(prompt) and is_messages(completion):
        return True
    if isinstance(prompt, str) and isinstance(completion, str):
        return False
    raise ValueError(
        f"unpaired preference row {index}: 'prompt' and 'completion' must both be strings or both be lists of chat "
        f"messages ({{'role', 'content'}}); got {type(prompt).__name__} and {type(completion).__name__}"
    )


def tokenize_unpaired_row(row: dict, processing_class, eos_token: str, index: int = 0) -> dict:
    """{"prompt_ids", "completion_ids"} of one row (EOS added to a text completion)."""
    if _check_row(row, index):
        kwargs = _template_kwargs(row)

        def ids(messages, **extra):
            return processing_class.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs, **extra)["input_ids"]

        prompt_ids = ids(row["prompt"], add_generation_prompt=True)
        full_ids = ids(row["prompt"] + row["completion"])
    else:
        completion = row["completion"] if row["completion"].endswith(eos_token) else row["completion"] + eos_token
        prompt_ids = processing_class(text=row["prompt"])["input_ids"]
        full_ids = processing_class(text=row["prompt"] + completion)["input_ids"]
    prompt_length = common_prefix_length(prompt_ids, full_ids)
    warn_if_prompt_not_prefix(processing_class, prompt_ids, prompt_length)
    return {"prompt_ids": prompt_ids[:prompt_length], "completion_ids": full_ids[prompt_length:]}


def _rotate_completions(batch: dict[str, list]) -> dict[str, list]:
    completions = batch["completion_ids"]
    return {"KL_completion_ids": completions[-1:] + completions[:-1]}


def is_tokenized_unpaired(dataset) -> bool:
    columns = getattr(dataset, "column_names", None) or []
    return {"prompt_ids", "completion_ids", "label"} <= set(columns)


def prepare_unpaired_preference_dataset(
    dataset,
    processing_class,
    max_length: int | None = 1024,
    kl_group_size: int | None = None,
    dataset_num_proc: int | None = None,
    remove_unused_columns: bool = True,
):
    """Rows -> {"prompt_ids", "completion_ids", "label"} (+ "KL_completion_ids" rotated within runs of
    ``kl_group_size`` rows when given; + any precomputed "ref_logps" / "ref_KL_logps"). A dataset already tokenized
    keeps its rows and mismatched completions (it is only filtered, and given them when it has none and needs them).
    A list of dicts becomes a ``datasets.Dataset``."""
    if dataset is None:
        return None
    if isinstance(dataset, list):
        dataset = Dataset.from_list(dataset)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    map_kwargs = {"num_proc": dataset_num_proc} if isinstance(dataset, Dataset) else {}
    if not is_tokenized_unpaired(dataset):
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError("the unpaired preference dataset is empty: give rows with 'prompt', 'completion' and 'label'")
        if "prompt" not in first:
            if "chosen" not in first or "rejected" not in first:
                raise ValueError(
                    f"unpaired preference row 0: expected 'prompt', 'completion' and 'label' (or paired 'chosen' and "
                    f"'rejected'); got {sorted(first)}"
                )
            dataset = dataset.map(lambda row, index: extract_prompt(row, index), with_indices=True, **map_kwargs)
        first = next(iter(dataset))
        if "chosen" in first and "rejected" in first:
            dataset = unpair_preference_dataset(dataset, **map_kwargs)
        conversational = is_messages(next(iter(dataset))["prompt"])

        def tokenize(row, index):
            if is_messages(row.get("prompt")) != conversational:
                raise ValueError(f"unpaired preference row {index}: every row must be conversational, or every row text")
            return tokenize_unpaired_row(row, processing_class, tokenizer.eos_token, index)

        dataset = dataset.map(tokenize, with_indices=True, **map_kwargs)
    if max_length is not None:
        dataset = dataset.filter(lambda row: len(row["prompt_ids"]) < max_length, **map_kwargs)
    columns = getattr(dataset, "column_names", None) or []
    if kl_group_size is not None and "KL_completion_ids" not in columns:
        dataset = dataset.map(_rotate_completions, batched=True, batch_size=kl_group_size, **map_kwargs)
    if remove_unused_columns and isinstance(dataset, Dataset):
        unused = [c for c in dataset.column_names if c not in UNPAIRED_COLUMNS]
        dataset = dataset.remove_columns(unused) if unused else dataset
    return dataset


def desirability_warning(labels: list[bool], desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's advice when the desirable / undesirable counts differ and neither weight lies in the range that
    balances them (Eq. 8 of the KTO paper), or None."""
    desirable = max(sum(labels), 1)
    undesirable = max(len(labels) - desirable, 1)
    if desirable == undesirable:
        return None
    desirable_low = round(undesirable * undesirable_weight / desirable, 2)
    desirable_high = round(undesirable * undesirable_weight / desirable * 1.33, 2)
    undesirable_low = round(desirable * desirable_weight / undesirable / 1.33, 2)
    undesirable_high = round(desirable * desirable_weight / undesirable, 2)
    if desirable_low <= desirable_weight <= desirable_high or undesirable_low <= undesirable_weight <= undesirable_high:
        return None
    return (
        "You have different amounts of desirable/positive and undesirable/negative examples but the weights on the "
        "desirable and undesirable losses don't seem to be in an ideal range. Based on your data, we recommend EITHER "
        f"desirable_weight in [{desirable_low}, {desirable_high}] or undesirable_weight in [{undesirable_low}, "
        f"{undesirable_high}] (but NOT BOTH). See the documentation on how to optimally set these weights."
    )


@dataclass
class UnpairedPreferenceCollator:
    """Rows {"prompt_ids", "completion_ids", "label"} (+ "KL_completion_ids", "ref_logps", "ref_KL_logps") -> the
    batch described in the module docstring. ``max_length`` truncates each sequence (its end) before padding."""

    pad_token_id: int
    max_length: int | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = {}
        for prefix, key in (("", "completion_ids"), ("KL_", "KL_completion_ids")):
            if key not in rows[0]:
                continue
            sequences, masks = [], []
            for row in rows:
                ids = list(row["prompt_ids"]) + list(row[key])
                mask = [0] * len(row["prompt_ids"]) + [1] * len(row[key])
                if self.max_length is not None:
                    ids, mask = ids[: self.max_length], mask[: self.max_length]
                sequences.append(torch.tensor(ids, dtype=torch.long))
                masks.append(torch.tensor(mask, dtype=torch.long))
            batch[f"{prefix}input_ids"] = pad_right(sequences, self.pad_token_id, self.pad_to_multiple_of)
            batch[f"{prefix}attention_mask"] = pad_right([torch.ones_like(s) for s in sequences], 0, self.pad_to_multiple_of)
            batch[f"{prefix}completion_mask"] = pad_right(masks, 0, self.pad_to_multiple_of)
        for key in ("ref_logps", "ref_KL_logps"):
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows])
        batch["label"] = torch.tensor([bool(row["label"]) for row in rows])
        return batch


__all__ = [
    "UNPAIRED_COLUMNS",
    "UnpairedPreferenceCollator",
    "desirability_warning",
    "is_tokenized_unpaired",
    "prepare_unpaired_preference_dataset",
    "tokenize_unpaired_row",
    "unpair_preference_dataset",
]
