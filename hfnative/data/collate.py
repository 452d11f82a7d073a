"""Batching SFT rows into tensors, as TRL 1.16's `DataCollatorForLanguageModeling`.

Shapes: B rows in the batch, T the padded length (rounded up to `pad_to_multiple_of`), D documents.

Padded mode (default): input_ids, labels, attention_mask, all [B, T], padded on the right
(pad_token_id / -100 / 0). Rows attend only within themselves, so a "wrapped" packed row lets its
documents attend to each other, as in TRL.

Padding-free mode (on by default with "bfd" packing): the whole batch is one row [1, T].
position_ids restart at 0 at each document (from "seq_lengths" when rows are packed, else each row
is one document), so attention kernels that read positions or cu_seq_lens keep documents apart. The
label of each document's first token is -100 (nothing before it in that document predicts it), and
for varlen kernels: cu_seq_lens_q/k [D + 1] int32, max_length_q/k int, seq_idx [1, T] int32.
A padded tail (pad_to_multiple_of) has position 0 everywhere, so each padding token counts as its
own one-token document, as in TRL.
"""

from dataclasses import dataclass

import torch

from .tokenize import IGNORE_INDEX


def uses_padding_free(padding_free: bool, packing: bool, packing_strategy: str) -> bool:
    """TRL turns padding-free on for "bfd" / "bfd_split" packing, whatever `padding_free` says."""
    return padding_free or (packing and packing_strategy in ("bfd", "bfd_split"))


def pad_token_id_for(processing_class, eos_token: str | None = None) -> int:
    """The padding id TRL uses: the tokenizer's pad token, else its EOS (or the `eos_token` override)."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    pad_token = tokenizer.pad_token or eos_token or tokenizer.eos_token
    if pad_token is None or pad_token not in tokenizer.get_vocab():
        raise ValueError(
            f"The padding token {pad_token!r} is not in the vocabulary of {type(tokenizer).__name__}. "
            "Set `tokenizer.pad_token` to a token it has."
        )
    return tokenizer.convert_tokens_to_ids(pad_token)


def pad_right(sequences: list[torch.Tensor], value: int, multiple_of: int | None = None) -> torch.Tensor:
    """Stack 1-D tensors into [B, T], filling the right with `value`; T is rounded up to `multiple_of`."""
    length = max(len(s) for s in sequences)
    if multiple_of:
        length = -(-length // multiple_of) * multiple_of
    out = torch.full((len(sequences), length), value, dtype=sequences[0].dtype)
    for row, sequence in enumerate(sequences):
        out[row, : len(sequence)] = sequence
    return out


def document_position_ids(seq_lengths: list[int]) -> torch.Tensor:
    """Positions that restart at 0 at each document: [3, 2] -> [0, 1, 2, 0, 1]."""
    lengths = torch.as_tensor(seq_lengths, dtype=torch.long)
    starts = lengths.cumsum(0) - lengths
    return torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)


def varlen_boundaries(position_ids_1T: torch.Tensor) -> dict:
    """cu_seq_lens, max_length and seq_idx of a flattened [1, T] batch, from where positions are 0."""
    starts = (position_ids_1T[0] == 0).nonzero().flatten()
    cu_seq_lens = torch.cat([starts, torch.tensor([position_ids_1T.size(1)])]).to(torch.int32)
    doc_lengths = cu_seq_lens.diff()
    max_length = int(doc_lengths.max())
    seq_idx = torch.repeat_interleave(torch.arange(len(doc_lengths), dtype=torch.int32), doc_lengths)[None]
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
        "seq_idx": seq_idx,
    }


@dataclass
class LanguageModelingCollator:
    """Collate rows with "input_ids" and optional "labels" (default: a copy of input_ids) and
    "seq_lengths" (packed rows) into a batch; see the module docstring for the output."""

    pad_token_id: int
    padding_free: bool = False
    return_position_ids: bool = False  # padded mode: also return position_ids (sequence parallelism needs them)
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict]) -> dict:
        input_ids = [torch.as_tensor(example["input_ids"]) for example in examples]
        labels = [torch.as_tensor(example.get("labels", example["input_ids"])) for example in examples]
        if "seq_lengths" in examples[0]:
            position_ids = [document_position_ids(example["seq_lengths"]) for example in examples]
        else:
            position_ids = [torch.arange(len(ids)) for ids in input_ids]

        if self.padding_free:
            input_ids, labels, position_ids = [torch.cat(input_ids)], [torch.cat(labels)], [torch.cat(position_ids)]

        batch = {
            "input_ids": pad_right(input_ids, self.pad_token_id, self.pad_to_multiple_of),
            "labels": pad_right(labels, IGNORE_INDEX, self.pad_to_multiple_of),
        }
        if self.padding_free:
            batch["position_ids"] = pad_right(position_ids, 0, self.pad_to_multiple_of)
            batch["labels"][batch["position_ids"] == 0] = IGNORE_INDEX  # a document's first token has no context
            batch.update(varlen_boundaries(batch["position_ids"]))
        else:
            if self.return_position_ids:
                batch["position_ids"] = pad_right(position_ids, 0, self.pad_to_multiple_of)
            attention_mask = [torch.ones_like(ids) for ids in input_ids]
            batch["attention_mask"] = pad_right(attention_mask, 0, self.pad_to_multiple_of)
        return batch
