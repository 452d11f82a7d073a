"""`prepare_sft_dataset`: a raw SFT dataset in, the rows TRL 1.16's SFTTrainer trains on out.

The path, in TRL's order:
  formatting_func -> ShareGPT to ChatML -> per row: check format, EOS, tokenize, labels, truncate
  -> drop rows with no label token -> [shuffle -> pack -> drop packed rows with no label token] -> shuffle

The result keeps the columns TRL keeps: the original ones (text with EOS appended), "input_ids",
"labels", and "completion_mask" when it was not applied (prompt-completion with
completion_only_loss=False); packed datasets have only "input_ids", "labels" and, for "bfd",
"seq_lengths".
"""

import logging
from dataclasses import dataclass

from datasets import Dataset, IterableDataset

from .chat_templates import (
    KNOWN_TEMPLATES,
    has_generation_markers,
    template_text,
    STOP_NOT_TRAINED,
    stop_token_trained,
    training_chat_template,
    training_template_name,
)
from .formats import (
    CONVERSATIONAL_FORMATS,
    LANGUAGE_MODELING,
    PRETOKENIZED,
    PROMPT_COMPLETION,
    PROMPT_COMPLETION_FORMATS,
    check_row_format,
    column_names,
    format_error,
    from_value_to_chatml,
    has_prompt_and_completion,
    is_from_value_messages,
    malformed_message,
    row_format,
)
from .from_rows import dataset_from_rows
from .packing import PACKING_STRATEGIES, pack_dataset
from .tokenize import has_label_token, labels_from_masks, tokenize_row, truncate
from ..log_once import warn_once

logger = logging.getLogger(__name__)
_announced_templates: set[str] = set()  # training versions already announced in the log


@dataclass(frozen=True)
class RowRecipe:
    """What `prepare_row` does to every row."""

    row_format: str
    check_format: bool
    processing_class: object
    text_field: str
    eos_token: str | None
    eos_override: str | None
    assistant_only_loss: bool
    chat_template: str | None  # replaces the tokenizer's template (a training version of it), or None
    mask_columns: tuple[str, ...]  # masks folded into the labels (none when the dataset has "labels")
    build_labels: bool
    max_length: int | None  # truncate to this (None when packing: packing cuts rows itself)
    truncation_mode: str


def prepare_row(row: dict, index: int, recipe: RowRecipe) -> dict:
    """Check one row's format, tokenize it, build its labels and truncate it; returns the columns to set."""
    if recipe.check_format:
        check_row_format(row, index, recipe.row_format, recipe.text_field)
    if recipe.row_format == PRETOKENIZED:
        output = {}
    else:
        try:
            output = tokenize_row(
                row,
                recipe.row_format,
                recipe.processing_class,
                text_field=recipe.text_field,
                eos_token=recipe.eos_token,
                eos_override=recipe.eos_override,
                assistant_only_loss=recipe.assistant_only_loss,
                chat_template=recipe.chat_template,
            )
        except Exception as err:  # the chat template's own error (jinja, or its raise_exception) lacks the row
            if recipe.row_format not in CONVERSATIONAL_FORMATS:
                raise
            raise _chat_template_error(index, row, err) from err
    if "assistant_masks" in output and 1 not in output["assistant_masks"]:
        raise ValueError(
            f"Row {index} has no assistant token, so assistant_only_loss=True would train on nothing. Every "
            "conversation needs an assistant turn, and the chat template must wrap assistant replies in "
            "{% generation %} ... {% endgeneration %} (known templates are swapped for a training version that "
            "does: " + ", ".join(KNOWN_TEMPLATES) + ")."
        )
    columns = {**row, **output}
    if recipe.build_labels:
        masks = [columns[name] for name in recipe.mask_columns]
        output["labels"] = labels_from_masks(columns["input_ids"], masks)
        for name in recipe.mask_columns:
            output.pop(name, None)
    if recipe.max_length is not None:
        labels = output.get("labels", columns.get("labels"))
        output["input_ids"] = truncate(columns["input_ids"], recipe.max_length, recipe.truncation_mode)
        output["labels"] = truncate(labels, recipe.max_length, recipe.truncation_mode)
    return output


