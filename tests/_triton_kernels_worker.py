"""The Triton kernels (``hfnative.models.triton_kernels``) run by Triton's interpreter on CPU tensors, against the op
sequences they replace and transformers' forward; and compiled for sm_90 (``compiles_for_sm90``). Run by
tests/test_triton_kernels.py in a process of its own with Triton on the path (the test's environment does not
install Triton: transformers changes what it does when Triton is importable), with ``TRITON_INTERPRET=1`` for every
check but the compile, which runs without it. Prints one JSON line: each check's name and its failure (null: passed).

The interpreter runs mended to round as a GPU does (``triton_kernels._mend_interpreter``: bf16 casts to nearest
even, bf16 dots in float32). The bf16 checks allow a few bf16 ulps of the tensor's scale (exp and sums in another
order than torch's), the fp32 checks float32 round-off; the rotations in bf16 (bf16 tables) compare with torch's
rounding points to the bit, and ``bf16_as_close_to_exact_as_torch`` asks each kernel's bf16 results to sit as close to
exact arithmetic as torch's. The GPU script's check compares the compiled kernels on CUDA more tightly.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import re
import sys
import tempfile
import traceback

import torch
from hf_configs import make_hf_model
from torch.utils._python_dispatch import TorchDispatchMode

from hfnative.converters.loading import load_pretrained
from hfnative.device_policy import use_device_policy
from hfnative.generation import cached_decoder
from hfnative.models import layers, triton_decode, triton_kernels
from hfnative.models.triton_kernels import TritonResidualRMSNorm, TritonRMSNorm, TritonRope, TritonSiluGated
from hfnative.parallel import apply_compile
from hfnative.parallel.activation_checkpoint import apply_activation_checkpointing

BF16_SCALE_TOLERANCE = 2.0**-6  # four bf16 ulps (2^-8 each, relative) of the tensor's largest magnitude


def _close(got, want, bf16: bool, what: str, fp32_scale_tolerance: float | None = None):
    """bf16: within BF16_SCALE_TOLERANCE of the tensor's largest magnitude; fp32: elementwise to float32 round-off,
    or with ``fp32_scale_tolerance`` within that fraction of the largest magnitude (sums over many products)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, the op sequence's {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if bf16 or fp32_scale_tolerance is not None:
        error = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        bound = BF16_SCALE_TOLERANCE if bf16 else fp32_scale_tolerance
        assert error <= bound * scale, f"{what}: max |diff| {error:.3g} over scale {scale:.3g}"
    else:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6, msg=what)


def _grads(function, inputs, grad_out_seed=1):
    out = function(*inputs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed)).to(out.dtype)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad_out)
    return out, grads


def check_rms_norm():
    """Every variant (Llama's cast-then-scale, Gemma's 1 + w, OLMo's scale in float32) over rows laid out as a
    [B, S, D] activation (small, and over several tiles and programs), a per-head [B, H, S, d] view of [B, S, H, d]
    (q/k norms) and a strided slice (copied), in fp32 and bf16 (with fp32 and bf16 weights), the weight's gradient on
    and off."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.bfloat16, torch.bfloat16)):
        for float_offset in (None, 1.0, 0.0):
            for layout in ("rows", "many_rows", "heads", "strided"):
                for weight_grad in (True, False):
                    cases.append((x_dtype, w_dtype, float_offset, layout, weight_grad))
    for x_dtype, w_dtype, float_offset, layout, weight_grad in cases:
        dim = 24 if layout == "heads" else 40  # 40: a block of 64 with 24 masked columns
        if layout == "heads":
            base = torch.randn(2, 5, 3, dim, generator=generator) * 3
            make = lambda base: base.to(x_dtype).transpose(1, 2)  # noqa: E731
        elif layout == "strided":
            base = torch.randn(2, 7, 2 * dim, generator=generator) * 3
            make = lambda base: base.to(x_dtype)[..., ::2]  # noqa: E731
        elif layout == "many_rows":  # 64 rows a tile, 8 tiles a backward program: two programs, the last partial
            base = torch.randn(3, 250, dim, generator=generator) * 3
        else:
            base = torch.randn(3, 7, dim, generator=generator) * 3
            make = lambda base: base.to(x_dtype)  # noqa: E731
        weight = (torch.randn(dim, generator=generator) * 0.3 + (0 if float_offset == 1.0 else 1)).to(w_dtype)
        results = []
        for function in (TritonRMSNorm.apply, layers._RMSNormFunction.apply):
            x = make(base.clone()).detach().requires_grad_()
            w = weight.clone().requires_grad_(weight_grad)
            out, grads = _grads(lambda x, w: function(x, w, 1e-6, float_offset), (x, w))
            results.append((out, grads, x))
        (out, grads, x), (want_out, want_grads, _) = results
        what = f"rms_norm x={x_dtype} w={w_dtype} offset={float_offset} {layout} weight_grad={weight_grad}"
        bf16 = torch.bfloat16 in (x_dtype, w_dtype)
        _close(out, want_out, bf16, what + " output")
        assert len(grads) == len(want_grads)
        for name, got, want in zip(("x", "weight"), grads, want_grads):
            _close(got, want, bf16, f"{what} grad {name}")
        if layout == "heads":
            assert out.stride() == x.stride(), f"{what}: output strides {out.stride()} vs the input's {x.stride()}"


def check_rms_norm_fanned_out():
    """A pre-norm's output for several linear layers under autocast (``RMSNorm.for_linears``): written in bf16 by the
    kernel, one view per layer, and the layers' gradients summed in float32 by the backward kernel; against the torch
    path, every variant, one to three layers (the gradients of the views differ), and one layer's gradient absent."""
    generator = torch.Generator().manual_seed(5)
    for float_offset in (None, 1.0, 0.0):
        for consumers in (1, 2, 3):
            for missing in ((False, True) if consumers == 3 else (False,)):
                base = torch.randn(3, 150, 40, generator=generator) * 3  # two backward programs, the last partial
                weight = torch.randn(40, generator=generator) * 0.3 + (0 if float_offset == 1.0 else 1)
                grads_out = [torch.randn(base.shape, generator=generator).bfloat16() for _ in range(consumers)]
                results = []
                for triton in (True, False):
                    x, w = base.clone().requires_grad_(), weight.clone().requires_grad_()
                    if triton:
                        out = TritonRMSNorm.apply(x, w, 1e-6, float_offset, None, None, torch.bfloat16, consumers)
                    else:
                        out = layers._RMSNormFunction.apply(x, w, 1e-6, float_offset, torch.bfloat16, consumers)
                    outs = out if consumers > 1 else (out,)
                    used = [(o, g) for i, (o, g) in enumerate(zip(outs, grads_out)) if not (missing and i == 1)]
                    grads = torch.autograd.grad([o for o, _ in used], [x, w], [g for _, g in used])
                    results.append((outs, grads))
                (outs, grads), (want_outs, want_grads) = results
                what = f"fanned-out rms_norm offset={float_offset} consumers={consumers} missing={missing}"
                assert len({o.data_ptr() for o in outs}) == 1, f"{what}: the views do not share the output"
                for got, want in zip(outs, want_outs):
                    _close(got, want, True, what + " output")
                for name, got, want in zip(("x", "weight"), grads, want_grads):
                    _close(got, want, False, f"{what} grad {name}", fp32_scale_tolerance=1e-5)


