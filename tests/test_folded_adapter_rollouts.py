"""A LoRA policy's rollouts over its folded weights (``NativeRolloutEngine(fold_adapters=...)``): the decoded replica's
LoRA layers are plain linear layers over ``W + s B A``, made once per call. The oracle is the same model with its
adapters merged (``merge_lora``, held to peft's merge in tests/test_peft.py) decoded by the same engine: under bf16
autocast the two decode the same bf16 weights, so their rollouts are equal to the bit."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_configs import VOCAB, make_hf_model

from hfnative.converters.loading import load_pretrained
from hfnative.converters.peft import apply_lora
from hfnative.generation import NativeRolloutEngine, SamplingParams
from hfnative.generation.compute_weights import FUSED, fold_copy_bytes, foldable_adapters
from hfnative.peft.adapters import disable_adapters, merge_lora
from hfnative.peft.lora import LoraLinear

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

CASES = {
    "lora-all-linear": ("qwen3-gqa", dict(r=4, lora_alpha=8, target_modules="all-linear"), {}),
    "dora": ("qwen3-gqa", dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]), {}),
    "int8-base": ("qwen3-gqa", dict(r=4, lora_alpha=8, target_modules="all-linear"), dict(load_in_8bit=True)),
    "phi3-shared-A-and-unadapted": ("phi3-gqa", dict(r=4, lora_alpha=16, target_modules=["qkv_proj"]), {}),
}
SAMPLING = SamplingParams(max_new_tokens=6, seed=3)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 5)]


def _policy(case: str):
    """A converted model with adapters that change its outputs (B drawn, not zero)."""
    checkpoint, fields, quantize = CASES[case]
    converted = load_pretrained(make_hf_model(checkpoint))
    apply_lora(converted, fields, **quantize)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in converted.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return converted.model


def _rollouts(model, **engine):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return NativeRolloutEngine(model, **engine).generate(_prompts(), SAMPLING)


def _merged(model):
    return merge_lora(copy.deepcopy(model))


def _same(ours, theirs):
    assert ours.completion_ids == theirs.completion_ids
    assert all(torch.equal(torch.tensor(a), torch.tensor(b)) for a, b in zip(ours.logprobs, theirs.logprobs))


def _close(ours, theirs, atol: float):
    assert ours.completion_ids == theirs.completion_ids
    for a, b in zip(ours.logprobs, theirs.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=atol)


@pytest.mark.parametrize("case", list(CASES))
def test_folded_rollouts_equal_the_merged_models(case):
    model = _policy(case)
    engine = NativeRolloutEngine(model, fold_adapters=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = engine.generate(_prompts(), SAMPLING)
    _same(out, _rollouts(_merged(model)))
    # the unfolded layers decode the same function, computed another way (in bf16: log-probs compared where the
    # greedy tokens so far agree)
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        folded = engine.generate(_prompts(), greedy)
        unfolded = NativeRolloutEngine(model, fold_adapters=False).generate(_prompts(), greedy)
    gaps = []
    for ours, theirs, ours_lp, theirs_lp in zip(folded.completion_ids, unfolded.completion_ids, folded.logprobs,
                                                unfolded.logprobs):
        agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        gaps += [abs(a - b) for a, b in zip(ours_lp[: agree + 1], theirs_lp[: agree + 1])]
    assert gaps and max(gaps) < 0.05
    replica = engine._weights.replica
    assert not any(isinstance(m, LoraLinear) for m in replica.modules())
    assert all(p.dtype == torch.bfloat16 for name, p in replica.named_parameters() if "layers." in name
               and p.dim() == 2 and type(p.data) is torch.Tensor)
    # the folded projections are stacked: one matmul a block for q/k/v (where all three are LoRA or plain)
    assert all(hasattr(layer.attention, FUSED) for layer in replica.layers)
    # no per-call copies of the adapters or of the folded layers' base weights: the folds replace them
    adapted = foldable_adapters(model, torch.bfloat16)
    adapters = {id(p) for m in adapted for p in (m.weight, m.lora_A, m.lora_B)}
    assert len(engine._weights.folds) == len(adapted) == sum(isinstance(m, LoraLinear) for m in model.modules())
    assert not any(id(weight) in adapters for weight, _ in engine._weights.pairs)


def test_folded_adapters_follow_switches_and_in_place_updates():
    """The folded weights are made at every call: adapters switched off (``disable_adapters``, a reference's
    rollouts) decode the base model, and an adapter changed in place without moving its version counter (fused
    AdamW, writes through ``.data``) decodes as changed."""
    model = _policy("lora-all-linear")
    base = load_pretrained(make_hf_model("qwen3-gqa")).model  # the same weights, no adapters
    engine = NativeRolloutEngine(model, fold_adapters=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = engine.generate(_prompts(), SAMPLING)
        with disable_adapters(model):
            off = engine.generate(_prompts(), SAMPLING)
        lora_B = model.layers[0].attention.wq.lora_B
        version = lora_B._version
        lora_B.data.mul_(-3.0)
        assert lora_B._version == version
        changed = engine.generate(_prompts(), SAMPLING)
        replica = engine._weights.replica
        again = engine.generate(_prompts(), SAMPLING)
    assert engine._weights.replica is replica  # one replica, its copies refilled
    _same(off, _rollouts(base))
    _same(changed, _rollouts(_merged(model)))
    _same(again, changed)
    assert changed.logprobs != first.logprobs


def test_folding_without_autocast_decodes_in_the_weights_dtype():
    """No autocast (float32 weights): the folded copies are float32, and the rollouts match the unfolded layers'."""
    model = _policy("lora-all-linear")
    sampling = SamplingParams(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        engine = NativeRolloutEngine(model, fold_adapters=True)
        ours = engine.generate(_prompts(), sampling)
        theirs = NativeRolloutEngine(model, fold_adapters=False).generate(_prompts(), sampling)
    assert engine._weights.replica is not None and not any(
        isinstance(m, LoraLinear) for m in engine._weights.replica.modules())
    assert engine._weights.folds and all(copy.dtype == torch.float32 for _, copy in engine._weights.folds)
    _close(ours, theirs, atol=1e-4)


def test_a_quantized_base_computing_in_another_dtype_stays_unfolded_without_autocast():
    """An NF4 base computing in bf16 under a float32 model, no autocast: its layers cast their input and output, a
    plain layer would not, so they stay LoRA layers (the engine decodes the model itself); under autocast they fold."""
    checkpoint, fields, _ = CASES["lora-all-linear"]
    converted = load_pretrained(make_hf_model(checkpoint))
    apply_lora(converted, fields, load_in_4bit=True, quantization_config={"bnb_4bit_compute_dtype": "bfloat16"})
    model = converted.model
    assert foldable_adapters(model, None) == [] and len(foldable_adapters(model, torch.bfloat16)) == 14
    sampling = SamplingParams(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        ours = NativeRolloutEngine(model, fold_adapters=True).generate(_prompts(), sampling)
        theirs = NativeRolloutEngine(model, fold_adapters=False).generate(_prompts(), sampling)
    assert ours.completion_ids == theirs.completion_ids and ours.logprobs == theirs.logprobs


def test_a_layer_left_unfolded_keeps_the_shared_adapter():
    """Phi-3's fused qkv_proj: wq, wk and wv share one A. With wk left unfolded (a hook on it), wq and wv fold and wk
    stays a LoRA layer reading a bf16 copy of that A; the rollouts match the unfolded model's."""
    model = _policy("phi3-shared-A-and-unadapted")
    attention = model.layers[0].attention
    assert attention.wq.lora_A is attention.wk.lora_A
    handle = attention.wk.register_forward_hook(lambda module, args, out: None)
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        engine = NativeRolloutEngine(model, fold_adapters=True)
        ours = engine.generate(_prompts(), greedy)
        theirs = NativeRolloutEngine(model, fold_adapters=False).generate(_prompts(), greedy)
    handle.remove()
    replica = engine._weights.replica.layers[0].attention
    assert type(replica.wq) is torch.nn.Linear and isinstance(replica.wk, LoraLinear)
    assert replica.wk.lora_A.dtype == torch.bfloat16 and replica.wk.lora_A is not attention.wk.lora_A
    _close(ours, theirs, atol=0.05)


def test_what_folding_costs_and_the_default():
    """Folding costs no memory where the replica copies the base weights anyway (float32 under bf16 autocast), and a
    copy of each adapted weight where it shares them (already in bf16) or they are quantized. On a CPU the engine
    leaves the adapters unfolded unless asked."""
    model = _policy("lora-all-linear")
    adapted = foldable_adapters(model, torch.bfloat16)
    assert len(adapted) == 7 * len(model.layers)
    assert fold_copy_bytes(model, torch.bfloat16) == 0
    expected = sum(m.weight.numel() * 2 for m in adapted)
    bf16 = _policy("lora-all-linear")
    for m in foldable_adapters(bf16, torch.bfloat16):
        m.weight.data = m.weight.data.to(torch.bfloat16)
    assert fold_copy_bytes(bf16, torch.bfloat16) == expected
    assert fold_copy_bytes(_policy("int8-base"), torch.bfloat16) == expected
    assert fold_copy_bytes(model, None) == 2 * expected  # float32 copies
    # DoRA's float32 weights get no bf16 copy in the replica (autocast casts them at use): folding makes one
    dora = _policy("dora")
    assert fold_copy_bytes(dora, torch.bfloat16) == sum(m.weight.numel() * 2
                                                        for m in foldable_adapters(dora, torch.bfloat16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        engine = NativeRolloutEngine(model)
        engine.generate(_prompts(), SAMPLING)
    assert any(isinstance(m, LoraLinear) for m in engine._weights.replica.modules())


def test_folded_copies_stay_in_the_autocast_dtype_where_nothing_else_is_cast():
    """A frozen QLoRA policy whose other matmul weights are kept in bf16 (``keep_linear_weights_in``) and whose NF4
    layers compute in float32: the replica casts nothing else, yet its folded copies are bf16 (not the NF4 layers'
    float32), the bytes ``fold_copy_bytes`` counts."""
    from hfnative.generation.compute_weights import DecodingWeights
    from hfnative.models.compute_dtype import keep_linear_weights_in

    converted = load_pretrained(make_hf_model("qwen3-mha-tied-bias", dtype=torch.bfloat16))
    apply_lora(converted, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), load_in_4bit=True,
               quantization_config={"bnb_4bit_compute_dtype": "float32"})
    model = converted.model
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    keep_linear_weights_in(model, torch.bfloat16)
    folded = foldable_adapters(model, torch.bfloat16)
    assert folded and all(m.weight.dtype == torch.float32 for m in folded)
    weights = DecodingWeights()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        weights.model_for(model, torch.bfloat16, fold=True)
    assert {copy.dtype for _, copy in weights.folds} == {torch.bfloat16}
    assert sum(copy.numel() * copy.element_size() for _, copy in weights.folds) == fold_copy_bytes(model, torch.bfloat16)
