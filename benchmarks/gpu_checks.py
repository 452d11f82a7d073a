"""Numerical GPU checks: logits parity against transformers on a device and dtype, and the attention kernels.

    python benchmarks/gpu_checks.py parity --device cuda --dtype fp32
    python benchmarks/gpu_checks.py parity --device cuda --dtype bf16
    python benchmarks/gpu_checks.py attention --device cuda
    python benchmarks/gpu_checks.py generation --device cuda
    python benchmarks/gpu_checks.py generation --device cuda --compiled
    python benchmarks/gpu_checks.py kernels --device cuda
    python benchmarks/gpu_checks.py compile --device cuda

Both run on CPU too (that is how they are tested without a GPU). Each output line is one comparison,
``PASS`` / ``FAIL`` / ``SKIP``, its name and numbers; the exit status is 1 when any comparison failed.

parity: the tests' tiny transformers models (tests/hf_configs.py, one per family unless --all), saved in
fp32, loaded by transformers (SDPA, or eager where its model has no SDPA) and by hfnative on ``--device``,
compared on the parity batches of converters/parity.py (plain, right- and left-padded, packed; the packed row's
reference is each document run alone). fp32: max |Δlogit| <= 1e-5 and KL <= 1e-9,
DESIGN.md's contract. bf16: two bf16 implementations differ by rounding, not by a fixed bound, so both are
measured against transformers' fp32 logits and ours may be off by at most twice transformers' own bf16
error (or 1e-2, about one bf16 step at magnitude 1, whichever is larger).

attention: (1) each SDPA backend on a causal batch against fp32 math; (2) a packed row of documents through
``torch.nn.attention.varlen.varlen_attn`` and ``flex_attention`` against SDPA with the dense block-diagonal
mask; (3) hfnative's model with SDPA forced to flash / efficient / cuDNN against math; (4) hfnative's own
variable-length path (when the model offers ``attention_implementation = "varlen"``) against its dense-mask
path on packed and padded batches. Low-precision results follow the bf16 rule above.

generation: the native rollout engine (``gpu_rollout_checks.py``) as each way runs its decode step, and as a trainer
uses it between optimizer steps; ``--compiled``: the compiled decode step alone (its compiles from a cold cache take
minutes, so it is a check of its own).

compile: a compiled block's activation checkpoint inside its graph keeps what it is told to on this torch, and packed
batches compile into one graph a block around ``varlen_attn`` (``gpu_compile_checks.py``).

kernels: the Triton kernels (hfnative/models/triton_kernels.py: RMSNorm, the rotated q/k norm, the rotation alone,
the SiLU-gated unit, a pre-norm's one bf16 output for q, k and v, the head's cross-entropy) at the Qwen3-0.6B shape
against the op sequences they replace, forward and gradients, and each way's forward + backward time (on CPU: small
shapes, only under ``TRITON_INTERPRET=1`` with Triton importable).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

import hfnative  # noqa: F401  (before anything imports torchao: hfnative quiets its import-time lines)
from hfnative.converters.loading import load_pretrained
from hfnative.converters.parity import _per_document_logits, _reference_attention, compare_logits, parity_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_configs import CONFIGS, ONE_PER_FAMILY, save_hf_model  # noqa: E402  (the parity tests' models)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_MAX_ABS, FP32_KL = 1e-5, 1e-9  # DESIGN.md's parity contract
LOW_PRECISION_FLOOR = 1e-2  # about one bf16 step at magnitude 1: below it a difference is rounding


class Tally:
    """Prints one line per comparison and counts the failures."""

    def __init__(self):
        self.failures = 0

    def __call__(self, status: str, name: str, detail: str = "") -> None:
        self.failures += status == "FAIL"
        print(f"{status:<5} {name:<56} {detail}", flush=True)

    def check(self, ok: bool, name: str, detail: str) -> None:
        self("PASS" if ok else "FAIL", name, detail)


def low_precision_ok(error: float, reference_error: float) -> bool:
    """A low-precision result is as good as the reference's own low-precision result, up to 2x."""
    return error <= max(2 * reference_error, LOW_PRECISION_FLOOR)


def _on(inputs: dict, device: torch.device) -> dict:
    return {name: tensor.to(device) for name, tensor in inputs.items()}


def _reference_logits(reference, case: str, inputs: dict) -> torch.Tensor:
    """transformers' fp32 logits; a packed row as its documents run one by one (some transformers models, GPT-OSS
    among them, attend across the documents of a packed row)."""
    if case == "packed":
        return _per_document_logits(reference, inputs).float()
    return reference(**inputs, use_cache=False).logits.float()


def _native_logits(model, inputs: dict) -> torch.Tensor:
    return model(inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                 position_ids=inputs.get("position_ids")).logits.float()


# ------------------------------------------------------------------------------------------------
# parity