def check_residual_rms_norm():
    """The residual add and the norm after it in one kernel each way (``TritonResidualRMSNorm``) against ``x +
    update`` then the torch norm: every variant; a float32 stream with a bf16 update (autocast's), float32 throughout
    and bf16 throughout; the norm's output itself and fanned out in bf16 to one to three layers; with and without
    the stream's own gradient of the sum, and without any gradient of the norm's output. The sum bit for bit where
    float32, the gradients of x, the update and the weight to float32 round-off (bf16 ones to bf16's)."""
    generator = torch.Generator().manual_seed(6)
    cases = [(torch.float32, torch.bfloat16, None, None), (torch.float32, torch.bfloat16, torch.bfloat16, 1),
             (torch.float32, torch.bfloat16, torch.bfloat16, 3), (torch.float32, torch.float32, None, None),
             (torch.bfloat16, torch.bfloat16, None, None), (torch.float32, torch.bfloat16, torch.bfloat16, 2)]
    for float_offset in (None, 1.0, 0.0):
        for x_dtype, update_dtype, out_dtype, consumers in cases:
            for grad_h_given, outputs_used in ((True, True), (False, True), (True, False)):
                base = torch.randn(3, 150, 40, generator=generator) * 3  # two backward programs, the last partial
                update_base = torch.randn(base.shape, generator=generator)
                weight = torch.randn(40, generator=generator) * 0.3 + (0 if float_offset == 1.0 else 1)
                fanned = consumers or 1
                grad_h = torch.randn(base.shape, generator=generator).to(torch.promote_types(x_dtype, update_dtype))
                y_dtype = out_dtype or (torch.promote_types(grad_h.dtype, weight.dtype) if float_offset is None
                                        else grad_h.dtype)
                grads_y = [torch.randn(base.shape, generator=generator).to(y_dtype) for _ in range(fanned)]
                results = []
                for triton in (True, False):
                    x, update = base.to(x_dtype).requires_grad_(), update_base.to(update_dtype).requires_grad_()
                    w = weight.clone().requires_grad_()
                    if triton:
                        h, *outs = TritonResidualRMSNorm.apply(x, update, w, 1e-6, float_offset, out_dtype, fanned)
                    else:
                        h = x + update
                        out = layers._RMSNormFunction.apply(h, w, 1e-6, float_offset, out_dtype, fanned)
                        outs = list(out) if fanned > 1 else [out]
                    tensors, grads_in = [], []
                    if grad_h_given:
                        tensors.append(h), grads_in.append(grad_h)
                    if outputs_used:
                        tensors += outs
                        grads_in += grads_y
                    grads = torch.autograd.grad(tensors, [x, update, w], grads_in, allow_unused=True)
                    results.append((h, outs, grads))
                (h, outs, grads), (want_h, want_outs, want_grads) = results
                what = (f"residual rms_norm offset={float_offset} x={x_dtype} update={update_dtype} out={out_dtype} "
                        f"consumers={consumers} grad_h={grad_h_given} outputs_used={outputs_used}")
                bf16_sum = h.dtype == torch.bfloat16
                _close(h, want_h, bf16_sum, what + " sum")
                if not bf16_sum:
                    assert torch.equal(h, want_h), f"{what}: the sum is not x + update"
                # a bf16 sum: the interpreter rounds it otherwise than torch (see the module docstring), so all
                # that follows from it is compared to bf16's precision
                for got, want in zip(outs, want_outs):
                    _close(got, want, bf16_sum or got.dtype == torch.bfloat16, what + " output")
                for name, got, want in zip(("x", "update", "weight"), grads, want_grads):
                    if want is None:
                        assert got is None, f"{what}: grad {name} given where autograd gives none"
                        continue
                    assert got is not None, f"{what}: no grad {name}"
                    _close(got, want, bf16_sum or got.dtype == torch.bfloat16, f"{what} grad {name}",
                           fp32_scale_tolerance=1e-5)
    # a frozen update with a trained weight (the weight's gradient still made), a frozen weight (none made)
    for update_grad, weight_grad in ((False, True), (True, False)):
        x = torch.randn(2, 9, 40, generator=generator).requires_grad_()
        update = torch.randn(2, 9, 40, generator=generator).bfloat16().requires_grad_(update_grad)
        w = (torch.randn(40, generator=generator) * 0.3 + 1).requires_grad_(weight_grad)
        results = []
        for triton in (True, False):
            if triton:
                h, out = TritonResidualRMSNorm.apply(x, update, w, 1e-6, None)
            else:
                h = x + update
                out = layers._RMSNormFunction.apply(h, w, 1e-6, None)
            wanted = [t for t in (x, update, w) if t.requires_grad]
            results.append(torch.autograd.grad((h * 0.5).sum() + out.square().sum(), wanted))
        for got, want in zip(*results):
            _close(got, want, got.dtype == torch.bfloat16, f"residual rms_norm update_grad={update_grad} "
                   f"weight_grad={weight_grad}", fp32_scale_tolerance=1e-5)


