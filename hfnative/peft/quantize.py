"""A quantized frozen base for LoRA: linear weights stored in 4 or 8 bits, computed in a floating dtype.

- 4 bits (QLoRA, ``load_in_4bit``): torchao's NF4 tensors, computed in a chosen dtype. torchao (>= 0.14) is imported
  only when quantizing. NF4 runs on CPU as well as GPU: the weight is dequantized block by block for each matmul.
- 8 bits (``load_in_8bit``): ``Int8Weight``, bitsandbytes' LLM.int8 storage (each row as int8 values and the row's
  absolute maximum, quantized from the fp16 weight exactly as bitsandbytes does). Each matmul dequantizes the rows to
  the activations' dtype (autocast's, under autocast) and multiplies in full: the activations are not quantized, so
  every input column is computed as LLM.int8 computes its outlier columns.

A quantized weight never receives a gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hfnative.models import triton_dequant
from hfnative.models.selective_checkpoint import keep_as_matmul
from hfnative.precision import autocast_dtype

NF4_BLOCK_SIZE = 64  # weights per absmax scale (QLoRA's value)
NF4_SCALER_BLOCK_SIZE = 256  # scales per second-level (double-quantization) scale


def _torchao_nf4():
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError:
        try:  # torchao < 0.15 kept NF4 under dtypes
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        except ImportError as err:
            raise ImportError("QLoRA (load_in_4bit) needs torchao: pip install 'hfnative[quant]'") from err
    return NF4Tensor, to_nf4


def is_nf4(tensor: torch.Tensor) -> bool:
    # by class name, so that checking a plain weight never imports torchao
    return type(tensor).__name__ == "NF4Tensor"


def is_quantized(tensor: torch.Tensor) -> bool:
    """An NF4 or an int8 (``Int8Weight``) frozen weight."""
    return is_nf4(tensor) or isinstance(tensor, Int8Weight)


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, except that an NF4 weight is applied in its own (compute) dtype and the result cast back, and an
    int8 weight is applied in the activations' dtype (``int8_linear``)."""
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    if not is_nf4(weight):
        return F.linear(x, weight, bias)
    # x in the weight's dtype, as torchao's linear_nf4 takes it; under autocast, where autocast's own cast undoes that
    # one (a weight's dtype that holds x exactly, or the autocast dtype itself), x as it is: the same values, two
    # casts of the activations fewer each way
    narrow = _autocast_dtype(x)
    as_is = narrow is not None and weight.dtype in (torch.float32, x.dtype, narrow)
    out = _NF4Linear.apply(x if as_is else x.to(weight.dtype), weight)  # saves only the NF4 weight for backward
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype)


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the weight's values (NF4 -> its compute dtype; int8 -> the dtype it was quantized from)."""
    if isinstance(weight, Int8Weight):
        return weight.dequantize()
    return nf4_values(weight, weight.dtype) if is_nf4(weight) else weight


# --- 4 bits: torchao's NF4 -----------------------------------------------------------------------------


