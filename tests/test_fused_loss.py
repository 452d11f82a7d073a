"""Fused (chunked) losses against autograd on materialized float64 logits as the oracle."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hfnative.losses.cross_entropy import (
    IGNORE_INDEX,
    fused_linear_cross_entropy,
    label_positions,
    linear_cross_entropy,
    shift_labels,
)
from hfnative.losses._chunks import chunk_size_for
from hfnative.losses.distillation import fused_linear_generalized_jsd
from hfnative.losses.logprobs import fused_linear_token_logprobs

V, D, B, S = 50, 16, 3, 14

HEAD_CASES = [  # (softcap, temperature, chunk_size): chunk sizes that do not divide the token count
    (None, 1.0, None),
    (None, 0.7, 5),
    (30.0, 1.0, 4),
    (3.0, 0.8, 7),
    (None, 1.3, 1),
]
HEAD_IDS = ["plain", "temperature", "softcap", "softcap+temperature", "chunk=1"]


class TiedToyModel(torch.nn.Module):
    """An embedding used both for the input lookup and as the output head, with a layer between."""

    def __init__(self, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embedding = torch.nn.Parameter(torch.randn(V, D, generator=generator) * 0.5)
        self.mix = torch.nn.Parameter(torch.randn(D, D, generator=generator) / D**0.5)

    def hidden(self, input_ids_BS):
        return torch.tanh(self.embedding[input_ids_BS] @ self.mix) * 2.0


def toy_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, S), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = IGNORE_INDEX  # a prompt
    labels[2, 9:] = IGNORE_INDEX  # padding
    return input_ids, labels


def reference_logits(hidden, weight, softcap, temperature):
    z = hidden.double() @ weight.double().T
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z / temperature


def grads_of(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("softcap, temperature, chunk_size", HEAD_CASES, ids=HEAD_IDS)
def test_fused_cross_entropy_matches_materialized_logits(softcap, temperature, chunk_size):
    model = TiedToyModel()
    input_ids, labels = toy_batch()
    targets_BS = shift_labels(labels)

    hidden_ND, targets_N = label_positions(model.hidden(input_ids), targets_BS)
    num_tokens = targets_N.shape[0]
    assert num_tokens < B * (S - 1) and num_tokens % 7 != 0
    out = fused_linear_cross_entropy(hidden_ND, model.embedding, targets_N, softcap, temperature, chunk_size)
    (out.loss_sum / num_tokens).backward()
    fused_grads = grads_of(model)

    # oracle: float64 logits over every position, F.cross_entropy skipping the ignored ones
    model64 = TiedToyModel().double()
    logits = reference_logits(model64.hidden(input_ids).flatten(0, 1), model64.embedding, softcap, temperature)
    loss64 = F.cross_entropy(logits, targets_BS.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    (loss64 / num_tokens).backward()
    ref_grads = grads_of(model64)

    assert out.num_tokens == num_tokens
    torch.testing.assert_close(out.loss_sum.double() / num_tokens, loss64.detach() / num_tokens, rtol=1e-6, atol=1e-6)
    for name in ref_grads:  # the tied embedding gets the lookup's and the head's gradient
        torch.testing.assert_close(fused_grads[name].double(), ref_grads[name], rtol=1e-6, atol=1e-6, msg=name)
    assert fused_grads["embedding"][input_ids.unique()].abs().sum() > 0

    with torch.no_grad():
        kept = targets_BS.flatten() != IGNORE_INDEX
        logp = torch.log_softmax(logits[kept], dim=-1)
        entropy = -(logp.exp() * logp).sum()
        correct = (logits[kept].argmax(-1) == targets_BS.flatten()[kept]).sum()
    torch.testing.assert_close(out.entropy_sum.double() / num_tokens, entropy / num_tokens, rtol=1e-6, atol=1e-6)
    assert out.correct_sum.item() == correct.item()


def test_plain_linear_cross_entropy_agrees_with_fused():
    model = TiedToyModel()
    input_ids, labels = toy_batch()
    hidden_ND, targets_N = label_positions(model.hidden(input_ids), shift_labels(labels))
    fused = fused_linear_cross_entropy(hidden_ND, model.embedding, targets_N, 5.0, 0.9, chunk_size=6)
    plain = linear_cross_entropy(hidden_ND, model.embedding, targets_N, 5.0, 0.9)
    for a, b in ((fused.loss_sum, plain.loss_sum), (fused.entropy_sum, plain.entropy_sum)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
    assert fused.correct_sum == plain.correct_sum and fused.num_tokens == plain.num_tokens


@pytest.mark.parametrize("grad", [True, False])
def test_token_accuracy_breaks_ties_like_argmax(grad):
    """Duplicated head rows give exactly tied logits: only the first of the tied ids counts as correct,
    as with torch.argmax on materialized logits (what TRL's mean_token_accuracy uses)."""
    torch.manual_seed(0)
    weight = torch.randn(V, D)
    weight[7] = weight[3] = weight[5] * 4.0  # ids 3 and 7 share one long row: tied, and the max for hidden ~ it
    hidden = weight[3][None, :].repeat(12, 1) + 0.01 * torch.randn(12, D)
    targets = torch.tensor([3, 7, 3, 7, 1, 3, 7, 2, 3, 3, 7, 0])
    logits = hidden @ weight.T
    assert (logits[:, 3] == logits[:, 7]).all() and (logits.argmax(-1) == 3).all()
    with torch.set_grad_enabled(grad):
        out = fused_linear_cross_entropy(hidden.requires_grad_(grad), weight, targets, chunk_size=5)
    assert out.correct_sum.item() == (logits.argmax(-1) == targets).sum().item() == 5
    probs = logits.double().softmax(-1)
    entropy = -(probs * probs.log()).sum()
    torch.testing.assert_close(out.entropy_sum.double(), entropy, rtol=1e-5, atol=1e-5)


def test_frozen_head_gets_no_gradient_and_no_tokens_is_zero():
    hidden = torch.randn(9, D, requires_grad=True)
    head = torch.randn(V, D)  # requires_grad=False, as a frozen head under LoRA
    targets = torch.randint(0, V, (9,))
    fused_linear_cross_entropy(hidden, head, targets, chunk_size=4).loss_sum.backward()
    expected = torch.autograd.grad(F.cross_entropy(hidden @ head.T, targets, reduction="sum"), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected, rtol=0, atol=1e-5)

    weight = torch.randn(V, D, requires_grad=True)
    empty = fused_linear_cross_entropy(torch.zeros(0, D, requires_grad=True), weight, torch.zeros(0, dtype=torch.long))
    assert empty.loss_sum.item() == 0.0 and empty.num_tokens == 0
    empty.loss_sum.backward()
    assert weight.grad.abs().sum() == 0


@pytest.fixture(params=["bf16 kernels", "fp32 products"])
def cpu_bf16_path(request, monkeypatch):
    """Both CPU paths of a bf16 head: the bf16 matmuls, and the fp32 products of the bf16 operands the loops take on
    a CPU without fast bf16 kernels (``cpu_low_precision_is_slow``); which one this CPU takes is forced."""
    from hfnative import metrics

    slow = request.param == "fp32 products"
    monkeypatch.setattr(metrics, "cpu_low_precision_is_slow", lambda dtype: slow and dtype != torch.float32)
    return request.param


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_bf16_inputs_run_and_stay_close(softcap, cpu_bf16_path):
    generator = torch.Generator().manual_seed(3)
    hidden32 = torch.randn(40, D, generator=generator)
    weight32 = torch.randn(V, D, generator=generator) * 0.5
    targets = torch.randint(0, V, (40,), generator=generator)
    hidden = hidden32.bfloat16().requires_grad_()
    weight = weight32.bfloat16().requires_grad_()
    out = fused_linear_cross_entropy(hidden, weight, targets, softcap, chunk_size=16)
    (out.loss_sum / 40).backward()
    assert out.loss_sum.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    loss64 = F.cross_entropy(reference_logits(h64, w64, softcap, 1.0), targets, reduction="sum") / 40
    loss64.backward()
    torch.testing.assert_close(out.loss_sum.double() / 40, loss64.detach(), rtol=2e-2, atol=0)
    for grad, ref in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        error = (grad.double() - ref).norm() / ref.norm()
        assert error < 2e-2, error
    if softcap is None:  # the logits are the bf16 product's: the exact one rounded to bf16, as a bf16 matmul gives
        rounded = (h64.detach() @ w64.detach().T).bfloat16().double()
        loss_of_rounded = F.cross_entropy(rounded, targets, reduction="sum") / 40
        torch.testing.assert_close(out.loss_sum.double() / 40, loss_of_rounded, rtol=1e-5, atol=0)


def test_an_upstream_scale_does_not_bias_bf16_gradients(cpu_bf16_path):
    """The loss divided by a step's token count (1/3000, which bf16 rounds up by 0.16%): the bf16 gradients' least-
    squares scale against float64 autograd of the same loss is 1 to within their random rounding (the scale is applied
    in float32, not rounded to bf16 first)."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(256, D, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(512, D, generator=generator) * 0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, 512, (256,), generator=generator)
    (fused_linear_cross_entropy(hidden, weight, targets, None, chunk_size=64).loss_sum / 3000).backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    (F.cross_entropy(h64 @ w64.T, targets, reduction="sum") / 3000).backward()
    for grad, ref in ((hidden.grad.double(), h64.grad), (weight.grad.double(), w64.grad)):
        scale = ((grad * ref).sum() / (ref * ref).sum()).item()
        assert abs(scale - 1) < 5e-4, scale


def test_autocast_runs_the_projection_in_bf16_like_the_plain_path(cpu_bf16_path):
    """The trainer calls the loss under torch.autocast(bf16) with fp32 parameters."""
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(30, D, generator=generator, requires_grad=True)
    weight = (torch.randn(V, D, generator=generator) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (30,), generator=generator)
    results = []
    for loss_fn in (fused_linear_cross_entropy, linear_cross_entropy):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = loss_fn(hidden, weight, targets)
        out.loss_sum.backward()
        results.append((out.loss_sum.detach(), hidden.grad, weight.grad))
        hidden.grad = weight.grad = None
    (fused_loss, fused_h, fused_w), (plain_loss, plain_h, plain_w) = results
    assert fused_h.dtype == fused_w.dtype == torch.float32
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-3, atol=0)
    torch.testing.assert_close(fused_h, plain_h, rtol=0, atol=2e-2)
    torch.testing.assert_close(fused_w, plain_w, rtol=0, atol=2e-2)
    with pytest.raises(ValueError, match="head weight is torch.float32"):
        fused_linear_cross_entropy(hidden.detach().bfloat16(), weight, targets)


@pytest.mark.parametrize("softcap, temperature, chunk_size", HEAD_CASES, ids=HEAD_IDS)
def test_token_logprobs_gradient_under_any_upstream_gradient(softcap, temperature, chunk_size):
    model = TiedToyModel(seed=1)
    input_ids, labels = toy_batch(seed=1)
    targets_N = shift_labels(labels).flatten()  # ignored positions kept: they must give 0 and no gradient
    # a random weight per token, scaled like a mean so gradients are O(1) and 1e-6 is fp32 round-off
    upstream_N = torch.randn(targets_N.shape[0], generator=torch.Generator().manual_seed(7)) / targets_N.shape[0]

    logprobs, entropy = fused_linear_token_logprobs(
        model.hidden(input_ids).flatten(0, 1), model.embedding, targets_N, softcap, temperature, chunk_size
    )
    (logprobs * upstream_N).sum().backward()
    fused_grads = grads_of(model)
    assert not entropy.requires_grad

    model64 = TiedToyModel(seed=1).double()
    logits = reference_logits(model64.hidden(input_ids).flatten(0, 1), model64.embedding, softcap, temperature)
    logp_NV = torch.log_softmax(logits, dim=-1)
    valid = targets_N != IGNORE_INDEX
    ref_logprobs = logp_NV.gather(1, targets_N.clamp(min=0)[:, None])[:, 0] * valid
    ref_entropy = -(logp_NV.exp() * logp_NV).sum(-1) * valid
    (ref_logprobs * upstream_N.double()).sum().backward()
    ref_grads = grads_of(model64)

    torch.testing.assert_close(logprobs.double(), ref_logprobs.detach(), rtol=1e-6, atol=1e-6)
    # H = log Z - E[z] (TRL's formula) cancels digits in fp32: ~1e-6 of log Z, not of H
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=1e-6, atol=1e-5)
    assert (logprobs[~valid] == 0).all() and (entropy[~valid] == 0).all()
    for name in ref_grads:
        torch.testing.assert_close(fused_grads[name].double(), ref_grads[name], rtol=1e-6, atol=1e-6, msg=name)


def test_token_logprobs_bf16_and_no_grad(cpu_bf16_path):
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(33, D, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(V, D, generator=generator) * 0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (33,), generator=generator)
    logprobs, _ = fused_linear_token_logprobs(hidden, weight, targets, chunk_size=8)
    logprobs.sum().backward()
    ref = torch.log_softmax(reference_logits(hidden.detach(), weight.detach(), None, 1.0), -1)
    torch.testing.assert_close(logprobs.double(), ref.gather(1, targets[:, None])[:, 0], rtol=2e-2, atol=2e-2)
    assert hidden.grad.dtype == torch.bfloat16 and torch.isfinite(weight.grad).all()
    with torch.no_grad():
        no_grad_logprobs, _ = fused_linear_token_logprobs(hidden, weight, targets, chunk_size=8)
    assert not no_grad_logprobs.requires_grad
    torch.testing.assert_close(no_grad_logprobs, logprobs.detach())


# --- knowledge distillation: TRL's generalized_jsd_loss is the oracle ---------------------------

@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.3])
@pytest.mark.parametrize("temperature, softcap, chunk_size", [(1.0, None, None), (0.9, 5.0, 4)], ids=["plain", "T+cap"])
@pytest.mark.parametrize("teacher_as", ["hidden", "logits"])
def test_generalized_jsd_matches_trl(beta, temperature, softcap, chunk_size, teacher_as):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    generator = torch.Generator().manual_seed(11)
    num_tokens, teacher_dim = 23, 12
    student_hidden = torch.randn(num_tokens, D, generator=generator).requires_grad_()
    student_head = (torch.randn(V, D, generator=generator) * 0.5).requires_grad_()
    teacher_hidden = torch.randn(num_tokens, teacher_dim, generator=generator)
    teacher_head = torch.randn(V, teacher_dim, generator=generator) * 0.5
    teacher_logits = reference_logits(teacher_hidden, teacher_head, softcap, 1.0)

    teacher = (
        dict(teacher_hidden_ND=teacher_hidden, teacher_weight_VD=teacher_head, teacher_softcap=softcap)
        if teacher_as == "hidden"
        else dict(teacher_logits_NV=teacher_logits.float())
    )
    out = fused_linear_generalized_jsd(student_hidden, student_head, **teacher, beta=beta, temperature=temperature,
                                       student_softcap=softcap, chunk_size=chunk_size)
    (out.loss_sum / num_tokens).backward()

    h64, w64 = student_hidden.detach().double().requires_grad_(), student_head.detach().double().requires_grad_()
    student_logits = reference_logits(h64, w64, softcap, 1.0)
    # labels=None, reduction="batchmean" on [1, N, V] sums over everything (batch size 1)
    expected = gkd.GKDTrainer.generalized_jsd_loss(student_logits[None], teacher_logits[None], beta=beta,
                                                   temperature=temperature) / num_tokens
    expected.backward()
    torch.testing.assert_close(out.loss_sum.double() / num_tokens, expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(student_hidden.grad.double(), h64.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(student_head.grad.double(), w64.grad, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        logp = torch.log_softmax(student_logits / temperature, -1)
        entropy = -(logp.exp() * logp).sum() / num_tokens
    torch.testing.assert_close(out.student_entropy_sum.double() / num_tokens, entropy, rtol=1e-6, atol=1e-6)


def test_generalized_jsd_rejects_bad_arguments():
    hidden, head = torch.randn(4, D), torch.randn(V, D)
    with pytest.raises(ValueError, match="0 <= beta <= 1"):
        fused_linear_generalized_jsd(hidden, head, teacher_logits_NV=torch.randn(4, V), beta=1.5)
    with pytest.raises(ValueError, match="either"):
        fused_linear_generalized_jsd(hidden, head)
    with pytest.raises(ValueError, match="vocabulary"):
        fused_linear_generalized_jsd(hidden, head, teacher_logits_NV=torch.randn(4, V + 1))


# --- memory: what autograd keeps for backward --------------------------------------------------

def largest_saved_tensor(fn) -> int:
    """Run fn() under a saved-tensors hook; return the largest number of elements autograd saved."""
    sizes = [0]

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return max(sizes)


def test_fused_losses_never_save_token_by_vocab_tensors():
    num_tokens, dim, vocab = 64, 8, 200  # N * V = 12800 is larger than anything else (V * D = 1600)
    hidden = torch.randn(num_tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (num_tokens,))
    token_by_vocab = num_tokens * vocab

    plain = largest_saved_tensor(lambda: linear_cross_entropy(hidden, weight, targets).loss_sum.backward())
    assert plain >= token_by_vocab  # the check can fail: the plain path keeps [N, V] for backward
    fused = largest_saved_tensor(
        lambda: fused_linear_cross_entropy(hidden, weight, targets, 30.0, 0.9, chunk_size=16).loss_sum.backward()
    )
    assert fused <= max(vocab * dim, num_tokens * dim)
    logprobs = largest_saved_tensor(
        lambda: fused_linear_token_logprobs(hidden, weight, targets, chunk_size=16)[0].sum().backward()
    )
    assert logprobs <= max(vocab * dim, num_tokens * dim)
    teacher_hidden, teacher_head = torch.randn(num_tokens, dim), torch.randn(vocab, dim)
    distillation = largest_saved_tensor(
        lambda: fused_linear_generalized_jsd(hidden, weight, teacher_hidden, teacher_head, chunk_size=16)
        .loss_sum.backward()
    )
    assert distillation <= max(vocab * dim, num_tokens * dim)


def test_second_backward_through_the_fused_loss_is_refused_not_wrong():
    """Backward scales the gradients computed in forward in place; a second backward through the same
    graph must fail loudly rather than apply the scale twice."""
    hidden = torch.randn(6, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    loss = fused_linear_cross_entropy(hidden, weight, torch.randint(0, V, (6,))).loss_sum
    (loss * 0.5).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("vocab,hidden", [(32000, 256), (32000, 768), (151936, 1024), (151936, 4096), (262144, 5376)])
def test_default_chunk_keeps_loss_scratch_within_the_head_gradient(vocab, hidden):
    """The fp32 [chunk, V] buffers (two, or one when the softmax runs in place) take no more than the fp32
    [V, D] weight gradient (or 256 tokens' worth when D < 256), and one buffer never exceeds 256 MiB."""
    for buffers in (1, 2):
        chunk = chunk_size_for(100_000, vocab, hidden, buffers=buffers)
        assert buffers * chunk * vocab <= max(vocab * hidden, 2 * 128 * vocab)
        assert chunk * vocab * 4 <= 256 * 2**20
        assert chunk >= min(256 // buffers, (1 << 26) // vocab)
        assert chunk_size_for(50, vocab, hidden, buffers=buffers) == 50  # never more than the tokens there are


class _NewTensorsOfAtLeast(TorchDispatchMode):
    """Counts op results of at least ``numel`` elements held in new memory (not an input's storage, as views,
    in-place and out= results are)."""

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


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
def test_generalized_jsd_makes_four_chunk_tensors_once(beta, softcap):
    """Over several chunks the fused JSD makes four [C, V] tensors, each once and reused chunk to chunk: the student's
    logits and log-probabilities, the teacher's logits and one scratch tensor (p_s is formed again where it is
    needed, not kept); a soft-cap keeps the student's logits for backward, so the divergence takes a second scratch
    tensor then (beta = 1 needs none)."""
    vocab, hidden, teacher_dim, chunk = 64, 16, 8, 24
    num_tokens = 3 * chunk + 5
    generator = torch.Generator().manual_seed(3)
    student_hidden = torch.randn(num_tokens, hidden, generator=generator).requires_grad_()
    student_head = torch.randn(vocab, hidden, generator=generator).requires_grad_()
    teacher = dict(teacher_hidden_ND=torch.randn(num_tokens, teacher_dim, generator=generator),
                   teacher_weight_VD=torch.randn(vocab, teacher_dim, generator=generator))
    assert max(t.numel() for t in (student_hidden, student_head, *teacher.values())) < chunk * vocab
    counter = _NewTensorsOfAtLeast(chunk * vocab)
    with counter:
        out = fused_linear_generalized_jsd(student_hidden, student_head, **teacher, beta=beta, student_softcap=softcap,
                                           chunk_size=chunk)
    assert torch.isfinite(out.loss_sum)
    assert counter.count == (5 if softcap is not None and beta != 1.0 else 4)


def test_two_buffer_path_gives_the_in_place_results(monkeypatch):
    """Devices without the in-place softmax take two [C, V] buffers: the same loss, statistics and gradients."""
    import hfnative.losses.cross_entropy as cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(37, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    targets = torch.randint(0, V, (37,))
    results = []
    for verified in (True, False):
        monkeypatch.setattr(cross_entropy, "softmax_in_place_verified", lambda device: verified)
        out = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=8)
        grads = torch.autograd.grad(out.loss_sum, (hidden, weight))
        results.append((out.loss_sum, out.entropy_sum, out.correct_sum, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec", ["cross_entropy", "token_logprobs", "generalized_jsd"])
def test_a_heads_loss_output_shows_its_differentiable_tensors_to_pytree(spec):
    """FSDP2 gathers a unit's parameters again before its backward from a hook on the tensors the unit's last module
    returned; torch 2.11 finds them with ``tree_flatten``. A head loss whose output hid its loss from pytree left the
    tied head unit resharded through its backward, and the final norm read a freed weight. The same flattening here:
    a hook hung on each differentiable leaf fires in the loss's backward."""
    from hfnative.models.head import GeneralizedJSD, OutputHead, TokenCrossEntropy, TokenLogprobs

    generator = torch.Generator().manual_seed(0)
    head, teacher = OutputHead(D, V), OutputHead(D, V)
    for module in (head, teacher):
        module.weight.data = torch.randn(V, D, generator=generator) * 0.3
    hidden = torch.randn(B, S, D, generator=generator, requires_grad=True)
    targets = torch.randint(0, V, (B, S), generator=generator)
    targets[0, :3] = IGNORE_INDEX
    loss = {
        "cross_entropy": TokenCrossEntropy(targets),
        "token_logprobs": TokenLogprobs(targets),
        "generalized_jsd": GeneralizedJSD(targets, torch.randn(B, S, D, generator=generator), teacher),
    }[spec]
    output = head(hidden, loss=loss)
    fired = []
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    assert leaves, f"{type(output).__name__} shows pytree no tensor that needs a gradient"
    for leaf in leaves:
        leaf.register_hook(lambda grad: fired.append(grad) or grad)
    total = output[0].sum() if isinstance(output, tuple) else output.loss_sum
    total.backward()
    assert fired and hidden.grad is not None
