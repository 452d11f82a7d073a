"""How the variable-length path calls torch's ``varlen_attn``, whose keywords changed between torch releases.

The kernel itself needs CUDA (benchmarks/gpu_checks.py checks it there). Here a CPU stand-in with each release's
signature takes its place: it refuses keywords that release does not have and, as releases before ``enable_gqa``
do, fewer key/value heads than query heads, and computes each document's causal (windowed) attention from
explicit per-document masks. ``_flash_varlen`` must then equal the dense-mask SDPA path on the same plan.
"""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from hfnative.models import attention
from hfnative.models.attention import plan_attention


def _stand_in(keywords: set[str]):
    """A CPU ``varlen_attn`` that takes exactly ``keywords`` besides the positional arguments."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options):
        unknown = set(options) - keywords
        if unknown:
            raise TypeError(f"varlen_attn() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        gqa = options.get("enable_gqa", False)
        if key.shape[1] != query.shape[1] and not gqa:
            raise RuntimeError("key/value heads must equal query heads")
        if "window_size" in options:
            left, right = options["window_size"]
            assert right == 0, "causal attention has no right window"
            window = None if left < 0 else left + 1
        else:
            assert options.get("is_causal") is True
            window = None
        scale = options.get("scale", query.shape[-1] ** -0.5)
        assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
        bounds = cu_seq_q.tolist()
        out = []
        for start, end in zip(bounds, bounds[1:]):
            q, k, v = (x[start:end].transpose(0, 1)[None] for x in (query, key, value))  # [1, h, n, d]
            i = torch.arange(end - start)
            allowed = (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - window) if window else True)
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                      enable_gqa=gqa)[0].transpose(0, 1))
        return torch.cat(out)

    positional = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for name in ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")]
    named = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in sorted(keywords)]
    varlen_attn.__signature__ = inspect.Signature(positional + named)
    return varlen_attn


RELEASES = {
    "2.10": {"is_causal", "return_aux"},
    "2.11": {"return_aux", "scale", "window_size"},
    "2.13": {"return_aux", "scale", "window_size", "enable_gqa", "seqused_k", "block_table", "num_splits"},
}


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_flash_varlen_call_matches_dense_mask(monkeypatch, release, window, layout):
    keywords = RELEASES[release]
    monkeypatch.setattr(attention, "VARLEN_KERNEL", attention.VarlenKernel.of(_stand_in(keywords)))
    B, H, K, S, d = 2, 4, 2, 16, 8
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, heads, S, d, generator=generator) for heads in (H, K, K))
    if layout == "packed":
        positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ([6, 10], [3, 9, 4])])
        plan = plan_attention(B, S, q.device, position_ids_BS=positions, sliding_window=window)
        dense = plan_attention(B, S, q.device, position_ids_BS=positions, sliding_window=window, implementation="sdpa")
        valid = torch.ones(B, S, dtype=torch.bool)
    else:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, 12:] = 0
        mask[1, :5] = 0
        plan = plan_attention(B, S, q.device, attention_mask_BS=mask, sliding_window=window)
        dense = plan_attention(B, S, q.device, attention_mask_BS=mask, sliding_window=window, implementation="sdpa")
        valid = mask.bool()
    scale = 0.3  # not 1/sqrt(d): a release without `scale` must leave this layer to the per-document path
    for layer_scale in (d ** -0.5, scale):
        takes = attention.VARLEN_KERNEL.takes(d, plan.sliding_window, layer_scale)
        expected_takes = ("window_size" in keywords or not plan.sliding_window) and (
            "scale" in keywords or math.isclose(layer_scale, d ** -0.5))
        assert takes == expected_takes
        if not takes:
            continue
        got = attention._flash_varlen(q, k, v, plan, plan.sliding_window, layer_scale)
        want = attention.attend(q, k, v, dense, sliding=bool(window), scale=layer_scale)
        diff = (got - want).permute(0, 2, 1, 3)[valid].abs().max().item()
        assert diff <= 1e-5, f"torch {release}: max |Δ| {diff:.2e}"


def test_flash_varlen_needs_cuda_and_low_precision():
    q = torch.zeros(1, 2, 4, 8)
    assert not attention.flash_varlen_serves(q.device, q.dtype, 8)
    assert not attention.flash_varlen_serves(q.device, torch.bfloat16, 8)
    cuda = torch.device("cuda")
    assert attention.flash_varlen_serves(cuda, torch.bfloat16, 8) == (attention.VARLEN_KERNEL.function is not None)
    assert not attention.flash_varlen_serves(cuda, torch.float32, 8)
    assert not attention.flash_varlen_serves(cuda, torch.bfloat16, 8, sinks=True)


@pytest.mark.parametrize("name", ["qwen3-gqa", "llama-gqa"])
def test_models_reach_the_kernel_under_autocast(monkeypatch, name):
    """bf16 autocast over fp32 weights: Qwen3's QK-norm leaves q and k in fp32 beside a bf16 v. Every layer must
    still reach ``varlen_attn`` (as SDPA would, in the autocast dtype), and the logits equal the dense-mask path's."""
    from hf_configs import make_hf_model

    from hfnative.converters.loading import load_pretrained

    calls = []
    kernel = _stand_in(RELEASES["2.13"])

    def counted(query, key, value, *args, **options):
        calls.append((query.dtype, key.dtype, value.dtype))
        return kernel(query, key, value, *args, **options)

    counted.__signature__ = kernel.__signature__
    monkeypatch.setattr(attention, "VARLEN_KERNEL", attention.VarlenKernel.of(counted))
    monkeypatch.setattr(attention, "VARLEN_KERNEL_DEVICES", ("cpu",))  # the stand-in runs on the CPU
    model = load_pretrained(make_hf_model(name)).model.eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, 20), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ([8, 12], [5, 9, 6])])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.attention_implementation = "varlen"
        varlen = model(ids, position_ids=positions).logits.float()
        assert calls == [(torch.bfloat16,) * 3] * len(model.layers)
        model.attention_implementation = "sdpa"
        dense = model(ids, position_ids=positions).logits.float()
    assert len(calls) == len(model.layers)  # the dense path never calls the kernel
    scale = dense.abs().max().item()
    assert (varlen - dense).abs().max().item() <= 2e-2 * scale


def test_masked_grouped_attention_repeats_key_value_heads_where_asked(monkeypatch):
    """torch's fused CUDA kernels take a mask or ``enable_gqa``, not both (SDPA would fall back to its math kernel):
    a masked call on CUDA repeats the key/value heads instead. Repeated, each query head reads its own group's key/value
    head, as SDPA's grouping does; on a CPU, and without a mask, the call groups."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 7, 8, generator=generator) for heads in (4, 2, 2))
    query, key = torch.arange(7)[:, None], torch.arange(7)[None, :]
    mask = ((key <= query) & (key > query - 3)).expand(2, 1, 7, 7)  # a sliding window of 3
    grouped = attention._sdpa(q, k, v, mask, 0.3, repeat_heads=False)
    repeated = attention._sdpa(q, k, v, mask, 0.3, repeat_heads=True)
    torch.testing.assert_close(repeated, grouped, rtol=1e-6, atol=1e-6)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) * 0.3
    explicit = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(grouped, explicit, rtol=1e-5, atol=1e-5)

    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, **options):
        calls.append((k.shape[1], options["enable_gqa"]))
        return sdpa(q, k, v, **options)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    attention._sdpa(q, k, v, mask, 0.3)  # a CPU: grouped
    attention._sdpa(q, k, v, mask, 0.3, repeat_heads=True)
    assert calls == [(2, True), (4, False)]
