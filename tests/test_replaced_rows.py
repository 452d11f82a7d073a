"""The fused losses with some rows of the head matrix read from elsewhere (``ReplacedRows``: peft's trained token rows,
``hfnative.peft.token_rows``) against the same losses on the matrix with those rows copied in: float64 logits through
autograd as the oracle in fp32, the fused loss over the copied matrix under bf16 autocast. Both device policies: the
CPU's chunk-by-chunk gradients, and the GPU's gradients held and made in blocks (small chunks and blocks here, so a
loop has several of each)."""

import dataclasses

import pytest
import torch
from test_fused_loss import _NewTensorsOfAtLeast, cpu_bf16_path  # noqa: F401  (a fixture, used by name)

from hfnative.device_policy import GPU_POLICY, use_device_policy
from hfnative.losses import (
    IGNORE_INDEX,
    ReplacedRows,
    fused_linear_cross_entropy,
    fused_linear_generalized_jsd,
    fused_linear_token_logprobs,
    generalized_jsd_terms,
)
from hfnative.losses import _chunks
from hfnative.models.head import OutputHead, TokenCrossEntropy
from hfnative.peft.token_rows import TokenRows

V, D, N, DT = 50, 16, 29, 12
INDICES = [17, 3, 48]  # unsorted, the last row included
LOSSES = ["cross_entropy", "token_logprobs", "generalized_jsd"]
CASES = {"plain": (None, 1.0, 7), "softcap+temperature": (4.0, 0.8, 5)}  # (softcap, temperature, chunk_size)
GPU_BLOCKS = dataclasses.replace(GPU_POLICY, name="gpu-small-blocks", head_chunk_elements=5 * V,
                                 head_gradient_block_elements=12 * V)  # chunks of 5 rows, blocks of 10
POLICIES = {"cpu": "cpu", "gpu-blocks": GPU_BLOCKS}


def _chunk_for(policy: str, chunk: int) -> int | None:
    """The CPU cases' own chunk size; None under the GPU policy, whose rule (chunks and blocks) then applies: a given
    chunk size would make its gradients chunk by chunk."""
    return None if policy == "gpu-blocks" else chunk


@pytest.fixture
def flushes(monkeypatch):
    """How many blocks of held gradients ``HeadGradients`` made (the GPU policy's path)."""
    count = [0]
    flush = _chunks.HeadGradients._flush

    def counted(self):
        count[0] += self._held_rows > 0
        flush(self)

    monkeypatch.setattr(_chunks.HeadGradients, "_flush", counted)
    return count


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=generator)
    weight = torch.randn(V, D, generator=generator) * 0.5
    rows = torch.randn(len(INDICES), D, generator=generator) * 0.5
    targets = torch.randint(0, V, (N,), generator=generator)
    targets[:6] = torch.tensor(INDICES * 2)  # replaced tokens as targets too
    targets[[7, 20]] = IGNORE_INDEX
    upstream = torch.randn(N, generator=generator) / N  # a weight per token for the log-probs
    teacher_hidden, teacher_weight = torch.randn(N, DT, generator=generator), torch.randn(V, DT, generator=generator)
    return hidden, weight, rows, targets, upstream, (teacher_hidden, teacher_weight)


def _logits64(hidden, weight, softcap, temperature):
    z = hidden.double() @ weight.double().T
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z / temperature


def _fused(loss, hidden, weight, targets, upstream, teacher, softcap, temperature, chunk, replaced=None):
    """The loss as a scalar to differentiate (the log-probs weighted by ``upstream``)."""
    if loss == "cross_entropy":
        out = fused_linear_cross_entropy(hidden, weight, targets, softcap, temperature, chunk, masked=True,
                                         replaced_rows=replaced)
        return out.loss_sum
    if loss == "token_logprobs":
        logprobs, _ = fused_linear_token_logprobs(hidden, weight, targets, softcap, temperature, chunk,
                                                  replaced_rows=replaced)
        return (logprobs * upstream).sum()
    out = fused_linear_generalized_jsd(hidden, weight, teacher_hidden_ND=teacher[0], teacher_weight_VD=teacher[1],
                                       beta=0.3, temperature=temperature, student_softcap=softcap, chunk_size=chunk,
                                       targets_N=targets, student_replaced_rows=replaced)
    return out.loss_sum