def check_norm_rope():
    """A per-head q/k norm and the rotation after it in one kernel against the norm then ``apply_rotary``: Llama's
    and Gemma's norm variants, q from bf16 projections (autocast's) and fp32 ones, one batch row's tables and several,
    over several tiles and programs (two heads of 32 channels: 128 rows a tile)."""
    from hfnative.models.rope import apply_rotary
    from hfnative.models.triton_kernels import norm_rope_supported

    generator = torch.Generator().manual_seed(2)
    for x_dtype, float_offset, batch, seq in ((torch.float32, None, 2, 5), (torch.bfloat16, None, 3, 700),
                                              (torch.float32, 1.0, 1, 9), (torch.bfloat16, None, 1, 3)):
        heads, d = 2, 32
        base = torch.randn(batch, seq, heads, d, generator=generator) * 3
        angles = torch.randn(batch, seq, d // 2, generator=generator) * 3
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        weight = torch.randn(d, generator=generator) * 0.3 + (0 if float_offset == 1.0 else 1)
        results = []
        for fused in (True, False):
            x = base.to(x_dtype).requires_grad_()
            w = weight.clone().requires_grad_()
            if fused:
                assert norm_rope_supported(x, w, float_offset, cos, sin)
                out = TritonRMSNorm.apply(x, w, 1e-6, float_offset, cos, sin).transpose(1, 2)
            else:
                out = apply_rotary(layers._RMSNormFunction.apply(x.transpose(1, 2), w, 1e-6, float_offset), cos, sin)
            grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
            results.append((out, torch.autograd.grad(out, (x, w), grad_out), out.stride()))
        (out, grads, strides), (want, want_grads, want_strides) = results
        what = f"norm_rope x={x_dtype} offset={float_offset} [{batch}, {seq}, {heads}, {d}]"
        bf16 = x_dtype == torch.bfloat16
        _close(out, want, bf16, what + " output")
        assert strides == want_strides, f"{what}: strides {strides}, the op sequence's {want_strides}"
        for name, got, expected in zip(("x", "weight"), grads, want_grads):
            _close(got, expected, bf16, f"{what} grad {name}")
    # written in the attention's dtype (out_dtype, ``Attention._rotated`` under autocast): the float32 rotation
    # rounded once, as the attention's cast of it rounds; backward takes the attention's bf16 gradient as it is
    heads, d, batch, seq = 2, 32, 2, 300
    base = torch.randn(batch, seq, heads, d, generator=generator) * 3
    angles = torch.randn(batch, seq, d // 2, generator=generator) * 3
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    weight = torch.randn(d, generator=generator) * 0.3 + 1
    grad_out = torch.randn(batch, heads, seq, d, generator=generator).bfloat16()
    results = []
    for fused in (True, False):
        x, w = base.bfloat16().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            out = TritonRMSNorm.apply(x, w, 1e-6, None, cos, sin, torch.bfloat16).transpose(1, 2)
        else:
            out = apply_rotary(layers._RMSNormFunction.apply(x.transpose(1, 2), w, 1e-6, None), cos, sin)
            out = out.to(torch.bfloat16)
        results.append((out, torch.autograd.grad(out, (x, w), grad_out)))
    (out, grads), (want, want_grads) = results
    _close(out, want, True, "norm_rope written in bf16: output")
    for name, got, expected in zip(("x", "weight"), grads, want_grads):
        _close(got, expected, True, f"norm_rope written in bf16: grad {name}")
    # a model whose weights are bf16 (the norm's weight and the tables too): torch rotates in bf16, rounding each
    # product and the sum, and so does the kernel. The norm's sums run in another order (a 1-ulp difference now and
    # then); a rotation in float32 rounded once would differ from torch's in far more elements than the share allowed
    for float_offset in (None, 1.0):
        heads, d, batch, seq = 2, 32, 2, 300
        base = torch.randn(batch, seq, heads, d, generator=generator) * 3
        angles = torch.randn(batch, seq, d // 2, generator=generator) * 3
        cos, sin = (t.bfloat16() for t in (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()))
        weight = (torch.randn(d, generator=generator) * 0.3 + (0 if float_offset == 1.0 else 1)).bfloat16()
        grad_out = torch.randn(batch, heads, seq, d, generator=generator).bfloat16()
        results = []
        for fused in (True, False):
            x, w = base.bfloat16().requires_grad_(), weight.clone().requires_grad_()
            if fused:
                assert norm_rope_supported(x, w, float_offset, cos, sin)
                out = TritonRMSNorm.apply(x, w, 1e-6, float_offset, cos, sin).transpose(1, 2)
                grads = torch.autograd.grad(out, (x, w), grad_out)
                results.append((out, grads))
                continue
            else:
                out = apply_rotary(layers._RMSNormFunction.apply(x.transpose(1, 2), w, 1e-6, float_offset), cos, sin)
            results.append((out, torch.autograd.grad(out, (x, w), grad_out)))
        (out, grads), (want, want_grads) = results
        what = f"norm_rope, bf16 weights and tables, offset={float_offset}"
        _close(out, want, True, what + ": output")
        same = (out == want).float().mean().item()
        assert same >= 0.97, f"{what}: {same:.1%} of the output equal to torch's bf16 rotation (>= 97% expected)"
        for name, got, expected in zip(("x", "weight"), grads, want_grads):
            _close(got, expected, True, f"{what}: grad {name}")
    assert not norm_rope_supported(x.detach().half(), w, None, cos, sin), "fp16 heads with bf16 tables"


def check_rope():
    """The rotation alone (heads without a per-head norm) in one kernel against ``apply_rotary`` with float32 tables:
    bf16 heads (autocast's projections: rotated in float32, cast once; gradients cast where autograd casts them) and
    fp32 ones, one batch row's tables and several, over several tiles."""
    from hfnative.models.rope import apply_rotary
    from hfnative.models.triton_kernels import rope_supported

    generator = torch.Generator().manual_seed(4)
    for x_dtype, batch, seq in ((torch.float32, 2, 5), (torch.bfloat16, 3, 300), (torch.bfloat16, 1, 7)):
        heads, d = 3, 32
        base = torch.randn(batch, seq, heads, d, generator=generator) * 3
        angles = torch.randn(batch, seq, d // 2, generator=generator) * 3
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        results = []
        for fused in (True, False):
            x = base.to(x_dtype).requires_grad_()
            if fused:
                assert rope_supported(x, cos, sin)
                out = TritonRope.apply(x, cos, sin).transpose(1, 2)
            else:
                out = apply_rotary(x.transpose(1, 2), cos, sin)
            grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
            results.append((out, torch.autograd.grad(out, x, grad_out)[0], out.stride()))
        (out, grad, strides), (want, want_grad, want_strides) = results
        what = f"rope x={x_dtype} [{batch}, {seq}, {heads}, {d}]"
        bf16 = x_dtype == torch.bfloat16
        _close(out, want, bf16, what + " output")
        assert strides == want_strides, f"{what}: strides {strides}, the op sequence's {want_strides}"
        _close(grad, want_grad, bf16, what + " grad x")
    # tables in the heads' dtype (a model whose weights are bf16): torch rotates in bf16, rounding each product and
    # the sum; the kernel rounds at the same points, so both ways equal torch's to the bit
    heads, d, batch, seq = 3, 32, 2, 300
    base = torch.randn(batch, seq, heads, d, generator=generator) * 3
    angles = torch.randn(batch, seq, d // 2, generator=generator) * 3
    cos, sin = (t.bfloat16() for t in (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()))
    grad_out = torch.randn(batch, heads, seq, d, generator=generator).bfloat16()
    results = []
    for fused in (True, False):
        x = base.bfloat16().requires_grad_()
        if fused:
            assert rope_supported(x, cos, sin)
            out = TritonRope.apply(x, cos, sin).transpose(1, 2)
            results.append((out, torch.autograd.grad(out, x, grad_out)[0]))
            continue
        else:
            out = apply_rotary(x.transpose(1, 2), cos, sin)
        results.append((out, torch.autograd.grad(out, x, grad_out)[0]))
    (out, grad), (want, want_grad) = results
    assert out.dtype == want.dtype == torch.bfloat16 and torch.equal(out, want), (
        f"rope with bf16 tables: output max |diff| {(out.float() - want.float()).abs().max().item():.3g}")
    assert torch.equal(grad, want_grad), (
        f"rope with bf16 tables: grad max |diff| {(grad.float() - want_grad.float()).abs().max().item():.3g}")
    assert not rope_supported(x.detach().half(), cos, sin), "fp16 heads with bf16 tables"


def check_cross_entropy():
    """The fused head's cross-entropy with the Triton kernel (the GPU policy, gradients in blocks) against the same
    loss without it and against materialized logits: the NLL, entropy and top-1 sums and both gradients, masked and
    not, fp32 and bf16 autocast, over several chunks and blocks and three blocks of the vocabulary (5,000 entries), with
    a tie for the maximum across those blocks (the first index wins, as argmax's); then with a temperature, with
    only the weight's gradient, and without gradients."""
    import dataclasses

    from hfnative.device_policy import GPU_POLICY
    from hfnative.losses import IGNORE_INDEX
    from hfnative.losses.cross_entropy import fused_linear_cross_entropy, linear_cross_entropy

    N, D, V = 37, 16, 5000
    policy = dataclasses.replace(GPU_POLICY, name="gpu-small-chunks", head_chunk_elements=8 * V,
                                 head_gradient_block_elements=16 * V)  # chunks of 8 rows, blocks of 16
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(N, D, generator=generator)
    weight = torch.randn(V, D, generator=generator)
    weight[4100] = weight[7]  # entries 7 and 4100 tie in every row
    hidden[:6] = weight[7] * 4  # rows whose maximum is that tie
    with torch.no_grad():
        argmax = (hidden @ weight.T).argmax(-1)
    targets = torch.randint(0, V, (N,), generator=generator)
    targets[10:20] = argmax[10:20]  # rows the top-1 hits
    targets[:3] = 7  # the tie's first index: a hit
    targets[3:6] = 4100  # its second: not a hit
    for masked in (False, True):
        t = targets.clone()
        if masked:
            t[[2, 11, 30]] = IGNORE_INDEX
        for bf16 in (False, True):
            runs = {}
            for way in ("triton", "torch", "materialized"):
                os.environ[triton_kernels.ENV_SWITCH] = "1" if way == "triton" else "0"
                h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                with use_device_policy(policy), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    if way == "materialized":
                        out = linear_cross_entropy(h, w, t, masked=masked)
                    else:
                        out = fused_linear_cross_entropy(h, w, t, masked=masked)
                    (out.loss_sum * 0.5).backward()
                runs[way] = (out.loss_sum.detach(), out.entropy_sum, out.correct_sum, h.grad, w.grad)
            what = f"cross_entropy masked={masked} bf16={bf16}"
            triton, others = runs["triton"], (runs["torch"], runs["materialized"])
            for other in others:
                assert int(triton[2]) == int(other[2]), f"{what}: top-1 hits {int(triton[2])} vs {int(other[2])}"
                # the entropy log Z - E[z] cancels in the peaked rows: the two torch paths differ by 1e-5 themselves
                for name, got, want, tolerance in zip(("loss", "entropy"), triton[:2], other[:2],
                                                      (2e-3 if bf16 else 1e-6, 2e-3 if bf16 else 1e-4)):
                    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=0, msg=f"{what} {name}")
            expected_hits = 13 - (2 if masked else 0)  # rows 10-19 and the tie's rows 0-2; masking drops 2 and 11
            for name, got, want in zip(("hidden", "weight"), triton[3:], runs["torch"][3:]):
                # each gradient entry sums 5,000 (hidden) or 37 (weight) products of softmax terms made apart
                _close(got, want, bf16, f"{what} grad {name}", fp32_scale_tolerance=5e-5)
            assert int(triton[2]) == expected_hits, f"{what}: {int(triton[2])} hits, expected {expected_hits}"

    # a temperature, only the weight's gradient, and no gradient at all (evaluation): as torch's ops
    for case in ("temperature", "weight_only", "no_grad"):
        runs = {}
        for switch in ("1", "0"):
            os.environ[triton_kernels.ENV_SWITCH] = switch
            h = hidden.clone().requires_grad_(case != "weight_only")
            w = weight.clone().requires_grad_(case != "no_grad")
            with use_device_policy(policy), torch.set_grad_enabled(case != "no_grad"):
                out = fused_linear_cross_entropy(h, w, targets, temperature=0.7 if case == "temperature" else 1.0)
                if case != "no_grad":
                    out.loss_sum.backward()
            runs[switch] = (out.loss_sum.detach(), out.entropy_sum, out.correct_sum, h.grad, w.grad)
        (loss, entropy, correct, h_grad, w_grad), want = runs["1"], runs["0"]
        torch.testing.assert_close(loss, want[0], rtol=1e-6, atol=0, msg=f"cross_entropy {case} loss")
        torch.testing.assert_close(entropy, want[1], rtol=1e-4, atol=0, msg=f"cross_entropy {case} entropy")
        assert int(correct) == int(want[2]), f"cross_entropy {case}: hits {int(correct)} vs {int(want[2])}"
        assert (h_grad is None) == (want[3] is None) and (w_grad is None) == (want[4] is None), case
        for name, got, expected in (("hidden", h_grad, want[3]), ("weight", w_grad, want[4])):
            if expected is not None:
                _close(got, expected, False, f"cross_entropy {case} grad {name}", fp32_scale_tolerance=5e-5)


def check_cross_entropy_replaced_rows():
    """The Triton cross-entropy kernel (the GPU policy, gradients in blocks) with rows of the head read from elsewhere
    (``ReplacedRows``: trained token rows over a frozen matrix) against torch's ops over the matrix with the rows copied
    in: the loss and the gradients of the hidden states and the rows, fp32 and bf16 autocast, masked rows, several
    chunks and blocks."""
    import dataclasses

    from hfnative.device_policy import GPU_POLICY
    from hfnative.losses import IGNORE_INDEX, ReplacedRows
    from hfnative.losses.cross_entropy import fused_linear_cross_entropy

    N, D, V = 37, 16, 3000
    policy = dataclasses.replace(GPU_POLICY, name="gpu-small-chunks", head_chunk_elements=8 * V,
                                 head_gradient_block_elements=16 * V)
    generator = torch.Generator().manual_seed(9)
    hidden = torch.randn(N, D, generator=generator)
    weight = torch.randn(V, D, generator=generator)  # frozen
    rows = torch.randn(3, D, generator=generator)
    indices = torch.tensor([2999, 5, 1200])
    targets = torch.randint(0, V, (N,), generator=generator)
    targets[:6] = indices.repeat(2)
    targets[[8, 30]] = IGNORE_INDEX
    launches = [0]
    rows_kernel = triton_kernels.cross_entropy_rows

    def counted(*args, **kwargs):
        launches[0] += 1
        return rows_kernel(*args, **kwargs)

    triton_kernels.cross_entropy_rows = counted
    for bf16 in (False, True):
        runs = {}
        for way in ("triton", "copied"):
            os.environ[triton_kernels.ENV_SWITCH] = "1" if way == "triton" else "0"
            h, r = hidden.clone().requires_grad_(), rows.clone().requires_grad_()
            with use_device_policy(policy), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                if way == "triton":
                    out = fused_linear_cross_entropy(h, weight, targets, masked=True,
                                                     replaced_rows=ReplacedRows(indices, r))
                else:
                    out = fused_linear_cross_entropy(h, weight.index_copy(0, indices, r), targets, masked=True)
                (out.loss_sum * 0.5).backward()
            runs[way] = (out.loss_sum.detach(), h.grad, r.grad)
        what = f"cross_entropy replaced rows bf16={bf16}"
        assert launches[0] == 5, f"{what}: the Triton kernel ran {launches[0]} times, not once for each of 5 chunks"
        launches[0] = 0
        (loss, h_grad, r_grad), (want, want_h, want_r) = runs["triton"], runs["copied"]
        torch.testing.assert_close(loss, want, rtol=2e-3 if bf16 else 1e-6, atol=0, msg=f"{what} loss")
        assert r_grad.abs().sum() > 0, what
        for name, got, expected in (("hidden", h_grad, want_h), ("rows", r_grad, want_r)):
            _close(got, expected, bf16, f"{what} grad {name}", fp32_scale_tolerance=5e-5)
    triton_kernels.cross_entropy_rows = rows_kernel


def check_silu_gated():
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((3, 7, 40), (2000,)):  # 2,000: two programs, the second partly masked
            gate0 = torch.randn(shape, generator=generator) * 4
            up0 = torch.randn(shape, generator=generator)
            results = []
            for function in (TritonSiluGated.apply, lambda g, u: layers._GatedActivation.apply(g, u, "silu")):
                gate = gate0.to(dtype).requires_grad_()
                up = up0.to(dtype).requires_grad_()
                results.append(_grads(function, (gate, up)))
            (out, grads), (want_out, want_grads) = results
            what = f"silu_gated {dtype} {shape}"
            _close(out, want_out, dtype == torch.bfloat16, what + " output")
            for name, got, want in zip(("gate", "up"), grads, want_grads):
                _close(got, want, dtype == torch.bfloat16, f"{what} grad {name}")
        # the two halves of one product [B, S, 2 x 600] (a decoded replica's stacked gate and up projections): read
        # in place, rows 1,200 apart, the same values
        product = (torch.randn(3, 5, 1200, generator=generator) * 4).to(dtype).requires_grad_()
        gate, up = product.split(600, dim=-1)
        out = TritonSiluGated.apply(gate, up)
        (grad,) = torch.autograd.grad(out.sum(), product)
        want_gate, want_up = (t.detach().contiguous().requires_grad_() for t in (gate, up))
        want = layers._GatedActivation.apply(want_gate, want_up, "silu")
        want_grad = torch.cat(torch.autograd.grad(want.sum(), (want_gate, want_up)), dim=-1)
        _close(out, want, dtype == torch.bfloat16, f"silu_gated {dtype} on halves of one product")
        _close(grad, want_grad, dtype == torch.bfloat16, f"silu_gated {dtype} on halves of one product: grad")


@contextlib.contextmanager
def _dequantizing(use_kernel: bool, launched: collections.Counter):
    """The quantized weights made whole by the kernels (each launch counted in ``launched["int8"]`` or
    ``launched["nf4"]``), or with ``use_kernel`` False by the op sequences they replace."""
    from hfnative.models import triton_dequant

    kernels = triton_dequant.int8_values, triton_dequant.nf4_values
    supported = triton_dequant.int8_supported, triton_dequant.nf4_supported

    def counted(name, kernel):
        def run(*args):
            launched[name] += 1
            return kernel(*args)
        return run

    if use_kernel:
        triton_dequant.int8_values, triton_dequant.nf4_values = counted("int8", kernels[0]), counted("nf4", kernels[1])
    else:
        triton_dequant.int8_supported = triton_dequant.nf4_supported = lambda *args: False
    try:
        yield
    finally:
        triton_dequant.int8_values, triton_dequant.nf4_values = kernels
        triton_dequant.int8_supported, triton_dequant.nf4_supported = supported


def check_dequantize():
    """A quantized base's weights made whole in one kernel (``hfnative.models.triton_dequant``) equal the op sequences
    they replace to the bit: int8 rows as bitsandbytes' ``int8_vectorwise_dequant`` computes them (float32 products,
    rounded once), a row of zeros included; torchao's NF4 ``get_original_weight`` then a cast, for NF4 tensors in
    float32, bf16 and fp16 (the scalers' own blocks of 256 and, for a small layer, of 8), in float32, bf16 and fp16;
    sizes that leave the last program part-filled. Then LoRA layers over an int8 and an NF4 base, forward and
    backward in float32 and under bf16 autocast, give the same outputs and gradients with the kernels as without."""
    from hfnative.models import triton_dequant
    from hfnative.peft import quantize
    from hfnative.peft.lora import LoraLinear

    generator = torch.Generator().manual_seed(3)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    with use_device_policy("gpu"):
        rows = torch.randint(-127, 128, (37, 100), generator=generator, dtype=torch.int8)
        absmax = torch.rand(37, generator=generator) * 3
        absmax[5] = 0.0
        for dtype in floats:
            assert triton_dequant.int8_supported(rows, absmax, dtype), dtype
            got = triton_dequant.int8_values(rows, absmax, dtype, 1 / 127)
            want = ((rows.float() * absmax[:, None]) * torch.tensor(1 / 127)).to(dtype)
            assert torch.equal(got, want), f"int8 rows in {dtype}: {(got.float() - want.float()).abs().max()}"
        for shape in ((96, 512), (24, 64)):
            weight = torch.randn(shape, generator=generator) * 0.05
            weight[3, 7] = 1.5  # a block with an outlier
            for table in floats:
                nf4 = quantize.to_nf4_parameter(weight, table)
                for dtype in floats:
                    assert triton_dequant.nf4_supported(nf4, dtype), (shape, table, dtype)
                    got = triton_dequant.nf4_values(nf4, dtype)
                    want = nf4.get_original_weight().to(dtype)
                    assert torch.equal(got, want), \
                        f"NF4 {shape} {table} to {dtype}: {(got.float() - want.float()).abs().max()}"
        assert not triton_dequant.nf4_supported(quantize.to_nf4_parameter(weight, torch.float32).t(), torch.float32)

        launched = collections.Counter()
        base = torch.nn.Linear(128, 64, bias=True)
        x0 = torch.randn(2, 5, 128, generator=generator)
        for bits, bf16 in itertools.product(("int8", "nf4"), (False, True)):
            results = []
            for use_kernel in (False, True):
                torch.manual_seed(0)
                layer = torch.nn.Linear(128, 64, bias=True)
                layer.load_state_dict(base.state_dict())
                weight = (quantize.to_int8_parameter(layer.weight) if bits == "int8"
                          else quantize.to_nf4_parameter(layer.weight, torch.float32))
                lora = LoraLinear(quantize.QuantizedLinear(layer, weight), r=4, scaling=2.0)
                torch.nn.init.normal_(lora.lora_B, generator=torch.Generator().manual_seed(1))
                x = x0.clone().requires_grad_()
                before = dict(launched)
                with _dequantizing(use_kernel, launched):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        out = lora(x)
                    out.float().square().mean().backward()
                if use_kernel:  # forward and backward each made the weight whole in the kernel
                    assert launched[bits] - before.get(bits, 0) == 2, (bits, bf16, launched, before)
                results.append((out, x.grad, lora.lora_A.grad, lora.lora_B.grad))
            for name, got, want in zip(("output", "x grad", "lora_A grad", "lora_B grad"), results[1], results[0]):
                assert got.dtype == want.dtype and torch.equal(got, want), \
                    f"LoRA over {bits} (bf16 autocast {bf16}): {name} differs by {(got - want).abs().max()}"


def check_dequantize_rollouts():
    """The native engine's rollouts of a QLoRA policy (an NF4 base computed in bf16, LoRA on every linear layer) under
    the GPU policy and bf16 autocast, as GRPO's run: each decode step makes every NF4 weight whole in the kernel, and
    the greedy completions and their log-probs equal, to the bit, those made with torchao's op sequence."""
    from hfnative.converters.peft import apply_lora
    from hfnative.generation.native import NativeRolloutEngine
    from hfnative.generation.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as directory:
        make_hf_model("qwen3-gqa").save_pretrained(directory)
        converted = load_pretrained(directory)
    apply_lora(converted, dict(r=4, lora_alpha=8, target_modules="all-linear"), quantization_config={
        "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"})
    with torch.no_grad():  # adapters that change the completions
        for name, parameter in converted.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(generator=torch.Generator().manual_seed(len(name)))
    prompts = [[5, 9, 11, 3], [7, 2], [4, 4, 8, 1, 6, 2]]
    launched = collections.Counter()
    runs = {}
    for use_kernel in (True, False):
        with _dequantizing(use_kernel, launched), use_device_policy("gpu"), torch.autocast("cpu", dtype=torch.bfloat16):
            runs[use_kernel] = NativeRolloutEngine(converted.model).generate(
                prompts, SamplingParams(max_new_tokens=5, do_sample=False))
    assert launched["nf4"] >= 5 * 2 * 7, f"{launched['nf4']} NF4 weights made whole by the kernel in 5 steps of 2 blocks"
    _same_rollouts(runs[True], runs[False], 0.0, "a QLoRA policy's rollouts")


class _Launches:
    """Counts the kernels' autograd functions as they are applied."""

    def __init__(self):
        self.counts = {"rms_norm": 0, "norm_rope": 0, "residual_norm": 0, "rope": 0, "silu_gated": 0,
                       "cross_entropy": 0, "decode_qkv": 0, "decode_attention": 0}
        self._originals = (TritonRMSNorm.apply, TritonSiluGated.apply, TritonRope.apply,
                           triton_kernels.cross_entropy_rows, TritonResidualRMSNorm.apply, cached_decoder.decode_qkv,
                           cached_decoder.decode_attention)

    def __enter__(self):
        norm, gated, rope, cross_entropy, residual_norm, decode, attend = self._originals

        def counted(name, apply):
            def wrapper(*args):
                self.counts[name] += 1
                if apply is norm:  # with cos: rotated in the kernel
                    self.counts["norm_rope"] += len(args) > 4 and args[4] is not None
                if apply is residual_norm:
                    self.counts["residual_norm"] += 1
                return apply(*args)
            return wrapper

        TritonRMSNorm.apply = counted("rms_norm", norm)
        TritonSiluGated.apply = counted("silu_gated", gated)
        TritonRope.apply = counted("rope", rope)
        triton_kernels.cross_entropy_rows = counted("cross_entropy", cross_entropy)
        TritonResidualRMSNorm.apply = counted("rms_norm", residual_norm)  # with the residual add before the norm
        cached_decoder.decode_qkv = counted("decode_qkv", decode)
        cached_decoder.decode_attention = counted("decode_attention", attend)
        return self

    def __exit__(self, *exc):
        (TritonRMSNorm.apply, TritonSiluGated.apply, TritonRope.apply, triton_kernels.cross_entropy_rows,
         TritonResidualRMSNorm.apply, cached_decoder.decode_qkv, cached_decoder.decode_attention) = self._originals


def _same_rollouts(out, want, atol: float, what: str) -> None:
    """The same completions, and log-probs within ``atol`` of ``want``'s."""
    assert out.completion_ids == want.completion_ids, f"{what}: {out.completion_ids} vs {want.completion_ids}"
    logprobs, want_logprobs = (torch.tensor([x for row in o.logprobs for x in row]) for o in (out, want))
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=atol, msg=f"{what}: log-probs")


def _native(name, directory):
    reference = make_hf_model(name)
    reference.save_pretrained(directory)
    return reference, load_pretrained(directory).model


def _step(model, input_ids, triton: bool, bf16: bool = False):
    """(loss, logits, {name: grad}) of one training step's forward and backward under the GPU policy."""
    os.environ[triton_kernels.ENV_SWITCH] = "1" if triton else "0"
    model.zero_grad(set_to_none=True)
    with use_device_policy("gpu"):  # a checkpointed block's recompute asks the policy again in backward
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids, labels=input_ids)
            logits = out.logits.float()
        out.loss.backward()
    return out.loss.detach(), logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


EXPECTED_LAUNCHES = {  # per forward of the 2-block models: RMSNorms, of them with the rotation, of them after the
    # residual add (the MLP's pre-norm), rotations alone, SiLU-gated units, the head's cross-entropy (one chunk of
    # these 22 tokens)
    "llama-gqa": (2 * 2 + 1, 0, 2, 2 * 2, 2, 1),  # two pre-norms a block, the final norm; q and k rotated
    "qwen3-gqa": (2 * 4 + 1, 2 * 2, 2, 0, 2, 1),  # two pre-norms and per-head q/k norms (rotated) a block, the final
    # norm
    "qwen3moe-topk-norm": (2 * 4 + 1, 2 * 2, 2, 0, 2, 1),  # the experts' gated unit, once a block
    "olmo3-sliding-gqa": (2 * 4 + 1, 0, 0, 2 * 2, 2, 1),  # post-norms (no pre-norm after an add); q/k norms over the
    # projection, then rotated; weights scaled in float32
    # four norms a block, q/k norms (1 + w); a GELU-tanh unit; soft-capped logits (torch's cross-entropy)
    "gemma3-softcap-linear-untied": (2 * 6 + 1, 2 * 2, 2, 0, 0, 0),
}


def check_decoding_bf16_weights():
    """The native engine's greedy decoding of a model loaded in bf16 (its norm weights and rotary tables bf16 too) under
    the GPU policy: with the kernels (the q/k norms rotating in bf16 as torch does, the residual add with the MLP's
    pre-norm) every family's completions and their log-probs equal the engine's without the kernels (torch's ops), and
    the kernels run where expected: per decode step and block, the rotated q/k norms of Qwen3 (Llama's rotation
    alone), the MLP's pre-norm after the residual add, and the attention's pre-norm after the previous block's, and
    per decode step the final norm after the last block's."""
    from hfnative.generation.native import NativeRolloutEngine
    from hfnative.generation.sampling import SamplingParams

    prompts = [[5, 9, 11, 3], [7, 2], [4, 4, 8, 1, 6, 2]]
    new_tokens = 6
    for name, rotated, rotations in (("qwen3-gqa", 2 * 2, 0), ("llama-gqa", 0, 2 * 2)):
        with tempfile.TemporaryDirectory() as directory:
            make_hf_model(name).save_pretrained(directory)
            model = load_pretrained(directory, dtype=torch.bfloat16).model
        runs = {}
        for triton in ("1", "0"):
            os.environ[triton_kernels.ENV_SWITCH] = triton
            with use_device_policy("gpu"), _Launches() as launches:
                out = NativeRolloutEngine(model).generate(
                    prompts, SamplingParams(max_new_tokens=new_tokens, do_sample=False))
            runs[triton] = (out, dict(launches.counts))
        (out, counts), (want, _) = runs["1"], runs["0"]
        _same_rollouts(out, want, 2e-2, f"decoding {name}")
        calls = new_tokens  # the prefill and the decode steps: each runs every block once
        # the prefill rotates its q/k heads as training does; a decode step in one kernel a block (check decode_qkv)
        assert counts["norm_rope"] == rotated and counts["rope"] == rotations, (name, counts)
        assert counts["decode_qkv"] == 2 * (calls - 1), (name, counts)
        # the MLP's pre-norm in each of the 2 blocks and the second block's attention pre-norm (the first block's
        # output added inside it); a decode step's final norm too (the last block's output added inside it)
        assert counts["residual_norm"] == 3 * calls + (calls - 1), (name, counts)


def check_decode_qkv():
    """A decode step's query, key and value heads in one kernel (``decode_qkv``: the q/k norms, the rotation and both
    cache writes) give what the training path's kernels and the cache's writes give, to the bit: greedy completions
    and their log-probs of the native engine with the kernel equal those with it left out (``decode_qkv_supported``
    answering no), under the GPU policy with the interpreter rounding as a GPU does, for Qwen3's per-head norms
    (float32 weights under bf16 autocast, as the trainers' rollouts, its q/k/v slices of one product; bf16 weights, as
    they are and stacked; float32), Llama's rotation alone and
    Gemma 3's (1 + w) norms in bf16 with its sliding layers' ring caches. The kernel runs once a block and decode
    step."""
    from hfnative.generation.native import NativeRolloutEngine
    from hfnative.generation.sampling import SamplingParams

    prompts = [[5, 9, 11, 3], [7, 2], [4, 4, 8, 1, 6, 2]]
    new_tokens = 7
    supported = cached_decoder.decode_qkv_supported
    os.environ[triton_kernels.ENV_SWITCH] = "1"
    cases = (("qwen3-gqa", torch.float32, True, None), ("qwen3-gqa", torch.bfloat16, False, None),
             ("qwen3-gqa", torch.bfloat16, False, True), ("qwen3-gqa", torch.float32, False, None),
             ("llama-gqa", torch.float32, True, None), ("llama-gqa", torch.bfloat16, False, None),
             ("gemma3-softcap-linear-untied", torch.bfloat16, False, None))
    for name, dtype, autocast, stack in cases:  # stack: the projections stacked (slices of one product) without a cast
        with tempfile.TemporaryDirectory() as directory:
            make_hf_model(name).save_pretrained(directory)
            model = load_pretrained(directory, dtype=dtype).model
        runs = {}
        for one_kernel in (True, False):
            cached_decoder.decode_qkv_supported = supported if one_kernel else (lambda *args: False)
            try:
                with (use_device_policy("gpu"), _Launches() as launches,
                      torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)):
                    out = NativeRolloutEngine(model, stack_projections=stack).generate(
                        prompts, SamplingParams(max_new_tokens=new_tokens, do_sample=False))
            finally:
                cached_decoder.decode_qkv_supported = supported
            runs[one_kernel] = (out, launches.counts["decode_qkv"])
        (out, launched), (want, _) = runs[True], runs[False]
        what = f"{name} {dtype}{' under bf16 autocast' if autocast else ''}{', stacked' if stack else ''}"
        assert launched == len(model.layers) * (new_tokens - 1), f"{what}: decode_qkv ran {launched} times"
        assert out.completion_ids == want.completion_ids, f"{what}: {out.completion_ids} vs {want.completion_ids}"
        assert out.logprobs == want.logprobs, f"{what}: log-probs {out.logprobs} vs {want.logprobs}"


def _attention_reference(q_BH1d, keys_BKLd, values_BKLd, seen_BL, scale):
    """Softmax attention in float64 of each row's query heads over the entries it sees (query head h reads key/value
    head h // (H / K))."""
    H, K = q_BH1d.shape[1], keys_BKLd.shape[1]
    keys, values = (t.double().repeat_interleave(H // K, 1) for t in (keys_BKLd, values_BKLd))
    scores = (q_BH1d.double() @ keys.transpose(-1, -2)) * scale
    return (scores.masked_fill(~seen_BL[:, None, None, :], float("-inf")).softmax(-1) @ values)


def check_decode_attention():
    """``decode_attention`` (a decode step's attention, one kernel a layer, no mask) against softmax attention in
    float64: float32 to float32 round-off, bf16 within four bf16 ulps of the values' scale (the probabilities meet
    the values in bf16, as a flash kernel's do); full-length buffers read from each row's padding to the slot
    written (a padding past a whole block of entries), rings by the slot each entry holds (a block of empty entries
    seen by no row), query heads sharing key/value heads 1, 2 and 3 to a group, heads of 16, 24, 128 and 256, each
    row's cache read whole and in 2 and 4 parts joined by ``decode_attention_combine`` (a part of unseen or no
    entries among them). Then
    the native engine's greedy decoding with it against the engine with SDPA under the cache's mask: the same
    completions, log-probs to float32 round-off (bf16: 2e-2), one launch a layer and step, no mask made, one
    static-shape step for every read length (no graph per length); a query it does not take going to SDPA under masks
    made then; the same after rows moved to the front of the batch (most stopped); and a compiled step (bf16 Gemma 3)
    calling it as a custom op."""
    from hfnative.generation.kv_cache import KVCache
    from hfnative.generation.native import NativeRolloutEngine
    from hfnative.generation.sampling import SamplingParams

    g = torch.Generator().manual_seed(11)
    with use_device_policy("gpu"):
        for dtype in (torch.float32, torch.bfloat16):
            for heads, kv_heads, d in ((4, 4, 16), (8, 4, 128), (6, 2, 24), (4, 2, 256)):
                B, L, slot = 3, 150, 130
                keys, values = (torch.randn(B, kv_heads, L, d, generator=g).to(dtype) for _ in range(2))
                q = torch.randn(B, heads, 1, d, generator=g).to(dtype)
                assert triton_decode.decode_attention_supported(keys, values, heads)
                pad = torch.tensor([0, 5, 70])
                entries = torch.arange(L)
                rings = torch.full((L,), -1)
                rings[:41] = torch.arange(41)  # a ring of 150 entries filled up to slot 40
                cases = (("full", None, (entries[None] >= pad[:, None]) & (entries[None] <= slot)),
                         ("ring", rings, rings[None] >= torch.tensor([0, 20, 40])[:, None]))
                for (kind, entry_slot, seen), splits in itertools.product(cases, (1, 2, 4)):
                    row_pad = pad if entry_slot is None else torch.tensor([0, 20, 40])
                    # the entries a row does not see hold NaN: read and weighed 0, they would make NaN
                    unseen = (~seen)[:, None, :, None].expand_as(keys)
                    out = triton_decode._decode_attention(
                        q, keys.masked_fill(unseen, float("nan")), values.masked_fill(unseen, float("nan")), row_pad,
                        torch.tensor([slot]), entry_slot, d**-0.5, splits)
                    want = _attention_reference(q, keys, values, seen, d**-0.5)
                    what = f"{kind} {dtype} heads {heads}/{kv_heads} of {d} in {splits} parts"
                    assert out.dtype == dtype and out.shape == q.shape, what
                    error = (out.double() - want).abs().max().item()
                    bound = (2.0**-6 * values.abs().max().item() if dtype == torch.bfloat16 else 1e-5)
                    assert error <= bound, f"{what}: max |diff| {error:.3g} > {bound:.3g}"

    made_masks = []
    make_masks = KVCache._make_masks
    KVCache._make_masks = lambda cache, n: (made_masks.append(n), make_masks(cache, n))
    supported = cached_decoder.decode_attention_supported
    os.environ[triton_kernels.ENV_SWITCH] = "1"
    prompts = [[5, 9, 11, 3], [7, 2], [4, 4, 8, 1, 6, 2]]
    new_tokens = 7
    cases = (("qwen3-gqa", torch.float32, True, True), ("qwen3-gqa", torch.bfloat16, False, False),
             ("llama-gqa", torch.float32, False, False), ("gemma3-softcap-linear-untied", torch.bfloat16, False, True))
    try:
        for name, dtype, autocast, and_static in cases:
            with tempfile.TemporaryDirectory() as directory:
                make_hf_model(name).save_pretrained(directory)
                model = load_pretrained(directory, dtype=dtype).model
            runs = {}
            for kernel, static in ((True, False), (False, False)) + (((True, True),) if and_static else ()):
                cached_decoder.decode_attention_supported = supported if kernel else (lambda *args: False)
                made_masks.clear()
                engine = NativeRolloutEngine(model)
                engine.bucketed_reads = static  # the steps a CUDA graph captures, run uncaptured
                with (use_device_policy("gpu"), _Launches() as launches,
                      torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)):
                    out = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, do_sample=False))
                runs[kernel, static] = out
                what = f"{name} {dtype}{' under bf16 autocast' if autocast else ''}{', static' if static else ''}"
                if kernel:
                    assert launches.counts["decode_attention"] == len(model.layers) * (new_tokens - 1), what
                    [batch] = engine._batches.values()
                    assert not made_masks, f"{what}: masks made for lengths {made_masks}"
                    assert len(batch.runners) == 1, f"{what}: {len(batch.runners)} steps made"
                    if static:  # bound to read the whole cache (no length), the attention by the kernel
                        assert [runner.step.args[-2:] for runner in batch.runners.values()] == [(None, True)], what
                else:
                    assert launches.counts["decode_attention"] == 0 and made_masks, what
            want = runs[False, False]
            tolerance = 2e-2 if torch.bfloat16 in (dtype, torch.bfloat16 if autocast else None) else 1e-5
            for (kernel, static), out in runs.items():
                what = f"{name} {dtype}{' under bf16 autocast' if autocast else ''}, kernel {kernel}, static {static}"
                _same_rollouts(out, want, tolerance, what)
        # a query the kernel does not take (here: none) goes to SDPA under masks made then: the engine without it
        takes = cached_decoder.decode_attention_takes
        cached_decoder.decode_attention_takes = lambda *args: False
        made_masks.clear()
        try:
            with use_device_policy("gpu"):
                out = NativeRolloutEngine(model).generate(prompts, SamplingParams(max_new_tokens=new_tokens,
                                                                                  do_sample=False))
        finally:
            cached_decoder.decode_attention_takes = takes
        assert made_masks and out.logprobs == runs[False, False].logprobs, "a query the kernel does not take"
        # rows moved to the front of the batch's buffers once most have stopped (8 rows, seeded samples, many stop ids):
        # the kernel reads the front's views, the same tokens and log-probs as SDPA's
        with tempfile.TemporaryDirectory() as directory:
            make_hf_model("llama-gqa").save_pretrained(directory)
            llama = load_pretrained(directory).model
        eight = [[5 + i, 9, 11, 3][: 1 + i % 4] for i in range(8)]
        stopping = SamplingParams(max_new_tokens=12, seed=3, eos_token_id=list(range(20, 80)))
        moved = {}
        for kernel in (True, False):
            cached_decoder.decode_attention_supported = supported if kernel else (lambda *args: False)
            engine = NativeRolloutEngine(llama)
            with use_device_policy("gpu"), _Launches() as launches:
                moved[kernel] = (engine.generate(eight, stopping), launches.counts["decode_attention"])
            [batch] = engine._batches.values()
            assert batch._fronts, "no rows moved: the stop ids are not met early enough"
        (out, launched), (want, _) = moved[True], moved[False]
        assert launched, "moved rows: no decode_attention launch"
        _same_rollouts(out, want, 1e-5, "moved rows")
        cached_decoder.decode_attention_supported = supported
        # a compiled step (compile=True, what the trainers pass with torch_compile=True) calls the kernel as the custom
        # op hfnative::decode_attention: one frame, no graph break, no mask made by a step, the eager engine's tokens
        launched = []
        launch = triton_decode._decode_attention
        triton_decode._decode_attention = lambda *args: (launched.append(1), launch(*args))[1]
        made_masks.clear()
        torch._dynamo.reset()
        from torch._dynamo.utils import counters
        counters.clear()
        try:
            with use_device_policy("gpu"):
                out = NativeRolloutEngine(model, compile=True).generate(
                    prompts, SamplingParams(max_new_tokens=new_tokens, do_sample=False))
        finally:
            triton_decode._decode_attention = launch
        want = runs[True, False]
        assert len(launched) == len(model.layers) * (new_tokens - 1), f"compiled: {len(launched)} launches"
        assert counters["frames"]["total"] == 1 and not counters["graph_break"], (dict(counters["frames"]),
                                                                                  dict(counters["graph_break"]))
        assert not made_masks, f"compiled: masks {made_masks}"
        _same_rollouts(out, want, 2e-2, "compiled")
    finally:
        cached_decoder.decode_attention_supported = supported
        KVCache._make_masks = make_masks


