"""The GPU's device policy (``hfnative.device_policy``), run here on CPU: each path it changes equals the CPU's
(today's) path, and the fused losses equal float64 materialized logits.

- the output head's losses (cross-entropy, per-token log-probs, generalized JSD) with every position projected and the
  ignored ones masked, top-1 from one ``max`` pass, and the head's gradients made per block of chunks (a policy with
  small chunks and blocks, so several of each and a partial last one run; and the GPU policy itself, one of each):
  losses, statistics and gradients, in fp32 and under CPU bf16 autocast;
- the decoder keeps its activations (no recompute-in-backward hooks) with the same gradients, bit for bit;
- a compiled block is one graph (no graph break) in fp32 and under autocast, and steps of one shape do not recompile.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from hfnative.device_policy import CPU_POLICY, GPU_POLICY, device_policy, use_device_policy
from hfnative.losses import IGNORE_INDEX
from hfnative.models import recompute
from hfnative.models.args import ModelArgs
from hfnative.models.decoder import Transformer
from hfnative.models.head import GeneralizedJSD, OutputHead, TokenCrossEntropy, TokenLogprobs
from hfnative.parallel import apply_activation_checkpointing, apply_compile

V, D, B, S = 40, 16, 3, 11
# several chunks of 4 tokens and blocks of 8 (two chunks), the last of each partial: 33 positions
SMALL_BLOCKS = dataclasses.replace(GPU_POLICY, name="gpu-small-blocks", head_chunk_elements=4 * V,
                                   head_gradient_block_elements=8 * V)
GPU_POLICIES = [SMALL_BLOCKS, GPU_POLICY]


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.nn.Parameter(torch.randn(B, S, D, generator=generator))
    weight = torch.nn.Parameter(torch.randn(V, D, generator=generator) * 0.5)
    targets = torch.randint(0, V, (B, S), generator=generator)
    targets[0, :4] = IGNORE_INDEX  # a prompt
    targets[2, 7:] = IGNORE_INDEX  # padding
    teacher_hidden = torch.randn(B, S, D, generator=generator)
    teacher = OutputHead(D, V)
    teacher.weight.data = torch.randn(V, D, generator=generator) * 0.5
    return hidden, weight, targets, teacher_hidden, teacher


def _run(name, policy, bf16, softcap=None, temperature=1.0):
    """(outputs, gradients of hidden and weight) of one head loss under ``policy``."""
    hidden, weight, targets, teacher_hidden, teacher = _inputs()
    with use_device_policy(policy), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if name == "cross_entropy":
            out = TokenCrossEntropy(targets)(hidden, weight, softcap)
            loss = out.loss_sum / 2
            outputs = [out.loss_sum, out.entropy_sum, out.correct_sum, torch.as_tensor(out.num_tokens)]
        elif name == "logprobs":
            spec = TokenLogprobs(targets, temperature, statistics=("mean_logits", "is_top1", "log_sum_sq_probs"),
                                 compact=True)
            logprobs, entropy, stats = spec(hidden, weight, softcap)
            loss = (logprobs * torch.linspace(-1, 2, S)).sum()  # a per-token upstream gradient
            outputs = [logprobs, entropy, *stats.values()]
        else:
            out = GeneralizedJSD(targets, teacher_hidden, teacher, beta=0.3, temperature=temperature)(hidden, weight,
                                                                                                    softcap)
            loss = out.loss_sum
            outputs = [out.loss_sum, out.student_entropy_sum, torch.as_tensor(out.num_tokens)]
    loss.backward()
    return [o.detach() for o in outputs], [hidden.grad, weight.grad]


def _reference_float64(name, softcap=None, temperature=1.0):
    """The same quantities from float64 materialized logits (autograd), for the fp32 cases."""
    hidden, weight, targets, _, _ = _inputs()
    z = hidden.double() @ weight.double().T
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    if name == "cross_entropy":
        log_p = F.log_softmax(z, -1)
        nll = -log_p.gather(-1, safe[..., None])[..., 0] * valid
        loss = nll.sum() / 2
        entropy = (-(log_p.exp() * log_p).sum(-1) * valid).sum()
        correct = ((z.argmax(-1) == targets) & valid).sum()
        outputs = [nll.sum(), entropy, correct, valid.sum()]
    else:
        log_p = F.log_softmax(z / temperature, -1)
        logprobs = log_p.gather(-1, safe[..., None])[..., 0] * valid
        loss = (logprobs * torch.linspace(-1, 2, S, dtype=torch.float64)).sum()
        outputs = [logprobs]
    loss.backward()
    return [o.detach() for o in outputs], [hidden.grad, weight.grad]


CASES = [("cross_entropy", None, 1.0), ("cross_entropy", 5.0, 1.0), ("logprobs", None, 0.7), ("logprobs", 4.0, 1.0),
         ("jsd", None, 1.0), ("jsd", 3.0, 0.8)]
CASE_IDS = ["cross-entropy", "cross-entropy-softcap", "logprobs-temperature", "logprobs-softcap", "jsd",
            "jsd-softcap-temperature"]


@pytest.mark.parametrize("policy", GPU_POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("name, softcap, temperature", CASES, ids=CASE_IDS)
def test_gpu_head_equals_the_cpu_head_in_fp32(name, softcap, temperature, policy):
    outputs, grads = _run(name, policy, False, softcap, temperature)
    cpu_outputs, cpu_grads = _run(name, CPU_POLICY, False, softcap, temperature)
    for got, expected in zip(outputs + grads, cpu_outputs + cpu_grads):
        torch.testing.assert_close(got.to(expected.dtype), expected, rtol=1e-5, atol=1e-5)
    if name != "jsd":
        ref_outputs, ref_grads = _reference_float64(name, softcap, temperature)
        for got, expected in zip(outputs[: len(ref_outputs)] + grads, ref_outputs + ref_grads):
            torch.testing.assert_close(got.double(), expected.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", GPU_POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("name, softcap, temperature", CASES, ids=CASE_IDS)
def test_gpu_head_equals_the_cpu_head_under_bf16_autocast(name, softcap, temperature, policy):
    """The logits are the same bf16 products on both paths; the gradients differ by where they are rounded to bf16
    (the block's GEMM takes the bf16 logit gradient, the CPU's chunk loop the fp32 one for the weight): a few bf16
    ulps of the largest entry."""
    outputs, grads = _run(name, policy, True, softcap, temperature)
    cpu_outputs, cpu_grads = _run(name, CPU_POLICY, True, softcap, temperature)
    for got, expected in zip(outputs, cpu_outputs):
        torch.testing.assert_close(got.to(expected.dtype), expected, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, cpu_grads):
        assert got.dtype == expected.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=0, atol=2 ** -7 * expected.abs().max().item())


def test_the_policy_follows_the_device_unless_forced(monkeypatch):
    monkeypatch.delenv("HFNATIVE_DEVICE_POLICY", raising=False)
    assert device_policy("cpu") is CPU_POLICY and device_policy("cuda") is GPU_POLICY
    with use_device_policy("gpu"):
        assert device_policy("cpu") is GPU_POLICY
    monkeypatch.setenv("HFNATIVE_DEVICE_POLICY", "gpu")
    assert device_policy("cpu") is GPU_POLICY
    monkeypatch.setenv("HFNATIVE_DEVICE_POLICY", "tpu-ish")
    with pytest.raises(ValueError, match="HFNATIVE_DEVICE_POLICY"):
        device_policy("cpu")


# --- the decoder -----------------------------------------------------------------------------------------------


def _tiny_model(seed=0, n_layers=2) -> Transformer:
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=64, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64,
                     qk_norm=True)
    model = Transformer(args)
    model.init_weights()
    return model


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


def _loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_gpu_policy_keeps_activations_with_the_same_gradients(monkeypatch):
    registered = []
    entry = recompute._Entry

    def counting_entry(tensor, remake):
        registered.append(1)
        return entry(tensor, remake)

    monkeypatch.setattr(recompute, "_Entry", counting_entry)
    model = _tiny_model()
    input_ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with use_device_policy("cpu"):
        cpu_loss, cpu_grads = _loss_and_grads(model, input_ids)
    assert registered, "the CPU policy remakes the cheap activations in backward"
    registered.clear()
    with use_device_policy("gpu"):
        gpu_loss, gpu_grads = _loss_and_grads(model, input_ids)
    assert not registered, "the GPU policy keeps them"
    # the head's reductions run in another order on the GPU policy's path: equal to fp32 round-off
    torch.testing.assert_close(gpu_loss, cpu_loss, rtol=1e-6, atol=0)
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


# --- compile ---------------------------------------------------------------------------------------------------

needs_compile = pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported() or not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile is unavailable here (no dynamo support or no C++ compiler)",
)


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_block_compiles_to_one_graph(bf16, padded):
    model = _tiny_model()
    input_ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.long)
    if padded:
        mask[1, 8:] = 0
    model.attention_implementation = "sdpa"  # padded: a dense mask (the per-document path runs eagerly on CPU)
    plan = model.plan_attention(input_ids, mask if padded else None)
    hidden = model.tok_embeddings(input_ids)
    cos_sin = model.rope(torch.arange(12).expand(2, 12), torch.float32)
    block = model.layers[0]
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        explained = torch._dynamo.explain(type(block).forward)(block, hidden, cos_sin, plan)
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    assert explained.graph_count == 1


@needs_compile
@pytest.mark.parametrize("checkpointed", [False, True], ids=["", "activation-checkpointing"])
def test_compiled_steps_of_one_shape_do_not_recompile_under_the_gpu_policy(checkpointed):
    """With activation checkpointing the block's graph holds its selective checkpoint (the policy's default keep,
    ``hfnative.parallel.compile``): one graph, no break, bf16 autocast included, and the eager model's gradients."""
    torch._dynamo.reset()
    counters.clear()
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 10), generator=generator) for _ in range(4)]
    with use_device_policy("gpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = _tiny_model(n_layers=1)
        loss, grads = _loss_and_grads(eager, batches[0])
        model = apply_compile(_tiny_model(n_layers=1))
        if checkpointed:
            apply_activation_checkpointing(model, "full")
        c_loss, c_grads = _loss_and_grads(model, batches[0])
        graphs = counters["stats"]["unique_graphs"]
        for input_ids in batches[1:]:
            _loss_and_grads(model, input_ids)
    assert graphs == 1 and counters["stats"]["unique_graphs"] == graphs, "a step of the same shape recompiled"
    assert not counters["graph_break"]
    torch.testing.assert_close(c_loss, loss, rtol=1e-2, atol=0)  # bf16 matmuls, fused differently
    for name in grads:
        assert _relative_error(c_grads[name], grads[name]) < 2e-2, name


def test_gpu_policy_checkpoints_selectively_with_the_same_gradients():
    """Under activation checkpointing the GPU policy keeps attention and every second matmul: backward recomputes
    half the matmuls full checkpointing does, and the gradients equal the un-checkpointed model's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hfnative.models.selective_checkpoint import MATMULS
    from hfnative.parallel import apply_activation_checkpointing

    class MatmulCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in MATMULS
            return func(*args, **(kwargs or {}))

    input_ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    recomputed = {}
    for name in ("cpu", "gpu"):
        counts = {}
        for checkpointed in (False, True):
            model = _tiny_model()
            if checkpointed:
                apply_activation_checkpointing(model, "full")
            with use_device_policy(name), MatmulCounter() as counter:
                loss, grads = _loss_and_grads(model, input_ids)
            counts[checkpointed] = counter.count
            if not checkpointed:
                plain_loss, plain_grads = loss, grads
        torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
        for key, grad in plain_grads.items():
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
        recomputed[name] = counts[True] - counts[False]
    # 7 matmuls a block forward (q, k, v, o, gate, up, down), 2 blocks: full checkpointing recomputes the first 6 of
    # each (torch stops the recompute once backward has what it reads: the down projection's output it does not),
    # selective only the 2nd, 4th and 6th (attention is kept too)
    assert recomputed == {"cpu": 12, "gpu": 6}, recomputed


def test_selective_checkpointing_under_autocast_after_a_forward_without_grad():
    """A forward without grad first (a reference or KL pass) leaves autocast's cast cache filled; the checkpointed
    blocks must still recompute the ops their forward ran. Gradients equal the un-checkpointed model's under the
    same autocast."""
    from hfnative.parallel import apply_activation_checkpointing

    input_ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    results = []
    for checkpointed in (False, True):
        model = _tiny_model()
        if checkpointed:
            apply_activation_checkpointing(model, "full")
        with use_device_policy("gpu"), torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                model(input_ids)
            results.append(_loss_and_grads(model, input_ids))
    (plain_loss, plain_grads), (loss, grads) = results
    assert torch.equal(loss, plain_loss)
    for key, grad in plain_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=0, atol=0, msg=key)
