"""SFT dataset formats: which one a row is in, and a clear error when it is in none.

A row is read only through the fields that hold a value (`None` counts as absent), because a list of
dicts with different keys becomes a table whose missing cells are `None`.
"""

LANGUAGE_MODELING = "language modeling"  # {dataset_text_field: str}
CONVERSATIONAL = "conversational"  # {"messages": [{"role": ..., "content": ...}, ...]}
PROMPT_COMPLETION = "prompt-completion"  # {"prompt": str, "completion": str}
CONVERSATIONAL_PROMPT_COMPLETION = "conversational prompt-completion"  # {"prompt": [msgs], "completion": [msgs]}
PRETOKENIZED = "pre-tokenized"  # {"input_ids": [int], "completion_mask"?, "assistant_masks"?, "labels"?}

CONVERSATIONAL_FORMATS = (CONVERSATIONAL, CONVERSATIONAL_PROMPT_COMPLETION)
PROMPT_COMPLETION_FORMATS = (PROMPT_COMPLETION, CONVERSATIONAL_PROMPT_COMPLETION)


def accepted_formats(text_field: str) -> str:
    return (
        f'{{"{text_field}": str}} (language modeling; the column is `dataset_text_field`), '
        '{"messages": [{"role", "content"}, ...]} (conversational), '
        '{"conversations": [{"from", "value"}, ...]} (conversational, converted to "messages"), '
        '{"prompt": str, "completion": str} (prompt-completion), '
        '{"prompt": [messages], "completion": [messages]} (conversational prompt-completion), '
        '{"input_ids": [int], optional "completion_mask" / "assistant_masks" / "labels"} (pre-tokenized)'
    )


def is_messages(value) -> bool:
    """True for a non-empty list of chat messages (dicts with a "role")."""
    return isinstance(value, list) and len(value) > 0 and all(isinstance(m, dict) and "role" in m for m in value)


def is_from_value_messages(value) -> bool:
    """True for a ShareGPT-style conversation: a non-empty list of {"from", "value"} dicts."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "from" in m and "value" in m for m in value)
    )


def row_format(row: dict, text_field: str) -> str | None:
    """The format of one row, or None when it fits none. Precedence follows TRL: tokens, then
    prompt-completion, then messages, then text."""
    present = {key for key, value in row.items() if value is not None}
    if "input_ids" in present:
        return PRETOKENIZED if isinstance(row["input_ids"], list) else None
    if {"prompt", "completion"} <= present:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return PROMPT_COMPLETION
        if is_messages(prompt) and is_messages(completion):
            return CONVERSATIONAL_PROMPT_COMPLETION
        return None
    if "messages" in present and is_messages(row["messages"]):
        return CONVERSATIONAL
    if text_field in present and isinstance(row[text_field], str):
        return LANGUAGE_MODELING
    return None


def has_prompt_and_completion(row) -> bool:
    """TRL's default for completion_only_loss, read from a dataset's first row (before any formatting)."""
    return isinstance(row, dict) and "prompt" in row and "completion" in row


class RowFormatError(ValueError, KeyError):
    """A dataset row in no format SFT accepts. A ValueError that names the row, and a KeyError, as TRL raises
    for the column it looks for and does not find (e.g. a misspelt `dataset_text_field`)."""

    __str__ = Exception.__str__  # the message, not KeyError's repr of it


def format_error(index: int, row: dict, text_field: str) -> RowFormatError:
    """The error for a row in no accepted format: it names the row, what it holds and what is accepted."""
    present = sorted(key for key, value in row.items() if value is not None)
    missing = sorted(key for key, value in row.items() if value is None)
    described = {key: type(row[key]).__name__ for key in present}
    hints = []
    if "prompt" in present and "completion" not in present:
        hints.append('a "prompt" needs a "completion" for SFT (prompt-only data is for GRPO/DPO-style trainers)')
    if "prompt" in present and "completion" in present:
        hints.append('"prompt" and "completion" must both be strings or both be lists of messages')
    problem = malformed_message(row)
    if problem:
        hints.append(f"{problem}; each message needs a 'role' and a 'content'")
    if text_field not in row:
        strings = [key for key in present if isinstance(row[key], str)]
        if strings and not {"prompt", "completion"} & set(present):
            hints.append(
                f"dataset_text_field is {text_field!r} but there is no such column; "
                f"if the text is in {strings[0]!r}, pass dataset_text_field={strings[0]!r}"
            )
    message = (
        f"Row {index} of the dataset is in no format SFT accepts. It has these columns with values: {described}"
        + (f" (and these empty: {missing})" if missing else "")
        + f". Accepted formats: {accepted_formats(text_field)}."
    )
    if hints:
        message += " Hint: " + "; ".join(hints) + "."
    return RowFormatError(message)


def check_row_format(row: dict, index: int, expected: str, text_field: str) -> None:
    """Raise a ValueError naming the row when it is not in the dataset's format (taken from row 0)."""
    found = row_format(row, text_field)
    if found is None:
        raise format_error(index, row, text_field)
    if found != expected:
        raise ValueError(
            f"Row {index} is {found} but the dataset is {expected} (decided by row 0). "
            "All rows of one dataset must share a format; split the dataset or convert the rows."
        )


def malformed_message(row: dict) -> str | None:
    """Where a conversational row's first message that is not {"role": str, "content": str} is, and what
    it has instead; None when every message has both (a hint for the error when a template fails)."""
    for column in ("messages", "prompt", "completion"):
        messages = row.get(column)
        if not isinstance(messages, list):
            continue
        for position, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if not isinstance(role, str):
                return f"{column}[{position}] has no 'role'"
            content = message.get("content")
            if not isinstance(content, str):
                has = "no 'content'" if content is None else f"content of type {type(content).__name__}"
                return f"{column}[{position}] (role {role!r}) has {has}"
    return None


def from_value_to_chatml(conversation: list[dict]) -> list[dict]:
    """ShareGPT messages ({"from", "value"}) as ChatML messages ({"role", "content"}); other keys are kept."""
    renamed = {"from": "role", "value": "content"}
    return [{renamed.get(key, key): value for key, value in message.items()} for message in conversation]


def column_names(dataset) -> list[str]:
    """Column names of a `Dataset` or `IterableDataset` (read from the first row when not declared)."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    return list(next(iter(dataset)).keys())
