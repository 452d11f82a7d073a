"""Activation checkpointing of one decoder block, with a fraction of ``torch.utils.checkpoint``'s host work.

The mechanism is torch's non-reentrant checkpoint: saved-tensor hooks replace every tensor the block's forward saves
for backward by its index; the block keeps only its inputs; the first unpack in backward runs the block's forward
again under the forward's autocast and RNG states and the ``context_fn``'s recompute context, collects what it saves
in the same order, and stops as soon as it has the last one (torch's early stop: the rest of the block is never run
again). Gradients are those of torch's checkpoint, to the bit.

What differs is what a saved tensor costs on the host. Torch's hooks make a holder object, a weak reference and a
per-backward dict for each, record its shape, dtype and device in a dict, and run the recompute's hook behind a
dynamo-disable wrapper; a Qwen3 block saves about 37 tensors, so at 28 blocks that Python is paid about 1,000 times
in forward, in the recompute and in backward each step: about 12% of a checkpointed step's host time, where a GPU
step of a small model waits for its host (``benchmarks/RESULTS.md``). Here a saved tensor is an index into one list
a block, its shape, dtype and device a tuple: the same checks (the recompute must save tensors of the forward's
shapes, dtypes and devices, backward reads each once, and the block's inputs must not have been changed in place),
without the objects.

Left out, as the decoder never needs them: nested checkpoints, ``GraphExecGroup``, the debug trace, and device
contexts (``with torch.device(...)``) around the forward, and torch's global early-stop switch. A second backward
through the block (``retain_graph``) recomputes it again, as torch's does for each backward; a recomputed tensor
whose forward node is gone before backward stays until the block's backward ends (torch's weak references free it
sooner; the decoder's blocks save none such).
"""

from __future__ import annotations

import contextlib

import torch

from hfnative.device_policy import forced_device_policy, use_device_policy


class CheckpointError(RuntimeError):
    """The recompute did not save what the forward saved."""


class _Stop(Exception):
    """Raised by the recompute's pack hook once it has every tensor backward needs (the early stop)."""


def _tensor_inputs(args) -> list[torch.Tensor]:
    """The tensors among ``args`` and in its tuples (a block's rotary tables); not in lists or other objects, which
    the block may append to (MoE router logits)."""
    tensors = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            tensors.append(arg)
        elif isinstance(arg, tuple):
            tensors.extend(t for t in arg if isinstance(t, torch.Tensor))
    return tensors


class _ForwardState:
    """What the recompute must run under that backward would not: the forward's autocast settings (the block's device
    and the CPU's), its RNG states (a LoRA layer's dropout draws the same mask again) and the device policy it forced
    (``use_device_policy``: the policy chooses kernels and dtypes, e.g. the experts' under autocast)."""

    __slots__ = ("device_type", "autocast", "cpu_autocast", "cpu_rng", "devices", "device_rngs", "policy")

    def __init__(self, device_type: str, inputs: list[torch.Tensor]):
        self.device_type = device_type
        self.policy = forced_device_policy()
        cache = torch.is_autocast_cache_enabled()
        self.autocast = None
        if device_type != "cpu" and torch.amp.is_autocast_available(device_type):
            self.autocast = dict(enabled=torch.is_autocast_enabled(device_type),
                                 dtype=torch.get_autocast_dtype(device_type), cache_enabled=cache)
        self.cpu_autocast = dict(enabled=torch.is_autocast_enabled("cpu"), dtype=torch.get_autocast_dtype("cpu"),
                                 cache_enabled=cache)
        self.cpu_rng = torch.get_rng_state()
        self.devices, self.device_rngs = [], []
        module = getattr(torch, device_type, None) if device_type != "cpu" else None
        if module is not None and getattr(module, "_initialized", False):
            self.devices = sorted({t.device.index if t.device.index is not None else module.current_device()
                                   for t in inputs if t.device.type == device_type})
            self.device_rngs = [module.get_rng_state(index) for index in self.devices]

    @contextlib.contextmanager
    def restored(self):
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                module = getattr(torch, self.device_type)
                for index, state in zip(self.devices, self.device_rngs):
                    module.set_rng_state(state, index)
            device_autocast = (torch.autocast(self.device_type, **self.autocast) if self.autocast is not None
                               else contextlib.nullcontext())
            with device_autocast, torch.autocast("cpu", **self.cpu_autocast), use_device_policy(self.policy):
                yield