def _chat_template_error(index: int, row: dict, err: Exception) -> ValueError:
    problem = malformed_message(row)
    return ValueError(
        f"Row {index}: the chat template could not render its messages ({type(err).__name__}: "
        f"{' '.join(str(err).split())}){': ' + problem if problem else ''}. Each message needs a 'role' the "
        "template accepts and a 'content' string; fix or drop the row."
    )


def applied_masks(fmt: str, columns: list[str], completion_only_loss: bool, assistant_only_loss: bool) -> list[str]:
    """The mask columns folded into the labels, as TRL: "completion_mask" only with completion_only_loss,
    "assistant_masks" whenever present (tokenizing makes it only with assistant_only_loss)."""
    has_completion_mask = fmt in PROMPT_COMPLETION_FORMATS or "completion_mask" in columns
    has_assistant_masks = (assistant_only_loss and fmt in CONVERSATIONAL_FORMATS) or "assistant_masks" in columns
    return (["completion_mask"] if completion_only_loss and has_completion_mask else []) + (
        ["assistant_masks"] if has_assistant_masks else []
    )


def drop_rows_without_labels(dataset, what: str, num_proc: int | None = None, why: str = "no row has a label token"):
    """Drop rows whose labels are all -100 (they add no loss), logging how many went. When that is every
    row, a ValueError says how many and ``why`` (a run on nothing would report success and save the
    untouched model); a stream's rows are counted only as they go by, so the trainer checks it instead."""
    if isinstance(dataset, IterableDataset):  # no length up front: log the first drop as rows stream by
        return dataset.filter(_LabelFilter(what))
    kept = dataset.filter(lambda row: has_label_token(row["labels"]), num_proc=num_proc)
    if len(kept) == 0 and len(dataset) > 0:
        raise ValueError(f"All {len(dataset)} {what} of the dataset were dropped, so there is nothing to train on: {why}.")
    if len(kept) < len(dataset):
        logger.warning(
            "Dropped %d of %d %s with no label token left (e.g. a prompt that fills max_length).",
            len(dataset) - len(kept),
            len(dataset),
            what,
        )
    return kept


class _LabelFilter:
    def __init__(self, what: str):
        self.what, self.logged = what, False

    def __call__(self, row: dict) -> bool:
        keep = has_label_token(row["labels"])
        if not keep and not self.logged:
            self.logged = True
            logger.warning("Dropping %s with no label token left; later drops are not logged.", self.what)
        return keep


def _as_dataset(dataset):
    if isinstance(dataset, (Dataset, IterableDataset)):
        return dataset
    if isinstance(dataset, list) and all(isinstance(row, dict) for row in dataset):
        return dataset_from_rows(dataset)
    raise TypeError(
        f"The dataset must be a datasets.Dataset, a datasets.IterableDataset or a list of dicts, got "
        f"{type(dataset).__name__}."
    )


def _check_mappable(dataset) -> None:
    if isinstance(dataset, Dataset) and dataset.format["type"] == "custom":
        raise ValueError(
            "SFTTrainer cannot prepare a dataset that uses `Dataset.with_transform()`: preparation calls "
            "`Dataset.map()`, which would bake the transform's output in. Materialize the transform with "
            "`Dataset.map()` first, or pass dataset_kwargs={'skip_prepare_dataset': True} with trainer-ready rows."
        )


def _check_eos_token(processing_class, eos_token: str | None) -> None:
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if eos_token is not None and eos_token not in tokenizer.get_vocab():
        raise ValueError(
            f"The specified `eos_token` ({eos_token!r}) is not found in the vocabulary of the given "
            f"`processing_class` ({type(processing_class).__name__}), so no row can end with it "
            f"(eos_token {eos_token!r} is not in the vocabulary): set `eos_token` to a token it has (its own is "
            f"{tokenizer.eos_token!r})."
        )


