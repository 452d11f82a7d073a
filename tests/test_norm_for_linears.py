"""A pre-norm's output under autocast (``RMSNorm.for_linears``): the norm writes it in the autocast dtype once and
hands each linear layer a view, where autocast would cast the float32 output once for each layer and keep each copy
for backward. Checked against autograd on that op sequence (outputs bit for bit, gradients to float32 round-off: only
the order of the layers' gradients' sum differs), and in a model: each pre-norm keeps one copy, not one per layer."""

from __future__ import annotations

import pytest
import torch

from hfnative.device_policy import use_device_policy
from hfnative.models.args import ModelArgs
from hfnative.models.decoder import Transformer
from hfnative.models.layers import RMSNorm, cast_for_linears

D = 24


def _setup(float_offset, seed=0):
    generator = torch.Generator().manual_seed(seed)
    norm = RMSNorm(D, 1e-6, unit_offset=float_offset == 1.0, scale_in_float32=float_offset == 0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=generator) * 0.3 + (0 if float_offset == 1.0 else 1))
    linears = [torch.nn.Linear(D, width, bias=False) for width in (16, 8, 8)]
    for linear in linears:
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.2)
    x = (torch.randn(2, 7, D, generator=generator) * 3).requires_grad_()
    upstream = [torch.randn(2, 7, linear.out_features, generator=generator) for linear in linears]
    return norm, linears, x, upstream


def _run(float_offset, fanned: bool, consumers: int):
    """float_offset "none": no norm (a post-norm block's sublayer input, ``cast_for_linears``)."""
    norm, linears, x, upstream = _setup(None if float_offset == "none" else float_offset)
    linears = linears[:consumers]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if float_offset == "none":  # the residual stream: not a leaf (autocast caches a leaf's cast, as a weight's)
            stream = x * 1.0
            inputs = cast_for_linears(stream, consumers) if fanned else (stream,) * consumers
        else:
            inputs = norm.for_linears(x, consumers) if fanned else (norm(x),) * consumers
        outs = [linear(inp) for linear, inp in zip(linears, inputs)]
    loss = sum((out.float() * up).sum() for out, up in zip(outs, upstream))
    loss.backward()
    params = ([] if float_offset == "none" else [norm.weight]) + [linear.weight for linear in linears]
    return inputs, outs, x.grad, [p.grad for p in params]


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("float_offset", [None, 1.0, 0.0, "none"], ids=["llama", "gemma", "olmo", "no-norm"])
def test_fanned_out_norm_equals_a_cast_for_each_linear(float_offset, consumers):
    inputs, outs, grad_x, grads = _run(float_offset, fanned=True, consumers=consumers)
    _, want_outs, want_grad_x, want_grads = _run(float_offset, fanned=False, consumers=consumers)
    assert all(inp.dtype == torch.bfloat16 for inp in inputs)
    assert len({inp.data_ptr() for inp in inputs}) == 1  # one tensor's views
    for out, want in zip(outs, want_outs):
        assert torch.equal(out, want)
    torch.testing.assert_close(grad_x, want_grad_x, rtol=1e-5, atol=1e-6)
    layers = 0 if float_offset == "none" else 1
    if layers:
        torch.testing.assert_close(grads[0], want_grads[0], rtol=1e-5, atol=1e-5)  # the norm's weight
    for got, want in zip(grads[layers:], want_grads[layers:]):  # the layers' weights: the same inputs and gradients
        assert torch.equal(got, want)


def test_without_autocast_the_output_is_the_norms_own():
    norm, _, x, _ = _setup(None)
    outs = norm.for_linears(x, 3)
    assert len(outs) == 3 and all(out is outs[0] for out in outs) and outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], norm(x), rtol=0, atol=0)
    assert cast_for_linears(x, 2) == (x, x)


def _model(norm_placement="pre"):
    torch.manual_seed(0)
    # attention width 4 x 8 = 32 differs from the model's 40: tensors of width 40 are the residual stream's
    args = ModelArgs(vocab_size=64, dim=40, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=56,
                     qk_norm=True, norm_placement=norm_placement)
    model = Transformer(args)
    model.init_weights()
    return model


def _saved_bf16_inputs_and_grads(model, input_ids):
    """Distinct bf16 [tokens, D] storages kept for backward (a linear layer's input), their bytes, and the
    gradients."""
    storages = {}

    def pack(tensor):
        if tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == (input_ids.numel(), model.args.dim):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    model.zero_grad(set_to_none=True)
    with use_device_policy("gpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
    return len(storages), sum(storages.values()), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("norm_placement", ["pre", "post"])
def test_each_pre_norm_keeps_one_copy_for_its_linears(monkeypatch, norm_placement):
    """Pre-norms (Llama, Qwen3) and post-norm blocks, whose sublayers read the residual stream itself (OLMo)."""
    from hfnative.models import layers

    input_ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    count, nbytes, loss, grads = _saved_bf16_inputs_and_grads(_model(norm_placement), input_ids)
    # the same model with autocast casting the float32 inputs for each layer (transformers' op sequence)
    monkeypatch.setattr(layers, "narrowing_autocast_dtype", lambda x, produced: None)
    cast_count, cast_bytes, cast_loss, cast_grads = _saved_bf16_inputs_and_grads(_model(norm_placement), input_ids)
    # a block: the attention's pre-norm feeds q, k and v, the MLP's the gate and up projections; the output head
    # keeps the final norm's output, cast once either way
    assert (cast_count, count) == (2 * (3 + 2) + 1, 2 * 2 + 1)
    assert nbytes * 11 == cast_bytes * 5
    assert torch.equal(loss, cast_loss)
    for name, grad in cast_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_lora_projections_keep_their_input_as_autocast_casts_it(tmp_path, monkeypatch):
    """A LoRA projection reads its input twice (base and adapter): it is not handed a bf16 view (autograd would sum
    the two reads' gradients in bf16), so its gradients are bit-identical to transformers' op sequence's."""
    from hf_configs import save_hf_model

    from hfnative.converters.loading import load_pretrained
    from hfnative.converters.peft import apply_lora
    from hfnative.models import layers

    save_hf_model("qwen3-gqa", tmp_path)

    def grads():
        converted = load_pretrained(tmp_path)
        torch.manual_seed(0)
        apply_lora(converted, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
        with torch.no_grad():  # lora_B starts at zero
            for name, param in sorted(converted.model.named_parameters()):
                if "lora_B" in name:
                    param.add_(0.1)
        model = converted.model.train()
        ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    fanned = grads()
    monkeypatch.setattr(layers, "narrowing_autocast_dtype", lambda x, produced: None)
    for name, grad in grads().items():
        assert torch.equal(fanned[name], grad), name