def parity(tally: Tally, device: torch.device, dtype: torch.dtype, names: list[str], batch: int = 3, seq_len: int = 16) -> None:
    for name in names:
        with tempfile.TemporaryDirectory() as folder:
            reference = save_hf_model(name, folder).to(device)  # fp32, as the tests build it
            reference_low = None
            if dtype != torch.float32:
                reference_low = transformers.AutoModelForCausalLM.from_pretrained(
                    folder, dtype=dtype, attn_implementation=_reference_attention(reference.config))
                reference_low = reference_low.to(device).eval()
            native = load_pretrained(folder, dtype=dtype, device=device).model.eval()
            with torch.no_grad():
                for case, inputs, valid in parity_batches(native.args.vocab_size, batch, seq_len):
                    inputs, valid = _on(inputs, device), valid.to(device)
                    expected = _reference_logits(reference, case, inputs)
                    ours = compare_logits(case, expected, _native_logits(native, inputs), valid)
                    label = f"parity {name} {case}"
                    if reference_low is None:
                        tally.check(ours.max_abs_diff <= FP32_MAX_ABS and ours.kl <= FP32_KL, label,
                                    f"max|Δ| {ours.max_abs_diff:.2e}  KL {ours.kl:.1e}")
                        continue
                    theirs = compare_logits(case, expected, _reference_logits(reference_low, case, inputs), valid)
                    tally.check(low_precision_ok(ours.max_abs_diff, theirs.max_abs_diff), label,
                                f"vs fp32: ours max|Δ| {ours.max_abs_diff:.2e} KL {ours.kl:.1e}, "
                                f"transformers {theirs.max_abs_diff:.2e} KL {theirs.kl:.1e}")


# ------------------------------------------------------------------------------------------------
# attention kernels


def _milliseconds(function, device: torch.device, repeats: int = 5) -> float:
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    function()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def _random_qkv(device, dtype, heads: int, kv_heads: int, seq_len: int, head_dim: int = 128, batch: int = 1):
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, seq_len, head_dim, device=device, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, device=device, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, device=device, generator=generator).to(dtype)
    return q, k, v


def _fp32_math(q, k, v, **kwargs) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)


def sdpa_backends(tally: Tally, device: torch.device, dtype: torch.dtype, seq_len: int) -> None:
    """Every SDPA backend on a causal batch (GQA) against fp32 math."""
    q, k, v = _random_qkv(device, dtype, heads=8, kv_heads=2, seq_len=seq_len, batch=2)
    expected = _fp32_math(q, k, v, is_causal=True, enable_gqa=True)
    math_error = (_fp32_math(q, k, v, is_causal=True, enable_gqa=True).to(dtype).float() - expected).abs().max().item()
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        label = f"sdpa {backend.name.lower()} causal {tuple(q.shape)} {str(dtype)[6:]}"
        try:
            error = (run().float() - expected).abs().max().item()
        except RuntimeError as err:
            tally("SKIP", label, f"no kernel here: {str(err).splitlines()[0][:100]}")
            continue
        ok = error <= FP32_MAX_ABS if dtype == torch.float32 else low_precision_ok(error, math_error)
        tally.check(ok, label, f"max|Δ| vs fp32 math {error:.2e}, {_milliseconds(run, device):.2f} ms")


def packed_kernels(tally: Tally, device: torch.device, dtype: torch.dtype, lengths: list[int]) -> None:
    """One packed row of documents: varlen_attn and flex_attention against SDPA with the dense mask."""
    seq_len, heads, kv_heads = sum(lengths), 8, 2
    q, k, v = _random_qkv(device, dtype, heads, kv_heads, seq_len)
    documents = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    positions = torch.arange(seq_len, device=device)
    mask = (documents[:, None] == documents[None, :]) & (positions[None, :] <= positions[:, None])
    expected = _fp32_math(q, k, v, attn_mask=mask, enable_gqa=True)
    dense = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
    dense_error = (dense().float() - expected).abs().max().item()
    tally.check(dense_error <= FP32_MAX_ABS if dtype == torch.float32 else dense_error <= LOW_PRECISION_FLOOR,
                f"packed {lengths} dense-mask sdpa", f"max|Δ| vs fp32 math {dense_error:.2e}, {_milliseconds(dense, device):.2f} ms")

    def judge(name: str, run) -> None:
        error = (run().float() - expected).abs().max().item()
        ok = error <= FP32_MAX_ABS if dtype == torch.float32 else low_precision_ok(error, dense_error)
        tally.check(ok, f"packed {lengths} {name}", f"max|Δ| vs fp32 math {error:.2e}, {_milliseconds(run, device):.2f} ms")

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        tally("SKIP", "packed varlen_attn", f"not available: torch {torch.__version__} has no torch.nn.attention.varlen")
    else:
        if device.type != "cuda" or dtype == torch.float32:
            tally("SKIP", "packed varlen_attn", "not available: flash kernels need CUDA and bf16/fp16")
        else:
            cu_seq = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
            parameters = inspect.signature(varlen_attn).parameters
            causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
            repeat = 1 if "enable_gqa" in parameters else heads // kv_heads
            extra = {"enable_gqa": True} if "enable_gqa" in parameters else {}

            def tokens(x, times=1):  # [1, h, S, d] -> [S, h * times, d]
                return x[0].repeat_interleave(times, dim=0).transpose(0, 1)

            def run_varlen():
                out = varlen_attn(tokens(q), tokens(k, repeat), tokens(v, repeat), cu_seq, cu_seq, max(lengths),
                                  max(lengths), **causal, **extra)
                return out.transpose(0, 1)[None]

            judge("varlen_attn", run_varlen)

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        tally("SKIP", "packed flex_attention", f"not available in torch {torch.__version__}")
        return

    def document_causal(b, h, q_index, kv_index):
        return (documents[q_index] == documents[kv_index]) & (kv_index <= q_index)

    block_mask = create_block_mask(document_causal, None, None, seq_len, seq_len, device=device)
    flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention  # eager is the reference path on CPU
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
    judge("flex_attention" + (" (compiled)" if device.type == "cuda" else ""),
          lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True))


