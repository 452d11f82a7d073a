"""Selective activation checkpointing: what a checkpointed block keeps for backward on a GPU.

Full checkpointing (``torch.utils.checkpoint``) keeps a block's input and runs its whole forward again in backward:
every matmul twice. Selective checkpointing keeps the results of some expensive ops and recomputes the rest, as
torchtitan's "op" policy does: most of full checkpointing's memory saving for a fraction of its recompute time on a
GPU. The device policy (``hfnative.device_policy``, ``selective_checkpointing``) chooses it; a CPU, where the
recompute costs little next to the memory, keeps full checkpointing.

What is kept is chosen in the block's code: it runs the calls whose results a selective checkpoint may keep through
``kept_in_checkpoint(kind, fn, *args)``: the attention (kind "attention"), and the query, value and gate
projections (the MoE router for a MoE block; kind "projection"). A checkpoint keeps the kinds its setting names
(``CHECKPOINT_KEEPS``, ``model.checkpoint_keeps``): "attention_and_projections", the GPU policy's default where
it fits (``affordable_keep`` steps down to "attention", then "nothing", when the kept results would take more than
half the device's free memory: a run that fits with full checkpointing does not run out of memory for them);
"attention", what TRL's ``gradient_checkpointing_kwargs={"selective": True}`` keeps (one activation a block, about
as large as the block's input); "nothing", full checkpointing (TRL's default, and the CPU policy's). Inside the
calls the matmuls' and attention kernels' results are kept in forward and handed back in the recompute without
running them again; everything else in the block is recomputed: the norms, the rotary
embedding, the activation, the key, output and up projections (3 of a block's 7 matmuls, as torchtitan's "every
second matmul" rule), a MoE block's experts. The down projection's result is not kept: the recompute stops once
backward has what it reads (the down projection's input) and would never read it. A LoRA projection keeps its
adapter's rank-wide product and the ``addmm`` that adds the up-projection to its base product; the base product, that
matmul's addend only, is not kept (the recompute is handed the sum back and never reads it: ``_Unread``).

Only the ops inside those calls pass through a dispatch mode (a Python call each, about 10 us on a host). Torch's
selective-checkpoint contexts pass every op of the forward and of the recompute through one, with a Python policy:
at Qwen3-0.6B's 28 blocks that made a checkpointed step's host time 1.8x full checkpointing's, where these calls
make it 1.2x (``benchmarks/RESULTS.md``). A plain projection (``nn.Linear`` without a bias over a plain tensor, the
common case) takes no dispatch mode at all: one autograd function (``_KeptProduct``) makes its product and keeps it
in forward, hands it back in the recompute, and gives autograd's matmul gradients; what is left in the mode is the
attention kernel and the layers that are tensor subclasses or several matmuls (LoRA, float8, tensor parallel).
The blocks themselves are checkpointed by ``hfnative.models.block_checkpoint`` (torch's mechanism, less host work).

Inside the block autocast's cast cache is off: a weight cast earlier in the step (a forward without grad, as KTO's
and DPO's reference passes) would come from the cache in forward but be cast again in the recompute, and the two
would not run the same ops (each weight is cast once a block either way).

A compiled block (``hfnative.parallel.compile``) runs its checkpoint inside its graph instead, with torch's selective
checkpoint contexts (``compiled_checkpoint_context``): there the policy runs once, while the graph is traced, and no
dispatch mode runs at all. ``kept_in_checkpoint`` then annotates the ops of its call with their kind
(``torch.fx.traceback.annotate``), and the policy saves the annotated matmuls and attention kernels of the kinds
kept; the compiler recomputes everything else in the backward graph, fused with backward's own elementwise work,
instead of running the block's whole forward graph again.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules import module as _module_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from hfnative.precision import autocast_dtype

aten = torch.ops.aten

MATMULS = {aten.mm.default, aten.addmm.default}


def _attention_ops() -> set:
    ops = {
        getattr(aten, name).default
        for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                     "_flash_attention_forward")
        if hasattr(aten, name)
    }
    # torch's variable-length attention (packed batches on a GPU) is a custom op the dispatch mode sees whole; it is
    # registered when its module is imported (hfnative.models.attention imports it at first use)
    try:
        import torch.nn.attention.varlen  # noqa: F401

        ops.add(torch.ops.torch_attn._varlen_attn.default)
    except (ImportError, AttributeError, RuntimeError):
        pass
    return ops


ATTENTION = _attention_ops()
KEPT_OPS = MATMULS | ATTENTION
# what a checkpointed block keeps besides its input: the kinds of kept_in_checkpoint calls whose results it keeps
CHECKPOINT_KEEPS = {"nothing": frozenset(), "attention": frozenset({"attention"}),
                    "attention_and_projections": frozenset({"attention", "projection"})}

# the selective checkpoint running its forward or its recompute on this thread (backward may run on another thread)
_running = threading.local()


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


class _KeptResults(TorchDispatchMode):
    """A selective checkpoint's results list and the kinds of ``kept_in_checkpoint`` calls it keeps."""

    def __init__(self, kept: list, kinds: frozenset):
        super().__init__()
        self.kept, self.kinds = kept, kinds

    def start(self) -> None:
        """Called as the block's forward (or a recompute) starts."""


