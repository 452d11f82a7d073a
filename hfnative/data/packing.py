"""Packing tokenized documents into rows of at most `seq_length` tokens, as TRL 1.16's `pack_dataset`.

Strategies:
- "bfd" (best-fit decreasing): documents longer than `seq_length` keep their first `seq_length`
  tokens; each row records its documents' lengths in "seq_lengths" so positions restart per document.
- "bfd_split": like "bfd", but an overlong document is cut into `seq_length` pieces (the last one
  shorter) that are packed as separate documents, so no token is lost.
- "wrapped": all documents concatenated and cut every `seq_length` tokens, across document
  boundaries; no "seq_lengths".

Packing runs on blocks of 1000 rows (the `datasets.map` batch size TRL uses), so rows are never
packed across blocks and each block of "wrapped" ends with a shorter row.
"""

from bisect import bisect_left, insort
from collections import defaultdict, deque
from itertools import chain

from .formats import column_names

PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
PACKING_BLOCK_SIZE = 1000  # rows packed together; `datasets.map`'s default batch size, as in TRL


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group document indices into bins whose lengths sum to at most `capacity`.

    Documents are placed longest first (ties in dataset order); each goes into the open bin with the
    least room that still fits it (the oldest such bin), or starts a new bin. Bins come back in the
    order they were opened, each listing its documents in the order they were placed.
    """
    assert all(0 < length <= capacity for length in lengths)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable sort: ties stay in order
    bins: list[list[int]] = []
    bins_by_room: dict[int, deque] = defaultdict(deque)  # room left -> bins with that room, oldest first
    rooms: list[int] = []  # sorted room sizes that some open bin has (0 < room < capacity)
    for index in order:
        length = lengths[index]
        position = bisect_left(rooms, length)
        if position < len(rooms):
            room = rooms[position]
            bin_ = bins_by_room[room].popleft()
            if not bins_by_room[room]:
                del rooms[position]
        else:
            room, bin_ = capacity, []
            bins.append(bin_)
        bin_.append(index)
        room -= length
        if room > 0:
            if not bins_by_room[room]:
                insort(rooms, room)
            bins_by_room[room].append(bin_)
    return bins


def split_overlong(documents: list[list], seq_length: int) -> list[list]:
    """Each document cut into consecutive pieces of `seq_length` (the last one possibly shorter)."""
    return [doc[start : start + seq_length] for doc in documents for start in range(0, len(doc), seq_length)]


def pack_block_bfd(block: dict[str, list[list]], seq_length: int, split: bool = False) -> dict[str, list]:
    """Best-fit-decreasing packing of one block of rows. Every column holds one list per row, all of
    the same lengths (e.g. "input_ids" and "labels"); adds "seq_lengths"."""
    names = list(block)
    keep = [i for i, doc in enumerate(block[names[0]]) if len(doc) > 0]  # empty documents are dropped
    columns = {name: [block[name][i] for i in keep] for name in names}
    if split:
        columns = {name: split_overlong(docs, seq_length) for name, docs in columns.items()}
    else:
        columns = {name: [doc[:seq_length] for doc in docs] for name, docs in columns.items()}
    lengths = [len(doc) for doc in columns[names[0]]]
    bins = best_fit_decreasing(lengths, seq_length)
    packed = {
        name: [list(chain.from_iterable(docs[i] for i in bin_)) for bin_ in bins] for name, docs in columns.items()
    }
    packed["seq_lengths"] = [[lengths[i] for i in bin_] for bin_ in bins]
    return packed


def pack_block_wrapped(block: dict[str, list[list]], seq_length: int) -> dict[str, list]:
    """Concatenate one block of rows and cut it every `seq_length` tokens."""
    packed = {}
    for name, docs in block.items():
        stream = list(chain.from_iterable(docs))
        packed[name] = [stream[start : start + seq_length] for start in range(0, len(stream), seq_length)]
    return packed


def pack_dataset(dataset, seq_length: int, strategy: str = "bfd", num_proc: int | None = None):
    """Pack every list column of a `datasets.Dataset` / `IterableDataset` (typically "input_ids" and
    "labels") into rows of at most `seq_length`; "bfd" strategies add a "seq_lengths" column."""
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"packing_strategy must be one of {PACKING_STRATEGIES}, got {strategy!r}.")
    if strategy == "wrapped":
        function, fn_kwargs = pack_block_wrapped, {"seq_length": seq_length}
    else:
        function, fn_kwargs = pack_block_bfd, {"seq_length": seq_length, "split": strategy == "bfd_split"}
    map_kwargs = {"num_proc": num_proc} if num_proc is not None else {}
    return dataset.map(
        function,
        batched=True,
        batch_size=PACKING_BLOCK_SIZE,
        fn_kwargs=fn_kwargs,
        remove_columns=column_names(dataset),
        **map_kwargs,
    )