def _check_options(packing, packing_strategy, padding_free, max_length, truncation_mode):
    if packing_strategy not in PACKING_STRATEGIES:
        raise ValueError(f"packing_strategy must be one of {PACKING_STRATEGIES}, got {packing_strategy!r}.")
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end', got {truncation_mode!r}.")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be a positive number of tokens or None, got {max_length}.")
    if packing and max_length is None:
        raise ValueError("packing=True needs max_length: it is the length of a packed row.")
    if padding_free and not packing and max_length is not None:
        raise ValueError(
            "padding_free=True without packing does not enforce max_length. Enable packing "
            "(packing=True, packing_strategy='bfd'), or set max_length=None with rows already short enough."
        )


def prepare_sft_dataset(
    dataset,
    processing_class,
    *,
    dataset_text_field: str = "text",
    max_length: int | None = 1024,
    packing: bool = False,
    packing_strategy: str = "bfd",
    padding_free: bool = False,
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    eos_token: str | None = None,
    formatting_func=None,
    dataset_num_proc: int | None = None,
    dataset_kwargs: dict | None = None,
    truncation_mode: str = "keep_start",
    shuffle_dataset: bool = False,
    seed: int = 42,
):
    """Tokenize, mask, truncate and pack an SFT dataset the way TRL 1.16's SFTTrainer does.

    `dataset` is a `datasets.Dataset`, an `IterableDataset` (returned lazily, as an IterableDataset) or
    a list of dicts; the keyword arguments are SFTConfig's fields of the same names (`seed` is
    TrainingArguments.seed). Each output row has "input_ids" [L] and "labels" [L] (-100 where not
    trained), L <= max_length, and "seq_lengths" [D] when packed with "bfd" / "bfd_split".
    With assistant_only_loss=True and a released chat template that has no generation markers,
    conversations are rendered with hfnative's training version of it (`chat_templates.py`).
    Raises ValueError for a row in no accepted format (naming the row) or a missing column.
    """
    if packing_strategy == "bfd-requeue":  # TRL's deprecated name for it
        packing_strategy = "bfd_split"
    _check_options(packing, packing_strategy, padding_free, max_length, truncation_mode)
    dataset = _as_dataset(dataset)
    _check_eos_token(processing_class, eos_token)
    skip = (dataset_kwargs or {}).get("skip_prepare_dataset", False)
    # as TRL, the first row is checked against the settings even when the rows are used as they are
    first_row = next(iter(dataset), None)
    fmt = None if first_row is None else _tokenized_format(first_row, None if skip else formatting_func, dataset_text_field)
    if first_row is not None:
        _check_first_row(first_row, fmt, assistant_only_loss)
    if skip:
        return _unprepared(dataset)
    _check_mappable(dataset)
    if first_row is None:
        raise ValueError("The dataset is empty: SFT needs at least one row.")
    if completion_only_loss is None:  # as TRL: decided by the columns, before any formatting
        completion_only_loss = has_prompt_and_completion(first_row)
    if completion_only_loss and formatting_func is not None:
        raise ValueError(
            "A formatting function was provided while `completion_only_loss=True`, which is incompatible: "
            "formatting_func turns rows into plain text, so there is no completion to restrict the loss to. Apply "
            "the formatting before passing the dataset, or set completion_only_loss=False."
        )
    if fmt is None:
        raise format_error(0, first_row, dataset_text_field)
    num_proc = dataset_num_proc if isinstance(dataset, Dataset) else None  # IterableDataset.map has no num_proc

    dataset, text_field = _to_known_format(dataset, fmt, first_row, formatting_func, dataset_text_field, num_proc)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    effective_eos = eos_token or tokenizer.eos_token
    if fmt in (LANGUAGE_MODELING, PROMPT_COMPLETION) and effective_eos is None:
        raise ValueError("The tokenizer has no eos_token to end each text with; pass eos_token=<a token it has>.")
    chat_template = _assistant_mask_template(processing_class) if assistant_only_loss and fmt != PRETOKENIZED else None
    if assistant_only_loss and fmt != PRETOKENIZED:
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if not stop_token_trained(tokenizer, chat_template):
            warn_once(logger, STOP_NOT_TRAINED)  # TRL's warning
    columns = column_names(dataset)
    build_labels = "labels" not in columns  # a dataset's own labels are used as they are
    mask_columns = applied_masks(fmt, columns, completion_only_loss, assistant_only_loss) if build_labels else []
    recipe = RowRecipe(
        row_format=fmt,
        check_format=formatting_func is None or fmt == PRETOKENIZED,  # formatted rows are text, whatever else
        processing_class=processing_class,
        text_field=text_field,
        eos_token=effective_eos,
        eos_override=eos_token,
        assistant_only_loss=assistant_only_loss,
        chat_template=chat_template,
        mask_columns=tuple(mask_columns),
        build_labels=build_labels,
        max_length=None if packing else max_length,
        truncation_mode=truncation_mode,
    )
    dataset = dataset.map(
        prepare_row,
        with_indices=True,
        fn_kwargs={"recipe": recipe},
        remove_columns=[name for name in mask_columns if name in columns],
        **_parallel(num_proc),
    )

    why = _why_no_label_token(recipe, completion_only_loss)
    if not packing:
        dataset = drop_rows_without_labels(dataset, "rows", num_proc, why)
    else:
        dataset = dataset.select_columns(["input_ids", "labels"])
        if shuffle_dataset:  # as TRL: also before packing, so that packed neighbours are not correlated
            dataset = dataset.shuffle(seed=seed)
        dataset = pack_dataset(dataset, max_length, packing_strategy, num_proc=num_proc)
        dataset = drop_rows_without_labels(dataset, "packed rows", num_proc, why)
    if shuffle_dataset:
        dataset = dataset.shuffle(seed=seed)
    return dataset


