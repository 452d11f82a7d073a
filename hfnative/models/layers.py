"""Shared decoder blocks: RMSNorm, grouped-query attention, gated MLP.

Shapes: B batch, S sequence, D model dim, H query heads, K key/value heads, d head_dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hfnative.precision import autocast_dtype

from .args import ModelArgs
from .attention import AttentionPlan, attend
from .recompute import keep_as_recomputed
from .rope import apply_rotary
from .selective_checkpoint import kept_in_checkpoint
from .triton_kernels import (MAX_FANNED, TritonResidualRMSNorm, TritonRMSNorm, TritonRope, TritonSiluGated,
                             fanned_out, norm_rope_supported, residual_rms_norm_supported, rms_norm_supported,
                             rope_supported, silu_gated_supported, use_triton_kernels)


def _times(fresh: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """fresh * other, for a tensor the caller has just made and needs no more: in fresh's place when the product
    keeps fresh's dtype (the same values without a second tensor of that size). promote_types, not result_type (which
    torch.compile cannot trace): the two agree here, where neither tensor is 0-d.

    Out of place while compiling: the compiler plans the buffers itself, and torch 2.11's dynamo routes the gradients
    of an autograd.Function whose forward writes in place into the tensor it returns to the wrong output (zero
    gradients for the norms and everything before them; pytorch/pytorch#180642)."""
    if torch.compiler.is_compiling() or fresh.dtype != torch.promote_types(fresh.dtype, other.dtype):
        return fresh * other
    return fresh.mul_(other)


def gradient_sum(grads, dtype: torch.dtype) -> torch.Tensor | None:
    """The fanned-out callers' gradients summed in ``dtype`` (as autograd sums them behind the casts they replace)."""
    present = [grad for grad in grads if grad is not None]
    if not present:
        return None
    total = present[0].to(dtype)
    for grad in present[1:]:
        total = total + grad.to(dtype)
    return total


def narrowing_autocast_dtype(x: torch.Tensor, produced: torch.dtype) -> torch.dtype | None:
    """The autocast dtype where a linear layer under autocast would cast a ``produced``-dtype input made from ``x``
    to a narrower one; None elsewhere (no autocast, a tensor subclass, compiling: the compiler fuses the casts)."""
    if type(x) is not torch.Tensor or torch.compiler.is_compiling():
        return None
    dtype = autocast_dtype(x.device.type)
    if dtype is None or not produced.is_floating_point or torch.finfo(dtype).bits >= torch.finfo(produced).bits:
        return None
    return dtype


class _CastForLinears(torch.autograd.Function):
    """x cast once to ``dtype`` and a view of it for each of ``consumers`` layers; backward sums their gradients in
    x's dtype, as autograd sums them behind one cast per layer."""

    @staticmethod
    def forward(ctx, x, dtype: torch.dtype, consumers: int):
        ctx.set_materialize_grads(False)
        ctx.x_dtype = x.dtype
        return fanned_out(x.to(dtype), consumers)

    @staticmethod
    def backward(ctx, *grads):
        return gradient_sum(grads, ctx.x_dtype), None, None


def plain_linears(*modules: nn.Module) -> bool:
    """Whether each module is a plain ``nn.Linear``, which autocast casts a float32 input for and which reads it once:
    an input made for them in bf16 (``RMSNorm.for_linears``, ``cast_for_linears``) gives the same values. A LoRA layer
    reads its input twice (base and adapter: autograd would sum their gradients in bf16), a QLoRA or float8 layer
    chooses its own dtypes; without a gradient (rollouts, a reference's forward) a LoRA layer that casts a float32
    input once itself (``LoraLinear.narrow_input_without_grad``) takes one made in bf16 too."""
    no_grad = not torch.is_grad_enabled()
    return all(type(module) is nn.Linear or (no_grad and getattr(module, "narrow_input_without_grad", False))
               for module in modules)


def cast_for_linears(x: torch.Tensor, consumers: int) -> tuple[torch.Tensor, ...]:
    """``x`` for ``consumers`` linear layers, one tensor each: under autocast cast once to its dtype, a view each
    (``RMSNorm.for_linears`` without a norm: a post-norm block's sublayer input); elsewhere x itself."""
    dtype = narrowing_autocast_dtype(x, x.dtype)
    if dtype is None:
        return (x,) * consumers
    out = _CastForLinears.apply(x, dtype, consumers)
    return out if consumers > 1 else (out,)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that keeps only its input and 1/rms for backward (autograd on the op sequence would also
    keep the normalized [..., D] tensor); the normalized tensor is recomputed in backward. Forward is
    transformers' op sequence; backward gives autograd's gradients of it, including the casts it implies.

    float_offset None: ``weight * normed.to(x.dtype)`` (Llama); a number c: ``(normed * (c + weight))``
    in float32, cast to x's dtype after (c = 1: Gemma's (1 + w); c = 0: OLMo, GPT-OSS).

    out_dtype: the output cast to it (``RMSNorm.for_linears``); consumers: that many views of it returned
    (``fanned_out``), their gradients summed in the norm's own output dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, float_offset: float | None, out_dtype=None, consumers: int = 1):
        ctx.set_materialize_grads(False)  # a consumer without a gradient is left out of the sum, not read as zeros
        x_float = x.float()
        rstd = torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
        normed = x_float * rstd
        ctx.save_for_backward(x, weight, rstd)
        ctx.float_offset = float_offset
        if float_offset is not None:
            y = (normed * (float_offset + weight.float())).type_as(x)
        else:
            y = _times(normed.to(x.dtype), weight)
        ctx.y_dtype = y.dtype
        return fanned_out(y if out_dtype is None else y.to(out_dtype), consumers)

    @staticmethod
    def backward(ctx, *grads):
        x, weight, rstd = ctx.saved_tensors
        grad_out = gradient_sum(grads, ctx.y_dtype)
        if grad_out is None:
            return None, None, None, None, None, None
        normed = x.float() * rstd
        reduce_dims = tuple(range(grad_out.dim() - 1))
        grad_weight = grad_normed = None
        if ctx.float_offset is not None:
            grad_float = grad_out.float()
            if ctx.needs_input_grad[1]:
                grad_weight = (grad_float * normed).sum(reduce_dims).to(weight.dtype)
            grad_normed = grad_float * (ctx.float_offset + weight.float())
        else:
            if ctx.needs_input_grad[1]:
                grad_weight = (grad_out * normed.to(x.dtype)).sum(reduce_dims).to(weight.dtype)
            grad_normed = (grad_out * weight).to(x.dtype).float()
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d(x * rstd)/dx applied to g: rstd * (g - normed * mean(g * normed))
            grad_x = (rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None, None, None, None


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; ``unit_offset`` scales by (1 + w) as Gemma does; ``scale_in_float32``
    multiplies by the weight before the cast back to the input dtype instead of after."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False, scale_in_float32: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.float_offset = 1.0 if unit_offset else (0.0 if scale_in_float32 else None)
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self):
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton_kernels(x, self.weight) and rms_norm_supported(x, self.weight):
            return TritonRMSNorm.apply(x, self.weight, self.eps, self.float_offset)
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.float_offset)

    def for_linears(self, x: torch.Tensor, consumers: int) -> tuple[torch.Tensor, ...]:
        """The norm's output for ``consumers`` plain linear layers (``plain_linears``), one tensor each. Under
        autocast, which would cast a float32 output to its dtype once for each layer (a copy each, each kept for
        backward), the norm writes its output in the autocast dtype once and hands each layer a view of it; backward
        sums their gradients in float32, as autograd sums them behind the casts. Elsewhere (no autocast, a tensor
        subclass, compiling: the compiler fuses the casts) the output itself, ``consumers`` times."""
        out_dtype = self._autocast_output_dtype(x)
        if out_dtype is None:
            return (self(x),) * consumers
        if use_triton_kernels(x, self.weight) and rms_norm_supported(x, self.weight) and consumers <= MAX_FANNED:
            out = TritonRMSNorm.apply(x, self.weight, self.eps, self.float_offset, None, None, out_dtype, consumers)
        else:
            out = _RMSNormFunction.apply(x, self.weight, self.eps, self.float_offset, out_dtype, consumers)
        return out if consumers > 1 else (out,)

    def after_residual(self, x: torch.Tensor, update: torch.Tensor, consumers: int | None = None):
        """``(x + update, this norm of that sum)`` (a residual stream's step and the next sublayer's pre-norm) in one
        Triton kernel each way (``TritonResidualRMSNorm``), or None where they do not run (the caller adds, then
        norms). consumers: the norm's output for that many plain linear layers, as ``for_linears`` gives it; None:
        the output itself."""
        if (self._forward_hooks or self._forward_pre_hooks or (consumers or 1) > MAX_FANNED
                or not (use_triton_kernels(x, update, self.weight)
                        and residual_rms_norm_supported(x, update, self.weight))):
            return None  # (a hook on the norm sees its call, as it does without the kernels)
        out_dtype = None
        if consumers is not None:
            out_dtype = self._autocast_output_dtype(x, torch.promote_types(x.dtype, update.dtype))
        fanned = consumers if out_dtype is not None else 1
        h, *out = TritonResidualRMSNorm.apply(x, update, self.weight, self.eps, self.float_offset, out_dtype, fanned)
        if consumers is None:
            return h, out[0]
        return h, tuple(out) if len(out) > 1 else (out[0],) * consumers

    def _autocast_output_dtype(self, x: torch.Tensor, input_dtype: torch.dtype | None = None) -> torch.dtype | None:
        """The autocast dtype where autocast would cast this norm's output to a narrower one for a linear layer;
        input_dtype: the normed input's (default x's)."""
        input_dtype = x.dtype if input_dtype is None else input_dtype
        produced = torch.promote_types(input_dtype, self.weight.dtype) if self.float_offset is None else input_dtype
        return narrowing_autocast_dtype(x, produced)