def nf4_values(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An NF4 weight's values in ``dtype``: torchao's ``weight.to(dtype)`` (``get_original_weight``, then a cast), in
    one kernel where the block's Triton kernels run (``hfnative.models.triton_dequant``, the same values)."""
    if triton_dequant.nf4_supported(weight, dtype):
        return triton_dequant.nf4_values(weight, dtype)
    # torchao's to(dtype) dequantizes (the same dtype included); outside autocast, whose promotion of torch.stack
    # refuses a weight of another half dtype than autocast's (its own ops are none that autocast narrows)
    with torch.autocast(weight.device.type, enabled=False):
        return weight.to(dtype)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes a matmul of ``x`` in, or None where it leaves x as it is (off; float64)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return autocast_dtype(x.device.type)


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    return _autocast_dtype(x) or x.dtype


class _NF4Linear(torch.autograd.Function):
    """torchao's ``linear_nf4``: ``x @ W.T`` saving only the NF4 weight, W made whole for each matmul, forward and
    backward, by ``nf4_values``. Forward makes it in the matmul's dtype (autocast's, under autocast, where torchao makes
    it in its own and autocast casts it again: the same values, rounded once)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, nf4_values(weight, _matmul_dtype(x)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad @ nf4_values(weight, grad.dtype), None


# --- 8 bits: LLM.int8's storage ------------------------------------------------------------------------

_INT8_MAX = 127.0


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' ``int8_vectorwise_quant`` of a weight (how ``Int8Params`` stores it): the weight in fp16, each
    row's absolute maximum in fp32, each value rounded to ``round(w * 127 / absmax)``. A row of zeros stays zeros."""
    half = weight.detach().to(torch.float16)
    absmax = half.abs().amax(dim=1).float()
    scale = _INT8_MAX / absmax.masked_fill(absmax == 0, 1.0)
    return torch.round(half * scale.unsqueeze(1)).to(torch.int8), absmax


def int8_values(data: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight int8 rows stand for, in ``dtype``: bitsandbytes' ``CB * SCB * (1 / 127)`` (``int8_vectorwise_dequant``,
    its products in its order) in float32, rounded once to ``dtype`` (a row scale rounded to bf16 first would bias the
    whole row)."""
    if triton_dequant.int8_supported(data, absmax, dtype):  # one kernel, the same values
        return triton_dequant.int8_values(data, absmax, dtype, 1.0 / _INT8_MAX)
    values = data * absmax.unsqueeze(1)  # int8 x float32: float32
    values.mul_(1.0 / _INT8_MAX)
    return values if dtype == torch.float32 else values.to(dtype)


class Int8Weight(torch.Tensor):
    """A frozen 2-D weight held as int8 rows (``data_int8``, one byte a value) and each row's absolute maximum
    (``absmax``, fp32). Its ``dtype`` is the floating dtype it stands for (``dequantize``'s). Moving, detaching and
    cloning keep it int8; ``copy_`` into it takes another int8 weight's rows, or quantizes a plain tensor's values
    (``load_state_dict``, as NF4 tensors do); any other operation runs on its dequantized values (a new plain tensor:
    a view of it is a view of that copy), and any other operation that would write into it is refused."""

    data_int8: torch.Tensor
    absmax: torch.Tensor

    @staticmethod
    def __new__(cls, data_int8: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data_int8.shape, dtype=dtype, device=data_int8.device,
                                                   requires_grad=False)

    def __init__(self, data_int8: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype):
        if data_int8.dtype != torch.int8 or data_int8.dim() != 2 or absmax.shape != data_int8.shape[:1]:
            raise ValueError(f"Int8Weight takes int8 rows [out, in] and one absmax per row; got {data_int8.dtype} "
                             f"{list(data_int8.shape)} and absmax {list(absmax.shape)}")
        self.data_int8 = data_int8
        self.absmax = absmax

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Weight":
        data, absmax = int8_rows(weight)
        return cls(data, absmax, weight.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return int8_values(self.data_int8, self.absmax, dtype or self.dtype)

    def __repr__(self) -> str:
        return f"Int8Weight(shape={list(self.shape)}, dtype={self.dtype}, device={self.device})"

    def __tensor_flatten__(self):
        return ["data_int8", "absmax"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Int8Weight(inner["data_int8"], inner["absmax"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default, aten.clone.default):
            this = args[0]
            make = (lambda t: t.clone()) if func is aten.clone.default else (lambda t: t.detach())
            return Int8Weight(make(this.data_int8), make(this.absmax), this.dtype)
        if func is aten._to_copy.default:  # .to(device) moves the int8 rows; .to(float dtype) changes what they stand for
            this = args[0]
            device = kwargs.get("device") or this.device
            dtype = kwargs.get("dtype") or this.dtype
            if not dtype.is_floating_point:
                return func(this.dequantize(), **kwargs)
            return Int8Weight(this.data_int8.to(device), this.absmax.to(device), dtype)
        if func is aten.copy_.default and isinstance(args[0], Int8Weight):
            this, source = args[0], args[1]
            data, absmax = ((source.data_int8, source.absmax) if isinstance(source, Int8Weight)
                            else int8_rows(source))
            this.data_int8.copy_(data)
            this.absmax.copy_(absmax)
            return this
        if func._schema.is_mutable:
            named = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
            written = [named.get(a.name) for a in func._schema.arguments
                       if a.alias_info is not None and a.alias_info.is_write]
            if any(isinstance(t, Int8Weight) for value in written
                   for t in (value if isinstance(value, (list, tuple)) else [value])):
                raise RuntimeError(f"{func}: an int8 (load_in_8bit) base weight is frozen and cannot be written to")
        unwrap = (lambda a: a.dequantize() if isinstance(a, Int8Weight) else a)
        return func(*[_map(unwrap, a) for a in args], **{k: _map(unwrap, v) for k, v in kwargs.items()})


def _map(fn, value):
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    return fn(value)


@torch.library.custom_op("hfnative::int8_linear", mutates_args=())
def _int8_linear_op(x: torch.Tensor, data: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """x @ W.T with W made from int8 rows in x's dtype (one op to autograd and to torch.compile: backward keeps
    only the int8 rows and their maxima, never a float copy of W)."""
    return F.linear(x, int8_values(data, absmax, x.dtype))


@_int8_linear_op.register_fake
def _(x, data, absmax):
    return x.new_empty(*x.shape[:-1], data.shape[0])


def _int8_linear_context(ctx, inputs, output):
    _, data, absmax = inputs
    ctx.save_for_backward(data, absmax)


def _int8_linear_backward(ctx, grad):
    data, absmax = ctx.saved_tensors
    return grad @ int8_values(data, absmax, grad.dtype), None, None


_int8_linear_op.register_autograd(_int8_linear_backward, setup_context=_int8_linear_context)
keep_as_matmul(torch.ops.hfnative.int8_linear.default)  # a selectively checkpointed block keeps the product


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear over an int8 weight: computed in autocast's dtype under autocast (as F.linear would), else in x's;
    W takes no gradient."""
    device = x.device.type
    dtype = autocast_dtype(device) or x.dtype
    with torch.autocast(device, enabled=False):
        out = _int8_linear_op(x.to(dtype), weight.data_int8, weight.absmax)
        if bias is not None:
            out = out + bias.to(dtype)
    return out


def to_int8_parameter(weight: torch.Tensor, name: str = "weight") -> nn.Parameter:
    """A frozen ``Int8Weight`` copy of a 2-D ``weight``."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: shape {list(weight.shape)} cannot be stored as int8 rows (needs a 2-D weight); "
                         "leave this layer unquantized")
    return nn.Parameter(Int8Weight.quantize(weight), requires_grad=False)


def _scaler_block_size(n_blocks: int) -> int:
    # torchao needs the number of scales divisible by the scaler block; small layers get a smaller one
    size = NF4_SCALER_BLOCK_SIZE
    while n_blocks % size:
        size //= 2
    return size


def to_nf4_parameter(weight: torch.Tensor, compute_dtype: torch.dtype, name: str = "weight") -> nn.Parameter:
    """A frozen NF4 copy of ``weight`` (cast to ``compute_dtype`` first, which is then its matmul dtype)."""
    _, to_nf4 = _torchao_nf4()
    if weight.dim() != 2 or weight.numel() % NF4_BLOCK_SIZE:
        raise ValueError(
            f"{name}: shape {list(weight.shape)} cannot be stored as NF4 (needs a 2-D weight whose size is a multiple "
            f"of {NF4_BLOCK_SIZE}); leave this layer unquantized"
        )
    value = weight.detach().to(compute_dtype).contiguous()
    nf4 = to_nf4(value, NF4_BLOCK_SIZE, _scaler_block_size(value.numel() // NF4_BLOCK_SIZE))
    return nn.Parameter(nf4, requires_grad=False)


class FrozenLinear(nn.Linear):
    """An nn.Linear computed through ``frozen_linear``, so its weight may be plain or quantized (NF4, int8).

    quantize_base swaps the weight of such a layer in place (a LoraLinear keeps its adapter) and
    replaces any other nn.Linear by a QuantizedLinear.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)

    @property
    def narrow_input_without_grad(self) -> bool:
        """Whether, without a gradient under autocast, the output is the same from the input in the autocast dtype as
        from it in float32 (``hfnative.models.layers.plain_linears``): a plain or int8 weight, which autocast (or
        ``int8_linear``) computes in the autocast dtype whatever the input's; not NF4, whose product comes back in the
        input's dtype, as bitsandbytes' does."""
        return not is_nf4(self.weight)


