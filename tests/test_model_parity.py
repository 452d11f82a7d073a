"""Native models vs transformers on the same weights: logits and gradients (fp32)."""

import pytest
import torch
import torch.nn.functional as F
from hf_configs import CONFIGS, VOCAB, save_hf_model
from transformers.core_model_loading import revert_weight_conversion

from hfnative.converters.export import hub_state_dict_pieces, hub_tensor
from hfnative.converters.loading import load_pretrained
from hfnative.converters.parity import parity_batches

SEQ = 16


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_hf_model(request.param, directory)
    converted = load_pretrained(directory)
    return reference, converted


def _native_kwargs(inputs):
    return dict(attention_mask=inputs.get("attention_mask"), position_ids=inputs.get("position_ids"))


# transformers' GPT-OSS builds its masks without position_ids, so it attends across the documents of a
# packed row: there, each document run alone is the reference
PACKED_PER_DOCUMENT = {"gpt_oss"}


def _reference_logits(reference, case, inputs):
    if case != "packed" or reference.config.model_type not in PACKED_PER_DOCUMENT:
        return reference(**inputs, use_cache=False).logits
    starts = (inputs["position_ids"][0] == 0).nonzero()[:, 0].tolist()
    lengths = [end - start for start, end in zip(starts, starts[1:] + [inputs["input_ids"].shape[1]])]
    documents = inputs["input_ids"].split(lengths, dim=1)
    return torch.cat([reference(input_ids=ids, use_cache=False).logits for ids in documents], dim=1)


def test_logits_match_transformers(pair):
    reference, converted = pair
    with torch.no_grad():
        for case, inputs, valid in parity_batches(VOCAB, batch=3, seq_len=SEQ):
            expected = _reference_logits(reference, case, inputs)
            got = converted.model(inputs["input_ids"], **_native_kwargs(inputs)).logits
            diff = (expected[valid] - got[valid]).abs().max().item()
            assert diff <= 1e-5, f"{case}: max |Δlogit| = {diff:.2e}"
            kl = F.kl_div(F.log_softmax(got[valid].double(), -1), F.log_softmax(expected[valid].double(), -1), log_target=True, reduction="batchmean")
            assert kl.item() <= 1e-9, f"{case}: KL = {kl.item():.2e}"


def test_packed_documents_do_not_attend_across_boundaries(pair):
    """A packed row gives each document the logits it has when run on its own."""
    _, converted = pair
    lengths = [5, 7, 4]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = converted.model(ids, position_ids=position_ids).logits
        alone = torch.cat([converted.model(chunk).logits for chunk in ids.split(lengths, dim=1)], dim=1)
    assert (packed - alone).abs().max().item() <= 1e-5


def _masked_nll(logits, input_ids, valid):
    targets = input_ids[:, 1:]
    keep = valid[:, 1:] & valid[:, :-1]
    logp = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets[..., None])[..., 0]
    return -(logp * keep).sum() / keep.sum()


def test_gradients_match_transformers(pair):
    reference, converted = pair
    cases = {case: (inputs, valid) for case, inputs, valid in parity_batches(VOCAB, batch=3, seq_len=SEQ, seed=3)}
    inputs, valid = cases["left-padded"]
    reference.zero_grad()
    converted.model.zero_grad()
    _masked_nll(reference(**inputs, use_cache=False).logits, inputs["input_ids"], valid).backward()
    _masked_nll(converted.model(inputs["input_ids"], **_native_kwargs(inputs)).logits, inputs["input_ids"], valid).backward()

    reference_grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    reference_grads = revert_weight_conversion(reference, reference_grads)  # Hub key names
    native_grads = {name: p.grad for name, p in converted.model.named_parameters()}
    for hf_key, pieces in hub_state_dict_pieces(converted).items():
        got = hub_tensor(pieces, native_grads)
        expected = reference_grads[hf_key]
        scale = expected.abs().max().clamp_min(1e-5)  # a gradient that is zero in exact arithmetic
        rel = ((got - expected).abs().max() / scale).item()
        assert rel <= 1e-5, f"{hf_key}: relative gradient difference {rel:.2e} (max |grad| {scale.item():.2e})"


def _logits_and_grads(model, implementation, ids, **kwargs):
    model.attention_implementation = implementation
    model.zero_grad(set_to_none=True)
    logits = model(ids, **kwargs).logits
    valid = kwargs["attention_mask"].bool() if "attention_mask" in kwargs else torch.ones_like(ids, dtype=torch.bool)
    (logits[valid].float().square().mean()).backward()  # gradients through every real position
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.attention_implementation = "varlen"
    return logits.detach(), valid, grads


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_varlen_attention_equals_dense_mask(pair, layout):
    """Per-document attention (no [S, S] mask) gives the dense-mask path's logits and gradients."""
    _, converted = pair
    generator = torch.Generator().manual_seed(5)
    if layout == "packed":  # two rows of 3 documents; SEQ > the sliding window of the sliding configs
        lengths = [[7, 5, 12], [3, 13, 8]]
        ids = torch.randint(0, VOCAB, (2, 24), generator=generator)
        kwargs = {"position_ids": torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])}
    else:  # right and left padding
        ids = torch.randint(0, VOCAB, (2, 20), generator=generator)
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[0, 15:] = 0
        mask[1, :6] = 0
        kwargs = {"attention_mask": mask}
    plan = converted.model.plan_attention(ids, **{k + "_BS": v for k, v in kwargs.items()})
    assert plan.kind == "varlen" and plan.global_mask is None
    dense_logits, valid, dense_grads = _logits_and_grads(converted.model, "sdpa", ids, **kwargs)
    varlen_logits, _, varlen_grads = _logits_and_grads(converted.model, "varlen", ids, **kwargs)
    assert (varlen_logits[valid] - dense_logits[valid]).abs().max().item() <= 1e-5
    assert dense_grads.keys() == varlen_grads.keys()
    for name, expected in dense_grads.items():
        scale = expected.abs().max().clamp_min(1e-5)
        assert ((varlen_grads[name] - expected).abs().max() / scale).item() <= 1e-5, name
