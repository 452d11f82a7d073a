"""The fused losses with some rows of the head matrix read from elsewhere (``ReplacedRows``: peft's trained token rows,
``hfnative.peft.token_rows``) against the same losses on the matrix with those rows copied in: float64 logits through
autograd as the oracle in fp32, the fused loss over the copied matrix under bf16 autocast. Both device policies: the
CPU's chunk-by-chunk gradients, and the GPU's gradients held and made in blocks (small chunks and blocks here, so a
loop has several of each)."""

import dataclasses

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hfnative.device_policy import GPU_POLICY, use_device_policy
from hfnative.losses import (
    IGNORE_INDEX,
    ReplacedRows,
    fused_linear_cross_entropy,
    fused_linear_generalized_jsd,
    fused_linear_token_logprobs,
    generalized_jsd_terms,
)

V, D, N, DT = 50, 16, 29, 12
INDICES = [17, 3, 48]  # unsorted, the last row included
LOSSES = ["cross_entropy", "token_logprobs", "generalized_jsd"]
CASES = {"plain": (None, 1.0, 7), "softcap+temperature": (4.0, 0.8, 5)}  # (softcap, temperature, chunk_size)
GPU_BLOCKS = dataclasses.replace(GPU_POLICY, name="gpu-small-blocks", head_chunk_elements=5 * V,
                                 head_gradient_block_elements=12 * V)  # chunks of 5 rows, blocks of 10
POLICIES = {"cpu": "cpu", "gpu-blocks": GPU_BLOCKS}


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
def test_replaced_rows_equal_float64_logits_of_the_copied_matrix(loss, case, policy):
    """fp32: the value and the gradients of the hidden states, the rows and the matrix (zero on the replaced rows)."""
    softcap, temperature, chunk = CASES[case]
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


@pytest.fixture(params=["bf16 matmuls", "fp32 products"])
def cpu_bf16_path(request, monkeypatch):
    """Both CPU paths of a bf16 head (as tests/test_fused_loss.py forces them)."""
    from hfnative import metrics

    slow = request.param == "fp32 products"
    monkeypatch.setattr(metrics, "cpu_low_precision_is_slow", lambda dtype: slow and dtype != torch.float32)
    return request.param


@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
@pytest.mark.parametrize("loss", LOSSES)
def test_replaced_rows_under_bf16_autocast_follow_the_copied_matrix(loss, policy, cpu_bf16_path):
    """bf16 autocast over fp32 weights and float32 rows (peft's on a bf16 base): as the fused loss over the copied
    matrix, to bf16 round-off (the replaced columns are a product of their own, rounded apart)."""
    softcap, temperature, chunk = CASES["softcap+temperature"]
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


class _NewTensorsOfAtLeast(TorchDispatchMode):
    """Counts op results of at least ``numel`` elements held in new memory."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.count += sum(1 for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel() >= self.numel
                          and t.untyped_storage().data_ptr() not in inputs)
        return out


@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
def test_replaced_rows_of_a_frozen_matrix_make_no_matrix_sized_tensor(policy):
    """A frozen head with trained rows (LoRA with trainable_token_indices): forward and backward make no tensor as
    large as the [V, D] matrix, where the copied matrix makes the copy and its gradient."""
    vocab, dim, tokens, chunk = 200, 64, 40, 8  # V * D = 12,800 > C * V = 1,600 and N * D = 2,560
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(vocab, dim, generator=generator)  # frozen
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    policy = dataclasses.replace(GPU_POLICY, head_chunk_elements=chunk * vocab, head_gradient_block_elements=chunk * vocab,
                                 name="gpu-small") if policy == "gpu-blocks" else "cpu"
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
