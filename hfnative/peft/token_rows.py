"""peft's ``trainable_token_indices`` on native models: some rows of the token embedding (and of the output head)
trained while the rest stay frozen, as peft's ``TrainableTokensLayer`` trains them.

A ``TokenRows`` holds, for one [V, D] matrix, the trained rows themselves (``values``, peft's
``trainable_tokens_delta``: rows, not differences, started from the matrix's own) and their token ids. The embedding
(``TokenRowsEmbedding``) looks tokens up in the base table and puts the trained row where a token is one of them; the
output head's logits get the trained rows' columns in place (``TokenRows.logits``), and its fused losses read the rows
in place of the matrix's (``hfnative.losses.ReplacedRows``), so the matrix is never copied. On a model whose head is
tied to the embedding, the head reads the embedding's ``TokenRows`` (peft ties the two adapters). Switched off
(``adapter_enabled``, peft's ``disable_adapter``) both read the base rows again.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hfnative.losses import ReplacedRows


class TokenRows(nn.Module):
    """Trained rows ``indices`` of a [V, D] matrix."""

    def __init__(self, weight: torch.Tensor, indices: list[int], dtype: torch.dtype | None = None):
        super().__init__()
        index = torch.as_tensor(list(indices), dtype=torch.long, device=weight.device)
        rows = weight.detach()[index]
        self.values = nn.Parameter(rows.to(dtype or rows.dtype, copy=True))  # peft's trainable_tokens_delta
        self.register_buffer("indices", index, persistent=False)
        slots = torch.full((weight.shape[0],), -1, dtype=torch.long, device=weight.device)
        slots[index] = torch.arange(len(index), device=weight.device)
        self.register_buffer("slots", slots, persistent=False)  # token id -> its row in values (-1: not trained)
        self.adapter_enabled = True

    def replace(self, weight_VD: torch.Tensor) -> torch.Tensor:
        """``weight_VD`` with the trained rows in place (a new tensor; the weight itself is untouched)."""
        if not self.adapter_enabled:
            return weight_VD
        return self.replaced_rows(weight_VD.dtype).weight(weight_VD)

    def replaced_rows(self, dtype: torch.dtype) -> ReplacedRows:
        """The rows as a fused loss reads them in place of the matrix's (``hfnative.losses.ReplacedRows``), in the
        matrix's ``dtype`` as ``replace`` puts them."""
        return ReplacedRows(self.indices, self.values.to(dtype))

    def lookup(self, tokens: torch.Tensor, weight_VD: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
        """The embedding of ``tokens`` in ``weight_VD`` with the trained rows in place, without copying the table."""
        embedded = F.embedding(tokens, weight_VD, padding_idx)
        if not self.adapter_enabled:
            return embedded
        slots = self.slots[tokens]
        trained = self.values.to(embedded.dtype)[slots.clamp(min=0)]
        if padding_idx is not None:  # the padding row takes no gradient from a lookup, as in F.embedding
            trained = torch.where((tokens == padding_idx).unsqueeze(-1), trained.detach(), trained)
        return torch.where((slots >= 0).unsqueeze(-1), trained, embedded)

    def logits(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``hidden`` times the base matrix: a fresh product, written in place) with the trained rows'
        columns put in, without a copy of the matrix."""
        if not self.adapter_enabled:
            return logits
        return self.replaced_rows(hidden.dtype).put_columns(hidden, logits)

    def extra_repr(self) -> str:
        return f"rows={self.values.shape[0]}, dim={self.values.shape[1]}"


class TokenRowsEmbedding(nn.Embedding):
    """An ``nn.Embedding`` carrying a ``TokenRows`` (``token_rows``); the same module, its class changed in place
    (``add_token_rows``), so whatever holds it (a tied head) keeps holding it."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_rows.lookup(tokens, self.weight, self.padding_idx)


def add_token_rows(model: nn.Module, embedding_indices: list[int] | None, head_indices: list[int] | None,
                   head_shares: bool, upcast: bool = True) -> None:
    """Trainable rows on ``model``'s embedding (``embedding_indices``) and on its output head: its own
    (``head_indices``), or the embedding's (``head_shares``: a tied model, as peft ties the two adapters).
    ``upcast``: rows of a bf16 / fp16 matrix are trained in float32 (peft's autocast_adapter_dtype)."""

    def dtype(weight: torch.Tensor) -> torch.dtype | None:
        return torch.float32 if upcast and weight.dtype in (torch.float16, torch.bfloat16) else None

    embedding = model.tok_embeddings
    if embedding_indices:
        check_token_indices(embedding_indices, embedding.weight.shape[0], "embed_tokens")
        if type(embedding) is not nn.Embedding:
            raise ValueError(f"trainable_token_indices: the embedding is a {type(embedding).__name__}, not an nn.Embedding")
        embedding.__class__ = TokenRowsEmbedding
        embedding.token_rows = TokenRows(embedding.weight, embedding_indices, dtype(embedding.weight))
    head = model.output
    if head_shares:
        head.share_token_rows(embedding.token_rows)
    elif head_indices:
        check_token_indices(head_indices, head.out_features, "lm_head")
        head.token_rows = TokenRows(head.base_projection(), head_indices, dtype(head.base_projection()))


def check_token_indices(indices: list[int], rows: int, layer: str) -> None:
    bad = [i for i in indices if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < rows]
    if bad:
        raise ValueError(f"trainable_token_indices[{layer!r}]: {bad[:8]} are not token ids of its {rows} rows")
    if len(set(indices)) != len(indices):
        twice = sorted({i for i in indices if indices.count(i) > 1})
        raise ValueError(f"trainable_token_indices[{layer!r}] lists {twice[:8]} more than once: list each token once")


def token_rows_modules(model: nn.Module) -> dict[str, TokenRows]:
    """The model's ``TokenRows`` by module name (the embedding's, an untied head's own)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, TokenRows)}


def has_token_rows(model: nn.Module) -> bool:
    return bool(token_rows_modules(model))


def tied_head_apart(model: nn.Module) -> bool:
    """Whether a head tied to the embedding trains rows of its own (other than the embedding's): what no model
    without adapters can hold (``TIED_HEAD_APART``)."""
    head = getattr(model, "output", None)
    return head is not None and head.is_tied and "token_rows" in head._modules


def rows_weights(model: nn.Module, gather=None) -> dict[str, torch.Tensor]:
    """The embedding's and the head's matrices with their trained rows in place, by native parameter name
    ("tok_embeddings.weight", "output.weight"; the head only where it holds a matrix of its own), as a model
    without trainable rows would hold them. gather: what makes a tensor whole (a sharded model's)."""
    gather = gather or (lambda tensor: tensor)
    folded = {}
    embedding = getattr(model, "tok_embeddings", None)  # None on a later pipeline stage
    if isinstance(embedding, TokenRowsEmbedding):
        rows = embedding.token_rows
        folded["tok_embeddings.weight"] = _folded(gather(embedding.weight.detach()), rows, gather)
    head = getattr(model, "output", None)  # None on an earlier pipeline stage
    rows = head.token_rows_in_use() if head is not None else None
    if tied_head_apart(model):
        raise ValueError(TIED_HEAD_APART)
    if rows is not None and not head.is_tied:
        folded["output.weight"] = _folded(gather(head.weight.detach()), rows, gather)
    return folded


TIED_HEAD_APART = (
    "the model ties its output head to the embedding, but trainable_token_indices trained other rows of the head "
    "than of the embedding; a model without adapters, tied, cannot hold both. Give lm_head the embedding's rows (or "
    "leave it out of trainable_token_indices), or load the base with tie_word_embeddings=False")


def _folded(weight: torch.Tensor, rows: TokenRows, gather) -> torch.Tensor:
    return weight.index_copy(0, gather(rows.indices), gather(rows.values.detach()).to(weight.dtype))


@torch.no_grad()
def remove_token_rows(model: nn.Module) -> None:
    """Fold the trained rows into the embedding and head matrices (peft's merge) and drop the ``TokenRows``."""
    for name, weight in rows_weights(model).items():
        getattr(model.get_submodule(name.rpartition(".")[0]), "weight").data.copy_(weight)
    embedding = getattr(model, "tok_embeddings", None)
    if isinstance(embedding, TokenRowsEmbedding):
        del embedding.token_rows
        embedding.__class__ = nn.Embedding
    if getattr(model, "output", None) is not None:
        model.output.drop_token_rows()


__all__ = ["TIED_HEAD_APART", "TokenRows", "TokenRowsEmbedding", "add_token_rows", "check_token_indices", "has_token_rows",
           "remove_token_rows", "rows_weights", "tied_head_apart", "token_rows_modules"]