def check_models():
    """A training step of each family under the GPU policy: the kernels run where expected, the logits equal
    transformers' forward, and the loss and every gradient equal the same step with the kernels off; then the same
    with every block checkpointed (the GPU policy's selective checkpointing recomputes the kernels)."""
    input_ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(3))
    for name, (norms, rotated, after_add, rotations, gated, heads) in EXPECTED_LAUNCHES.items():
        with tempfile.TemporaryDirectory() as directory:
            reference, model = _native(name, directory)
            with torch.no_grad():
                want_logits = reference(input_ids).logits
            off_loss, off_logits, off_grads = _step(model, input_ids, triton=False)
            with _Launches() as launches:
                loss, logits, grads = _step(model, input_ids, triton=True)
            expected = {"rms_norm": norms, "norm_rope": rotated, "residual_norm": after_add, "rope": rotations,
                        "silu_gated": gated, "cross_entropy": heads, "decode_qkv": 0, "decode_attention": 0}
            assert launches.counts == expected, f"{name}: {launches.counts}"
            torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=2e-5, msg=f"{name} logits")
            torch.testing.assert_close(loss, off_loss, rtol=1e-6, atol=0, msg=f"{name} loss")
            for param, grad in off_grads.items():
                torch.testing.assert_close(grads[param], grad, rtol=1e-5, atol=1e-6, msg=f"{name} grad {param}")
            apply_activation_checkpointing(model, "full")
            with _Launches() as launches:
                ac_loss, _, ac_grads = _step(model, input_ids, triton=True)
            assert launches.counts["rms_norm"] == norms + norms - 1, f"{name} checkpointed: {launches.counts}"
            torch.testing.assert_close(ac_loss, off_loss, rtol=1e-6, atol=0, msg=f"{name} checkpointed loss")
            for param, grad in off_grads.items():
                torch.testing.assert_close(ac_grads[param], grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{name} checkpointed grad {param}")


def check_bf16_autocast():
    """Under bf16 autocast the step with the kernels follows the step without them to bf16 round-off."""
    input_ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    with tempfile.TemporaryDirectory() as directory:
        _, model = _native("qwen3-gqa", directory)
        off_loss, _, off_grads = _step(model, input_ids, triton=False, bf16=True)
        with _Launches() as launches:
            loss, _, grads = _step(model, input_ids, triton=True, bf16=True)
    assert launches.counts == {"rms_norm": 9, "norm_rope": 4, "residual_norm": 2, "rope": 0, "silu_gated": 2,
                               "cross_entropy": 1, "decode_qkv": 0, "decode_attention": 0}, launches.counts
    assert abs(loss.item() - off_loss.item()) <= 1e-2 * abs(off_loss.item()), (loss.item(), off_loss.item())
    for param, grad in off_grads.items():
        cosine = torch.nn.functional.cosine_similarity(grads[param].flatten(), grad.flatten(), dim=0).item()
        assert cosine >= 0.999, f"bf16 grad {param}: cosine {cosine:.5f} to the step without the kernels"
    # the rotated q and k heads reach attention in bf16 and their gradients leave it so: no cast of a [B, ., S, d]
    # tensor either way (the kernel writes bf16 and reads the bf16 gradient; written in float32, they were cast
    # twice a block each way)
    with _Casts() as casts:
        _step(model, input_ids, triton=True, bf16=True)
    assert casts.of_heads == 0, f"{casts.of_heads} casts of q or k heads with the kernels"


def _distance(got, exact) -> float:
    """Relative L2 distance of ``got`` from ``exact`` (a float64 tensor or a dict of them)."""
    if isinstance(exact, dict):
        return (sum(((got[k].double() - exact[k].double()) ** 2).sum() for k in exact)
                / sum((exact[k].double() ** 2).sum() for k in exact)).sqrt().item()
    return ((got.double() - exact.double()).norm() / exact.double().norm()).item()


def check_bf16_as_close_to_exact_as_torch():
    """In bf16 the kernels' results sit as close to the exact values as torch's op sequences' do (within 10%): each
    kernel's output and gradients against float64 arithmetic on the same inputs, and a Qwen3 step's gradients under
    bf16 autocast against its float32 step. A rounding step torch does not take (a value written in bf16 where torch
    keeps float32, a cast that cuts bits off instead of rounding them, as Triton's interpreter did) puts a kernel
    about twice as far."""
    from hfnative.models.rope import apply_rotary

    generator = torch.Generator().manual_seed(11)
    batch, seq, heads, d, width = 2, 128, 4, 64, 256
    angles = torch.randn(batch, seq, d // 2, generator=generator) * 3
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    head_weight = torch.randn(d, generator=generator) * 0.3 + 1
    weight = torch.randn(width, generator=generator) * 0.3 + 1

    def rms_norm(x, w):  # the exact norm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    # name: (inputs, the kernel, torch's op sequence, the exact function); each gets the same bf16 output gradient
    cases = {
        "q/k norm and rotation, written in bf16": (
            (torch.randn(batch, seq, heads, d, generator=generator).mul(3).bfloat16(), head_weight),
            lambda x, w: TritonRMSNorm.apply(x, w, 1e-6, None, cos, sin, torch.bfloat16).transpose(1, 2),
            lambda x, w: apply_rotary(layers._RMSNormFunction.apply(x.transpose(1, 2), w, 1e-6, None), cos,
                                      sin).bfloat16(),
            lambda x, w: apply_rotary(rms_norm(x.transpose(1, 2), w), cos.double(), sin.double())),
        "pre-norm of the float32 stream, written in bf16": (
            (torch.randn(batch * seq, width, generator=generator), weight),
            lambda x, w: TritonRMSNorm.apply(x, w, 1e-6, None, None, None, torch.bfloat16),
            lambda x, w: layers._RMSNormFunction.apply(x, w, 1e-6, None).bfloat16(),
            rms_norm),
        "residual add and norm, written in bf16": (
            (torch.randn(batch * seq, width, generator=generator),
             torch.randn(batch * seq, width, generator=generator).bfloat16(), weight),
            lambda x, u, w: TritonResidualRMSNorm.apply(x, u, w, 1e-6, None, torch.bfloat16)[1],
            lambda x, u, w: layers._RMSNormFunction.apply(x + u, w, 1e-6, None).bfloat16(),
            lambda x, u, w: rms_norm(x + u, w)),
        "SiLU-gated unit in bf16": (
            (torch.randn(batch * seq, width, generator=generator).bfloat16(),
             torch.randn(batch * seq, width, generator=generator).bfloat16()),
            lambda g, u: TritonSiluGated.apply(g, u),
            lambda g, u: torch.nn.functional.silu(g) * u,
            lambda g, u: torch.nn.functional.silu(g) * u),
    }
    for what, (inputs, kernel, ops, exact) in cases.items():
        results = {}
        for name, function in (("kernel", kernel), ("torch", ops), ("exact", exact)):
            args = [(x.double() if name == "exact" else x.clone()).requires_grad_() for x in inputs]
            out = function(*args)
            grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(12)).bfloat16()
            grads = torch.autograd.grad(out, args, grad_out.to(out.dtype))
            results[name] = (out, *grads)
        for index, part in enumerate(("output", *(f"grad {i}" for i in range(len(inputs))))):
            exact_part = results["exact"][index]
            kernel_distance = _distance(results["kernel"][index], exact_part)
            torch_distance = _distance(results["torch"][index], exact_part)
            assert kernel_distance <= 1.1 * torch_distance + 1e-7, \
                f"{what} {part}: {kernel_distance:.3e} from exact, torch's ops {torch_distance:.3e}"

    input_ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(13))
    with tempfile.TemporaryDirectory() as directory:
        _, model = _native("qwen3-gqa", directory)
        _, _, exact_grads = _step(model, input_ids, triton=False, bf16=False)
        _, _, torch_grads = _step(model, input_ids, triton=False, bf16=True)
        with _Launches() as launches:
            _, _, kernel_grads = _step(model, input_ids, triton=True, bf16=True)
    assert launches.counts["norm_rope"] and launches.counts["silu_gated"] and launches.counts["cross_entropy"], \
        launches.counts
    kernel_distance, torch_distance = _distance(kernel_grads, exact_grads), _distance(torch_grads, exact_grads)
    assert kernel_distance <= 1.1 * torch_distance, \
        f"bf16 step's gradients: {kernel_distance:.3e} from the float32 step's, torch's ops {torch_distance:.3e}"