class _Unread:
    """In place of a kept result that the recompute hands on to no op it runs (the addend of a kept ``addmm``, which
    the recompute is handed back too): its layout, for an uninitialized tensor of it there (a tensor-parallel
    layer's: a DTensor of the same placements over an uninitialized local tensor)."""

    def __init__(self, tensor: torch.Tensor):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        self.shape, self.stride = local.shape, local.stride()
        self.dtype, self.device = local.dtype, local.device
        self.spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()) if isinstance(
            tensor, DTensor) else None

    def tensor(self) -> torch.Tensor:
        local = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _same_memory(kept, addend) -> bool:
    """Whether ``kept`` (a kept result) is ``addend``: the same memory and layout (for DTensors, their local tensors',
    and the same placements)."""
    if isinstance(kept, DTensor) and isinstance(addend, DTensor):
        if (kept.device_mesh != addend.device_mesh or kept.placements != addend.placements
                or kept.shape != addend.shape):
            return False
        kept, addend = kept._local_tensor, addend._local_tensor
    return (type(kept) is torch.Tensor and type(addend) is torch.Tensor and kept.data_ptr() == addend.data_ptr()
            and kept.shape == addend.shape and kept.stride() == addend.stride())


class _Keep(_KeptResults):
    """Forward: runs each op and keeps the results of the matmuls and attention kernels, in order. Inside the call of
    a module that reads a product only as the addend of a later ``addmm`` (its ``product_addend_unread``: a LoRA
    layer, whose base product is the sum's addend), that product is not kept: the recompute is handed the ``addmm``'s
    result back and never reads the addend."""

    addends_from: int | None = None  # the index in ``kept`` where such a call's results start (None: outside one)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in KEPT_OPS:
            if func is aten.addmm.default and self.addends_from is not None:
                self.unread(args[0])
            self.keep(func, out)
        return out

    def keep(self, func, out) -> None:
        """``out``, the result of ``func`` (an op of ``KEPT_OPS``, or ``_KeptProduct``), kept for the recompute."""
        kept = out.detach() if type(out) is torch.Tensor else tree_map(_detached, out)
        self.kept.append((func, kept, _versions(kept)))

    def unread(self, addend: torch.Tensor) -> None:
        """The result kept in this call that is ``addend`` (the same memory and layout), if any, kept as its layout."""
        for index in range(len(self.kept) - 1, self.addends_from - 1, -1):
            func, kept, _ = self.kept[index]
            if _same_memory(kept, addend):
                self.kept[index] = (func, _Unread(kept), [])
                return


