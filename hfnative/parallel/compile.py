"""torch.compile applied block by block. On a CPU every dimension is dynamic from the first call (size-1
dimensions aside), so new sequence lengths (padding-free batches, packing) never recompile; on a GPU (the device
policy's ``compile_dynamic``, ``hfnative.device_policy``) the first shape compiles static kernels and a dimension turns
dynamic only when a second shape arrives (torch's automatic dynamic shapes): batches of one shape (packing,
``pad_to_multiple_of``, fixed-length rows) keep the static kernels, the ones a GPU runs fastest.

A block compiles to one graph for full-length rows and dense masks (tests/test_device_policy.py checks it with
``torch._dynamo.explain``), and for packed or padded batches where ``varlen_attn`` serves the attention (CUDA,
bf16/fp16): the kernel is a custom op traced into the graph, the documents' bounds dynamic sizes from the first graph
on (tests/test_varlen_compile.py). Elsewhere such batches attend with one SDPA call per document, eagerly, between
two graphs of the block.

Shapes: B batch, S sequence, D model dim, r rotary dim.

Activation checkpointing of a compiled block runs inside its graph (``checkpoint_keep=`` on the block's call, which
the decoder passes): the block's forward under a non-reentrant checkpoint, with torch's selective checkpoint contexts
keeping what ``model.checkpoint_keeps`` (or the device policy) names (``hfnative.models.selective_checkpoint``). The
compiler then saves those results in forward and recomputes the rest in the backward graph, fused with backward's own
work, where a checkpoint around the compiled forward would run the whole forward graph again in backward. Under
tensor parallelism, in a mixture-of-experts block (only its attention compiled), for per-document attention and on a
torch without ``torch.fx.traceback.annotate`` the checkpoint stays around the compiled forward.

Only the blocks are compiled: the decoder's top level plans attention from host-side positions,
which would break a whole-model graph. All blocks of one kind share one compiled graph (parameters
are graph inputs), so compile time does not grow with depth. Per-document ("varlen") attention without
the kernel runs eagerly between the graphs of a block (its spans differ every batch). Expected graphs: one
set per attention plan kind (causal, dense mask, varlen), one more the first time a batch of size 1
is seen (torch specializes size-1 dimensions), and under static-first compiling one more when the longest
document's length first changes.

Under tensor parallelism (``apply_compile(model, tensor_parallel=True)``) the blocks are compiled with static shapes
and without torch's compile caches (``fx_graph_cache``, which the AOTAutograd cache stands on). torch 2.13 fails
on the split blocks otherwise: with dynamic shapes inductor raises RecursionError in the backward of the DTensor
projections, and a graph read back from the caches (a second run on the machine, or a second compile in the
process) returns a wrong gradient for the block's input (the parameters before it ~100% off), while the same
graph compiled afresh is exact. tests/test_compile_and_checkpointing.py checks this way against eager TP2 and
holds both torch failures as strict expected failures; tests/test_parallel.py and tests/test_distributed_trainer.py
check TP2 and FSDP2 x TP2 compiled against one process. Static shapes mean one graph per batch shape: padded
batches of many lengths reach torch's ``torch._dynamo.config.recompile_limit`` (the shapes beyond it then run
eagerly, with torch's warning); packing or ``pad_to_multiple_of`` keeps the shapes few.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types

import torch
import torch.utils.checkpoint
from torch import nn

from hfnative.device_policy import CPU_POLICY, device_policy
from hfnative.models.selective_checkpoint import compiled_checkpoint_context, compiled_keeping_supported


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """How torch.compile compiles the blocks: its backend (any name torch's registry knows: "inductor", "aot_eager",
    "eager", a backend registered with ``torch._dynamo.register_backend``) and inductor's mode ("default",
    "reduce-overhead", "max-autotune", ...: the names ``torch._inductor.list_mode_options()`` gives; None is
    "default"). transformers' ``torch_compile_backend`` / ``torch_compile_mode`` and accelerate's ``dynamo_backend``
    / ``dynamo_mode`` ask for them."""

    backend: str = "inductor"
    mode: str | None = None

    def __post_init__(self):
        import torch._dynamo
        from torch._inductor import list_mode_options

        known = torch._dynamo.list_backends(exclude_tags=())
        if self.backend not in known:
            raise ValueError(f"torch_compile_backend={self.backend!r}: torch.compile has no such backend; use one of "
                             f"{sorted(known)} (or register yours with torch._dynamo.register_backend)")
        modes = list(list_mode_options())
        if self.mode is not None and self.mode not in modes:
            raise ValueError(f"torch_compile_mode={self.mode!r}: torch.compile's modes are {modes}")
        if self.backend != "inductor" and self.mode not in (None, "default"):
            raise ValueError(f"torch_compile_mode={self.mode!r} with torch_compile_backend={self.backend!r}: the modes "
                             "are inductor's; unset the mode or use the inductor backend")

    def compile(self, fn, dynamic: bool | None, options: dict | None = None):
        """``torch.compile(fn)`` with this backend and mode; ``options`` are inductor settings (what the mode sets,
        overridden by them; a backend other than inductor takes none)."""
        if self.backend != "inductor":
            return torch.compile(fn, backend=self.backend, dynamic=dynamic)
        if options is None:
            return torch.compile(fn, dynamic=dynamic, mode=self.mode)
        # torch.compile takes a mode or options, not both: the mode's settings, then the given ones over them
        from torch._inductor import list_mode_options

        mode_options = list_mode_options(self.mode, dynamic) if self.mode else {}
        return torch.compile(fn, dynamic=dynamic, options={**mode_options, **options})


def _call_compiled(self, *inputs, checkpoint_keep: str | None = None, **kwargs):
    """The compiled forward; with ``checkpoint_keep`` (a block compiled with its checkpoint inside), the forward under
    an activation checkpoint that keeps that (``CHECKPOINT_KEEPS``)."""
    if checkpoint_keep is not None:
        return self._compiled_checkpointed(self, checkpoint_keep, *inputs, **kwargs)
    # keyword arguments pass through: transformers' decoder layers (the fallback wrapper's) take them
    return self._compiled_forward(self, *inputs, **kwargs)


def _checkpointed(forward):
    """``forward`` under a non-reentrant activation checkpoint, to be compiled whole: the checkpoint of a block's own
    graph, keeping ``keep`` (its argument, a constant the graph is specialized on)."""

    def checkpointed_forward(self, keep: str, *inputs, **kwargs):
        context = {} if keep == "nothing" else {"context_fn": functools.partial(compiled_checkpoint_context, keep)}
        return torch.utils.checkpoint.checkpoint(forward, self, *inputs, use_reentrant=False, **context, **kwargs)

    return checkpointed_forward


class _KeptRegionsMutateNothingKept(logging.Filter):
    """torch warns, once, wherever a compiled checkpoint has a selective policy, that its region must not run in-place
    ops. A block's in-place ops (the rotary embedding's sum, the norms' and gated units' products) write only tensors
    they have just made, never a matmul's or the attention's result, which are all the policy keeps."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint under torch.compile" not in record.getMessage()