class _Casts(TorchDispatchMode):
    """Counts dtype casts of 4-D float tensors (attention heads)."""

    def __init__(self):
        super().__init__()
        self.of_heads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].dim() == 4 and args[0].is_floating_point():
            self.of_heads += 1
        return func(*args, **(kwargs or {}))


def check_compiled_blocks_leave_them_to_the_compiler():
    """A compiled block runs torch's op sequence (the compiler fuses it): no kernel is applied, and the step equals
    the eager one with the kernels."""
    input_ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    with tempfile.TemporaryDirectory() as directory:
        _, model = _native("qwen3-gqa", directory)
        eager_loss, _, eager_grads = _step(model, input_ids, triton=True)
        with use_device_policy("gpu"):
            apply_compile(model)
        with _Launches() as launches:
            loss, _, grads = _step(model, input_ids, triton=True)
    # the final norm runs eagerly
    assert launches.counts == {"rms_norm": 1, "norm_rope": 0, "residual_norm": 0, "rope": 0, "silu_gated": 0,
                               "cross_entropy": 1, "decode_qkv": 0, "decode_attention": 0}, launches.counts
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for param, grad in eager_grads.items():
        torch.testing.assert_close(grads[param], grad, rtol=1e-4, atol=1e-5, msg=f"compiled grad {param}")


