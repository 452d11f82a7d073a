"""The collective groups the training loop hands its objectives: gathers and reductions over the data-parallel ranks
(``DataParallelGroup``) and over the context-parallel ranks that split each sequence (``ContextParallelGroup``). Each
is built over a 1-D device mesh of the run's layout, and is the identity over one rank, so the same code runs on one
process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .context_parallel import place_in_sequence


class DataParallelGroup:
    """Gathers and reductions over the data-parallel ranks (``mesh``: their 1-D device mesh, None for one), shared by
    the objectives (through their context) and evaluation; over one rank each is the identity."""

    def __init__(self, mesh: DeviceMesh | None, device: torch.device):
        self._run = mesh if mesh is not None and mesh.size() > 1 else None
        self.device = device

    @property
    def size(self) -> int:
        return 1 if self._run is None else self._run.size()

    @property
    def rank(self) -> int:
        return 0 if self._run is None else self._run.get_local_rank()

    def _group(self):
        return self._run.get_group()

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` [n, ...] of every rank (the same n on each), concatenated in rank order, on its own device."""
        if self._run is None:
            return tensor
        local = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self._group())
        return torch.cat(parts).to(tensor.device)

    def local_rows(self, count: int) -> slice:
        """This rank's ``count`` rows in ``gather_rows``' concatenation."""
        return slice(self.rank * count, (self.rank + 1) * count)

    def gather_objects(self, value) -> list:
        """``value`` of every rank, as a list in rank order ([value] for one process)."""
        if self._run is None:
            return [value]
        parts = [None] * self.size
        dist.all_gather_object(parts, value, group=self._group())
        return parts

    def gather_lists(self, items: list) -> list:
        """The lists of every rank, concatenated in rank order (tensors moved to the CPU)."""
        items = [x.cpu() if isinstance(x, torch.Tensor) else x for x in items]
        return [x for part in self.gather_objects(items) for x in part]

    def gather_values(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's values [n_r] (any lengths), concatenated in rank order, on ``values``' device: the lengths in
        one small gather (one read by the host), the values padded to the longest and gathered on the device."""
        if self._run is None:
            return values
        local = values.to(self.device).reshape(-1)
        lengths = self.gather_rows(local.new_full((1,), local.numel(), dtype=torch.long)).tolist()
        padded = torch.cat([local, local.new_zeros(max(lengths) - local.numel())])
        parts = self.gather_rows(padded[None])
        return torch.cat([part[:n] for part, n in zip(parts, lengths)]).to(values.device)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks (a new tensor, on this rank's device)."""
        total = torch.as_tensor(tensor).to(self.device).clone()
        if self._run is not None:
            dist.all_reduce(total, group=self._group())
        return total

    def ratio_of_sums(self, numerator: torch.Tensor, denominator: torch.Tensor, floor: float = 1.0) -> float:
        """The ranks' summed ``numerator`` over their summed ``denominator`` (at least ``floor``): a mean over every
        rank's items from each rank's sums, in one collective."""
        totals = self.sum(torch.stack([torch.as_tensor(numerator), torch.as_tensor(denominator)]).double())
        return float(totals[0] / totals[1].clamp(min=floor))

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``tensor`` over the ranks (a new tensor, on this rank's device)."""
        top = torch.as_tensor(tensor).to(self.device).clone()
        if self._run is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self._group())
        return top


class _SumOverRanks(torch.autograd.Function):
    """``tensor`` summed over ``group``'s ranks, each rank's gradient the sum of every rank's upstream gradient
    (every rank's loss reads the sum, so each addend's gradient gathers all of theirs)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ContextParallelGroup:
    """The ranks that split each sequence of a batch (context parallel; ``mesh``: their 1-D device mesh, None for
    one), shared by the objectives through their context; over one rank each method is the identity. ``sum`` is
    differentiable: a per-sequence value summed over the ranks' chunks (a sequence log-prob) trains as one process's,
    when every rank's loss reads the sum and the training loop divides a micro-batch mean by the cp ranks too.
    ``split``: a batch of whole sequences -> this rank's share (the training loop's context-parallel split)."""

    def __init__(self, mesh: DeviceMesh | None, split=None):
        self._run = mesh if mesh is not None and mesh.size() > 1 else None
        self._split = split

    @property
    def size(self) -> int:
        return 1 if self._run is None else self._run.size()

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the cp ranks (differentiable; a new tensor)."""
        if self._run is None:
            return tensor
        return _SumOverRanks.apply(tensor, self._run.get_group())

    def split(self, batch: dict) -> dict:
        """A batch of whole sequences (host tensors [B, S], as a collator makes them) as this rank's share: the
        context-parallel split the trainer's collator applies (``split_batch``); unchanged with cp = 1."""
        return batch if self._run is None else self._split(batch)

    @property
    def rank(self) -> int:
        return 0 if self._run is None else self._run.get_local_rank()

    def gather_sequence(self, x_BS: torch.Tensor) -> torch.Tensor:
        """Per-position values of this rank's share of the sequences [B, S / cp, ...] as the whole sequences'
        [B, S, ...] on every cp rank (differentiable, as ``sum``); unchanged with cp = 1."""
        if self._run is None:
            return x_BS
        return self.sum(place_in_sequence(x_BS, self.size, self.rank))


__all__ = ["ContextParallelGroup", "DataParallelGroup"]