def model_norm(args: ModelArgs, dim: int | None = None) -> RMSNorm:
    """An RMSNorm over ``dim`` (default: the model dim) with the family's norm settings."""
    return RMSNorm(args.dim if dim is None else dim, args.norm_eps, args.norm_unit_offset, args.norm_scale_in_float32)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.scale = args.attention_scale if args.attention_scale is not None else args.head_dim**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.output_proj_bias)
        self.qk_norm_over_projection = args.qk_norm_scope == "projection"
        if args.qk_norm:
            q_dim, k_dim = args.head_dim, args.head_dim
            if self.qk_norm_over_projection:
                q_dim, k_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
            self.q_norm, self.k_norm = model_norm(args, q_dim), model_norm(args, k_dim)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if args.attention_sinks else None  # [H]
        # whether a compiled block traces the variable-length kernel into its graph (not under tensor parallelism,
        # whose static-shape graphs would recompile for every new longest document; hfnative.parallel.compile)
        self.varlen_in_graph = True

    def project_qkv(
        self, x_BSD: torch.Tensor | tuple[torch.Tensor, ...], cos_sin: tuple[torch.Tensor, torch.Tensor],
        for_autocast_attention: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [B, H, S, d], rotated keys and values [B, K, S, d] (q/k norms applied). The rotated
        queries and keys are remade from the projections in backward (``hfnative.models.recompute``); a selectively
        checkpointed block keeps the query and value projections (``hfnative.models.selective_checkpoint``).
        x_BSD: the input, or one for each projection (``RMSNorm.for_linears``). for_autocast_attention: the caller's
        attention casts q and k to the autocast dtype (``_rotated``)."""
        return self.heads(*self.projections(x_BSD), cos_sin, for_autocast_attention)

    def projections(self, x_BSD: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The query, key and value projections [B, S, heads * d] of x (or of one input each)."""
        x_q, x_k, x_v = x_BSD if isinstance(x_BSD, tuple) else (x_BSD,) * 3
        return (kept_in_checkpoint("projection", self.wq, x_q), self.wk(x_k),
                kept_in_checkpoint("projection", self.wv, x_v))

    def heads(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
              for_autocast_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``project_qkv``'s heads from the projections (``projections``)."""
        cos, sin = cos_sin
        narrow = for_autocast_attention
        q_BHSd = self._rotated(xq, self.n_heads, self.q_norm, cos, sin, narrow)
        keep_as_recomputed(q_BHSd, lambda: self._rotated(xq, self.n_heads, self.q_norm, cos, sin, narrow))
        k_BKSd = self._rotated(xk, self.n_kv_heads, self.k_norm, cos, sin, narrow)
        keep_as_recomputed(k_BKSd, lambda: self._rotated(xk, self.n_kv_heads, self.k_norm, cos, sin, narrow))
        B, S, _ = xv.shape
        return q_BHSd, k_BKSd, xv.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)

    def _rotated(self, x_BSP, heads: int, norm: RMSNorm | None, cos, sin, narrow: bool = False) -> torch.Tensor:
        """A projection [B, S, heads * d] as heads [B, heads, S, d], normed (over the projection or per head) and
        rotated: where the Triton kernels run, a per-head norm and the rotation in one kernel, or the rotation in
        one. narrow: the heads go to an attention that casts them to the autocast dtype; the kernel of a norm whose
        rotation runs in float32 (a float32 weight over bf16 projections, Qwen3's) then writes them in that dtype,
        rounding once as that cast would (a float32 copy written, read and cast back in backward saved)."""
        B, S, _ = x_BSP.shape
        if norm is not None and self.qk_norm_over_projection:
            x_BSP = norm(x_BSP)
        x_BShd = x_BSP.view(B, S, heads, self.head_dim)
        triton = use_triton_kernels(x_BShd, *(() if norm is None else (norm.weight,)))
        if norm is not None and not self.qk_norm_over_projection:
            if triton and norm_rope_supported(x_BShd, norm.weight, norm.float_offset, cos, sin):
                # a float32 rotation written narrow; tables in a narrow dtype rotate in it (the attention casts)
                out_dtype = (narrowing_autocast_dtype(x_BShd, torch.float32)
                             if narrow and cos.dtype == torch.float32 else None)
                return TritonRMSNorm.apply(x_BShd, norm.weight, norm.eps, norm.float_offset, cos, sin,
                                           out_dtype).transpose(1, 2)
            return apply_rotary(norm(x_BShd.transpose(1, 2)), cos, sin)
        if triton and rope_supported(x_BShd, cos, sin):
            return TritonRope.apply(x_BShd, cos, sin).transpose(1, 2)
        return apply_rotary(x_BShd.transpose(1, 2), cos, sin)

    def forward(
        self,
        x_BSD: torch.Tensor | tuple[torch.Tensor, ...],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        sliding: bool = False,
    ) -> torch.Tensor:
        # every attention kernel but the explicit one with sinks and context parallelism's blocks takes q and k in
        # the autocast dtype (SDPA casts them, the variable-length kernel's caller too)
        autocast_attention = self.sinks is None and plan.context_parallel is None
        xq_BHSd, xk_BKSd, xv_BKSd = self.project_qkv(x_BSD, cos_sin, autocast_attention)
        out_BHSd = kept_in_checkpoint("attention", attend, xq_BHSd, xk_BKSd, xv_BKSd, plan, sliding, self.scale,
                                      self.sinks, self.varlen_in_graph)
        return self.wo(out_BHSd.transpose(1, 2).flatten(2))


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
# d act(x)/dx applied to a gradient: the aten kernels autograd itself uses for these activations
_ACTIVATION_BACKWARD = {
    "silu": lambda grad, x: torch.ops.aten.silu_backward(grad, x),
    "gelu_tanh": lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh"),
}


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up (one [tokens, hidden_dim] tensor made, not two)."""
    return _times(ACTIVATIONS[activation](gate), up)


class _GatedActivation(torch.autograd.Function):
    """act(gate) * up keeping only gate and up for backward; act(gate) is recomputed there (autograd
    on the two ops would also keep act(gate), a third [tokens, hidden_dim] tensor). Same gradients."""

    @staticmethod
    def forward(ctx, gate, up, activation: str):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return gated(gate, up, activation)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = _times(ACTIVATIONS[ctx.activation](gate), grad_out)
        if ctx.needs_input_grad[0]:
            grad_gate = _ACTIVATION_BACKWARD[ctx.activation](grad_out * up, gate)
        return grad_gate, grad_up, None


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up with gradients, keeping gate and up for backward: one Triton kernel each way where they run
    (``hfnative.models.triton_kernels``), else ``_GatedActivation``."""
    if activation == "silu" and use_triton_kernels(gate, up) and silu_gated_supported(gate, up):
        return TritonSiluGated.apply(gate, up)
    return _GatedActivation.apply(gate, up, activation)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gated unit: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class FeedForward(nn.Module):
    """Gated MLP: w2(act(w1 x) * w3 x) — w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int, activation: str, bias: bool = False):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: the input, or one for the gate and one for the up projection (``RMSNorm.for_linears``)."""
        x_gate, x_up = x if isinstance(x, tuple) else (x, x)
        gate, up = kept_in_checkpoint("projection", self.w1, x_gate), self.w3(x_up)
        hidden = gated_activation(gate, up, self.activation)
        # the down projection's input is remade from gate and up (which the gated unit keeps) in backward: the CPU
        # policy's trade, whose blocks never run the Triton kernels (the remade tensor is the op sequence's)
        keep_as_recomputed(hidden, lambda: gated(gate, up, self.activation))
        return self.w2(hidden)
