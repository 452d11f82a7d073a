"""SFT data: dataset formats, tokenization + loss masks, packing and collation (TRL 1.16 compatible)."""

from .collate import LanguageModelingCollator, pad_token_id_for, uses_padding_free
from .formats import row_format
from .packing import pack_dataset
from .prepare import prepare_sft_dataset

__all__ = [
    "LanguageModelingCollator",
    "pack_dataset",
    "pad_token_id_for",
    "prepare_sft_dataset",
    "row_format",
    "uses_padding_free",
]
