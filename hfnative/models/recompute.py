"""Tensors a block keeps for backward that are remade there instead of kept: the cheap, elementwise ones.

Autograd keeps every tensor a backward formula reads until that backward runs. In a decoder block most of them are
needed; some are cheap to make again from tensors kept anyway: a pre-norm's output (from its input, which the norm
keeps), the rotated queries and keys attention reads (from the projections the q/k norms keep, or the projections
themselves), the gated MLP's act(gate) * up (from gate and up, which the gated unit keeps). A block that runs inside
``recomputed_in_backward()`` hands such a tensor to ``keep_as_recomputed(tensor, remake)``; where autograd would keep
it, the block keeps ``remake`` instead (a saved-tensor hook), and backward calls ``remake()`` under ``torch.no_grad``
with the forward's autocast state when the tensor is read. ``remake`` runs the forward's own ops on the forward's own
inputs, so the tensor backward reads is bit-identical to the one forward made; only elementwise work is repeated, no
matmul. At 100M parameters (a Qwen3-shaped model, hidden 768, MLP 2,048, 12 blocks) a forward over 2,048 tokens
kept 1,175 MiB for backward, and keeps 736 MiB with these remade.

The hooks are not installed where other saved-tensor hooks already run (activation checkpointing, activation
offloading: those decide what is kept), under torch.compile (the compiler chooses what to recompute), or for a tensor
subclass (DTensor: tensor parallel). ``HFNATIVE_RECOMPUTE_IN_BACKWARD=0`` switches it off.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch

from hfnative.switches import switched_off

__all__ = ["keep_as_recomputed", "recomputed_in_backward", "recompute_enabled"]

ENV_SWITCH = "HFNATIVE_RECOMPUTE_IN_BACKWARD"

# the registries of the blocks running now (innermost last); a block's entries live as long as what autograd keeps
_active: list[dict[int, _Entry]] = []


def recompute_enabled() -> bool:
    return not switched_off(ENV_SWITCH)


class _Entry:
    """One registered tensor: a weak reference to it (a storage matches only while the tensor lives, so a later
    tensor at a freed address never does), how to remake it, its layout, and the remade tensor while backward reads
    it (kept until every place that saved it has read it, then dropped)."""

    __slots__ = ("ref", "remake", "autocast", "size", "stride", "offset", "packs", "reads", "cache")

    def __init__(self, tensor: torch.Tensor, remake: Callable[[], torch.Tensor]):
        self.ref = weakref.ref(tensor)
        self.remake = remake
        device = tensor.device.type
        self.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        self.size, self.stride, self.offset = tensor.size(), tensor.stride(), tensor.storage_offset()
        self.packs = self.reads = 0
        self.cache = None

    def read(self) -> torch.Tensor:
        if self.cache is None:
            device, dtype, enabled = self.autocast
            with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                remade = self.remake()
            if remade.size() != self.size or remade.stride() != self.stride or remade.storage_offset() != self.offset:
                raise RuntimeError(
                    f"a tensor remade for backward has size {tuple(remade.size())}, stride {remade.stride()}, "
                    f"offset {remade.storage_offset()}; forward made size {tuple(self.size)}, stride {self.stride}, "
                    f"offset {self.offset}. Set {ENV_SWITCH}=0 and report this."
                )
            self.cache = remade
        remade = self.cache
        self.reads += 1
        if self.reads >= self.packs:  # every saver has read it (a second backward with retain_graph remakes it)
            self.cache, self.reads = None, 0
        return remade


class _Packed:
    __slots__ = ("entry", "size", "stride", "offset")

    def __init__(self, entry: _Entry, saved: torch.Tensor):
        self.entry = entry
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()


def _pack(registry: dict[int, _Entry]):
    def pack(saved: torch.Tensor):
        if type(saved) is not torch.Tensor or not registry:
            return saved
        entry = registry.get(saved.untyped_storage().data_ptr())
        if entry is None or entry.ref() is None:
            return saved
        entry.packs += 1
        return _Packed(entry, saved)

    return pack


def _unpack(packed):
    if type(packed) is not _Packed:
        return packed
    return packed.entry.read().as_strided(packed.size, packed.stride, packed.offset)


def _hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


@contextlib.contextmanager
def recomputed_in_backward(enabled: bool = True):
    """Run a block's forward so that tensors handed to ``keep_as_recomputed`` are remade in backward, not kept.
    Does nothing when ``enabled`` is false, without grad mode, under torch.compile, where saved-tensor hooks are
    installed already, or when switched off (``HFNATIVE_RECOMPUTE_IN_BACKWARD=0``)."""
    if (not enabled or not torch.is_grad_enabled() or torch.compiler.is_compiling() or _hooks_installed()
            or not recompute_enabled()):
        yield
        return
    registry: dict[int, _Entry] = {}
    _active.append(registry)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack(registry), _unpack):
            yield
    finally:
        _active.pop()


def keep_as_recomputed(tensor: torch.Tensor, remake: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Inside ``recomputed_in_backward``: where autograd keeps ``tensor`` (or a view of it) for backward, keep
    ``remake`` instead, called in backward to make it again; it must run the ops that made ``tensor`` on tensors that
    are kept anyway, so that what it returns is bit-identical. Elsewhere a no-op. Returns ``tensor``."""
    if _active and type(tensor) is torch.Tensor and tensor.requires_grad:
        _active[-1][tensor.untyped_storage().data_ptr()] = _Entry(tensor, remake)
    return tensor