class _Replay(_KeptResults):
    """Recompute: hands back what forward kept, in the same order, without running those ops; runs every other."""

    def start(self) -> None:
        self.next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in KEPT_OPS:
            return func(*args, **(kwargs or {}))
        return self.take(func)

    def replays(self, func) -> bool:
        """Whether the next kept result is ``func``'s (the recompute takes the way forward took)."""
        return self.next < len(self.kept) and self.kept[self.next] is not None and self.kept[self.next][0] is func

    def take(self, func):
        """What forward kept for ``func``, the next kept result in order (handed back once)."""
        if self.next >= len(self.kept) or self.kept[self.next] is None:
            raise RuntimeError(
                f"selective activation checkpointing: the recompute ran {func} where forward kept "
                f"{'nothing more' if self.next >= len(self.kept) else 'a result already handed back'}: backward "
                "through a checkpointed block runs once (no retain_graph), and its forward must run the same ops "
                "again (gradient_checkpointing_kwargs={'selective': False} checkpoints blocks fully instead)."
            )
        kept_func, kept, versions = self.kept[self.next]
        if kept_func is not func or _versions(kept) != versions:
            raise RuntimeError(
                f"selective activation checkpointing: the recompute ran {func} where forward ran {kept_func}, or a "
                "kept result was changed in place since; the block's forward must run the same ops in the recompute."
            )
        self.kept[self.next] = None  # handed back: the recomputed graph holds it now
        self.next += 1
        return kept.tensor() if type(kept) is _Unread else kept


