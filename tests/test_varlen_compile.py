"""Packed batches under ``torch_compile=True`` where ``varlen_attn`` serves the attention (CUDA, bf16): the kernel call
is traced into each block's graph, so a block is one graph, new document layouts do not recompile it, and its
activation checkpoint runs inside that graph.

torch's ``varlen_attn`` is a custom op (``torch_attn::_varlen_attn`` and its backward) whose kernels need CUDA. Here
the ops get CPU kernels of their own (per-document attention in float32, written out with its backward formulas) and
the CPU is let through as a kernel device, so the very call a GPU makes is traced, compiled and run on a CPU. The
oracle is the eager model on the same kernels, and the per-document SDPA path (no custom op) for the forward.
"""

import copy
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from hfnative.models import attention
from hfnative.models.args import ModelArgs
from hfnative.models.decoder import Transformer
from hfnative.parallel import apply_activation_checkpointing, apply_compile

varlen = pytest.importorskip("torch.nn.attention.varlen")

needs_compile = pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported() or not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile is unavailable here (no dynamo support or no C++ compiler)",
)

VOCAB = 64


def _documents(cu_seq):
    bounds = cu_seq.tolist()
    return list(zip(bounds, bounds[1:]))


def _probabilities(q, k, start, end, scale, window_size, is_causal):
    """[h, n, n] float32 attention probabilities of one document, and its log-sum-exp [h, n]."""
    left, right = list(window_size) if window_size is not None else [-1, -1]
    if is_causal:
        right = 0
    scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * scale
    i = torch.arange(end - start)
    allowed = torch.ones(end - start, end - start, dtype=torch.bool)
    if right >= 0:
        allowed &= i[None, :] <= i[:, None] + right
    if left >= 0:
        allowed &= i[None, :] >= i[:, None] - left
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]), lse


def _float_heads(query, key, value):
    groups = query.shape[1] // key.shape[1]
    return query.float(), key.float().repeat_interleave(groups, 1), value.float().repeat_interleave(groups, 1)


KERNEL_CALLS = []  # the forward kernel's calls (at run time: a compiled graph calls the op, never this list)


def _cpu_varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                        window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    KERNEL_CALLS.append(int(max_q))
    q, k, v = _float_heads(query, key, value)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])
    for start, end in _documents(cu_seq_q):
        probs, lse[:, start:end] = _probabilities(q, k, start, end, scale, window_size, is_causal)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v[start:end])
    return out.to(query.dtype), lse, torch.zeros(2, dtype=torch.uint64)


def _cpu_varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                         rng_state, scale=None, window_size=None):
    q, k, v = _float_heads(query, key, value)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for start, end in _documents(cu_seq_q):
        probs, _ = _probabilities(q, k, start, end, scale, window_size, is_causal)
        g = grad_out[start:end].float()
        dv[start:end] = torch.einsum("hqk,qhd->khd", probs, g)
        dprobs = torch.einsum("qhd,khd->hqk", g, v[start:end])
        delta = (g * out[start:end].float()).sum(-1).transpose(0, 1)  # [h, n]
        dscores = probs * (dprobs - delta[..., None]) * scale
        dq[start:end] = torch.einsum("hqk,khd->qhd", dscores, k[start:end])
        dk[start:end] = torch.einsum("hqk,qhd->khd", dscores, q[start:end])
    T, K = key.shape[0], key.shape[1]
    dk, dv = (x.view(T, K, -1, x.shape[-1]).sum(2) for x in (dk, dv))  # the query heads sharing a key/value head
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


@pytest.fixture
def varlen_kernel_on_cpu(monkeypatch):
    """torch's varlen ops with CPU kernels, and the CPU taken as a device they serve."""
    varlen._varlen_attn.register_kernel("cpu")(_cpu_varlen_forward)
    varlen._varlen_attn_backward.register_kernel("cpu")(_cpu_varlen_backward)
    monkeypatch.setattr(attention, "VARLEN_KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(attention, "VARLEN_KERNEL", attention.VarlenKernel.of(varlen.varlen_attn))
    KERNEL_CALLS.clear()
    return KERNEL_CALLS


def tiny_model(seed=0, sliding_window=None) -> Transformer:
    torch.manual_seed(seed)
    extra = {"sliding_window": sliding_window, "layer_types": ["sliding_attention", "full_attention"]} \
        if sliding_window else {}
    args = ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64,
                     **extra)
    model = Transformer(args)
    model.init_weights()
    return model