def model_attention(tally: Tally, device: torch.device, dtype: torch.dtype, config: str = "qwen3-gqa") -> None:
    """hfnative's model with each SDPA backend forced, and its variable-length path against its dense one."""
    with tempfile.TemporaryDirectory() as folder:
        save_hf_model(config, folder)
        model = load_pretrained(folder, dtype=dtype, device=device).model.eval()
        model_fp32 = load_pretrained(folder, dtype=torch.float32, device=device).model.eval()
    vocab = model.args.vocab_size
    ids = torch.randint(0, vocab, (2, 128), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        expected = _native_logits(model_fp32, {"input_ids": ids})
        with sdpa_kernel(SDPBackend.MATH):
            math_error = (_native_logits(model, {"input_ids": ids}) - expected).abs().max().item()
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            label = f"model {config} plain batch, sdpa {backend.name.lower()}"
            try:
                with sdpa_kernel(backend):
                    error = (_native_logits(model, {"input_ids": ids}) - expected).abs().max().item()
            except RuntimeError as err:
                # a plain causal batch is what flash is for: on CUDA in bf16 it must take it
                must = backend == SDPBackend.FLASH_ATTENTION and device.type == "cuda" and dtype != torch.float32
                tally("FAIL" if must else "SKIP", label, f"no kernel: {str(err).splitlines()[0][:100]}")
                continue
            ok = error <= FP32_MAX_ABS if dtype == torch.float32 else low_precision_ok(error, math_error)
            tally.check(ok, label, f"max|Δ| vs fp32 {error:.2e} (math backend {math_error:.2e})")

        if getattr(model, "attention_implementation", None) is None:
            tally("SKIP", "hfnative varlen path", "not available: hfnative.models offers no variable-length attention")
            return
        for case, inputs, valid in parity_batches(vocab, batch=3, seq_len=64, seed=1):
            if case == "plain":
                continue
            inputs, valid = _on(inputs, device), valid.to(device)
            model_fp32.attention_implementation = "sdpa"
            expected = _native_logits(model_fp32, inputs)
            errors = {}
            for implementation in ("sdpa", "varlen"):
                model.attention_implementation = implementation
                errors[implementation] = (_native_logits(model, inputs) - expected)[valid].abs().max().item()
            ok = (errors["varlen"] <= FP32_MAX_ABS if dtype == torch.float32
                  else low_precision_ok(errors["varlen"], errors["sdpa"]))
            tally.check(ok, f"hfnative varlen path, {case}",
                        f"max|Δ| vs fp32 dense: varlen {errors['varlen']:.2e}, dense mask {errors['sdpa']:.2e}")


def attention(tally: Tally, device: torch.device, dtype: torch.dtype) -> None:
    seq_len = 2048 if device.type == "cuda" else 256
    sdpa_backends(tally, device, dtype, seq_len)
    packed_kernels(tally, device, dtype, [seq_len * 3 // 8, seq_len // 2, seq_len // 8])
    model_attention(tally, device, dtype)
    ring_blocks(tally, device, dtype, seq_len)


def ring_blocks(tally: Tally, device: torch.device, dtype: torch.dtype, seq_len: int) -> None:
    """Context parallelism's ring attention on one device (a plan of one rank: its two chunks, a causal block each and
    a full block between them, merged by their log-sum-exps; packed, the blocks that documents cut in as one kernel
    call per document's segment) through the device's block kernel (on CUDA in bf16 aten's flash kernel and its
    backward, fed the merged output and log-sum-exp) and through the explicit softmax, against attention over the
    whole sequence in fp32: the output and the gradients of q, k and v; judged against SDPA in this dtype (causal over
    the sequence, or per document: the device's fused kernel either way). On CUDA in bf16 every masked block of the
    packed case must take the flash kernel a document at a time."""
    from hfnative.models.attention import document_ids
    from hfnative.parallel.context_parallel import plan_context_parallel, ring_attention
    from hfnative.parallel.ring_blocks import block_kernel

    q, k, v = _random_qkv(device, dtype, heads=8, kv_heads=2, seq_len=seq_len, batch=2)
    grad = torch.randn(q.shape, device=device, generator=torch.Generator(device=device).manual_seed(5)).to(dtype)
    scale = q.shape[-1] ** -0.5

    def run(attend, *inputs):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = attend(*leaves)
        (out.float() * grad.float()).sum().backward()
        return [out.detach().float()] + [x.grad.float() for x in leaves]

    lengths = [seq_len * 3 // 8, seq_len // 2, seq_len // 8]  # packed: documents cross the chunks' boundary
    positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(2, seq_len)
    documents = document_ids(positions)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    for case, doc_BS in (("causal", None), ("packed", documents)):
        dense = {} if doc_BS is None else {
            "attn_mask": (causal & (doc_BS[:, :, None] == doc_BS[:, None, :]))[:, None].to(device)}
        causal_kw = {"is_causal": True} if doc_BS is None else {}

        def whole(q, k, v):  # the device's fused kernel: causal over the sequence, or per document (no mask)
            if doc_BS is None:
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=scale, is_causal=True)
            bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], enable_gqa=True,
                                                             scale=scale, is_causal=True)
                              for a, b in zip(bounds, bounds[1:])], dim=2)

        expected = run(lambda q, k, v: _fp32_math(q, k, v, enable_gqa=True, scale=scale, **dense, **causal_kw),
                       q, k, v)
        bar = [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(run(whole, q, k, v), expected)]
        for kernel, name in ((None, "the device's block kernel"), ("math", "explicit softmax")):
            plan = plan_context_parallel(seq_len, 1, 0, None, doc_BS=doc_BS)
            plan.kernel = kernel
            label = f"ring attention {case} {tuple(q.shape)} {str(dtype)[6:]}, {name}"
            masked = [block for block in plan.blocks["global"] if block.kind == "masked"]
            wanted = "flash_cuda_segments" if device.type == "cuda" and dtype != torch.float32 else None
            if kernel is None and wanted and any(block_kernel(q, "masked", None, b.mask) != wanted for b in masked):
                tally("FAIL", label, "a packed block did not take the flash kernel a document at a time")
                continue
            try:
                got = run(lambda q, k, v: ring_attention(q, k, v, plan, plan.blocks["global"], scale), q, k, v)
            except RuntimeError as err:
                tally("FAIL", label, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
                continue
            errors = [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(got, expected)]
            ok = max(errors) <= 1e-5 if dtype == torch.float32 else low_precision_ok(max(errors), max(bar))
            milliseconds = _milliseconds(
                lambda: run(lambda q, k, v: ring_attention(q, k, v, plan, plan.blocks["global"], scale), q, k, v), device)
            tally.check(ok, label, "relative max|Δ| vs fp32 (out, dq, dk, dv): " + ", ".join(f"{e:.1e}" for e in errors)
                        + "; SDPA in this dtype: " + ", ".join(f"{e:.1e}" for e in bar)
                        + f"; forward + backward {milliseconds:.2f} ms (SDPA {_milliseconds(lambda: run(whole, q, k, v), device):.2f})")


# ------------------------------------------------------------------------------------------------
# Triton kernels


def _kernel_cases(device: torch.device):
    """(name, inputs, Triton function, op sequence) at the Qwen3-0.6B shape on CUDA (batch 4 x 2,048 tokens: hidden
    1,024, 16 query heads of 128, MLP 3,072, vocabulary 151,936), small on CPU."""
    import os

    from hfnative.device_policy import use_device_policy
    from hfnative.losses import IGNORE_INDEX
    from hfnative.losses.cross_entropy import fused_linear_cross_entropy
    from hfnative.models import layers, triton_decode, triton_kernels
    from hfnative.models.rope import apply_rotary
    from hfnative.models.triton_kernels import TritonResidualRMSNorm, TritonRMSNorm, TritonRope, TritonSiluGated

    cuda = device.type == "cuda"
    tokens, dim, heads, head_dim, hidden = (8192, 1024, 16, 128, 3072) if cuda else (300, 40, 3, 24, 56)
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, generator=generator) * scale

    def norm(x, w):
        return TritonRMSNorm.apply(x, w, 1e-6, None)

    def norm_ops(x, w):
        return layers._RMSNormFunction.apply(x, w, 1e-6, None)

    def gated_ops(gate, up):
        return layers._GatedActivation.apply(gate, up, "silu")

    angles = randn(4, tokens // 4, head_dim // 2, scale=3)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    def rotations(cos, sin):
        """(norm + rotation kernel, its op sequence, rotation kernel, its op sequence) with these tables."""
        def norm_rope(x_BSHd, w):
            return TritonRMSNorm.apply(x_BSHd, w, 1e-6, None, cos, sin).transpose(1, 2)

        def norm_rope_ops(x_BSHd, w):
            return apply_rotary(layers._RMSNormFunction.apply(x_BSHd.transpose(1, 2), w, 1e-6, None), cos, sin)

        def rope(x_BSHd):
            return TritonRope.apply(x_BSHd, cos, sin).transpose(1, 2)

        def rope_ops(x_BSHd):
            return apply_rotary(x_BSHd.transpose(1, 2), cos, sin)

        return norm_rope, norm_rope_ops, rope, rope_ops

    norm_rope, norm_rope_ops, rope, rope_ops = rotations(cos, sin)

    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        hidden_states = randn(tokens, dim, scale=3).to(dtype)
        yield f"rms_norm {label} [{tokens}, {dim}]", (hidden_states, randn(dim, scale=0.3) + 1), norm, norm_ops
        per_head = randn(4, tokens // 4, heads, head_dim, scale=3).to(dtype).transpose(1, 2)  # [B, H, S, d] view
        yield (f"q_norm {label} [4, {heads}, {tokens // 4}, {head_dim}]", (per_head, randn(head_dim, scale=0.3) + 1),
               norm, norm_ops)
        yield (f"q_norm + rope {label} [4, {tokens // 4}, {heads}, {head_dim}]",
               (per_head.transpose(1, 2).contiguous(), randn(head_dim, scale=0.3) + 1), norm_rope, norm_rope_ops)
        yield (f"rope {label} [4, {tokens // 4}, {heads}, {head_dim}]", (per_head.transpose(1, 2).contiguous(),),
               rope, rope_ops)
        yield (f"silu_gated {label} [{tokens}, {hidden}]",
               (randn(tokens, hidden, scale=4).to(dtype), randn(tokens, hidden).to(dtype)),
               TritonSiluGated.apply, gated_ops)

    # a model loaded in bf16: the q/k norm's weight and the rotary tables in bf16 too; torch rotates in bf16, rounding
    # each product and the sum, and so do the kernels (``ROUNDED``)
    norm_rope16, norm_rope16_ops, rope16, rope16_ops = rotations(cos.bfloat16(), sin.bfloat16())

    heads_bf16 = randn(4, tokens // 4, heads, head_dim, scale=3).bfloat16()
    yield (f"q_norm + rope bf16 weights and tables [4, {tokens // 4}, {heads}, {head_dim}]",
           (heads_bf16, (randn(head_dim, scale=0.3) + 1).bfloat16()), norm_rope16, norm_rope16_ops)
    yield f"rope bf16 tables [4, {tokens // 4}, {heads}, {head_dim}]", (heads_bf16,), rope16, rope16_ops

    # a pre-norm's output for the query, key and value projections under bf16 autocast (``RMSNorm.for_linears``): one
    # bf16 output, a view for each layer and their gradients summed in the backward kernel, against the norm's float32
    # output that autocast casts for each layer (both with the Triton norm; the outputs concatenated)
    projections = [randn(width, dim, scale=dim ** -0.5) for width in (heads * head_dim, dim, dim)]  # kv: 8 x 128

    def qkv(fanned: bool):
        def run(x, w, *weights):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                if fanned:
                    inputs = TritonRMSNorm.apply(x, w, 1e-6, None, None, None, torch.bfloat16, 3)
                else:
                    inputs = (TritonRMSNorm.apply(x, w, 1e-6, None),) * 3
                return torch.cat([F.linear(inp, weight) for inp, weight in zip(inputs, weights)], -1)
        return run

    yield (f"pre-norm for q, k, v bf16 autocast [{tokens}, {dim}]",
           (randn(tokens, dim, scale=3), randn(dim, scale=0.3) + 1, *projections), qkv(True), qkv(False))

    # the residual add before the MLP's pre-norm (``RMSNorm.after_residual``): the float32 stream plus the attention's
    # bf16 output, and the norm of the sum for the gate and up projections, in one kernel each way against the add
    # then the norm (the Triton norm both ways; the sum and the projections concatenated)
    gate_up = [randn(hidden, dim, scale=dim ** -0.5) for _ in range(2)]

    def residual_gate_up(fused: bool):
        def run(x, update, w, *weights):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                if fused:
                    h, *inputs = TritonResidualRMSNorm.apply(x, update, w, 1e-6, None, torch.bfloat16, 2)
                else:
                    h = x + update
                    inputs = TritonRMSNorm.apply(h, w, 1e-6, None, None, None, torch.bfloat16, 2)
                return torch.cat([h, *(F.linear(inp, weight) for inp, weight in zip(inputs, weights))], -1)
        return run

    yield (f"residual add + pre-norm for gate, up bf16 autocast [{tokens}, {dim}]",
           (randn(tokens, dim, scale=3), randn(tokens, dim).bfloat16(), randn(dim, scale=0.3) + 1, *gate_up),
           residual_gate_up(True), residual_gate_up(False))

    # the rotated q norm written in bf16 for attention under autocast, against the float32 output cast after
    def norm_rope_for_attention(x_BSHd, w):
        return TritonRMSNorm.apply(x_BSHd, w, 1e-6, None, cos, sin, torch.bfloat16).transpose(1, 2)

    def norm_rope_then_cast(x_BSHd, w):
        return norm_rope(x_BSHd, w).to(torch.bfloat16)

    yield (f"q_norm + rope written in bf16 autocast [4, {tokens // 4}, {heads}, {head_dim}]",
           (randn(4, tokens // 4, heads, head_dim, scale=3).bfloat16(), randn(head_dim, scale=0.3) + 1),
           norm_rope_for_attention, norm_rope_then_cast)

    # a decode step's heads in one kernel (``decode_qkv``: Qwen3's q/k norms, the rotation, both cache writes) at batch
    # 64 under bf16 autocast, against the training path's norm-and-rotation kernels and the cache's index_copy writes
    # (no gradients: decoding); the query heads, and the cache entry written, concatenated
    batch, kv_heads, slots = (64, 8, 320) if cuda else (4, 1, 12)
    entry = torch.tensor([slots // 2], device=device)
    angles_B1d = randn(batch, 1, head_dim, scale=3)

    def decode(one_kernel: bool):
        @torch.no_grad()
        def run(xq, xk, xv, q_weight, k_weight):
            keys = torch.zeros(batch, kv_heads, slots, head_dim, dtype=torch.bfloat16, device=device)
            values = torch.zeros_like(keys)
            cos_B1d, sin_B1d = angles_B1d.cos(), angles_B1d.sin()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                if one_kernel:
                    q = triton_decode.decode_qkv(xq, xk, xv, heads, (q_weight, k_weight), 1e-6, None, cos_B1d,
                                                  sin_B1d, keys, values, entry)
                else:
                    q, k = (TritonRMSNorm.apply(x.view(batch, 1, -1, head_dim), w, 1e-6, None, cos_B1d, sin_B1d,
                                                torch.bfloat16).transpose(1, 2) for x, w in ((xq, q_weight), (xk, k_weight)))
                    keys.index_copy_(2, entry, k.to(keys.dtype))
                    values.index_copy_(2, entry, xv.view(batch, 1, kv_heads, head_dim).transpose(1, 2).to(values.dtype))
            return torch.cat([q.flatten(), keys[:, :, entry].flatten(), values[:, :, entry].flatten()])
        return run

    yield (f"decode_qkv bf16 autocast [{batch}, 1, {heads} + 2 x {kv_heads} heads of {head_dim}]",
           (randn(batch, 1, heads * head_dim, scale=3).bfloat16(),
            randn(batch, 1, kv_heads * head_dim, scale=3).bfloat16(), randn(batch, 1, kv_heads * head_dim).bfloat16(),
            randn(head_dim, scale=0.3) + 1,
            randn(head_dim, scale=0.3) + 1), decode(True), decode(False))

    # a decode step's attention in one kernel (``decode_attention``: each row's entries from its padding to the slot
    # written, no mask) in bf16, against the path without it: SDPA over the cache read up to the next multiple of 64
    # slots, under the additive mask; at batch 64 (the rows x heads fill the GPU) and at batch 8 with a long cache
    # (each row's cache read in parts, ``attention_splits``)
    def attend(kernel: bool, rows: int, slot: int, read: int, pad_B: torch.Tensor):
        slot_1 = torch.tensor([slot], device=device)

        @torch.no_grad()
        def run(q, keys, values):
            if kernel:
                return triton_decode.decode_attention(q, keys, values, pad_B, slot_1, None, head_dim**-0.5)
            entries = torch.arange(read, device=device)
            seen = (entries[None] >= pad_B[:, None]) & (entries[None] <= slot)
            bias = torch.where(seen, 0.0, float("-inf")).to(q.dtype)[:, None, None, :]
            out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, heads // kv_heads, head_dim),
                                                 keys[:, :, :read], values[:, :, :read], attn_mask=bias,
                                                 scale=head_dim**-0.5)
            return out.reshape(rows, heads, 1, head_dim)
        return run

    for rows, cache_slots in ((batch, slots), (8, 4096)) if cuda else ((batch, slots),):
        slot = cache_slots * 5 // 8
        read = min(cache_slots, -(-(slot + 1) // 64) * 64)
        pad_B = torch.randint(0, max(slot // 4, 1), (rows,), device=device, generator=generator)
        splits = triton_decode.attention_splits(rows, kv_heads, cache_slots, device)
        yield (f"decode_attention bf16 [{rows}, {heads} heads of {head_dim}] x {cache_slots} slots ({kv_heads} kv "
               f"heads, {splits} part{'s' if splits > 1 else ''}), rows of {slot + 1 - pad_B.max().item()}..{slot + 1} "
               "entries",
               # (values around 2: an output well away from 0, so the shared bf16 tolerance of its scale holds)
               (randn(rows, heads, 1, head_dim, scale=3).bfloat16(),
                randn(rows, kv_heads, cache_slots, head_dim).bfloat16(),
                (randn(rows, kv_heads, cache_slots, head_dim) + 2).bfloat16()),
               attend(True, rows, slot, read, pad_B), attend(False, rows, slot, read, pad_B))

    # the fused head's cross-entropy, as SFT runs it under bf16 autocast (the GPU policy's chunks and blocks), with the
    # kernel and with torch's ops: the loss sum and both gradients; half the rows a prompt (ignored)
    vocab = 151936 if cuda else 5000
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    targets[::2] = IGNORE_INDEX

    def cross_entropy(switch: str):
        def loss(h_ND, w_VD):
            os.environ[triton_kernels.ENV_SWITCH] = switch
            try:  # (the GPU's policy on a CPU rehearsal too)
                with use_device_policy("gpu"), torch.autocast(device.type, dtype=torch.bfloat16):
                    return fused_linear_cross_entropy(h_ND, w_VD, targets, masked=True).loss_sum
            finally:
                os.environ.pop(triton_kernels.ENV_SWITCH)
        return loss

    yield (f"cross_entropy bf16 autocast [{tokens}, {dim}] x [{vocab}, {dim}]",
           (randn(tokens, dim), randn(vocab, dim, scale=0.05)), cross_entropy("1"), cross_entropy("0"))


def kernels(tally: Tally, device: torch.device) -> None:
    """The Triton kernels against the op sequences they replace: forward and both gradients (fp32: 1e-5 relative;
    bf16 activations: within one bf16 step of the tensor's scale, and the share of elements that differ at all),
    then each way's forward + backward time."""
    import os

    from hfnative.models import triton_kernels

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        tally("SKIP", "triton kernels", "on CPU they run only under Triton's interpreter (TRITON_INTERPRET=1)")
        return
    if not triton_kernels.available():
        tally("SKIP", "triton kernels", "Triton cannot be imported here")
        return
    # on a CPU the interpreter's bf16 casts round as a GPU's do (triton_kernels._mend_interpreter)
    for name, inputs, fused, reference in _kernel_cases(device):
        _check_kernel(tally, device, name, inputs, fused, reference)
        if device.type == "cuda" and name.startswith(WARPS_SWEPT):
            _warps_sweep(tally, device, name, inputs, fused)
    dequantization(tally, device)


def dequantization(tally: Tally, device: torch.device) -> None:
    """A quantized base's weight made whole for a matmul (``hfnative.models.triton_dequant``) at about Qwen3-8B's MLP
    shape (12,290 x 4,096: the last program part-filled, NF4's scales in blocks of 128; small on CPU): int8 rows to bf16
    and float32, NF4 in float32 to bf16 and float32, NF4 in bf16 to bf16; the kernel against the op sequence it
    replaces (int8: bitsandbytes' float32 formula then a cast; NF4: torchao's ``get_original_weight`` then a cast),
    equal to the bit, and each one's time; the kernel's GB/s over the bytes it must move."""
    from hfnative.device_policy import use_device_policy
    from hfnative.models import triton_dequant
    from hfnative.peft.quantize import to_nf4_parameter

    rows, cols = (12290, 4096) if device.type == "cuda" else (97, 256)
    generator = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(rows, cols, device=device, generator=generator) * 0.02
    data = torch.randint(-127, 128, (rows, cols), device=device, generator=generator, dtype=torch.int8)
    absmax = torch.rand(rows, device=device, generator=generator)
    cases = []
    for out in (torch.bfloat16, torch.float32):
        cases.append((f"int8 rows to {str(out)[6:]}", lambda out=out: triton_dequant.int8_supported(data, absmax, out),
                      lambda out=out: triton_dequant.int8_values(data, absmax, out, 1 / 127),
                      lambda out=out: ((data * absmax[:, None]) * (1 / 127)).to(out),
                      rows * cols * (1 + out.itemsize)))
    for table, out in ((torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
        nf4 = to_nf4_parameter(weight, table)
        cases.append((f"NF4 in {str(table)[6:]} to {str(out)[6:]}",
                      lambda nf4=nf4, out=out: triton_dequant.nf4_supported(nf4, out),
                      lambda nf4=nf4, out=out: triton_dequant.nf4_values(nf4, out),
                      lambda nf4=nf4, out=out: nf4.get_original_weight().to(out), rows * cols * (0.5 + out.itemsize)))
    with use_device_policy("gpu"):
        for name, supported, fused, reference, moved in cases:  # moved: bytes read and written at the fewest
            label = f"triton dequantize {name} [{rows}, {cols}]"
            if not supported():
                tally.check(False, label, "the kernel does not take this weight here")
                continue
            got, want = fused(), reference()
            fused_ms = _milliseconds(fused, device, repeats=10 if device.type == "cuda" else 1)
            torch_ms = _milliseconds(reference, device, repeats=10 if device.type == "cuda" else 1)
            tally.check(torch.equal(got, want), label,
                        f"elements differing {(got != want).float().mean().item():.1%}; {fused_ms:.3f} ms vs torch "
                        f"{torch_ms:.3f} ms (x{torch_ms / max(fused_ms, 1e-9):.2f}); at least {moved / 1e6:.1f} MB "
                        f"moved: {moved / (fused_ms * 1e6):.0f} GB/s")


def _run_timed(function, inputs, device: torch.device):
    """``function`` on fresh leaves of ``inputs``: (its output, the inputs' gradients for a fixed output gradient,
    none for a forward without them (decoding's), milliseconds a forward + backward)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]  # clone keeps a view's layout
    out = function(*leaves)
    grad_out = torch.ones_like(out).normal_(generator=torch.Generator(device=device).manual_seed(1))
    grads = torch.autograd.grad(out, leaves, grad_out) if out.requires_grad else ()

    def step(backward=out.requires_grad):
        out = function(*leaves)
        if backward:
            torch.autograd.grad(out, leaves, grad_out)

    return out, grads, _milliseconds(step, device, repeats=10 if device.type == "cuda" else 1)


def _check_kernel(tally: Tally, device: torch.device, name: str, inputs, fused, reference) -> None:
    """One of ``_kernel_cases``: the kernel and the op sequence, their outputs, gradients and times."""
    (out, grads, fused_ms), (want, want_grads, torch_ms) = (_run_timed(fused, inputs, device),
                                                            _run_timed(reference, inputs, device))
    worst, differing, ok = 0.0, 0.0, True
    for got, expected in zip((out, *grads), (want, *want_grads)):
        ok &= got.dtype == expected.dtype and got.shape == expected.shape
        error = (got.float() - expected.float()).abs().max().item()
        scale = expected.float().abs().max().item()
        if inputs[0].dtype == torch.float32 and "autocast" not in name:
            ok &= torch.allclose(got, expected, rtol=1e-5, atol=1e-6 * scale)
        else:  # one bf16 step of the scale
            ok &= error <= 2.0**-8 * scale
        worst = max(worst, error / max(scale, 1e-30))
        differing = max(differing, (got != expected).float().mean().item())
    # (the decode kernels read or write a few entries of their cache inputs, not all of them: no bound from those)
    moved = None if name.startswith("decode_") else _bytes_moved(inputs, out, grads)
    tally.check(ok, f"triton {name}", f"max |diff| / scale {worst:.1e}, elements differing {differing:.1%}; "
                                    f"{'fwd+bwd' if grads else 'fwd'} {fused_ms:.3f} ms vs torch {torch_ms:.3f} ms "
                                    f"(x{torch_ms / max(fused_ms, 1e-9):.2f})"
                                    + ("" if moved is None else f"; at least {moved / 1e6:.1f} MB moved: "
                                                                f"{moved / (fused_ms * 1e6):.0f} GB/s"))


def _bytes_moved(inputs, out: torch.Tensor, grads) -> int:
    """The fewest bytes a kernel's forward (and backward, with ``grads``) can move: the inputs read and the output
    written; then the output's gradient and the inputs read again, the inputs' gradients written. What a time over
    it says is how near the kernel runs to the memory's bandwidth."""
    size = sum(t.numel() * t.element_size() for t in inputs)
    moved = size + out.numel() * out.element_size()
    if grads:
        moved += out.numel() * out.element_size() + size + sum(g.numel() * g.element_size() for g in grads)
    return moved


WARPS_SWEPT = ("rms_norm bf16", "q_norm + rope bf16", "residual")  # the cases ``_warps_sweep`` times


def _warps_sweep(tally: Tally, device: torch.device, name: str, inputs, fused) -> None:
    """A norm kernel's forward + backward timed at 4, 8, 16 and 32 warps a program (the wrappers' rule,
    ``triton_kernels._warps``, gives about 8 elements a thread: 16 warps for the hidden norm's 4 rows of 1,024), for
    choosing that rule by measurement."""
    from hfnative.models import triton_kernels

    rule, times = triton_kernels._warps, {}
    try:
        for warps in (4, 8, 16, 32):
            triton_kernels._warps = lambda elements, warps=warps: warps
            out, grads, times[warps] = _run_timed(fused, inputs, device)
    finally:
        triton_kernels._warps = rule
    moved = _bytes_moved(inputs, out, grads)
    tally("TIME", f"warps {name}", ", ".join(f"{w}: {ms:.3f} ms ({moved / (ms * 1e6):.0f} GB/s)"
                                             for w, ms in times.items())
          + f"; the rule gives {rule(4096)} to a forward tile of 4,096 elements")


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=("parity", "attention", "generation", "kernels", "compile"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="parity: fp32 by default; attention: bf16 on cuda, fp32 on cpu by default")
    parser.add_argument("--all", action="store_true", help="parity: every tiny config, not one per family")
    parser.add_argument("--compiled", action="store_true",
                        help="generation: only the compiled (and, on CUDA, captured) decode step")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" for every tiny model
    tally = Tally()
    if args.check == "parity":
        parity(tally, device, DTYPES[args.dtype or "fp32"], sorted(CONFIGS) if args.all else ONE_PER_FAMILY)
    elif args.check == "generation":
        from gpu_rollout_checks import generation, moe_rollouts, rollouts_between_steps, unseeded_sampling

        if args.compiled:
            generation(tally, device, compiled=True)
        else:
            generation(tally, device)
            rollouts_between_steps(tally, device)
            unseeded_sampling(tally, device)
            moe_rollouts(tally, device)
    elif args.check == "kernels":
        kernels(tally, device)
    elif args.check == "compile":
        from gpu_compile_checks import checkpoint_in_graph, packed_in_graph

        checkpoint_in_graph(tally, device)
        packed_in_graph(tally, device)
    else:
        attention(tally, device, DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")])
    print(f"{tally.failures} failed" if tally.failures else "all passed")
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