def check_compiles_for_sm90():
    """Every launch a forward and backward make at the Qwen3-0.6B shape (each norm variant, the rotated q/k norm,
    the gated unit; fp32, bf16 activations over fp32 weights, bf16 weights; a quantized base's weights made whole)
    compiles for sm_90 (H100/H200) to a cubin with no register spill, the dequantization kernels with every rounding
    their own (no fused multiply-add, an IEEE division, no flush to zero)."""
    from _triton_compile import compile_for_sm90, qwen3_launches

    assert os.environ.get("TRITON_INTERPRET") != "1", "the compile check runs without the interpreter"
    reports = compile_for_sm90(qwen3_launches())
    kernels = {report["kernel"] for report in reports}
    assert kernels == set(triton_kernels.KERNEL_NAMES), kernels
    assert any(report["constexprs"].get("ROPE") for report in reports), "no rotated norm was compiled"
    assert {report["kernel"] for report in reports if report["constexprs"].get("ROUNDED")} == {
        "rms_norm_forward", "rms_norm_backward", "rope_forward", "decode_qkv"}, \
        "the rotations with bf16 tables were not compiled"
    spilled = [{k: v for k, v in report.items() if k != "ptx"} for report in reports if report["spill_bytes"]]
    assert not spilled, f"register spills: {spilled}"
    # the dequantization kernels give torch's values to the bit only if each operation rounds on its own: an IEEE
    # division, no multiply fused into an add, no flush of subnormals
    for report in reports:
        if report["kernel"] in ("int8_dequantize", "nf4_dequantize"):
            ptx = report["ptx"]
            assert not re.search(r"\bfma\.|\.ftz\b|div\.full|div\.approx", ptx), f"{report['kernel']}: inexact PTX"
            assert report["kernel"] == "int8_dequantize" or "div.rn.f32" in ptx, "nf4_dequantize: no div.rn.f32"