def packed_batch(documents: list[list[int]], seed=0):
    generator = torch.Generator().manual_seed(seed)
    seq_len = sum(documents[0])
    input_ids = torch.randint(0, VOCAB, (len(documents), seq_len), generator=generator)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    return input_ids, position_ids


LAYOUTS = [[[5, 7, 4], [10, 6]], [[3, 3, 3, 7], [16]], [[8, 8], [2, 11, 3]], [[1, 15], [4, 4, 4, 4]]]


def loss_and_grads(model, input_ids, position_ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids, position_ids=position_ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def padded_loss_and_grads(model, input_ids, attention_mask):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids, attention_mask=attention_mask).logits
    real = attention_mask[:, :-1].bool().flatten()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1)[real], input_ids[:, 1:].flatten()[real])
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_grads_close(actual, expected, where):
    for name, want in expected.items():
        scale = want.abs().max().item()
        worst = (actual[name] - want).abs().max().item()
        assert worst <= 3e-2 * scale + 1e-6, (where, name, worst, scale)  # bf16 products, other fusions


def test_the_cpu_kernels_are_per_document_attention(varlen_kernel_on_cpu, monkeypatch):
    """The stand-in kernels against the per-document SDPA path (forward) and autograd through it (backward)."""
    model = tiny_model(sliding_window=5)
    input_ids, position_ids = packed_batch(LAYOUTS[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(input_ids, position_ids=position_ids).logits.float()
    assert len(varlen_kernel_on_cpu) == 2  # both blocks, the sliding one included
    monkeypatch.setattr(attention, "VARLEN_KERNEL_DEVICES", ())  # the per-document SDPA path
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(input_ids, position_ids=position_ids).logits.float()
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()

    q, k, v = (torch.randn(16, heads, 8, dtype=torch.float64, requires_grad=True) for heads in (4, 2, 2))
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    out, lse, _ = _cpu_varlen_forward(q, k, v, cu, cu, 7, 7, window_size=[2, 0])
    grad = torch.randn_like(out)
    mine = _cpu_varlen_backward(grad, q, k, v, out, lse, cu, cu, 7, 7, False, None, window_size=[2, 0])
    theirs = torch.autograd.grad(out, (q, k, v), grad)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the kernels compute in float32


@needs_compile
@pytest.mark.parametrize("policy", ["cpu", "gpu"])
def test_packed_blocks_compile_whole_around_the_varlen_kernel(varlen_kernel_on_cpu, monkeypatch, policy):
    """No graph break in a block, eager's loss and gradients, and new document layouts (numbers of documents, longest
    document) compile no new graph after the first two batches (the GPU policy compiles static shapes first, and the
    longest document's length turns dynamic when it first changes); the same for padded rows."""
    monkeypatch.setenv("HFNATIVE_DEVICE_POLICY", policy)
    torch._dynamo.reset()
    counters.clear()
    eager = tiny_model()
    compiled = apply_compile(copy.deepcopy(eager))
    for index, documents in enumerate(LAYOUTS):
        batch = packed_batch(documents, seed=index)
        loss, grads = loss_and_grads(eager, *batch)
        c_loss, c_grads = loss_and_grads(compiled, *batch)
        torch.testing.assert_close(c_loss, loss, rtol=1e-2, atol=1e-2)
        assert_grads_close(c_grads, grads, (policy, index))
        if index == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a new document layout recompiled a block"
    # padded rows: the kernel runs over the real tokens only (an index of them, of a new length every batch)
    for index, padding in enumerate(([3, 0], [0, 5], [2, 7])):
        mask = torch.ones(2, 16, dtype=torch.long)
        for row, count in enumerate(padding):
            mask[row, :count] = 0
        input_ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(index))
        (loss, grads), (c_loss, c_grads) = (padded_loss_and_grads(model, input_ids, mask) for model in (eager, compiled))
        torch.testing.assert_close(c_loss, loss, rtol=1e-2, atol=1e-2)
        assert_grads_close(c_grads, grads, (policy, "padded", index))
        if index == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a new padding recompiled a block"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert varlen_kernel_on_cpu  # the kernel ran


@needs_compile
@pytest.mark.parametrize("keep", ["nothing", "attention_and_projections"])
def test_a_packed_blocks_checkpoint_runs_inside_its_graph(varlen_kernel_on_cpu, keep):
    """With checkpointing, a packed block compiled whole holds its checkpoint: backward recomputes inside the block's
    graph without calling the block again, and the gradients are eager's. Where the kernel does not serve the layer
    (float32 here) the block keeps the checkpoint around its compiled forward, and runs twice."""
    torch._dynamo.reset()
    eager = tiny_model()
    compiled = apply_activation_checkpointing(apply_compile(copy.deepcopy(eager)), "full", keep=keep)
    calls = [0, 0]
    for index, block in enumerate(compiled.layers):
        block.register_forward_pre_hook(lambda module, args, index=index: calls.__setitem__(index, calls[index] + 1))
    batch = packed_batch(LAYOUTS[2])
    loss, grads = loss_and_grads(eager, *batch)
    c_loss, c_grads = loss_and_grads(compiled, *batch)
    torch.testing.assert_close(c_loss, loss, rtol=1e-2, atol=1e-2)
    assert_grads_close(c_grads, grads, keep)
    assert calls == [1, 1]

    calls[:] = [0, 0]
    compiled.zero_grad(set_to_none=True)
    compiled(*batch[:1], position_ids=batch[1]).logits.sum().backward()  # float32: per-document attention
    assert calls == [2, 2]


@needs_compile
def test_a_packed_blocks_checkpoint_keeps_the_varlen_kernels_result(varlen_kernel_on_cpu, monkeypatch):
    """The graphs inductor's partitioner makes for a checkpointed packed block (captured, not compiled): full
    checkpointing runs ``varlen_attn`` again in backward; keeping the attention saves its result instead (the kept op
    is the custom op itself), and keeping the projections too recomputes 3 matmuls a block fewer."""
    import functools
    from collections import Counter

    from _compile_graphs import capturing_backend

    backend, graphs = capturing_backend()
    batch = packed_batch(LAYOUTS[0])
    recomputed = {}
    for keep in ("nothing", "attention", "attention_and_projections"):
        torch._dynamo.reset()
        graphs["forward"].clear(), graphs["backward"].clear()
        with monkeypatch.context() as patch:
            patch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
            model = apply_activation_checkpointing(apply_compile(tiny_model()), "full", keep=keep)
        loss_and_grads(model, *batch)
        assert len(graphs["forward"]) == len(graphs["backward"]) == 1, keep  # one graph for the blocks
        ops = Counter(str(node.target) for node in graphs["backward"][0].graph.nodes if node.op == "call_function")
        recomputed[keep] = (ops["torch_attn._varlen_attn.default"], ops["aten.mm.default"])
    assert recomputed["nothing"][0] == 1 and recomputed["attention"][0] == 0
    assert recomputed["attention_and_projections"] == (0, recomputed["attention"][1] - 3)


@needs_compile
def test_tensor_parallel_blocks_keep_the_varlen_kernel_out_of_their_static_graphs(varlen_kernel_on_cpu):
    """Blocks compiled for tensor parallelism (static shapes) call the kernel between two graphs: its longest-document
    length would otherwise be a constant of the graph, a new graph for almost every packed batch. New document
    layouts of one row length then compile nothing new."""
    torch._dynamo.reset()
    counters.clear()
    eager = tiny_model()
    compiled = apply_compile(copy.deepcopy(eager), tensor_parallel=True)
    assert all(not block.attention.varlen_in_graph for block in compiled.layers)
    for index, documents in enumerate(LAYOUTS):
        batch = packed_batch(documents, seed=index)
        (loss, grads), (c_loss, c_grads) = (loss_and_grads(model, *batch) for model in (eager, compiled))
        torch.testing.assert_close(c_loss, loss, rtol=1e-2, atol=1e-2)
        assert_grads_close(c_grads, grads, ("tensor parallel", index))
        if index == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a new document layout recompiled a block"
    assert counters["graph_break"], "the kernel ran inside the graph"
    assert len(varlen_kernel_on_cpu) == 2 * 2 * len(LAYOUTS)  # both models' two blocks, every batch


def test_attention_plans_are_not_frozen_dataclasses():
    """A plan goes into every compiled block. torch 2.11's dynamo builds each field of a frozen dataclass it is
    handed and guards on all of them (the number of rows in ``spans``, every int), so packed batches that differ only
    there recompiled the blocks on that release (the recompile tests here fail there with a frozen plan); of a plain
    object it guards only what the graph reads. torch 2.13 builds the fields lazily, so this asks it directly."""
    import dataclasses

    params = attention.AttentionPlan.__dataclass_params__
    assert dataclasses.is_dataclass(attention.AttentionPlan) and not params.frozen
    plan = attention.AttentionPlan("varlen", 8, spans=(((0, 3), (3, 8)),))
    assert plan == plan and plan != attention.AttentionPlan("varlen", 8, spans=plan.spans)  # by identity
    assert {plan: 1}[plan] == 1  # hashable, as a frozen one was
