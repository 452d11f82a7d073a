"""Tensors a block remakes in backward instead of keeping (hfnative.models.recompute): every family's gradients are
bit-identical to autograd keeping them, and a forward keeps less."""

from __future__ import annotations

import pytest
import torch
from hf_configs import ONE_PER_FAMILY, save_hf_model
from transformers import AutoModelForCausalLM, Qwen3Config

from hfnative.allocator import heap_stats
from hfnative.converters.loading import load_pretrained
from hfnative.models.recompute import ENV_SWITCH, keep_as_recomputed, recomputed_in_backward


@pytest.fixture(scope="module", params=ONE_PER_FAMILY)
def native(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, directory)
    model = load_pretrained(directory).model
    model.train()
    return model


def _batch(vocab: int, batch: int = 3, seq: int = 24, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :5] = 0  # left padding: per-document attention
    mask[2, -7:] = 0  # right padding
    return ids, mask


def _loss_and_grads(model, monkeypatch, enabled: bool, bf16: bool = False, backwards: int = 1, **inputs):
    monkeypatch.setenv(ENV_SWITCH, "1" if enabled else "0")
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = model(**inputs).hidden_states
    weights = torch.linspace(-1.0, 1.0, hidden.numel()).view_as(hidden)  # every position's gradient differs
    loss = (hidden.float() * weights).sum()
    for index in range(backwards):
        loss.backward(retain_graph=index < backwards - 1)
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_identical(kept, remade):
    assert torch.equal(kept[0], remade[0])
    assert kept[1].keys() == remade[1].keys()
    for name, grad in kept[1].items():
        assert torch.equal(grad, remade[1][name]), name


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_gradients_are_bit_identical_to_keeping_the_tensors(native, monkeypatch, padded):
    ids, mask = _batch(native.args.vocab_size)
    inputs = dict(input_ids=ids, attention_mask=mask if padded else None)
    kept = _loss_and_grads(native, monkeypatch, False, **inputs)
    _assert_identical(kept, _loss_and_grads(native, monkeypatch, True, **inputs))


def test_bf16_autocast_and_a_second_backward_are_bit_identical(native, monkeypatch):
    ids, mask = _batch(native.args.vocab_size, seed=1)
    inputs = dict(input_ids=ids, attention_mask=mask, bf16=True, backwards=2)
    kept = _loss_and_grads(native, monkeypatch, False, **inputs)
    _assert_identical(kept, _loss_and_grads(native, monkeypatch, True, **inputs))


def test_checkpointed_blocks_are_left_to_activation_checkpointing(native, monkeypatch):
    ids, mask = _batch(native.args.vocab_size, seed=2)
    plain = _loss_and_grads(native, monkeypatch, False, input_ids=ids, attention_mask=mask)
    native.checkpointed_layers = frozenset({0})
    try:
        checkpointed = _loss_and_grads(native, monkeypatch, True, input_ids=ids, attention_mask=mask)
    finally:
        native.checkpointed_layers = frozenset()
    for name, grad in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(heap_stats() is None, reason="needs glibc's mallinfo2 to count the bytes a forward keeps")
def test_a_forward_keeps_less(tmp_path, monkeypatch):
    """Remade instead of kept, per block of a Qwen3 with model dim D = 256 (4 query heads and 2 key/value heads of 64,
    MLP 4 D), in [tokens, D] fp32 tensors: the two pre-norm outputs (2), the rotated queries (1) and keys (0.5), and
    act(gate) * up (4): 7.5 of them."""
    config = Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path).model
    model.train()
    ids = torch.randint(0, 96, (4, 256))

    def kept_by_forward(enabled: bool) -> int:
        monkeypatch.setenv(ENV_SWITCH, "1" if enabled else "0")
        before = heap_stats().in_use
        hidden = model(ids).hidden_states
        kept = heap_stats().in_use - before
        del hidden
        return kept

    kept_bytes = {enabled: kept_by_forward(enabled) for enabled in (False, True)}
    one_tensor = 4 * 256 * 256 * 4  # [tokens, D] fp32 bytes
    saved = kept_bytes[False] - kept_bytes[True]
    assert saved >= 0.95 * 2 * 7.5 * one_tensor, kept_bytes


def test_a_tensor_remade_once_for_every_node_that_saved_it():
    x = torch.randn(5, 7, requires_grad=True)
    calls = []

    def remake():
        calls.append(1)
        return x.exp()

    def loss_of(y):
        return (y * y).sum() + (y.sin() * 3).sum()  # mul saves y twice, sin once

    loss_of(x.exp()).backward()
    kept = x.grad.clone()
    x.grad = None
    with recomputed_in_backward():
        loss = loss_of(keep_as_recomputed(x.exp(), remake))
    loss.backward()
    assert len(calls) == 1
    assert torch.equal(x.grad, kept)
    torch.testing.assert_close(x.grad, 2 * x.exp() ** 2 + 3 * x.exp().cos() * x.exp())


def test_a_remade_tensor_of_another_layout_is_an_error():
    x = torch.randn(4, 6, requires_grad=True)
    with recomputed_in_backward():
        y = keep_as_recomputed(x * 2, lambda: (x * 2).t().contiguous().t())  # same values, column-major
        loss = (y * y).sum()
    with pytest.raises(RuntimeError, match=ENV_SWITCH):
        loss.backward()


def test_nothing_is_remade_without_grad_mode_or_under_other_hooks():
    x = torch.randn(3, requires_grad=True)
    remade = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), recomputed_in_backward():
        y = keep_as_recomputed(x * 2, lambda: remade.append(1) or x * 2)
        (y * y).sum().backward()
    with torch.no_grad(), recomputed_in_backward():
        keep_as_recomputed(x * 2, lambda: remade.append(1) or x * 2)
    assert not remade
