"""Checkpoint loading, export round trips, error reporting and the parity command."""

import json
import subprocess
import sys
from pathlib import Path
import pytest
import torch
from hf_configs import ONE_PER_FAMILY, VOCAB, make_hf_model, save_hf_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hfnative.converters import parity
from hfnative.converters.export import export_hf
from hfnative.converters.families import UnsupportedModelError
from hfnative.converters.hub import resolve_model_dir
from hfnative.converters.loading import CheckpointError, load_pretrained


def _all_tensors(directory):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _logits(model_or_native, ids):
    with torch.no_grad():
        out = model_or_native(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact_and_loads_in_transformers(name, dtype, tmp_path):
    original = save_hf_model(name, tmp_path / "src", dtype=dtype)
    converted = load_pretrained(tmp_path / "src")
    assert next(converted.model.parameters()).dtype == dtype  # the config's dtype
    export_hf(converted, tmp_path / "out")

    before, after = _all_tensors(tmp_path / "src"), _all_tensors(tmp_path / "out")
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype, key
        assert torch.equal(before[key], after[key]), key
    assert json.loads((tmp_path / "src/config.json").read_text()) == json.loads((tmp_path / "out/config.json").read_text())
    assert (tmp_path / "out/generation_config.json").exists()

    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=dtype).eval()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(reloaded, ids), _logits(original, ids))


def test_sharded_checkpoint_loads_and_export_shards(tmp_path):
    reference = save_hf_model("qwen3moe-topk-norm", tmp_path / "src", max_shard_size="20KB")
    assert (tmp_path / "src/model.safetensors.index.json").exists()
    converted = load_pretrained(tmp_path / "src")
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    assert (_logits(reference, ids) - _logits(converted.model, ids)).abs().max() <= 1e-5

    export_hf(converted, tmp_path / "out", max_shard_size="20KB")
    index = json.loads((tmp_path / "out/model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / "out" / s).exists() for s in shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _all_tensors(tmp_path / "src").values())
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert torch.equal(_logits(reloaded, ids), _logits(reference, ids))


def test_transformers_model_object_converts_in_memory():
    reference = make_hf_model("mixtral-top2")
    converted = load_pretrained(reference)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    assert (_logits(reference, ids) - _logits(converted.model, ids)).abs().max() <= 1e-5


def test_dtype_override(tmp_path):
    save_hf_model("qwen3-gqa", tmp_path)
    converted = load_pretrained(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in converted.model.parameters()} == {torch.bfloat16}


def test_legacy_rope_fields_read_like_transformers(tmp_path):
    """Older Hub configs carry top-level rope_theta + rope_scaling instead of rope_parameters."""
    save_hf_model("llama-mha-tied-llama3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    converted = load_pretrained(tmp_path)
    assert converted.args.rope.scaling == "llama3" and converted.args.rope.theta == 500000.0
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    assert (_logits(reference, ids) - _logits(converted.model, ids)).abs().max() <= 1e-5


# --- bad checkpoints: a clear error, and no model ------------------------------------------------


@pytest.fixture
def sharded(tmp_path):
    save_hf_model("llama-gqa", tmp_path, max_shard_size="20KB")
    return tmp_path


def test_missing_shard_names_the_file(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (sharded / victim).unlink()
    with pytest.raises(CheckpointError, match=victim):
        load_pretrained(sharded)


def test_truncated_file_is_reported(sharded):
    victim = sorted(sharded.glob("model-*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=victim.name):
        load_pretrained(sharded)


def test_wrong_shape_missing_and_unexpected_tensors_are_listed(tmp_path):
    save_hf_model("llama-gqa", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(7, 32)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_pretrained(tmp_path)
    message = str(err.value)
    assert "model.layers.0.self_attn.q_proj.weight: checkpoint [7, 32]" in message
    assert "model.layers.1.mlp.up_proj.weight" in message and "missing" in message
    assert "model.layers.0.mystery.weight" in message and "unexpected" in message


def test_unsupported_architecture_and_rope_type(tmp_path):
    save_hf_model("llama-gqa", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForTokenClassification"]}))
    with pytest.raises(UnsupportedModelError, match="LlamaForTokenClassification.*Qwen3ForCausalLM"):
        load_pretrained(tmp_path)
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    with pytest.raises(UnsupportedModelError, match="dynamic.*llama3"):
        load_pretrained(tmp_path)


def test_pytorch_bin_only_checkpoint_is_refused(tmp_path):
    save_hf_model("llama-gqa", tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only from safetensors"):
        load_pretrained(tmp_path)


def test_missing_local_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_pretrained(tmp_path / "nope")


# --- Hub ids resolve through huggingface_hub's cache (offline) -------------------------------------


def test_hub_id_resolves_from_the_cache_offline(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / ("a" * 40)
    save_hf_model("llama-gqa", snapshot)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir(parents=True)
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert resolve_model_dir("tiny-org/tiny-llama", cache_dir=str(cache)) == snapshot
    converted = load_pretrained("tiny-org/tiny-llama", cache_dir=str(cache))
    assert converted.source_dir == snapshot
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1"):
        resolve_model_dir("tiny-org/absent", cache_dir=str(cache))


# --- hfnative-parity --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3-alternating", "gptoss-alternating-yarn"])  # SDPA / eager reference
def test_parity_command_passes_on_a_faithful_checkpoint(name, tmp_path, capsys):
    save_hf_model(name, tmp_path)
    assert parity.main(["--model_name_or_path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "packed" in out and "left-padded" in out and "PASS" in out


def test_parity_command_fails_past_tolerance(tmp_path, monkeypatch, capsys):
    save_hf_model("qwen2-gqa", tmp_path)
    from hfnative.converters import loading

    real_load = loading.load_pretrained

    def perturbed(*args, **kwargs):
        converted = real_load(*args, **kwargs)
        with torch.no_grad():
            converted.model.norm.weight.mul_(1.01)
        return converted

    monkeypatch.setattr(loading, "load_pretrained", perturbed)
    assert parity.main(["--model_name_or_path", str(tmp_path)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_parity_command_reports_bad_input(tmp_path, capsys):
    assert parity.main(["--model_name_or_path", str(tmp_path / "missing")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_bad_checkpoint_is_rejected_before_any_tensor_is_read(tmp_path, monkeypatch):
    save_hf_model("llama-gqa", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    from hfnative.converters import loading

    def never(*args, **kwargs):
        raise AssertionError("tensors were copied before the checkpoint was checked")

    monkeypatch.setattr(loading, "copy_into_model", never)
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_pretrained(tmp_path)


_PEAK_SCRIPT = r"""
import re, sys
from hfnative.converters.loading import load_pretrained
def mem(field):
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
load_pretrained(sys.argv[1])  # warm up: every import loading needs
before = mem("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
converted = load_pretrained(sys.argv[2])
params = list(converted.model.parameters())
print(mem("VmHWM") - before, sum(p.numel() * p.element_size() for p in params), max(p.numel() * p.element_size() for p in params))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to read peak memory")
def test_loading_peak_memory_is_one_copy_of_the_weights(tmp_path):
    """Peak memory while loading: the weights plus about one tensor, not two copies."""
    from transformers import LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "big"))
    save_hf_model("llama-gqa", tmp_path / "small")
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "small"), str(tmp_path / "big")],
                         capture_output=True, text=True, check=True).stdout.split()
    growth, weights, largest = map(int, out[-3:])
    assert growth <= weights + 2 * largest + 24 * 2**20, f"peak grew {growth / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"