class _Frame:
    """One checkpointed call: its inputs, what its forward saved (shape, dtype and device, by index), and the
    recompute's tensors until backward takes them."""

    __slots__ = ("fn", "args", "versions", "state", "recompute_context", "saved", "recomputed", "task")

    def __init__(self, fn, args, inputs: list[torch.Tensor], state: _ForwardState, recompute_context):
        self.fn, self.args, self.state, self.recompute_context = fn, args, state, recompute_context
        self.versions = [t._version for t in inputs]  # inputs: _tensor_inputs(args)
        self.saved: list[tuple] = []
        self.recomputed: list | None = None
        self.task = -1  # the backward (autograd graph task) the recomputed tensors are for

    def pack(self, tensor: torch.Tensor) -> int:
        self.saved.append((tensor.shape, tensor.dtype, tensor.device))
        return len(self.saved) - 1

    def unpack(self, index: int) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        recomputed = self.recomputed
        if recomputed is None or task != self.task or task == -1:
            # the first unpack of this backward (a second backward, retain_graph, recomputes again, as torch's does;
            # -1: read outside any backward, recomputed each time)
            recomputed = self.recomputed = self._recompute()
            self.task = task
        tensor = recomputed[index]
        if tensor is None:
            raise CheckpointError(
                f"activation checkpointing: backward read saved tensor {index} of a checkpointed block twice; each "
                "is handed to the node that saved it once a backward.")
        recomputed[index] = None  # backward holds it now; freed with the node that reads it
        shape, dtype, device = self.saved[index]
        if tensor.shape != shape or tensor.dtype != dtype or tensor.device != device:
            raise CheckpointError(
                f"activation checkpointing: the recompute saved a {tensor.dtype} tensor of shape "
                f"{tuple(tensor.shape)} on {tensor.device} where the forward saved a {dtype} tensor of shape "
                f"{tuple(shape)} on {device} (tensor {index}): the block's forward must run the same ops in backward "
                "as it did in forward.")
        return tensor

    def _recompute(self) -> list:
        if [t._version for t in _tensor_inputs(self.args)] != self.versions:
            raise CheckpointError(
                "activation checkpointing: an input of a checkpointed block was changed in place after its forward; "
                "backward recomputes the block from its inputs and would read the changed values.")
        count = len(self.saved)
        tensors: list = []

        def pack(tensor: torch.Tensor) -> None:
            tensors.append(tensor)
            if len(tensors) == count:
                raise _Stop
            return None

        with torch.autograd.graph.saved_tensors_hooks(pack, _nothing), torch.enable_grad(), \
                self.state.restored(), self.recompute_context:
            try:
                self.fn(*self.args)
            except _Stop:
                pass
        # detached once the recompute is over (not in the hook: a dispatch mode of the recompute context would see
        # each detach), so that its own graph is dropped
        tensors = [tensor.detach() if tensor.requires_grad else tensor for tensor in tensors]
        if len(tensors) < count:
            raise CheckpointError(
                f"activation checkpointing: the recompute saved {len(tensors)} tensors where the forward saved "
                f"{count}: the block's forward must run the same ops in backward as it did in forward.")
        return tensors


def _nothing(_):
    raise CheckpointError("activation checkpointing: a tensor the recompute saved was read by backward; the "
                          "recompute's graph is not for backward")


def checkpoint_block(fn, *args, context_fn=None):
    """``fn(*args)`` with only ``args`` kept for backward: what ``torch.utils.checkpoint.checkpoint(fn, *args,
    use_reentrant=False, context_fn=context_fn)`` computes, with less host work (module docstring). ``context_fn``
    returns the forward's and the recompute's context managers, as torch's."""
    if not torch.is_grad_enabled():
        return fn(*args)
    forward_context, recompute_context = (context_fn() if context_fn is not None
                                          else (contextlib.nullcontext(), contextlib.nullcontext()))
    inputs = _tensor_inputs(args)
    device_type = next((t.device.type for t in inputs if t.device.type != "cpu"), "cpu")
    frame = _Frame(fn, args, inputs, _ForwardState(device_type, inputs), recompute_context)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), forward_context:
        return fn(*args)


__all__ = ["CheckpointError", "checkpoint_block"]