class QuantizedLinear(FrozenLinear):
    """A frozen nn.Linear whose weight is quantized, NF4 or int8 (the same ``weight``/``bias`` names, so key maps
    still apply)."""

    def __init__(self, base: nn.Linear, weight: nn.Parameter):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = weight
        self.bias = base.bias


def quantized_parameter(settings, weight: torch.Tensor, name: str = "weight") -> nn.Parameter:
    """``weight`` stored as ``settings`` ask: ``NF4Settings`` (4 bits) or ``Int8Settings`` (8 bits)."""
    from .settings import Int8Settings

    if isinstance(settings, Int8Settings):
        return to_int8_parameter(weight, name)
    return to_nf4_parameter(weight, settings.compute_dtype, name)


def quantizable_linears(model: nn.Module, skip: tuple[str, ...] = ("output",)) -> list[str]:
    """The native names of the linears a quantized base stores in 4 or 8 bits when nothing else is asked: every
    nn.Linear except those named in ``skip`` (the output head, as bitsandbytes skips lm_head), MoE routers
    (transformers 5 does not implement them as nn.Linear, so bitsandbytes never quantizes them either) and linears
    whose weight is a trainable copy (modules_to_save)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name not in skip and not name.endswith(".router")
            and not hasattr(module, "original_weight")]  # a trainable copy (adapters.ORIGINAL_PREFIX)


def quantize_base(model: nn.Module, settings, module_names: list[str] | None = None,
                  device: torch.device | None = None) -> list[str]:
    """Store frozen nn.Linear weights in 4 or 8 bits (``settings``: NF4Settings or Int8Settings) in place; returns
    the native module names quantized.

    module_names: which linears (native names); None -> ``quantizable_linears``. A LoRA layer keeps its adapter and
    gets a quantized base; any other nn.Linear becomes a QuantizedLinear. Stacked expert weights ([E, ...]) are not
    quantized. A quantized weight is frozen. ``device``: where the quantized weights go, each moved there whole
    and quantized there one at a time (a model loaded on the host then holds at most one full-precision weight on the
    device); None: where they are.
    """
    done = []
    for name in quantizable_linears(model) if module_names is None else module_names:
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name} is a {type(module).__name__}, not an nn.Linear: it cannot be quantized")
        if is_quantized(module.weight):
            continue
        source = module.weight if device is None else module.weight.to(device)
        weight = quantized_parameter(settings, source, f"{name}.weight")
        del source
        if isinstance(module, FrozenLinear):
            module.weight = weight
        else:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, QuantizedLinear(module, weight))
        done.append(name)
    return done