_in_place_warning = _KeptRegionsMutateNothingKept()


def _compile_forward(module: nn.Module, compiled_by_type: dict, tensor_parallel: bool = False,
                     dynamic: bool | None = True, whole_block: bool = False,
                     settings: CompileSettings | None = None) -> None:
    if "_compiled_forward" in vars(module):  # already compiled: applying twice is a no-op
        return
    settings = settings or CompileSettings()
    cls = type(module)
    if cls not in compiled_by_type:
        # not fullgraph: per-document attention on CPU is a deliberate graph break (module docstring)
        compiled_by_type[cls] = (
            # under TP: static shapes, no compile caches (module docstring)
            settings.compile(cls.forward, dynamic=False, options={"fx_graph_cache": False}) if tensor_parallel
            else settings.compile(cls.forward, dynamic=dynamic)
        )
    module._compiled_forward = compiled_by_type[cls]
    # under tensor parallelism (static shapes) the variable-length kernel stays out of the graph: its longest-document
    # length would be a constant the graph is specialized on, a new graph for almost every packed batch
    (module.attention if hasattr(module, "attention") else module).varlen_in_graph = not tensor_parallel
    if whole_block and not tensor_parallel and compiled_keeping_supported():  # the checkpoint inside its graph
        key = (cls, "checkpointed")
        if key not in compiled_by_type:
            compiled_by_type[key] = settings.compile(_checkpointed(cls.forward), dynamic=dynamic)
            logging.getLogger("torch._higher_order_ops.wrap").addFilter(_in_place_warning)
        module._compiled_checkpointed = compiled_by_type[key]
    # a bound method (not a closure) so copy.deepcopy(model) rebinds it to the copy
    module.forward = types.MethodType(_call_compiled, module)


def apply_compile(model: nn.Module, tensor_parallel: bool = False, device: torch.device | str | None = None,
                  settings: CompileSettings | None = None) -> nn.Module:
    """Compile each decoder block separately; in place, parameter names unchanged.

    tensor_parallel: the blocks are split over tensor-parallel ranks: static shapes, no compile caches (module
    docstring). device: where the model will run (default: where its parameters are; a model on the meta device
    without it compiles as on a CPU). settings: torch.compile's backend and mode (default: inductor, its default
    mode).

    In a mixture-of-experts block only the attention is compiled; routing and experts run eagerly.
    Activation checkpointing (``model.checkpointed_layers``) composes with it: the recomputation in
    backward runs the same compiled graph. Evaluation under torch.no_grad compiles its own graphs
    once. copy.deepcopy of a compiled model gives a compiled copy (its blocks are rebound to it).
    """
    dynamic = (_compile_policy(model) if device is None else device_policy(device)).compile_dynamic
    compiled_by_type: dict = {}
    for block in model.layers:
        if not hasattr(block, "attention"):  # a block another pipeline stage holds
            continue
        whole_block = getattr(block, "moe", None) is None
        _compile_forward(block if whole_block else block.attention, compiled_by_type, tensor_parallel, dynamic,
                         whole_block, settings)
    return model


def _compile_policy(model: nn.Module):
    """The policy of the device the model's parameters are on (the CPU's for a model still on the meta device)."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type == "meta":
        return CPU_POLICY
    return device_policy(parameter.device)