def _oracle(loss, hidden, weight, targets, upstream, teacher, softcap, temperature):
    """The same scalar from float64 logits of the weight (already with the rows in place)."""
    valid = targets != IGNORE_INDEX
    log_p = torch.log_softmax(_logits64(hidden, weight, softcap, temperature), -1)
    if loss == "generalized_jsd":
        log_t = torch.log_softmax(_logits64(teacher[0], teacher[1], None, temperature), -1)
        return (generalized_jsd_terms(log_p, log_t, 0.3).sum(-1) * valid).sum()
    target_log_p = log_p.gather(1, targets.clamp(min=0)[:, None])[:, 0] * valid
    return -target_log_p.sum() if loss == "cross_entropy" else (target_log_p * upstream.double()).sum()


@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loss", LOSSES)
def test_replaced_rows_equal_float64_logits_of_the_copied_matrix(loss, case, policy, flushes):
    """fp32: the value and the gradients of the hidden states, the rows and the matrix (zero on the replaced rows)."""
    softcap, temperature, chunk = CASES[case]
    chunk = _chunk_for(policy, chunk)
    hidden, weight, rows, targets, upstream, teacher = _inputs()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, rows)]
    with use_device_policy(POLICIES[policy]):
        value = _fused(loss, leaves[0], leaves[1], targets, upstream, teacher, softcap, temperature, chunk,
                       ReplacedRows(torch.tensor(INDICES), leaves[2]))
    grads = torch.autograd.grad(value, leaves)

    leaves64 = [t.double().requires_grad_() for t in (hidden, weight, rows)]
    copied64 = leaves64[1].index_copy(0, torch.tensor(INDICES), leaves64[2])
    expected = _oracle(loss, leaves64[0], copied64, targets, upstream, teacher, softcap, temperature)
    expected_grads = torch.autograd.grad(expected, leaves64)

    torch.testing.assert_close(value.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("hidden", "weight", "rows"), grads, expected_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6, msg=name)
    assert not grads[1][INDICES].any()  # the matrix's replaced rows reach no logit
    assert grads[2].abs().sum() > 0
    assert (flushes[0] >= 3) == (policy == "gpu-blocks")  # 29 tokens in blocks of 10


def test_rows_changed_in_place_before_backward_are_refused():
    """The per-token log-probs make their gradients in backward, from the rows saved in forward: rows changed in place
    between the two (an optimizer step too early) fail autograd's check instead of giving wrong gradients."""
    hidden, weight, rows, targets, _, _ = _inputs()
    rows = rows.clone().requires_grad_()
    logprobs, _ = fused_linear_token_logprobs(hidden.requires_grad_(), weight, targets.clamp(min=0),
                                              replaced_rows=ReplacedRows(torch.tensor(INDICES), rows))
    with torch.no_grad():
        rows.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logprobs.sum().backward()


def test_a_head_with_token_rows_gives_a_callers_own_spec_the_matrix_with_the_rows_in_place():
    """The head's three loss specs read the rows in place (ReplacedRows); a spec of the caller's own keeps the
    documented call ``loss(hidden, weight, softcap)`` and gets the matrix with the rows in place."""
    hidden, weight, rows, targets, _, _ = _inputs()
    head = OutputHead(D, V)
    with torch.no_grad():
        head.weight.copy_(weight)
    head.weight.requires_grad_(False)
    head.token_rows = TokenRows(head.weight, INDICES)
    with torch.no_grad():
        head.token_rows.values.copy_(rows)
    seen = head(hidden[None], loss=lambda hidden_BSD, weight_VD, softcap: weight_VD)
    assert torch.equal(seen, weight.index_copy(0, torch.tensor(INDICES), rows))
    out = head(hidden[None], loss=TokenCrossEntropy(targets[None]))
    expected = _oracle("cross_entropy", hidden.double(), weight.index_copy(0, torch.tensor(INDICES), rows), targets,
                       None, None, None, 1.0)
    torch.testing.assert_close(out.loss_sum.double(), expected, rtol=1e-5, atol=1e-5)
    out.loss_sum.backward()
    assert head.token_rows.values.grad.abs().sum() > 0


