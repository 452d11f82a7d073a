"""MXFP4 checkpoints (GPT-OSS's experts): the dequantizer against hand-computed values and against
transformers' own, and a quantized checkpoint loading and exporting like its dequantized twin."""

import json

import pytest
import torch
from hf_configs import VOCAB
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig

from hfnative.converters.export import export_hf
from hfnative.converters.families import UnsupportedModelError
from hfnative.converters.loading import load_pretrained
from hfnative.converters.mxfp4 import dequantize_mxfp4

# FP4 E2M1 code points 0..15, written out from the format's definition
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_dequantize_by_hand():
    """Row r holds codes 0..15 then 15..0, two a byte (low nibble first), scaled by 2 ** (scale_r - 127)."""
    codes = list(range(16)) + list(range(15, -1, -1))
    row = torch.tensor([codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)], dtype=torch.uint8)
    blocks = row.repeat(3, 1, 1)  # [R=3, G=1, 16]
    scales = torch.tensor([[127], [130], [120]], dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    expected = torch.tensor([[E2M1[c] * factor for c in codes] for factor in (1.0, 8.0, 2.0**-7)])
    assert got.shape == (3, 32)
    assert torch.equal(got, expected)
    assert torch.equal(dequantize_mxfp4(blocks, scales), expected.to(torch.bfloat16))  # bf16 holds them exactly


def test_dequantize_matches_transformers():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 10, 4), generator=generator, dtype=torch.uint8)
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G*32, R]
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).transpose(-2, -1), expected)


def test_dequantize_rejects_bad_shapes():
    with pytest.raises(ValueError, match="expected"):
        dequantize_mxfp4(torch.zeros(2, 1, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))


# --- a tiny GPT-OSS checkpoint with MXFP4 experts ----------------------------------------------------

QUANTIZED = ("gate_up_proj", "down_proj")


def _tiny_gpt_oss():
    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, max_position_embeddings=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=3, num_experts_per_tok=2,
        sliding_window=5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _quantized_pair(tmp_path):
    """(transformers model with MXFP4-exact experts, its checkpoint dequantized, the same quantized)."""
    model = _tiny_gpt_oss()
    generator = torch.Generator().manual_seed(1)
    quantized = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rpartition(".")[2] not in QUANTIZED:
                continue
            E, columns, rows = param.shape  # the stored layout is the transpose [E, rows, columns]
            blocks = torch.randint(0, 256, (E, rows, columns // 32, 16), generator=generator, dtype=torch.uint8)
            scales = torch.randint(118, 124, (E, rows, columns // 32), generator=generator, dtype=torch.uint8)
            param.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(-2, -1))
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
    model.save_pretrained(str(tmp_path / "dequantized"))
    model.save_pretrained(str(tmp_path / "quantized"))
    tensors = load_file(str(tmp_path / "quantized/model.safetensors"))
    for name in [k for k in tensors if k.rpartition(".")[2] in QUANTIZED]:
        del tensors[name]
    save_file({**tensors, **quantized}, str(tmp_path / "quantized/model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "quantized/config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "quantized/config.json").write_text(json.dumps(config))
    return model, tmp_path / "dequantized", tmp_path / "quantized"


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_mxfp4_checkpoint_loads_and_exports_dequantized(tmp_path):
    reference, dequantized_dir, quantized_dir = _quantized_pair(tmp_path)
    from_quantized = load_pretrained(quantized_dir)
    from_dequantized = load_pretrained(dequantized_dir)
    for (name, a), (_, b) in zip(from_quantized.model.named_parameters(), from_dequantized.model.named_parameters()):
        assert torch.equal(a, b), name

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    assert (_logits(from_quantized.model, ids) - _logits(reference, ids)).abs().max() <= 1e-5
    # transformers reads the quantized folder itself (dequantizing on CPU): the same logits
    hf_quantized = AutoModelForCausalLM.from_pretrained(str(quantized_dir), attn_implementation="eager", dtype=torch.float32)
    assert (_logits(from_quantized.model, ids) - _logits(hf_quantized.eval(), ids)).abs().max() <= 1e-5

    export_hf(from_quantized, tmp_path / "out")  # written dequantized, without the quantization_config
    assert "quantization_config" not in json.loads((tmp_path / "out/config.json").read_text())
    exported, expected = load_file(str(tmp_path / "out/model.safetensors")), load_file(str(dequantized_dir / "model.safetensors"))
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    assert torch.equal(_logits(reloaded, ids), _logits(reference, ids))


def test_mxfp4_checkpoint_in_bfloat16(tmp_path):
    """In bf16 the dequantized experts are exact: the same parameters as the dequantized checkpoint cast."""
    _, dequantized_dir, quantized_dir = _quantized_pair(tmp_path)
    a = load_pretrained(quantized_dir, dtype=torch.bfloat16).model.state_dict()
    b = load_pretrained(dequantized_dir, dtype=torch.bfloat16).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_other_quantization_methods_are_refused(tmp_path):
    _tiny_gpt_oss().save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quant_method='fp8'.*mxfp4"):
        load_pretrained(tmp_path)
