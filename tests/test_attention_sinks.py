"""Attention sinks on every attention plan: softmax over [scores, sink] with the sink dropped equals plain
attention scaled by sigmoid(logsumexp(scores) - sink), computed here independently per query."""

import pytest
import torch

from hfnative.models.attention import attend, build_attention_mask, document_ids, plan_attention

B, H, K, S, D = 2, 4, 2, 12, 8


def _reference(q, k, v, allowed_BSS, sinks, scale):
    """Per row: softmax-attention output times sigmoid(lse - sink), from explicit scores."""
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~allowed_BSS[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.softmax(scores, dim=-1) @ v
    return out * torch.sigmoid(lse - sinks.view(1, H, 1, 1))


@pytest.mark.parametrize("layout", ["causal", "padded", "packed"])
@pytest.mark.parametrize("implementation", ["varlen", "sdpa"])
@pytest.mark.parametrize("window", [None, 4])
def test_sinks_on_every_plan(layout, implementation, window):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, S, D, generator=generator, dtype=torch.float64) for n in (H, K, K))
    sinks = torch.randn(H, generator=generator, dtype=torch.float64)
    mask = positions = None
    if layout == "padded":
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, 9:], mask[1, :3] = 0, 0
    if layout == "packed":
        positions = torch.cat([torch.arange(5), torch.arange(7)])[None].expand(B, S)
    plan = plan_attention(B, S, q.device, mask, positions, window, implementation)
    got = attend(q, k, v, plan, sliding=window is not None, scale=D**-0.5, sinks_H=sinks)

    doc_ids = document_ids(positions) if positions is not None else None
    allowed = build_attention_mask(S, q.device, mask, doc_ids, window)
    allowed = allowed[:, 0].expand(B, S, S) if allowed is not None else torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)
    expected = _reference(q, k, v, allowed, sinks, D**-0.5)
    real = mask.bool() if mask is not None else torch.ones(B, S, dtype=torch.bool)
    real_BHS = real[:, None, :].expand(B, H, S)
    assert (got[real_BHS] - expected[real_BHS]).abs().max().item() <= 1e-12


def test_sink_gradient_matches_autograd_of_reference():
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, S, D, generator=generator, dtype=torch.float64) for n in (H, K, K))
    sinks = torch.randn(H, generator=generator, dtype=torch.float64, requires_grad=True)
    plan = plan_attention(1, S, q.device)
    attend(q, k, v, plan, sliding=False, scale=D**-0.5, sinks_H=sinks).square().sum().backward()
    got = sinks.grad.clone()
    sinks.grad = None
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None]
    _reference(q, k, v, causal, sinks, D**-0.5).square().sum().backward()
    assert torch.allclose(got, sinks.grad, rtol=1e-10, atol=1e-12)