@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
@pytest.mark.parametrize("loss", LOSSES)
def test_replaced_rows_under_bf16_autocast_follow_the_copied_matrix(loss, policy, cpu_bf16_path):
    """bf16 autocast over fp32 weights and float32 rows (peft's on a bf16 base): as the fused loss over the copied
    matrix, to bf16 round-off (the replaced columns are a product of their own, rounded apart)."""
    softcap, temperature, chunk = CASES["softcap+temperature"]
    chunk = _chunk_for(policy, chunk)
    hidden, weight, rows, targets, upstream, teacher = _inputs(seed=1)
    results = []
    for way in ("replaced", "copied"):
        h, rows_leaf = hidden.clone().requires_grad_(), rows.clone().requires_grad_()
        with use_device_policy(POLICIES[policy]), torch.autocast("cpu", dtype=torch.bfloat16):
            if way == "replaced":
                value = _fused(loss, h, weight, targets, upstream, teacher, softcap, temperature, chunk,
                               ReplacedRows(torch.tensor(INDICES), rows_leaf))
            else:
                copied = weight.index_copy(0, torch.tensor(INDICES), rows_leaf)
                value = _fused(loss, h, copied, targets, upstream, teacher, softcap, temperature, chunk)
        results.append((value, *torch.autograd.grad(value, (h, rows_leaf))))
    (value, grad_h, grad_rows), (want, want_h, want_rows) = results
    assert grad_h.dtype == torch.float32 and grad_rows.dtype == torch.float32
    torch.testing.assert_close(value, want, rtol=1e-2, atol=1e-3 * N)
    for name, got, expected in (("hidden", grad_h, want_h), ("rows", grad_rows, want_rows)):
        scale = expected.abs().max()
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-2 * scale, msg=name)


@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
def test_replaced_rows_of_a_frozen_matrix_make_no_matrix_sized_tensor(policy, flushes):
    """A frozen head with trained rows (LoRA with trainable_token_indices): forward and backward make no tensor as
    large as the [V, D] matrix, where the copied matrix makes the copy and its gradient."""
    vocab, dim, tokens, chunk = 200, 64, 40, 8  # V * D = 12,800 > C * V = 1,600 and N * D = 2,560
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(vocab, dim, generator=generator)  # frozen
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    blocks = policy == "gpu-blocks"  # chunks of 8 tokens, blocks of 16
    policy = dataclasses.replace(GPU_POLICY, head_chunk_elements=chunk * vocab,
                                 head_gradient_block_elements=2 * chunk * vocab, name="gpu-small") if blocks else "cpu"
    chunk = None if blocks else chunk
    counts = {}
    for way in ("replaced", "copied"):
        hidden = torch.randn(tokens, dim, generator=generator, requires_grad=True)
        rows = torch.randn(3, dim, generator=generator, requires_grad=True)
        counter = _NewTensorsOfAtLeast(vocab * dim)
        with use_device_policy(policy), counter:
            if way == "replaced":
                out = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk, masked=True,
                                                 replaced_rows=ReplacedRows(torch.tensor([5, 1, 199]), rows))
            else:
                out = fused_linear_cross_entropy(hidden, weight.index_copy(0, torch.tensor([5, 1, 199]), rows), targets,
                                                 chunk_size=chunk, masked=True)
            out.loss_sum.backward()
        assert rows.grad is not None and rows.grad.abs().sum() > 0
        counts[way] = counter.count
    assert counts["copied"] >= 2  # the check can fail: the copy and its gradient
    assert counts["replaced"] == 0
    assert (flushes[0] >= 4) == blocks  # 40 tokens in blocks of 16, twice
