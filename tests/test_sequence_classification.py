"""Native sequence classifiers (reward models) vs transformers' ``*ForSequenceClassification`` on the same weights.

- Every tiny config of tests/hf_configs.py as a 3-label classifier: scores equal transformers' (fp32, max |Δ| <=
  1e-5) on right-padded, left-padded and unpadded rows, pooled at the last non-pad token; without a pad token a
  single row is scored at its last position and a batch is refused, as transformers refuses it.
- One config per family: the classifier exported back is tensor-for-tensor the checkpoint, its config.json names
  the classifier, and AutoModelForSequenceClassification loads it and scores the same.
- A causal-LM checkpoint given num_labels: its LM head dropped, a new score head equal to the one transformers'
  AutoModelForSequenceClassification draws under the same seed; exported, transformers loads it with no key missing.
"""

import json
from pathlib import Path

import pytest
import torch
from hf_configs import CONFIGS, EAGER_ONLY, ONE_PER_FAMILY, VOCAB, save_hf_model
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, set_seed

from hfnative.converters.export import export_hf
from hfnative.converters.loading import load_pretrained

PAD = VOCAB - 1
LABELS = 3


def _hf_classifier(name: str, pad_token_id=PAD):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    config.num_labels = LABELS
    config.pad_token_id = pad_token_id
    attention = "eager" if config.model_type in EAGER_ONLY else "sdpa"
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32, attn_implementation=attention)
    with torch.no_grad():  # norms start at exactly 1 (or 0); sinks and router biases small: perturb them
        for param_name, param in model.named_parameters():
            if "norm" in param_name or param_name.endswith("sinks") or param_name.endswith("_bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if param_name == "score.weight":
                param.normal_(0.0, 1.0)  # scores of order 1, so a wrong pooled position shows
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"cls-{request.param}")
    reference = _hf_classifier(request.param)
    reference.save_pretrained(str(directory))
    return reference, load_pretrained(directory), directory


def _batches():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, PAD, (3, 14), generator=generator)  # no pad token among the real ones
    right, left = ids.clone(), ids.clone()
    mask_right, mask_left = torch.ones_like(ids), torch.ones_like(ids)
    for row, length in enumerate((14, 9, 4)):
        right[row, length:], mask_right[row, length:] = PAD, 0
        left[row, : 14 - length], mask_left[row, : 14 - length] = PAD, 0
    return {"unpadded": (ids, torch.ones_like(ids)), "right-padded": (right, mask_right), "left-padded": (left, mask_left)}


def test_scores_match_transformers(pair):
    reference, converted, _ = pair
    assert converted.model.args.num_labels == LABELS and converted.model.args.pad_token_id == PAD
    with torch.no_grad():
        for case, (ids, mask) in _batches().items():
            expected = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
            got = converted.model(ids, attention_mask=mask).logits
            assert got.shape == expected.shape == (3, LABELS)
            diff = (expected - got).abs().max().item()
            assert diff <= 1e-5, f"{case}: max |Δscore| = {diff:.2e}"


def test_without_pad_token_one_row_is_scored_at_its_end(pair):
    reference, converted, _ = pair
    reference.config.get_text_config().pad_token_id = None
    converted.model.args.pad_token_id = None
    ids, _ = _batches()["unpadded"]
    try:
        with torch.no_grad():
            expected = reference(input_ids=ids[:1], use_cache=False).logits
            got = converted.model(ids[:1]).logits
        assert (expected - got).abs().max().item() <= 1e-5
        with pytest.raises(ValueError, match="Cannot handle batch sizes > 1 if no padding token is defined"):
            reference(input_ids=ids)
        with pytest.raises(ValueError, match="Cannot handle batch sizes > 1 if no padding token is defined"):
            converted.model(ids)
    finally:
        reference.config.get_text_config().pad_token_id = PAD
        converted.model.args.pad_token_id = PAD


def _safetensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_export_is_the_checkpoint_and_transformers_scores_it_the_same(name, tmp_path):
    source = tmp_path / "source"
    _hf_classifier(name).save_pretrained(str(source))
    converted = load_pretrained(source)
    out = export_hf(converted, tmp_path / "exported")
    original, exported = _safetensors(source), _safetensors(out)
    assert original.keys() == exported.keys() and "score.weight" in exported and "lm_head.weight" not in exported
    for key, tensor in original.items():
        assert torch.equal(tensor, exported[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(AutoModelForSequenceClassification.from_config(converted.config)).__name__]
    assert config["architectures"][0].endswith("ForSequenceClassification")
    reloaded = AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32).eval()
    ids, mask = _batches()["right-padded"]
    with torch.no_grad():
        diff = (reloaded(input_ids=ids, attention_mask=mask).logits - converted.model(ids, attention_mask=mask).logits)
    assert diff.abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["llama-mha-tied-llama3", "qwen3moe-topk-norm", "gemma3-softcap-linear-untied"])
def test_causal_checkpoint_gets_transformers_new_score_head(name, tmp_path):
    causal = tmp_path / "causal"
    save_hf_model(name, causal)
    set_seed(11)
    reference = AutoModelForSequenceClassification.from_pretrained(str(causal), num_labels=1, dtype=torch.float32).eval()
    converted = load_pretrained(causal, num_labels=1, score_seed=11)
    assert torch.equal(converted.model.output.weight, reference.score.weight)
    assert not converted.model.output.is_tied  # even when the causal LM ties its head to the embedding
    reference.config.pad_token_id = converted.config.pad_token_id = converted.model.args.pad_token_id = PAD
    ids, mask = _batches()["left-padded"]
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        assert (converted.model(ids, attention_mask=mask).logits - expected).abs().max().item() <= 1e-5
    out = export_hf(converted, tmp_path / "exported")
    assert "lm_head.weight" not in _safetensors(out) and not (out / "generation_config.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and config["pad_token_id"] == PAD
    reloaded, info = AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32,
                                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert (reloaded.eval()(input_ids=ids, attention_mask=mask).logits - expected).abs().max().item() <= 1e-5


def test_meta_model_is_the_classifier_and_causal_trainers_refuse_it(tmp_path):
    """A distributed run builds the classifier on the meta device with the checkpoint's keys; a trainer of causal LMs
    refuses a classifier, naming it and what to pass instead."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    import hfnative
    from hfnative.converters.families import model_pieces
    from hfnative.converters.loading import SafetensorsSource, check_checkpoint
    from hfnative.converters.sharded_loading import meta_model
    from hfnative.models.classifier import SequenceClassifier

    _hf_classifier("qwen3-gqa").save_pretrained(str(tmp_path / "classifier"))
    meta = meta_model(tmp_path / "classifier")
    assert isinstance(meta.model, SequenceClassifier) and meta.model.args.num_labels == LABELS
    check_checkpoint(SafetensorsSource(tmp_path / "classifier"), model_pieces(meta.family, meta.model.args), meta.model, "x")
    tokenizer = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3"))
    args = hfnative.SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match="is Qwen3ForSequenceClassification: .* pass a \\*ForCausalLM checkpoint"):
        hfnative.SFTTrainer(model=str(tmp_path / "classifier"), args=args, train_dataset=Dataset.from_list([{"text": "a"}]),
                            processing_class=tokenizer)
