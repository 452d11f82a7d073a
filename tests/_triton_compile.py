"""Compile the Triton kernels for a GPU on a machine without one: each launch the wrappers in
``hfnative.models.triton_kernels`` make for given inputs is recorded instead of run, then compiled by Triton for
sm_90 (H100/H200) down to a cubin, and ptxas reports each kernel's registers and spills. Used by
tests/_triton_kernels_worker.py (check ``compiles_for_sm90``) and runnable alone:

    PYTHONPATH=.triton-cpu:tests python tests/_triton_compile.py      # the Qwen3-0.6B shape's launches

Needs Triton importable and ``TRITON_INTERPRET`` unset (the interpreter's kernels do not compile).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import types

import torch

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32",
         torch.int8: "i8", torch.uint8: "u8"}


class _Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **constexprs)`` records the launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append((self.kernel, args, kwargs))
        return record


def recorded_launches(run) -> list:
    """The kernel launches ``run()`` makes through the wrappers (nothing is launched; outputs are left empty)."""
    from hfnative.models import triton_kernels

    real = triton_kernels._kernels()
    assert real is not None, "Triton cannot be imported"
    launches: list = []
    recording = real._replace(**{name: _Recorder(getattr(real, name), launches)
                                 for name in triton_kernels.KERNEL_NAMES})
    original = triton_kernels._kernels
    triton_kernels._kernels = lambda: recording
    try:
        run()
    finally:
        triton_kernels._kernels = original
    return launches


def _signature(kernel, args, kwargs):
    names = kernel.arg_names
    signature, constexprs = {}, {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} = {value!r}")
    options = {}
    for name, value in kwargs.items():
        if name in ("num_warps", "num_stages"):
            options[name] = value
        else:
            signature[name], constexprs[name] = "constexpr", value
    return signature, constexprs, options


def compile_for_sm90(launches) -> list[dict]:
    """Compiles each distinct launch to a cubin for sm_90; returns name, constexprs, registers, spill bytes and the
    PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    seen, reports = set(), []
    for kernel, args, kwargs in launches:
        signature, constexprs, options = _signature(kernel, args, kwargs)
        key = (kernel.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        assert "cubin" in compiled.asm, f"{kernel.__name__}: no cubin"
        report = {"kernel": kernel.__name__, "constexprs": constexprs, "num_warps": options.get("num_warps", 4),
                  "types": {k: v for k, v in signature.items() if v.startswith("*")}, "ptx": compiled.asm["ptx"]}
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as ptx:
            ptx.write(compiled.asm["ptx"])
        try:
            usage = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull],
                                   capture_output=True, text=True, check=True).stderr
        finally:
            os.unlink(ptx.name)
        report["registers"] = int(re.search(r"Used (\d+) registers", usage).group(1))
        report["spill_bytes"] = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", usage))
        reports.append(report)
    return reports