def _versions(value) -> list[int]:
    if type(value) is torch.Tensor:
        return [value._version]
    if type(value) is _Unread:
        return []
    return [t._version for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class _RunningUnder:
    """The block's forward (or its recompute) runs with ``mode`` for ``kept_in_checkpoint`` to enter, and autocast's
    cast cache off. Entered again by each backward that recomputes the block."""

    def __init__(self, mode: _KeptResults):
        self.mode = mode
        self.saved = []

    def __enter__(self):
        self.mode.start()
        self.saved.append((torch.is_autocast_cache_enabled(), getattr(_running, "mode", None)))
        torch.set_autocast_cache_enabled(False)
        _running.mode = self.mode
        return self

    def __exit__(self, *exc):
        cache_enabled, _running.mode = self.saved.pop()
        torch.set_autocast_cache_enabled(cache_enabled)
        return False


def selective_checkpoint_context(keep: str):
    """The ``context_fn`` of ``hfnative.models.block_checkpoint.checkpoint_block`` for one block's forward that keeps
    ``keep`` (a key of ``CHECKPOINT_KEEPS`` other than "nothing")."""
    kinds = CHECKPOINT_KEEPS[keep]
    kept: list = []
    return _RunningUnder(_Keep(kept, kinds)), _RunningUnder(_Replay(kept, kinds))


def _projection_bytes(module, element_size: int, autocast: bool) -> int | None:
    """What a kept projection's matmuls leave a token: a linear layer's output; a LoRA layer's adapter product (rank
    wide) and its output, where the layer sums into its up-projection's matmul (``LoraLinear.sums_in_matmul``; its
    base product is then that matmul's addend, not kept), else its base product and up-projection's output too; None for a DoRA layer (it also keeps
    weight-sized products, whatever the token count). Widths are the layers' whole ones: under tensor parallelism a
    rank keeps its share of heads or columns over the whole sequence, which its tokens (a sequence shard) times the
    whole width gives; a LoRA layer's adapter product is the whole sequence's on every rank of the split (a
    column-split layer's from the whole input and a replicated ``lora_A``; a row-split one's a partial sum), so it
    counts once a rank."""
    if getattr(module, "lora_magnitude_vector", None) is not None:
        return None
    lora_B = getattr(module, "lora_B", None)
    if lora_B is None:
        return module.out_features * element_size
    full_width = 1 if module.sums_in_matmul(autocast) else 2
    return (full_width * module.out_features + _tensor_parallel_copies(module.lora_A) * lora_B.shape[1]) * element_size


def _tensor_parallel_copies(weight: torch.Tensor) -> int:
    """The ranks of the tensor-parallel split ``weight`` (a parameter of a parallelized layer) is placed over: the size
    of its mesh's "tp" dim (1 for a plain tensor, or one not placed over such a dim)."""
    if not isinstance(weight, DTensor):
        return 1
    mesh, copies = weight.device_mesh, 1
    for dim, name in enumerate(mesh.mesh_dim_names or ()):
        if name == "tp":
            copies *= mesh.size(dim)
    return copies


def kept_bytes_per_token(block, keep: str, element_size: int, autocast: bool = False) -> int | None:
    """What a checkpointed decoder block (``hfnative.models.decoder.TransformerBlock``) keeps a token for ``keep``
    beyond full checkpointing's input: the attention's output in the compute dtype (``element_size`` bytes an entry)
    with its float32 log-sum-exp a head (nothing with attention sinks, whose attention is explicit ops); the query,
    value and gate projections' results (``_projection_bytes``; ``autocast``: the forward runs under autocast), or a
    MoE block's router logits. None where that is not a count per token (a DoRA projection)."""
    kinds = CHECKPOINT_KEEPS[keep]
    attention = block.attention
    total = 0
    if "attention" in kinds and attention.sinks is None:
        width = attention.wq.out_features  # all heads (module docstring of _projection_bytes)
        total += width * element_size + width // attention.head_dim * 4
    if "projection" in kinds:
        projections = [attention.wq, attention.wv,
                       block.feed_forward.w1 if block.feed_forward is not None else block.moe.router]
        for module in projections:
            size = _projection_bytes(module, element_size, autocast)
            if size is None:
                return None
            total += size
    return total


DEFAULT_KEEPS = ("attention_and_projections", "attention", "nothing")  # the default's choices, most kept first


def affordable_keep(blocks: list, tokens: int, element_size: int, available_bytes: int | None,
                    autocast: bool = False) -> str:
    """The device policy's default keep under activation checkpointing for a forward of ``tokens`` tokens through
    the checkpointed ``blocks``: the first of ``DEFAULT_KEEPS`` whose kept results take at most half of
    ``available_bytes`` (the device memory left once what the step will still allocate anyway is set aside: the
    caller's count; the other half leaves room for backward's own buffers), "nothing" when none does; with
    ``available_bytes`` None (not known: the GPU policy forced on another device), the first. What is kept never
    changes a gradient (the recompute hands back the very results), only the memory and the recompute's time."""
    if available_bytes is None:
        return DEFAULT_KEEPS[0]
    for keep in DEFAULT_KEEPS[:-1]:
        sizes = [kept_bytes_per_token(block, keep, element_size, autocast) for block in blocks]
        if None not in sizes and tokens * sum(sizes) <= available_bytes // 2:
            return keep
    return DEFAULT_KEEPS[-1]


def available_device_bytes(device: torch.device) -> int | None:
    """The memory a CUDA device can still give torch's allocator: free on the device plus what the allocator holds
    unused; None elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return free + stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)


# the annotation kept_in_checkpoint gives the ops of its call in a compiled graph (None: this torch cannot annotate,
# and compiled blocks keep their checkpoint outside their graph, recomputing it whole)
KEEP_ANNOTATION = "hfnative_checkpoint_keep"
_annotate = getattr(fx_traceback, "annotate", None)
# the matmuls a compiled graph may run for a projection (float8 projections: torchao's scaled matmul)
COMPILED_KEPT_OPS = KEPT_OPS | ({aten._scaled_mm.default} if hasattr(aten, "_scaled_mm") else set())


def keep_as_matmul(op) -> None:
    """Count ``op`` (a custom op that computes a linear layer's product, e.g. ``hfnative::int8_linear``) as a matmul:
    a selective checkpoint that keeps projections keeps its result, eager or compiled."""
    for ops in (MATMULS, KEPT_OPS, COMPILED_KEPT_OPS):
        ops.add(op)


def compiled_keeping_supported() -> bool:
    """Whether a compiled block can keep results through its own checkpoint (``compiled_checkpoint_context``)."""
    return _annotate is not None


def _annotated_kind() -> str | None:
    """The kind ``kept_in_checkpoint`` annotated the op being traced with (None outside its calls)."""
    custom = (fx_traceback.get_current_meta() or {}).get("custom") or {}
    return custom.get(KEEP_ANNOTATION)


def _compiled_policy(kinds: frozenset, ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if func in COMPILED_KEPT_OPS and _annotated_kind() in kinds:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def compiled_checkpoint_context(keep: str):
    """The ``context_fn`` of a checkpoint inside a compiled block's graph that keeps ``keep`` (a key of
    ``CHECKPOINT_KEEPS`` other than "nothing"): torch's selective checkpoint contexts, with a policy that saves the
    matmuls and attention kernels ``kept_in_checkpoint`` annotated with a kept kind, and recomputes the rest."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(functools.partial(_compiled_policy, CHECKPOINT_KEEPS[keep]))


def kept_in_checkpoint(kind: str, fn, *args):
    """``fn(*args)``; inside a selectively checkpointed block that keeps ``kind`` ("attention" or "projection"), the
    results of its matmuls and attention kernels are kept for backward and not recomputed (while compiling: its ops
    annotated for ``compiled_checkpoint_context``)."""
    if torch.compiler.is_compiling():
        if _annotate is None:
            return fn(*args)
        with _annotate({KEEP_ANNOTATION: kind}):
            return fn(*args)
    mode = getattr(_running, "mode", None)
    if mode is None or kind not in mode.kinds:
        return fn(*args)
    if kind == "projection" and (mode.replays(_KeptProduct) if isinstance(mode, _Replay)
                                 else _plain_projection(fn, args)):
        return _kept_product(mode, fn.weight, args[0])
    if isinstance(mode, _Keep) and getattr(fn, "product_addend_unread", False):
        mode.addends_from = len(mode.kept)
        try:
            with mode:
                return fn(*args)
        finally:
            mode.addends_from = None
    with mode:
        return fn(*args)


def _plain_projection(fn, args) -> bool:
    """Whether ``fn(*args)`` is a plain linear layer without a bias or module hooks over one contiguous plain tensor:
    ``_KeptProduct`` serves it without the dispatch mode (and without ``Module.__call__``, whose hooks it would skip),
    with the matmuls of autograd's own backward for those layouts. A LoRA, float8, quantized or tensor-parallel layer
    (a tensor subclass) takes the mode. Chosen in forward; the recompute takes what forward took (``replays``)."""
    return (type(fn) is nn.Linear and fn.bias is None and len(args) == 1 and type(args[0]) is torch.Tensor
            and args[0].dim() >= 2 and args[0].is_contiguous() and type(fn.weight) is nn.Parameter
            and type(fn.weight.data) is torch.Tensor and fn.weight.is_contiguous()
            and not (fn._forward_pre_hooks or fn._forward_hooks or fn._backward_pre_hooks or fn._backward_hooks
                     or _module_hooks._global_forward_pre_hooks or _module_hooks._global_forward_hooks
                     or _module_hooks._global_backward_pre_hooks or _module_hooks._global_backward_hooks))


def _autocast_operand(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as autocast hands it to a linear layer: cast to the autocast dtype (the cast cache is off in a
    checkpointed block, ``_RunningUnder``); itself outside autocast, or already in that dtype, or float64."""
    dtype = autocast_dtype(tensor.device.type)
    if dtype is None or not tensor.is_floating_point() or tensor.dtype in (dtype, torch.float64):
        return tensor
    return tensor.to(dtype)


def _kept_product(mode: _KeptResults, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` in a selectively checkpointed block's forward (kept) or recompute (handed back),
    through one autograd function instead of the dispatch mode's Python call for each of its ops (a cast, a view, a
    transpose, the matmul, a view back: the host time of 4 to 6 ops, twice a projection)."""
    x, weight = _autocast_operand(x), _autocast_operand(weight)
    if isinstance(mode, _Replay):
        return _KeptProduct.apply(x, weight, [mode.take(_KeptProduct)])
    out = _KeptProduct.apply(x, weight, None)
    mode.keep(_KeptProduct, out)
    return out


class _KeptProduct(torch.autograd.Function):
    """``x @ weight.T`` (``F.linear`` without a bias), made in forward or handed back in the recompute (``kept``: a
    one-element list), saving what autograd's matmul saves and giving its gradients with the same matmuls, to the
    bit (``mm``'s backward for a row-major input and a transposed weight)."""

    @staticmethod
    def forward(ctx, x, weight, kept):
        ctx.set_materialize_grads(False)
        # what mm saves: the input where the weight's gradient is wanted, the weight where the input's is
        x_grad, weight_grad = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if weight_grad else None, weight if x_grad else None)
        ctx.x_shape = x.shape
        return F.linear(x, weight) if kept is None else kept[0]

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:
            return None, None, None
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_2d.mm(weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_weight, None


__all__ = ["ATTENTION", "CHECKPOINT_KEEPS", "DEFAULT_KEEPS", "MATMULS", "affordable_keep", "available_device_bytes",
           "compiled_checkpoint_context", "compiled_keeping_supported", "keep_as_matmul", "kept_bytes_per_token",
           "kept_in_checkpoint", "selective_checkpoint_context"]