def check_one_variant_for_any_token_count():
    """A batch's token count does not pick the Triton variant its launches compile, so a batch of another length never
    compiles the kernels again: the Qwen3-0.6B shape's launches at 8,192 tokens and at 8,180 (its pre-norms' rows a
    multiple of 16, then not); each kernel's launches at 64, 61 and 1 tokens (rows of 8 key/value heads rotated,
    normed and rotated, alone, after the residual add); a decode step's attention over caches of 320 and 317 slots."""
    from _triton_compile import qwen3_launches, recorded_launches, specializations_for_sm90

    from hfnative.models.triton_decode import decode_attention

    assert os.environ.get("TRITON_INTERPRET") != "1", "Triton's launcher specialises only without the interpreter"

    def launches(tokens: int, slots: int):
        def run():
            w = torch.ones(1024, requires_grad=True)
            x = torch.zeros(tokens, 1024, requires_grad=True)
            TritonRMSNorm.apply(x, w, 1e-6, None, None, None, torch.bfloat16).sum().backward()
            update = torch.zeros(tokens, 1024, dtype=torch.bfloat16, requires_grad=True)
            h, y = TritonResidualRMSNorm.apply(x, update, w, 1e-6, None, torch.bfloat16)
            torch.autograd.backward((h, y), (torch.ones_like(h), torch.ones_like(y)))
            heads = torch.zeros(1, tokens, 8, 128, dtype=torch.bfloat16, requires_grad=True)
            cos = torch.zeros(1, tokens, 128)
            head_w = torch.ones(128, requires_grad=True)
            TritonRMSNorm.apply(heads, head_w, 1e-6, None, cos, cos, torch.bfloat16).sum().backward()
            TritonRope.apply(heads, cos, cos).sum().backward()
            gate = torch.zeros(tokens, 3072, dtype=torch.bfloat16, requires_grad=True)
            TritonSiluGated.apply(gate, gate.detach()).sum().backward()
            cache = torch.zeros(4, 8, slots, 128, dtype=torch.bfloat16)
            decode_attention(torch.zeros(4, 16, 1, 128, dtype=torch.bfloat16), cache, cache,
                             torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), None, 0.088)
        return recorded_launches(run)

    variants = {tokens: specializations_for_sm90(qwen3_launches(tokens)) for tokens in (8192, 8180)}
    assert len(variants[8192]) > 10, variants[8192]
    new = sorted({name for name, _ in variants[8180] - variants[8192]})
    assert not new, f"kernels compiled again for 8,180 tokens: {new}"
    first = specializations_for_sm90(launches(64, 320))
    assert {name for name, _ in first} >= {"rms_norm_forward", "rms_norm_backward", "rope_forward", "rope_backward",
                                           "silu_gated_forward", "silu_gated_backward", "decode_attention"}, first
    for tokens, slots in ((61, 317), (1, 320)):
        new = sorted({name for name, _ in specializations_for_sm90(launches(tokens, slots)) - first})
        assert not new, f"kernels compiled again for {tokens} tokens and {slots} cache slots: {new}"


CHECKS = {name[len("check_"):]: function for name, function in globals().items() if name.startswith("check_")}


def main(names):
    results = {}
    for name in names or CHECKS:
        try:
            CHECKS[name]()
            results[name] = None
        except Exception:  # noqa: BLE001 - every check reports, one failing does not stop the next
            results[name] = traceback.format_exc(limit=6)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