def _why_no_label_token(recipe: RowRecipe, completion_only_loss: bool) -> str:
    """Why a row can be left with no token to train on, and what to do, for the error when all are."""
    if not recipe.build_labels:
        trained = "the dataset's own 'labels' (every one is -100)"
    elif "assistant_masks" in recipe.mask_columns:
        trained = "an assistant turn"
    elif completion_only_loss and "completion_mask" in recipe.mask_columns:
        trained = "the completion"
    else:
        trained = "its text"
    if recipe.max_length is None:
        return f"no row has a token of {trained} to train on"
    return (
        f"after truncation to max_length={recipe.max_length} (truncation_mode={recipe.truncation_mode!r}) no row "
        f"keeps a token of {trained}, e.g. each prompt fills max_length. Raise max_length, shorten the prompts, "
        "or set truncation_mode='keep_end'"
    )


def _unprepared(dataset):
    """The dataset as it is (skip_prepare_dataset), refused when it has masks that nothing would apply."""
    columns = column_names(dataset)
    if "labels" not in columns and ("completion_mask" in columns or "assistant_masks" in columns):
        raise ValueError(
            "The dataset has mask columns but no 'labels', and skip_prepare_dataset=True skips building labels, "
            "so it would train on the full sequence. Add a 'labels' column (-100 for tokens not trained on) or "
            "drop skip_prepare_dataset."
        )
    return dataset


