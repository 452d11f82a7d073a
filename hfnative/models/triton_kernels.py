"""Triton kernels for a block's elementwise work on a GPU: RMSNorm, the rotary embedding and the SiLU-gated unit,
forward and backward.

Run eagerly, a block's norms, rotations and gated unit are chains of small elementwise kernels, each reading and
writing a whole activation: an RMSNorm is six kernels forward (square, mean, add, rsqrt, scale, weight) and about ten
backward; ``silu(gate) * up`` is two forward and four backward. On a GPU these are bound by memory bandwidth and, at
the Qwen3-0.6B shape, take most of a training step's device time. Each kernel here reads its inputs once and writes its
outputs once:

- ``rms_norm``: one kernel forward and one backward, in tiles of whole rows (4,096 elements); a backward program
  walks 8 tiles, summing the weight's gradient over their rows in float32, then the programs' sums are added. A
  per-head q/k norm (Qwen3's, Gemma 3's) rotates its heads in the same kernels, saving the rotary embedding's own
  passes over q and k (five kernels forward, about as many backward); under autocast it writes them in the dtype
  attention casts them to and reads their gradients in it (two casts a way saved). The MLP's pre-norm takes the
  residual add before it into its kernels (``TritonResidualRMSNorm``): forward writes the stream's sum and its norm,
  backward adds the stream's own gradient of the sum and writes the attention output's gradient in bf16, where torch
  runs an add forward and an add and a cast backward.
- ``rope``: the rotary embedding of q or k heads without a per-head norm before it (Llama, Mistral, Qwen2; OLMo's
  norm over the whole projection), one kernel each way where torch runs five forward and about six backward.
- ``silu_gated``: one kernel forward, one backward that makes the gate's and the up projection's gradients together.
- ``cross_entropy_rows``: the fused head's cross-entropy on one chunk of logits (``hfnative.losses.cross_entropy``,
  the GPU policy's blocks of gradients): each row's NLL, entropy and top-1 hit from one online pass over the head's
  bf16 product, and its gradient written in a second, straight into the block the weight's GEMM reads. The op
  sequence it replaces makes an fp32 copy of the logits, a softmax, a max, an expectation pass and a cast of the
  gradient: about 48 bytes an entry against 6.
- the decode step's kernels of the native rollout engine, ``decode_qkv`` and ``decode_attention``: their wrappers are
  in ``hfnative.models.triton_decode``, which says what they compute.
- a quantized base's weights made whole (int8 rows, NF4) for each matmul, ``int8_dequantize`` and ``nf4_dequantize``:
  their wrappers are in ``hfnative.models.triton_dequant``.

Each gives the values of the op sequence it replaces (``hfnative.models.layers``), cast where that sequence casts, so
bf16 results round at the same points; sums run in another order (a float32 round-off apart) and the norm's weight
gradient is summed in float32 where the op sequence multiplies in the output dtype first.

Where they run: the device policy's ``triton_kernels`` (on for a GPU); tensors on an NVIDIA GPU of compute capability
8.0 or later (or any device with ``TRITON_INTERPRET=1``, Triton's interpreter, which is how the CPU tests run them);
plain tensors (not DTensor); eager blocks (torch.compile fuses the op sequence itself); Triton importable.
``HFNATIVE_TRITON_KERNELS=0`` switches them off. The kernels are built at first use, so ``TRITON_INTERPRET`` set
before then decides how they run.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import warnings

import torch
from torch.autograd.function import once_differentiable

from hfnative.device_policy import device_policy
from hfnative.switches import switched_off

ENV_SWITCH = "HFNATIVE_TRITON_KERNELS"
MAX_NORM_DIM = 1 << 16  # a program holds whole rows
MAX_FANNED = 3  # the most fanned-out outputs of a norm whose gradients its backward kernel sums (q, k, v)


def fanned_out(y: torch.Tensor, consumers: int):
    """``y`` for ``consumers`` callers: y itself for one, else one view each, so that autograd hands the function
    that made y each caller's gradient apart instead of summing them in y's dtype (``layers.RMSNorm.for_linears``
    and the kernels' norms alike)."""
    return y if consumers == 1 else tuple(y.view_as(y) for _ in range(consumers))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


KERNEL_NAMES = ("rms_norm_forward", "rms_norm_backward", "rope_forward", "rope_backward", "silu_gated_forward",
                "silu_gated_backward", "cross_entropy_rows", "decode_qkv", "decode_attention",
                "decode_attention_combine", "int8_dequantize", "nf4_dequantize")
Kernels = collections.namedtuple("Kernels", KERNEL_NAMES)


@functools.cache
def _kernels() -> Kernels | None:
    """The kernels (``triton_kernel_sources``), or None when Triton cannot be imported."""
    try:
        from . import triton_kernel_sources as sources
    except ImportError:
        return None
    if _interpreting():
        _mend_interpreter()
    return Kernels(*(getattr(sources, name) for name in KERNEL_NAMES))


def _mend_interpreter() -> None:
    """What Triton's interpreter (3.6) gets wrong that the kernels meet, mended as a GPU does it:
    - it holds a kernel's scalars as one-element arrays and makes a loop's bounds of them with ``int(array)``, which
      numpy 2 refuses (``decode_attention``'s loop over the entries a row sees): the element is read instead;
    - ``tl.dot`` of bfloat16 operands multiplies their bits as integers: they are widened to float32 first (exact: a
      GPU's bf16 products are exact in its float32 accumulator too);
    - a float32 value cast to bfloat16 has its low bits cut off (rounded toward zero) where a GPU rounds
      to the nearest, ties to even (``cvt.rn.bf16.f32``, Triton's default): the cast rounds as torch's does, which
      is a GPU's. Cut off, every bf16 result the kernels write sat about twice as far from its exact value as
      torch's."""
    import numpy
    from triton.runtime import interpreter

    patch_tensor, builder = getattr(interpreter, "_patch_lang_tensor", None), getattr(interpreter, "InterpreterBuilder",
                                                                                      None)
    if patch_tensor is None or builder is None or getattr(patch_tensor, "mended", False):
        return

    def _element(self):
        data = self.handle.data
        assert data.size == 1, f"a block of {data.size} values where Triton takes a scalar"
        return int(data.reshape(-1)[0])

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _element)

    dot = builder.create_dot

    def widened(self, a, b, d, *args):
        a, b = (interpreter.TensorHandle(interpreter._convert_float(x.data, x.dtype, interpreter.tl.float32, None)
                                         .view(numpy.float32), interpreter.tl.float32)
                if x.dtype.name == "bf16" else x for x in (a, b))
        return dot(self, a, b, d, *args)

    convert = interpreter._convert_float
    nearest = (None, interpreter._ir.ROUNDING_MODE.RTNE)  # a cast's default, and asked for; rtz stays cut off

    def rounded(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype.primitive_bitwidth == 32 and output_dtype.name == "bf16" and rounding_mode in nearest:
            values = torch.from_numpy(numpy.array(data, copy=True).view(numpy.float32))
            return values.bfloat16().view(torch.int16).numpy().view(numpy.uint16).reshape(numpy.shape(data))
        return convert(data, input_dtype, output_dtype, rounding_mode)

    patched.mended = True
    interpreter._patch_lang_tensor, builder.create_dot, interpreter._convert_float = patched, widened, rounded


def available() -> bool:
    return _kernels() is not None


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a subclass such as DTensor


def use_triton_kernels(*tensors: torch.Tensor) -> bool:
    """Whether the block's elementwise ops on ``tensors`` run as these kernels (see the module docstring)."""
    first = tensors[0]
    if torch.compiler.is_compiling() or switched_off(ENV_SWITCH):
        return False
    if any(type(tensor) not in _PLAIN for tensor in tensors):
        return False
    if first.device.type == "cuda":
        if not _supported_gpu(first.device.index):
            return False
    elif not _interpreting():
        return False
    return device_policy(first.device).triton_kernels and available()


_GPU_CHECKED: dict[int | None, bool] = {}


def _supported_gpu(index: int | None) -> bool:
    """An NVIDIA GPU of compute capability 8.0 or later (Ampere on: bf16, and what the kernels were compiled and
    tested for) where a first tiny launch works (Triton builds its launcher with the host's C compiler and finds
    libcuda then: a machine without them keeps torch's ops, with a warning); other CUDA devices (older GPUs, ROCm)
    keep torch's ops."""
    if index in _GPU_CHECKED:
        return _GPU_CHECKED[index]
    if torch.version.hip is not None or torch.cuda.get_device_capability(index) < (8, 0) or not available():
        _GPU_CHECKED[index] = False
        return False
    if torch.cuda.is_current_stream_capturing():  # no launch to try inside a CUDA graph: ask again after it
        return True
    try:
        probe = torch.zeros(4, device=torch.device("cuda", index))
        TritonSiluGated.apply(probe, probe)
        torch.cuda.synchronize(probe.device)
        works = True
    except Exception as error:  # noqa: BLE001 - any failure to build or launch means torch's ops
        warnings.warn(f"hfnative's Triton kernels could not run on cuda:{index} ({type(error).__name__}: {error}); "
                      f"the model runs torch's ops instead ({ENV_SWITCH}=0 silences this)", stacklevel=2)
        works = False
    _GPU_CHECKED[index] = works
    return works


def _launch(name: str, programs: int | tuple[int, ...], device: torch.device, *args, **constexprs) -> None:
    """The kernel ``name`` over ``programs`` programs (or a grid of them) on ``device`` (Triton launches on the current
    CUDA device)."""
    kernel = getattr(_kernels(), name)
    grid = programs if isinstance(programs, tuple) else (programs,)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[grid](*args, **constexprs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype in _FLOATS and weight.dtype in _FLOATS and x.shape[-1] <= MAX_NORM_DIM and x.numel() > 0
            and weight.shape == x.shape[-1:] and weight.is_contiguous())


def _rows_of(tensor: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor`` laid out as ``like`` (default: as it is) when that is a dense permutation whose last dimension is
    contiguous (its rows then lie one after another in memory, in some order of the other dimensions), else
    contiguous. A per-head norm's input, [B, H, S, d] viewed from [B, S, H, d], keeps its layout."""
    layout = tensor if like is None else like
    if not _rows_in_memory(layout):
        return tensor.contiguous()
    if like is None or tensor.stride() == like.stride():
        return tensor
    return torch.empty_like(like, dtype=tensor.dtype).copy_(tensor)


def _rows_in_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` fills its span of memory once (its dimensions, by stride, are a contiguous layout) with the
    last dimension contiguous."""
    if tensor.stride(-1) != 1:
        return False
    span = 1
    for dim in sorted(range(tensor.dim()), key=tensor.stride):
        if tensor.size(dim) == 1:
            continue
        if tensor.stride(dim) != span:
            return False
        span *= tensor.size(dim)
    return True


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor from ``_rows_of`` as the memory it spans, [rows * dim] (its rows in memory order)."""
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


TILE_ELEMENTS = 4096  # a tile's rows x columns: several rows of a narrow norm (q/k norms: 32 rows of 128)
BACKWARD_TILES = 8  # tiles a backward program walks, summing the weight's gradient over them


def _tile(dim: int) -> tuple[int, int]:
    """(columns, rows) of a program's tile: the row padded to a power of two, and as many rows as fill the tile."""
    block = 1 << (dim - 1).bit_length()
    return block, max(1, TILE_ELEMENTS // block)


def _norm_forward(ctx, x, weight, eps: float, float_offset: float | None, cos, sin, out_dtype, update=None):
    """The forward launch of ``TritonRMSNorm`` and ``TritonResidualRMSNorm``: (the normed input h, the output y);
    h is x, or with ``update`` x + update written by the kernel. Saves h, the weight, 1/rms and the tables."""
    h = x if update is None else torch.empty_like(x, dtype=torch.promote_types(x.dtype, update.dtype))
    dim = x.shape[-1]
    rows = x.numel() // dim
    if out_dtype is None:
        out_dtype = torch.promote_types(h.dtype, weight.dtype) if float_offset is None else h.dtype
    y = torch.empty_like(x, dtype=out_dtype)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    block, tile_rows = _tile(dim)
    rope = cos is not None
    flat_x = _flat(x)
    _launch(
        "rms_norm_forward", _cdiv(rows, tile_rows), x.device,
        flat_x, *((flat_x, flat_x) if update is None else (_flat(update), _flat(h))), weight, _flat(y), rstd,
        *((cos, sin) if rope else (rstd, rstd)), rows, dim, x.shape[-2] if rope else 1, eps, float_offset or 0.0,
        LLAMA=float_offset is None, ROPE=rope, ADD=update is not None, ROWS=tile_rows, BLOCK=block,
        ROUNDED=_rotates_rounded(cos), num_warps=_warps(block * tile_rows),
    )
    ctx.save_for_backward(h, weight, rstd, cos, sin)
    ctx.float_offset = float_offset
    return h, y


def _norm_backward(ctx, grads, weight_grad: bool, residual_grad=None, update_dtype=None):
    """The backward launch: (the gradient of the normed input h, the weight's gradient, the update's gradient).
    ``weight_grad``: whether the weight needs its gradient; ``residual_grad``: the residual stream's own gradient of
    h, added; ``update_dtype``: the update's gradient is that sum in this dtype (None: the sum itself;
    ``TritonRMSNorm`` leaves it unread)."""
    x, weight, rstd, cos, sin = ctx.saved_tensors
    grads = [_rows_of(grad, like=x) for grad in grads if grad is not None]
    if not grads:
        if residual_grad is None:
            return None, None, None
        return residual_grad, None, residual_grad if update_dtype is None else residual_grad.to(update_dtype)
    dim = x.shape[-1]
    rows = x.numel() // dim
    block, tile_rows = _tile(dim)
    residual = residual_grad is not None
    if residual:  # half tiles: a gradient more to read and one to write would spill registers at 1,024 columns
        tile_rows = max(1, tile_rows // 2)
    programs = _cdiv(rows, tile_rows * BACKWARD_TILES)
    grad_x = torch.empty_like(x)
    grad_update = None if update_dtype is None else torch.empty_like(x, dtype=update_dtype)
    partial = torch.empty((programs, dim) if weight_grad else (1,), device=x.device, dtype=torch.float32)
    rope = cos is not None
    first = _flat(grads[0])
    _launch(
        "rms_norm_backward", programs, x.device,
        first, *(_flat(grads[i]) if i < len(grads) else first for i in (1, 2)),
        _flat(_rows_of(residual_grad, like=x)) if residual else first, _flat(x), weight, rstd,
        *((cos, sin) if rope else (rstd, rstd)), _flat(grad_x),
        _flat(grad_update) if grad_update is not None else _flat(grad_x), partial,
        rows, dim, x.shape[-2] if rope else 1, ctx.float_offset or 0.0,
        LLAMA=ctx.float_offset is None, ROPE=rope, GRADS=len(grads), RESIDUAL=residual,
        UPDATE_GRAD=grad_update is not None, ROWS=tile_rows, TILES=BACKWARD_TILES, BLOCK=block,
        WEIGHT_GRAD=weight_grad, ROUNDED=_rotates_rounded(cos), num_warps=_warps(block * tile_rows),
    )
    grad_weight = partial.sum(0).to(weight.dtype) if weight_grad else None
    return grad_x, grad_weight, grad_x if grad_update is None else grad_update


class TritonRMSNorm(torch.autograd.Function):
    """``layers._RMSNormFunction`` as two kernels: keeps x, the weight and 1/rms [rows] for backward. With cos and
    sin (a per-head norm over x [B, S, H, d], tables [B, S, d]), the normed heads are rotated in the same kernel, as
    ``rope.apply_rotary`` rotates them (``norm_rope_supported``). With out_dtype the kernel writes the output in it
    (rounding once, as a cast after the norm would); with consumers (up to ``MAX_FANNED``) it returns that many views
    of the output (``fanned_out``) and the backward kernel sums their gradients in float32."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, float_offset: float | None, cos=None, sin=None, out_dtype=None,
                consumers: int = 1):
        if consumers > MAX_FANNED or (consumers > 1 and cos is not None):
            raise ValueError(f"TritonRMSNorm: {consumers} fanned-out outputs (at most {MAX_FANNED}, without a "
                             "rotation)")
        ctx.set_materialize_grads(False)  # a consumer without a gradient is left out of the sum, not read as zeros
        _, y = _norm_forward(ctx, _rows_of(x), weight, eps, float_offset, cos, sin, out_dtype)
        return fanned_out(y, consumers)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        grad_x, grad_weight, _ = _norm_backward(ctx, grads, ctx.needs_input_grad[1])
        return (grad_x if ctx.needs_input_grad[0] else None), grad_weight, None, None, None, None, None, None


def residual_rms_norm_supported(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``TritonResidualRMSNorm`` runs x + update then the norm: both contiguous, of one shape."""
    return (rms_norm_supported(x, weight) and update.dtype in _FLOATS and update.shape == x.shape
            and x.is_contiguous() and update.is_contiguous())


class TritonResidualRMSNorm(torch.autograd.Function):
    """The residual stream's ``h = x + update`` and the RMSNorm of h (``TritonRMSNorm``'s output, ``out_dtype`` and
    ``consumers`` as there) in one kernel each way: returns (h, the norm's output or its views). The forward kernel
    writes h in promote(x, update)'s dtype and norms it as rounded; the backward kernel adds the gradient h gets from
    the rest of the residual stream to the norm's and writes the update's gradient in its dtype, where autograd
    would run an add, an accumulation and a cast. Keeps h (an output), the weight and 1/rms."""

    @staticmethod
    def forward(ctx, x, update, weight, eps: float, float_offset: float | None, out_dtype=None, consumers: int = 1):
        if consumers > MAX_FANNED:
            raise ValueError(f"TritonResidualRMSNorm: {consumers} fanned-out outputs (at most {MAX_FANNED})")
        ctx.set_materialize_grads(False)
        h, y = _norm_forward(ctx, x, weight, eps, float_offset, None, None, out_dtype, update)
        ctx.x_dtype, ctx.update_dtype = x.dtype, update.dtype
        out = fanned_out(y, consumers)
        return (h, *out) if consumers > 1 else (h, out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h, *grads):
        h_dtype = torch.promote_types(ctx.x_dtype, ctx.update_dtype)
        update_dtype = ctx.update_dtype if ctx.update_dtype != h_dtype else None
        grad_sum, grad_weight, grad_update = _norm_backward(ctx, grads, ctx.needs_input_grad[2], grad_h, update_dtype)
        grad_x = grad_sum if grad_sum is None or ctx.x_dtype == h_dtype else grad_sum.to(ctx.x_dtype)
        return ((grad_x if ctx.needs_input_grad[0] else None), (grad_update if ctx.needs_input_grad[1] else None),
                grad_weight, None, None, None, None)


def rope_supported(x_BSHd: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> bool:
    """Whether the rotation of x [B, S, H, d] runs as one kernel: x contiguous, every channel rotated (cos, sin
    [B, S, d], contiguous, without gradients, float32 (``apply_rotary`` then rotates in float32 and casts once) or
    in x's dtype (it then rotates in that dtype, rounding each op: a model whose weights are bf16))."""
    B, S, _, d = x_BSHd.shape
    return (x_BSHd.dtype in _FLOATS and x_BSHd.is_contiguous() and d % 2 == 0 and x_BSHd.numel() > 0
            and d <= MAX_NORM_DIM and _rotation_tables(cos_BSd, sin_BSd, (B, S, d), _rope_tables(x_BSHd.dtype)))


def _rope_tables(x_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The table dtypes the rotation kernel takes for heads of ``x_dtype`` (written in that dtype): float32 (rotated
    in float32, cast once) or ``x_dtype`` itself (rotated in it, rounding each op)."""
    return torch.float32, x_dtype


def _norm_rope_dtypes(x_dtype: torch.dtype, weight_dtype: torch.dtype,
                      float_offset: float | None) -> tuple[torch.dtype, tuple[torch.dtype, ...]]:
    """(the dtype a per-head norm of ``x_dtype`` heads writes them in, the table dtypes its rotation in the same
    kernel takes): float32 tables for float32 normed heads, tables in x's dtype for heads normed in it (rotated in it,
    rounding each op: a model whose weights are bf16), none otherwise."""
    normed = torch.promote_types(x_dtype, weight_dtype) if float_offset is None else x_dtype
    return normed, (torch.float32,) if normed == torch.float32 else (normed,) if normed == x_dtype else ()


def _rotation_tables(cos, sin, shape, dtypes) -> bool:
    """cos and sin as the kernels read them: ``shape``, contiguous, plain, without gradients, of one of ``dtypes``."""
    return all(t.shape == shape and t.dtype in dtypes and t.dtype == cos.dtype and t.is_contiguous()
               and not t.requires_grad and type(t) in _PLAIN for t in (cos, sin))


def _rotates_rounded(cos: torch.Tensor | None) -> bool:
    """Whether a kernel rotates as torch does in a narrow dtype (tables in it), rounding each product and the sum."""
    return cos is not None and cos.dtype != torch.float32


class TritonRope(torch.autograd.Function):
    """``rope.apply_rotary`` of x [B, S, H, d] (heads of the token at row // H) with tables [B, S, d] (float32, or in
    x's dtype: ``rope_supported``) as one kernel each way; nothing kept for backward but the tables."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        y = torch.empty_like(x)
        block, tile_rows = _tile(x.shape[-1])
        rows = x.numel() // x.shape[-1]
        _launch(
            "rope_forward", _cdiv(rows, tile_rows), x.device, x, y, cos, sin, rows, x.shape[-1], x.shape[-2],
            ROWS=tile_rows, BLOCK=block, ROUNDED=_rotates_rounded(cos), num_warps=_warps(block * tile_rows),
        )
        ctx.save_for_backward(cos, sin)
        ctx.heads, ctx.x_dtype = x.shape[-2], x.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = torch.empty_like(grad_out, dtype=ctx.x_dtype)
        block, tile_rows = _tile(grad_out.shape[-1])
        rows = grad_out.numel() // grad_out.shape[-1]
        _launch(
            "rope_backward", _cdiv(rows, tile_rows), grad_out.device,
            grad_out, grad_x, cos, sin, rows, grad_out.shape[-1], ctx.heads,
            ROWS=tile_rows, BLOCK=block, num_warps=_warps(block * tile_rows),
        )
        return grad_x, None, None


def norm_rope_supported(x_BSHd: torch.Tensor, weight: torch.Tensor, float_offset: float | None,
                        cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> bool:
    """Whether a per-head norm of x [B, S, H, d] and the rotation after it run as one kernel: x contiguous, every
    channel rotated (cos, sin [B, S, d], contiguous, without gradients), and either the normed heads and the tables in
    float32 (the rotation then runs in float32 as ``apply_rotary`` does) or both in one narrower dtype, x's (a model
    whose weights are bf16: ``apply_rotary`` then rotates in that dtype, rounding each op, and so does the kernel)."""
    B, S, _, d = x_BSHd.shape
    _, tables = _norm_rope_dtypes(x_BSHd.dtype, weight.dtype, float_offset)
    return (rms_norm_supported(x_BSHd, weight) and x_BSHd.is_contiguous() and d % 2 == 0
            and _rotation_tables(cos_BSd, sin_BSd, (B, S, d), tables))


def _warps(elements: int) -> int:
    """Warps for a tile of ``elements``: about 8 elements a thread (16 warps for a 4,096-element tile), which keeps
    the backward kernels' registers (the rotated norm's most of all) without spilling, for 4 to 32 warps."""
    return max(4, min(32, elements // 256))


_ELEMENTWISE_BLOCK = 1024


def silu_gated_supported(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return gate.dtype == up.dtype and gate.dtype in _FLOATS and gate.shape == up.shape and gate.numel() > 0


def _strided_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as [rows, last dim] with each row contiguous and the rows one stride apart: a view where its layout
    allows (a contiguous tensor, a slice of the last dimension), else a contiguous copy."""
    rows = (tensor if tensor.stride(-1) == 1 else tensor.contiguous()).reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class TritonSiluGated(torch.autograd.Function):
    """``silu(gate) * up`` (``layers._GatedActivation``) as two kernels: keeps gate and up for backward."""

    @staticmethod
    def forward(ctx, gate, up):
        n_cols = gate.shape[-1]
        # rows of the last dimension, each contiguous: their stride is read by the kernel (slices of one fused
        # gate-and-up product need no copy); anything else is copied contiguous
        gate_rows, up_rows = (_strided_rows(t) for t in (gate, up))
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        n = gate.numel()
        _launch("silu_gated_forward", _cdiv(n, _ELEMENTWISE_BLOCK), gate.device, gate_rows, up_rows, y, n, n_cols,
                gate_rows.stride(0), up_rows.stride(0), BLOCK=_ELEMENTWISE_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        gate, up = (t.contiguous() for t in ctx.saved_tensors)
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _launch("silu_gated_backward", _cdiv(n, _ELEMENTWISE_BLOCK), gate.device, grad_out.contiguous(), gate, up,
                grad_gate, grad_up, n, BLOCK=_ELEMENTWISE_BLOCK)
        return grad_gate, grad_up


CROSS_ENTROPY_BLOCK = 2048  # vocabulary entries a cross-entropy program reads at once


def cross_entropy_rows(z_CV: torch.Tensor, scale: float, targets_C: torch.Tensor, valid_C: torch.Tensor,
                       grad_CV: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the logits z = z_CV * scale (any float dtype, rows contiguous): the NLL of ``targets_C``, the
    entropy and the top-1 hit (int32), each times ``valid_C`` (float32 [C], 0 for an ignored row); with ``grad_CV``,
    dNLL/dz * valid written there (its dtype). One program a row; nothing of size [C, V] allocated."""
    rows, vocab = z_CV.shape
    loss = torch.empty(rows, dtype=torch.float32, device=z_CV.device)
    entropy = torch.empty_like(loss)
    correct = torch.empty(rows, dtype=torch.int32, device=z_CV.device)
    write = grad_CV is not None
    _launch(
        "cross_entropy_rows", rows, z_CV.device,
        z_CV, targets_C.contiguous(), valid_C.contiguous(), grad_CV if write else z_CV, loss, entropy, correct, vocab,
        z_CV.stride(0), grad_CV.stride(0) if write else 0, scale, WRITE_GRAD=write, BLOCK=CROSS_ENTROPY_BLOCK,
        BLOCKS=_cdiv(vocab, CROSS_ENTROPY_BLOCK), num_warps=_warps(CROSS_ENTROPY_BLOCK),
    )
    return loss, entropy, correct


def cross_entropy_supported(z_CV_dtype: torch.dtype, softcap: float | None) -> bool:
    return z_CV_dtype in _FLOATS and softcap is None


__all__ = ["ENV_SWITCH", "TritonRMSNorm", "TritonResidualRMSNorm", "TritonRope", "TritonSiluGated", "available",
           "fanned_out", "norm_rope_supported", "residual_rms_norm_supported", "rms_norm_supported", "rope_supported",
           "silu_gated_supported", "use_triton_kernels", "cross_entropy_rows", "cross_entropy_supported"]
