"""The decoder blocks' activation checkpoint (hfnative.models.block_checkpoint) against an un-checkpointed run and
torch.utils.checkpoint: the same gradients to the bit (a real block, fp32 and bf16 autocast; dropout draws the same
mask in the recompute), the recompute stops at the last tensor backward needs, a second backward recomputes again,
clear errors where the recompute cannot give what forward saved, and a fraction of torch's host work."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from hf_configs import save_hf_model

from hfnative.converters.loading import load_pretrained
from hfnative.models.block_checkpoint import CheckpointError, checkpoint_block


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    save_hf_model("qwen3-gqa", directory)
    return load_pretrained(directory).model.train()


def _block_inputs(model, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 12, model.args.dim, generator=generator, requires_grad=True)
    positions = torch.arange(12).expand(2, 12)
    cos_sin = model.rope(positions, torch.float32)
    plan = model.plan_attention(torch.zeros(2, 12, dtype=torch.long), None, None)
    return x, cos_sin, plan


def _gradients(model, run, bf16: bool):
    block = model.layers[0]
    x, cos_sin, plan = _block_inputs(model)
    block.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = run(block, x, cos_sin, plan)
    weights = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    (out.float() * weights).sum().backward()
    return [x.grad] + [p.grad for p in block.parameters()]


def _torch_checkpoint(fn, *args):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_checkpointed_block_has_the_plain_blocks_gradients(qwen3, bf16):
    plain = _gradients(qwen3, lambda fn, *args: fn(*args), bf16)
    ours = _gradients(qwen3, checkpoint_block, bf16)
    torchs = _gradients(qwen3, _torch_checkpoint, bf16)
    for expected, by_torch, got in zip(plain, torchs, ours):
        assert torch.equal(got, expected)
        assert torch.equal(got, by_torch)


def test_the_recompute_draws_the_forwards_random_numbers():
    weight = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        return F.dropout(x @ weight, p=0.5, training=True).tanh()

    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(3)
    fn(x).sum().backward()
    expected = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None
    torch.manual_seed(3)
    out = checkpoint_block(fn, x)
    torch.rand(100)  # the generator moves on before backward
    out.sum().backward()
    assert torch.equal(weight.grad, expected[0]) and torch.equal(x.grad, expected[1])


def test_the_recompute_stops_at_the_last_tensor_backward_needs():
    ran = []

    def fn(x):
        ran.append("start")
        y = x.sin()  # saves x
        z = y.exp()  # saves its result: the last saved tensor
        ran.append("after the last save")
        return z * 2.0 + 1.0  # a Python number: nothing saved

    x = torch.randn(5, requires_grad=True)
    out = checkpoint_block(fn, x)
    out.sum().backward()
    assert ran == ["start", "after the last save", "start"]
    assert torch.allclose(x.grad, 2.0 * x.sin().exp() * x.cos())


def test_a_second_backward_recomputes_again():
    """Backward takes each recomputed tensor from the checkpoint (which keeps none: they are freed with the nodes
    that read them), so a second backward (retain_graph) recomputes the block again, as torch's does."""
    weight = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)
    runs = []

    def fn(t):
        runs.append(None)
        return (t @ weight).sigmoid() @ weight

    out = checkpoint_block(fn, x)
    out.sum().backward(retain_graph=True)
    once = weight.grad.clone()
    out.sum().backward()
    assert torch.allclose(weight.grad, 2 * once)
    assert len(runs) == 3


def test_an_input_changed_in_place_after_forward_is_refused():
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    out = checkpoint_block(lambda t: (t @ weight).relu(), x)
    x.add_(1.0)
    with pytest.raises(CheckpointError, match="changed in place"):
        out.sum().backward()


@pytest.mark.parametrize("change", ["shape", "fewer"])
def test_a_recompute_that_saves_other_tensors_is_refused(change):
    weight = torch.randn(4, 4, requires_grad=True)
    calls = []

    def fn(x):
        calls.append(None)
        again = len(calls) > 1
        if change == "shape" and again:
            return (x[:1] @ weight).relu().sum() + (x @ weight).sum() * 0
        if change == "fewer" and again:
            return (x @ weight).sum()
        return (x @ weight).relu().sum()

    out = checkpoint_block(fn, torch.randn(2, 4))
    with pytest.raises(CheckpointError, match="must run the same ops"):
        out.backward()


def test_a_saved_tensor_read_twice_in_one_backward_is_refused():
    class ReadsTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            ctx.saved_tensors  # noqa: B018
            (x,) = ctx.saved_tensors
            return grad * 2

    out = checkpoint_block(lambda t: ReadsTwice.apply(t.sin()), torch.randn(3, requires_grad=True))
    with pytest.raises(CheckpointError, match="twice"):
        out.sum().backward()


def test_without_gradients_the_block_just_runs():
    with torch.no_grad():
        out = checkpoint_block(lambda t: t * 2, torch.ones(3))
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_the_checkpoint_makes_a_fraction_of_torchs_python_calls(qwen3):
    """torch's hooks run a holder, a weak reference, a dict and a dynamo-disable wrapper for each saved tensor; a
    block's forward and backward through ours makes under half of the Python calls torch's adds to the plain run."""
    block = qwen3.layers[0]
    x, cos_sin, plan = _block_inputs(qwen3)

    def calls(run) -> int:
        run(block, x, cos_sin, plan).sum().backward()  # warm: first-call caches
        count = [0]

        def profile(frame, event, arg):
            if event in ("call", "c_call"):
                count[0] += 1

        sys.setprofile(profile)
        try:
            run(block, x, cos_sin, plan).sum().backward()
        finally:
            sys.setprofile(None)
        return count[0]

    plain = calls(lambda fn, *args: fn(*args))
    ours, torchs = calls(checkpoint_block), calls(_torch_checkpoint)
    assert ours - plain < 0.5 * (torchs - plain), (plain, ours, torchs)
