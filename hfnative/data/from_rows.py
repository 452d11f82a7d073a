"""A list of dicts as a `datasets.Dataset`, with the row named when its values cannot share a column.

Arrow stores each column with one type, so a row whose value differs in kind from the rows before it
(a message content that is a number or a list where earlier ones are strings) makes Arrow fail with
no row number. The rows are then walked to find the first one that conflicts and where.
"""

from datasets import Dataset


class _Conflict(Exception):
    def __init__(self, where: str, before, here):
        super().__init__(where)
        self.where, self.before, self.here = where, before, here


def _describe(shape) -> str:
    if isinstance(shape, (dict, list)):
        return f"a {type(shape).__name__}"
    return "a number" if shape == "number" else shape


def _field(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def _merge(a, b, where: str):
    """The shape both ``a`` and ``b`` fit (None, a missing value, fits anything); _Conflict when none does."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        return {key: _merge(a.get(key), b.get(key), _field(where, key)) for key in a | b}
    if isinstance(a, list) and isinstance(b, list):
        return [_merge(a[0], b[0], f"{where}[]")]
    raise _Conflict(where, a, b)


def _shape(value, where: str):
    """A value's type skeleton: "str", "number", "bool", {key: shape}, [item shape] or None."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"  # Arrow widens ints to floats
    if isinstance(value, dict):
        return {key: _shape(item, _field(where, key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        merged = None
        for item in value:
            merged = _merge(merged, _shape(item, f"{where}[]"), f"{where}[]")
        return [merged]
    return type(value).__name__


def _first_conflict(rows: list[dict]) -> tuple[int, str] | None:
    """The first row whose values cannot share the columns of the rows before it (or of its own other
    values), and what conflicts: (3, "messages[].content holds a number where the rows before it have str")."""
    merged = None
    for index, row in enumerate(rows):
        try:
            shape = _shape(row, "")
        except _Conflict as conflict:
            return index, f"{conflict.where} mixes {_describe(conflict.before)} and {_describe(conflict.here)}"
        try:
            merged = _merge(merged, shape, "")
        except _Conflict as conflict:
            return index, (f"{conflict.where} holds {_describe(conflict.here)} where the rows before it have "
                           f"{_describe(conflict.before)}")
    return None


def dataset_from_rows(rows: list[dict]) -> Dataset:
    """The rows as a Dataset whose columns are the union of the rows' keys (Dataset.from_list keeps only
    the first row's, losing a misnamed field silently). Raises ValueError naming the first row whose
    values do not fit the column types of the rows before it."""
    names = list(dict.fromkeys(key for row in rows for key in row))
    try:
        return Dataset.from_dict({name: [row.get(name) for row in rows] for name in names})
    except (TypeError, ValueError) as err:  # pyarrow's ArrowInvalid / ArrowTypeError derive from these
        conflict = _first_conflict(rows)
        if conflict is None:
            raise
        index, what = conflict
        raise ValueError(
            f"Row {index} of the dataset: {what}, but Arrow stores a column as one kind of value "
            f"({' '.join(str(err).split())}). Make the row's values the same kind as the others', e.g. each "
            "message's content a string."
        ) from err