def specializations_for_sm90(launches) -> set[tuple[str, str]]:
    """Each launch's kernel and the specialisation Triton's launcher would compile it under for sm_90 (the argument
    types, the integers it specialises as 1 or multiples of 16, the pointers' alignment, the constexprs): one
    compiled variant per distinct entry."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders, variants = {}, set()
    for kernel, args, kwargs in launches:
        if kernel not in binders:
            binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, backend)
        _, specialization, options = binders[kernel](*args, **kwargs)
        variants.add((kernel.__name__, repr((specialization, sorted(options.items())))))
    return variants


def qwen3_launches(tokens: int = 8192) -> list:
    """The launches of one forward and backward of each kernel at the Qwen3-0.6B shape (hidden 1,024, 16 heads of
    128, MLP 3,072) under bf16 autocast over fp32 weights, in fp32, and with bf16 weights (rollouts, bf16 training);
    the rotation alone as Llama's heads take it; a pre-norm's bf16 output for two and three projections; the rotated
    q/k norm written in bf16 for attention; the MLP's pre-norm with the residual add before it; with bf16 weights,
    the rotations with bf16 tables (rounded as torch rotates in bf16); a decode step's heads (``decode_qkv``) in
    both, and its attention (``decode_attention``); a quantized base's int8 and NF4 weights made whole."""
    from hfnative.models import triton_decode, triton_dequant
    from hfnative.models.triton_decode import decode_attention, decode_qkv
    from hfnative.models.triton_kernels import (TritonResidualRMSNorm, TritonRMSNorm, TritonRope, TritonSiluGated,
                                               cross_entropy_rows)

    def run():
        for x_dtype, w_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                 (torch.bfloat16, torch.bfloat16)):
            w = torch.ones(1024, dtype=w_dtype, requires_grad=True)
            x = torch.zeros(tokens, 1024, dtype=x_dtype, requires_grad=True)
            TritonRMSNorm.apply(x, w, 1e-6, None).sum().backward()
            TritonRMSNorm.apply(x, w, 1e-6, 1.0).sum().backward()  # Gemma's (1 + w)
            if x_dtype == torch.float32:  # a pre-norm's bf16 output for q, k, v (and gate, up) under autocast
                for consumers in (2, 3):
                    outs = TritonRMSNorm.apply(x, w, 1e-6, None, None, None, torch.bfloat16, consumers)
                    torch.autograd.backward(outs, [torch.ones_like(out) for out in outs])
            # the MLP's pre-norm after the residual add (a bf16 update to the stream): fanned out in bf16 under
            # autocast, the norm's own output otherwise
            update = torch.zeros(tokens, 1024, dtype=torch.bfloat16, requires_grad=True)
            fanned = (torch.bfloat16, 2) if x_dtype == torch.float32 else (None, 1)
            outs = TritonResidualRMSNorm.apply(x, update, w, 1e-6, None, *fanned)
            torch.autograd.backward(outs, [torch.ones_like(out) for out in outs])
            q_w = torch.ones(128, dtype=w_dtype, requires_grad=True)
            q = torch.zeros(4, tokens // 4, 16, 128, dtype=x_dtype, requires_grad=True)
            cos = torch.zeros(4, tokens // 4, 128)
            if w_dtype == torch.float32:
                TritonRMSNorm.apply(q, q_w, 1e-6, None, cos, cos).sum().backward()
                if x_dtype == torch.bfloat16:  # written in the attention's dtype under autocast
                    TritonRMSNorm.apply(q, q_w, 1e-6, None, cos, cos, torch.bfloat16).sum().backward()
            else:  # bf16 weights: bf16 tables, the rotation rounded as torch's in bf16
                TritonRMSNorm.apply(q, q_w, 1e-6, None, cos.bfloat16(), cos.bfloat16()).sum().backward()
                TritonRope.apply(q, cos.bfloat16(), cos.bfloat16()).sum().backward()
            TritonRMSNorm.apply(q.transpose(1, 2), q_w, 1e-6, None).sum().backward()
            TritonRope.apply(q, cos, cos).sum().backward()  # Llama's heads, no norm before the rotation
            gate = torch.zeros(tokens, 3072, dtype=x_dtype, requires_grad=True)
            TritonSiluGated.apply(gate, gate.detach()).sum().backward()
            # the head's cross-entropy on a chunk of 883 tokens x 151,936 (the GPU policy's 2^27 logits), the
            # gradient written and not
            logits = torch.zeros(883, 151936, dtype=x_dtype)
            targets, valid = torch.zeros(883, dtype=torch.int64), torch.ones(883)
            cross_entropy_rows(logits, 1.0, targets, valid, torch.zeros(883, 151936, dtype=w_dtype))
            cross_entropy_rows(logits, 1.0, targets, valid, None)
            # a decode step's heads at batch 64 (a 320-slot cache): Qwen3's normed ones written in bf16 (float32
            # weights under autocast: float32 tables; bf16 weights: bf16 tables, rounded), Llama's rotated alone
            cache = torch.zeros(64, 8, 320, 128, dtype=torch.bfloat16)
            projection = torch.zeros(64, 1, 4096, dtype=torch.bfloat16)
            q, k, v = projection[..., :2048], projection[..., 2048:3072], projection[..., 3072:]
            tables = torch.zeros(64, 1, 128, dtype=torch.float32 if w_dtype == torch.float32 else torch.bfloat16)
            entry = torch.zeros(1, dtype=torch.int64)
            for weights in ((torch.ones(128, dtype=w_dtype),) * 2, None):
                decode_qkv(q, k, v, 16, weights, 1e-6, None, tables, tables, cache, cache, entry)
            # its attention (the cache read from each row's padding to the slot written; a ring's by entry), the
            # float32 cache of a model decoded in float32; Gemma 3's heads of 256 (in float32: blocks of 16 entries)
            pad = torch.zeros(64, dtype=torch.int64)
            wide = torch.zeros(64, 4, 320, 256, dtype=torch.bfloat16)
            for heads in (cache, cache.float(), wide, wide.float()):
                query = torch.zeros(64, 2 * heads.shape[1], 1, heads.shape[-1], dtype=heads.dtype)
                for ring in (None, torch.zeros(320, dtype=torch.int64)):
                    decode_attention(query, heads, heads, pad, entry, ring, 0.088)
            # at batch 8 each row's cache read in 4 parts, then joined
            query = torch.zeros(8, 16, 1, 128, dtype=torch.bfloat16)
            triton_decode._decode_attention(query, cache[:8], cache[:8], pad[:8], entry, None, 0.088, 4)
            # a quantized base's weight made whole at the MLP's shape (3,072 x 1,024): int8 rows in the matmul's
            # dtype, NF4 in float32 (bitsandbytes' default compute dtype) and bf16 to bf16 and float32
            rows = torch.zeros(3072, 1024, dtype=torch.int8)
            triton_dequant.int8_values(rows, torch.ones(3072), x_dtype, 1 / 127)
            for table in (torch.float32, torch.bfloat16):
                nf4 = types.SimpleNamespace(
                    shape=rows.shape, block_size=64, scaler_block_size=256,
                    quantized_data=torch.zeros(rows.numel() // 2, dtype=torch.uint8),
                    quantized_scalers=torch.zeros(rows.numel() // 64, dtype=torch.int8),
                    quantization_factor=torch.ones(rows.numel() // 64 // 256, dtype=table),
                    scaler_mean=torch.zeros((), dtype=table), nf4=torch.zeros(16, dtype=table))
                triton_dequant.nf4_values(nf4, x_dtype)

    return recorded_launches(run)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter's kernels do not compile")
    for line in compile_for_sm90(qwen3_launches()):
        print(line)
