"""The output head: the [V, D] projection to the vocabulary and the losses computed through it.

Shapes: B batch, S sequence, D model dim, V vocabulary, N label tokens.

Every use of the head goes through a module call (``head(hidden)`` for logits, ``head(hidden,
loss=...)`` for a loss), so wrappers that hook a module's forward (FSDP2's all-gather, a
vocab-parallel head) see each one. The losses are chunked: no [N, V] tensor is kept for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from hfnative.device_policy import device_policy
from hfnative.losses import (
    IGNORE_INDEX,
    CrossEntropyOutput,
    DistillationOutput,
    ReplacedRows,
    fused_linear_cross_entropy,
    fused_linear_generalized_jsd,
    fused_linear_token_logprobs,
    label_positions,
    linear_cross_entropy,
    linear_token_logprobs,
)


@dataclass
class TokenCrossEntropy:
    """Summed next-token NLL over the positions whose target is not IGNORE_INDEX, with entropy and
    top-1 sums. targets_BS: the shifted labels (position t's target is token t + 1). Where the device policy allows
    host reads the other positions are dropped before the projection; elsewhere they are projected and masked (no
    host read: ``num_tokens`` is then a device scalar)."""

    targets_BS: torch.Tensor
    fused: bool = True

    def __call__(self, hidden_BSD, weight_VD, softcap, replaced_rows: ReplacedRows | None = None) -> CrossEntropyOutput:
        if not self.fused:
            return self.on_positions(hidden_BSD, lambda hidden_ND, targets_N, masked: linear_cross_entropy(
                hidden_ND, _with_rows(weight_VD, replaced_rows), targets_N, softcap=softcap, masked=masked))
        return self.on_positions(hidden_BSD, lambda hidden_ND, targets_N, masked: fused_linear_cross_entropy(
            hidden_ND, weight_VD, targets_N, softcap=softcap, masked=masked, replaced_rows=replaced_rows))

    def on_positions(self, hidden_BSD, loss_fn) -> CrossEntropyOutput:
        """``loss_fn(hidden_ND, targets_N, masked)`` on the positions this spec projects: the labelled ones, or every
        one with ``masked`` (the device policy's choice, as the class docstring says)."""
        if not device_policy(hidden_BSD.device).host_reads:
            return loss_fn(hidden_BSD.flatten(0, -2), self.targets_BS.flatten(), True)
        hidden_ND, targets_N = label_positions(hidden_BSD, self.targets_BS)
        return loss_fn(hidden_ND, targets_N, False)


@dataclass
class TokenLogprobs:
    """Per-position log-prob of the target under softmax(logits / temperature), and the entropy:
    ([B, S], [B, S]) with zeros where the target is IGNORE_INDEX.

    statistics: names from ``hfnative.losses.logprobs.TOKEN_STATISTICS`` ("mean_logits", "is_top1",
    "log_sum_sq_probs"); when given, a third item maps each name to its [B, S] tensor (no gradient).
    compact: project only the positions whose target is not IGNORE_INDEX (the others cost nothing), where the
    device policy allows host reads (``hfnative.device_policy``; elsewhere every position is projected)."""

    targets_BS: torch.Tensor
    temperature: float = 1.0
    fused: bool = True
    statistics: tuple[str, ...] = ()
    compact: bool = False

    def __call__(self, hidden_BSD, weight_VD, softcap, replaced_rows: ReplacedRows | None = None) -> tuple:
        settings = dict(softcap=softcap, temperature=self.temperature, statistics=tuple(self.statistics))
        if not self.fused:
            return self.per_position(hidden_BSD, lambda hidden_ND, targets_N: linear_token_logprobs(
                hidden_ND, _with_rows(weight_VD, replaced_rows), targets_N, **settings))
        return self.per_position(hidden_BSD, lambda hidden_ND, targets_N: fused_linear_token_logprobs(
            hidden_ND, weight_VD, targets_N, replaced_rows=replaced_rows, **settings))

    def per_position(self, hidden_BSD, logprobs_fn) -> tuple:
        """What ``__call__`` returns, from ``logprobs_fn(hidden_ND, targets_N) -> (logprobs_N, entropy_N,
        *statistics_N)`` run on the positions this spec projects (all of them, or the labelled ones with
        ``compact``); the tensor-parallel head passes its vocabulary-parallel kernel here."""
        B, S, D = hidden_BSD.shape
        compact = self.compact and device_policy(hidden_BSD.device).host_reads
        keep_BS = self.targets_BS != IGNORE_INDEX if compact else None
        hidden_ND = hidden_BSD[keep_BS] if compact else hidden_BSD.reshape(B * S, D)
        targets_N = self.targets_BS[keep_BS] if compact else self.targets_BS.reshape(-1)
        outputs = logprobs_fn(hidden_ND, targets_N)
        if compact:  # back to [B, S]; masked_scatter keeps an all-ignored batch connected to the graph
            outputs = [x.new_zeros((B, S)).masked_scatter(keep_BS, x) for x in outputs]
        else:
            outputs = [x.view(B, S) for x in outputs]
        if not self.statistics:
            return outputs[0], outputs[1]
        return outputs[0], outputs[1], dict(zip(self.statistics, outputs[2:]))


@dataclass
class GeneralizedJSD:
    """Summed generalized JSD between this head's distribution and a teacher's, over the positions
    whose target is not IGNORE_INDEX. The teacher: its final hidden states [B, S, Dt] and head."""

    targets_BS: torch.Tensor
    teacher_hidden_BSD: torch.Tensor
    teacher_head: OutputHead
    beta: float = 0.5
    temperature: float = 1.0

    def __call__(self, hidden_BSD, weight_VD, softcap, replaced_rows: ReplacedRows | None = None) -> DistillationOutput:
        settings = dict(teacher_weight_VD=self.teacher_head.projection(), beta=self.beta, temperature=self.temperature,
                        student_softcap=softcap, teacher_softcap=self.teacher_head.softcap,
                        student_replaced_rows=replaced_rows)
        if not device_policy(hidden_BSD.device).host_reads:  # every position projected, the ignored ones masked
            return fused_linear_generalized_jsd(hidden_BSD.flatten(0, -2), weight_VD,
                                                teacher_hidden_ND=self.teacher_hidden_BSD.flatten(0, -2),
                                                targets_N=self.targets_BS.flatten(), **settings)
        keep = self.targets_BS != IGNORE_INDEX
        return fused_linear_generalized_jsd(hidden_BSD[keep], weight_VD, teacher_hidden_ND=self.teacher_hidden_BSD[keep],
                                            **settings)


def _with_rows(weight_VD: torch.Tensor, replaced_rows: ReplacedRows | None) -> torch.Tensor:
    """The weight with the replaced rows in place, for the paths that materialise the logits."""
    return weight_VD if replaced_rows is None else replaced_rows.weight(weight_VD)


class OutputHead(nn.Module):
    """softcap(hidden @ weight.T). ``weight`` [V, D] is the head's own parameter, or the embedding's
    when tied (then the head holds no parameter: the embedding module owns it, and ``head.weight`` is
    that parameter). Like nn.Linear it has ``weight``, ``bias`` (None), ``in_features`` and ``out_features``."""

    def __init__(self, dim: int, vocab_size: int, softcap: float | None = None, tied_embedding: nn.Embedding | None = None):
        super().__init__()
        self.softcap = softcap
        self._tied_embedding: tuple[nn.Embedding, ...] = ()  # in a tuple: not registered as a submodule
        if tied_embedding is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        else:
            self.tie(tied_embedding)

    @property
    def is_tied(self) -> bool:
        return "weight" not in self._parameters

    def tie(self, embedding: nn.Embedding) -> None:
        """Use the embedding's weight (dropping a parameter of the head's own, if any)."""
        self._parameters.pop("weight", None)
        self._tied_embedding = (embedding,)

    def untie(self) -> None:
        """Hold the tied embedding's parameter as ``weight`` too (one tensor, two names), so either
        can later be replaced on its own (peft's modules_to_save)."""
        if self.is_tied:
            embedding = self._tied_embedding[0]
            self._tied_embedding = ()
            self.weight = embedding.weight

    def __getattr__(self, name: str):
        # ``weight`` reads the tied embedding's parameter too, as a tied nn.Linear head's does
        if name == "weight" and self.__dict__.get("_tied_embedding"):
            return self.__dict__["_tied_embedding"][0].weight
        return super().__getattr__(name)

    # nn.Linear's other names, for code that treats the head as transformers' ``lm_head``
    bias = None

    @property
    def in_features(self) -> int:
        return self.base_projection().shape[1]

    @property
    def out_features(self) -> int:
        return self.base_projection().shape[0]

    def base_projection(self) -> torch.Tensor:
        """The [V, D] matrix the head holds (or the tied embedding's), without trained token rows."""
        return self._tied_embedding[0].weight if self.is_tied else self.weight

    def projection(self) -> torch.Tensor:
        """The [V, D] head matrix (with trained token rows in place: ``hfnative.peft.token_rows``)."""
        weight = self.base_projection()
        rows = self.token_rows_in_use()
        return weight if rows is None else rows.replace(weight)

    def token_rows_in_use(self):
        """The ``TokenRows`` the head applies: its own (``token_rows``), or the embedding's it shares; None."""
        return self._modules.get("token_rows") or self.__dict__.get("_shared_token_rows")

    def share_token_rows(self, rows) -> None:
        """Apply the embedding's trained rows too (a tied head: peft ties the head's adapter to the embedding's)."""
        self.__dict__["_shared_token_rows"] = rows  # not registered: the embedding owns it

    def drop_token_rows(self) -> None:
        self._modules.pop("token_rows", None)
        self.__dict__.pop("_shared_token_rows", None)

    def forward(self, hidden_BSD: torch.Tensor, loss=None):
        """Logits [B, S, V] (soft-capped), or ``loss(hidden, weight, softcap)`` for a loss spec
        (TokenCrossEntropy, TokenLogprobs, GeneralizedJSD, or one of the caller's own); trained token rows reach these
        three as ``replaced_rows=`` (the fused losses read them in place of the weight's rows, without a copy of it),
        any other spec gets the matrix with the rows in place."""
        rows = self.token_rows_in_use()
        if rows is not None and not rows.adapter_enabled:
            rows = None
        if loss is not None:
            if rows is None or not isinstance(loss, (TokenCrossEntropy, TokenLogprobs, GeneralizedJSD)):
                return loss(hidden_BSD, self.projection(), self.softcap)
            weight = self.base_projection()
            return loss(hidden_BSD, weight, self.softcap, replaced_rows=rows.replaced_rows(weight.dtype))
        if rows is None:
            logits = hidden_BSD @ self.projection().T
        else:  # trained token rows: their columns, without a copy of the matrix
            logits = rows.logits(hidden_BSD, hidden_BSD @ self.base_projection().T)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