def _tokenized_format(first_row: dict, formatting_func, text_field: str) -> str | None:
    """The format the rows are tokenized in, read from row 0: pre-tokenized, the text `formatting_func` makes,
    ShareGPT "conversations" as the messages they become, else the row's own (None: in no known format)."""
    if "input_ids" in first_row:
        return PRETOKENIZED
    if formatting_func is not None:
        return LANGUAGE_MODELING
    if is_from_value_messages(first_row.get("conversations")):
        first_row = {**first_row, "messages": from_value_to_chatml(first_row["conversations"])}
    return row_format(first_row, text_field)


def _check_first_row(first_row: dict, fmt: str | None, assistant_only_loss: bool) -> None:
    """TRL's checks of a dataset's first row against what SFT trains: text, and assistant turns to mask."""
    if "image" in first_row or "images" in first_row:
        raise ValueError(
            "The dataset appears to be vision-related (contains 'image' or 'images' keys), but the text SFT path "
            "trains text models only: drop the image columns, or use a trainer for vision-language models."
        )
    if assistant_only_loss and fmt in (LANGUAGE_MODELING, PROMPT_COMPLETION):
        raise ValueError(
            f"You set `assistant_only_loss=True`, but the dataset is not conversational: it is {fmt}, and "
            "assistant_only_loss=True needs a conversational dataset (messages), the only kind with assistant turns."
        )


def _to_known_format(dataset, fmt: str, first_row: dict, formatting_func, text_field: str, num_proc: int | None):
    """Apply `formatting_func` (its text goes to a "text" column) or turn ShareGPT "conversations" into
    "messages", as `fmt` (row 0's, from `_tokenized_format`) says; returns the dataset and its text column."""
    if fmt == PRETOKENIZED:
        if formatting_func is not None:
            logger.warning(  # TRL's text
                "You passed a dataset that is already processed (contains an `input_ids` field) together with a "
                "formatting function. Therefore `formatting_func` will be ignored. Either remove the "
                "`formatting_func` or pass a dataset that is not already processed."
            )
        return dataset, text_field
    if formatting_func is not None:
        dataset = dataset.map(lambda row: {"text": _formatted(formatting_func, row)}, **_parallel(num_proc))
        return dataset, "text"
    if is_from_value_messages(first_row.get("conversations")):
        dataset = dataset.map(
            lambda row: {"messages": from_value_to_chatml(row["conversations"])},
            remove_columns="conversations",
            **_parallel(num_proc),
        )
    return dataset, text_field


def _assistant_mask_template(processing_class) -> str | None:
    """The template to render conversations with for assistant_only_loss: None (the tokenizer's own) when it
    has generation markers, else the training version of a known template, as TRL swaps one in for tokenizing
    only (the tokenizer, and so the saved chat template, keep the original). An unknown one is an error."""
    if has_generation_markers(template_text(processing_class)):
        return None
    template = training_chat_template(processing_class)
    if template is None:
        raise ValueError(
            "assistant_only_loss=True needs a chat template that marks assistant replies with "
            "{% generation %} ... {% endgeneration %}; this tokenizer's template has no such markers and is not one "
            "that hfnative swaps for a training version automatically (recognised by their exact text: "
            + ", ".join(KNOWN_TEMPLATES)
            + "). Set processing_class.chat_template (or chat_template_path) to a template that has the markers, "
            "or set assistant_only_loss=False."
        )
    name = training_template_name(processing_class)
    if name not in _announced_templates:
        _announced_templates.add(name)
        logger.info(
            "assistant_only_loss=True: the %s chat template has no {%% generation %%} markers, so conversations are "
            "tokenized with hfnative's training version of it (same text, assistant replies marked). The tokenizer "
            "and its saved chat template are unchanged.",
            name,
        )
    return template


def _parallel(num_proc: int | None) -> dict:
    """`map` keyword for worker processes (IterableDataset.map takes none)."""
    return {"num_proc": num_proc} if num_proc is not None else {}


def _formatted(formatting_func, row: dict) -> str:
    text = formatting_func(row)
    if not isinstance(text, str):
        raise ValueError(f"formatting_func must return one string per row, got {type(text).__name__}.")
    return text
