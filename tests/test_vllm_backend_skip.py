"""The vLLM backend's parts that need no vllm: backend selection from TRL's arguments, weights under Hub
names (adapters merged) and the folder the CPU weight transport writes. The backend itself is exercised
in tests/vllm_backend/ (run in .venv-vllm by scripts/vllm_env.sh; skipped here when vllm is not importable)."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from trl import GRPOConfig

from hfnative.converters.hub_model import attach_hub_surface
from hfnative.converters.loading import load_pretrained
from hfnative.converters.rollouts import hub_named_tensors, vllm_dtype, vllm_model_folder
from hfnative.generation import NativeRolloutEngine, SamplingParams
from hfnative.generation.vllm_backend import vllm_sampling_kwargs, write_weights_folder
from hfnative.peft import LoraTarget, add_lora
from hfnative.trainers.rollout.engines import make_rollout_engine

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3"
HAS_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("vllm").origin is not None


def _config(tmp_path, **fields) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **fields)


def test_native_engine_unless_use_vllm(tmp_path):
    converted = load_pretrained(TINY)
    engine = make_rollout_engine(converted, _config(tmp_path))
    assert isinstance(engine, NativeRolloutEngine) and engine.model is converted.model  # live weights
    assert engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, do_sample=False)).finish_reason == ["length"]


def test_bad_vllm_mode_is_a_value_error(tmp_path):
    config = _config(tmp_path, use_vllm=True)
    config.vllm_mode = "remote"  # TRL checks the mode only when its trainer starts vLLM
    with pytest.raises(ValueError, match="vllm_mode='remote'"):
        make_rollout_engine(str(TINY), config)


@pytest.mark.skipif(HAS_VLLM, reason="vllm is importable here")
def test_use_vllm_without_vllm_says_what_to_do(tmp_path):
    for mode in ("colocate", "server"):
        with pytest.raises(ImportError, match="use_vllm=False"):
            make_rollout_engine(str(TINY), _config(tmp_path, use_vllm=True, vllm_mode=mode))


def test_vllm_runs_in_the_models_dtype():
    assert vllm_dtype(str(TINY)) == "float32"  # from config.json; vLLM's "auto" would pick bfloat16 on CPU
    assert vllm_dtype(load_pretrained(TINY, dtype=torch.bfloat16).model) == "bfloat16"
    assert vllm_dtype(load_pretrained(TINY)) == "float32"
    assert vllm_model_folder(str(TINY)) == str(TINY)
    assert vllm_model_folder(load_pretrained(TINY)) == str(TINY)  # the folder it was loaded from


def test_sampling_settings_in_vllms_terms():
    greedy = vllm_sampling_kwargs(SamplingParams(max_new_tokens=5, do_sample=False, eos_token_id=2, stop_token_ids=[7, 2]))
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and "seed" not in greedy
    # stop exactly on the given ids, never on the model's own EOS
    assert greedy["stop_token_ids"] == [2, 7] and greedy["ignore_eos"] is True
    assert greedy["max_tokens"] == 5 and greedy["logprobs"] == 0 and greedy["n"] == 1
    sampled = vllm_sampling_kwargs(SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                                                  repetition_penalty=1.2, seed=3))
    assert {k: sampled[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")} == dict(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.2, seed=3)
    assert sampled["stop_token_ids"] == []
    assert "structured_outputs" not in sampled


def test_structured_outputs_regex_reaches_vllm_and_nothing_else(tmp_path):
    """vllm_structured_outputs_regex: the rollout's sampling carries it to vLLM's structured outputs (as TRL passes it);
    without vLLM it is refused at the start (TRL drops it), and the native engine refuses a regex it cannot honour."""
    import hfnative
    from datasets import Dataset

    regex = r"(yes|no)\."
    assert vllm_sampling_kwargs(SamplingParams(max_new_tokens=4, regex=regex))["structured_outputs"] == {"regex": regex}
    with pytest.raises(ValueError, match="decoded by the vLLM backends only"):
        NativeRolloutEngine(load_pretrained(TINY)).generate([[5, 6]], SamplingParams(max_new_tokens=2, regex=regex))
    rows = Dataset.from_list([{"prompt": "Say yes"}] * 8)
    fields = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, num_generations=2,
                  per_device_train_batch_size=2, max_completion_length=4, vllm_structured_outputs_regex=regex)
    with pytest.raises(ValueError, match="vllm_structured_outputs_regex=.*use_vllm=True"):
        hfnative.GRPOTrainer(model=str(TINY), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                             args=hfnative.GRPOConfig(**fields), train_dataset=rows)
    from hfnative.trainers.rollout.prompts import sampling_params

    # the rollout's sampling under use_vllm=True (tests/vllm_backend trains with it through vLLM itself)
    assert sampling_params(hfnative.GRPOConfig(**fields, use_vllm=True), 4, [2]).regex == regex
    assert sampling_params(hfnative.GRPOConfig(**{**fields, "vllm_structured_outputs_regex": None}), 4, [2]).regex is None


def _lora_model():
    """tiny-qwen3 with adapters on q/v/gate/down whose B is non-zero (so the merge changes the weights)."""
    converted = load_pretrained(TINY)
    model = converted.model
    names = [f"layers.{i}.{m}" for i in range(model.args.n_layers)
             for m in ("attention.wq", "attention.wv", "feed_forward.w1", "feed_forward.w2")]
    add_lora(model, [LoraTarget((name,), r=4, lora_alpha=8) for name in names], {"r": 4, "lora_alpha": 8})
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return converted


def test_hub_named_tensors_are_the_checkpoints():
    """Names and values equal the safetensors file the model was loaded from."""
    hub = dict(hub_named_tensors(load_pretrained(TINY)))
    with safe_open(str(TINY / "model.safetensors"), framework="pt") as checkpoint:
        keys = {k for k in checkpoint.keys() if k != "lm_head.weight"}  # tied
        assert set(hub) == keys
        for key in keys:
            torch.testing.assert_close(hub[key], checkpoint.get_tensor(key), rtol=0, atol=0)


def test_a_trainers_model_gives_the_same_weights_and_folder():
    """A trainer holds the native model with transformers' surface (NativeCausalLM), not the ConvertedModel."""
    converted = load_pretrained(TINY)
    expected = dict(hub_named_tensors(converted))
    model = attach_hub_surface(converted.model, converted)
    got = dict(hub_named_tensors(model))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert Path(vllm_model_folder(model)).resolve() == TINY.resolve()
    assert vllm_dtype(model) == "float32"


def test_a_model_without_a_folder_is_exported_for_vllm():
    converted = load_pretrained(AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32))
    assert converted.source_dir is None
    folder = Path(vllm_model_folder(converted))
    try:
        exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        original = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
        input_ids = torch.tensor([[5, 60, 7, 300]])
        with torch.no_grad():
            torch.testing.assert_close(exported(input_ids=input_ids).logits, original(input_ids=input_ids).logits,
                                       rtol=0, atol=0)
    finally:
        shutil.rmtree(folder)


def test_weights_folder_loads_in_transformers_as_the_merged_model(tmp_path):
    """The CPU transport's folder, given a config.json, is a checkpoint transformers loads; its logits are the
    LoRA model's (adapters merged)."""
    converted = _lora_model()
    folder = tmp_path / "weights"
    path = write_weights_folder(hub_named_tensors(converted), folder)
    assert path == folder / "model.safetensors" and sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    with safe_open(str(path), framework="pt") as written:
        assert written.metadata() == {"format": "pt"}
        assert not any("lora" in key for key in written.keys())
    shutil.copy(TINY / "config.json", folder / "config.json")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    input_ids = torch.tensor([[5, 60, 7, 300, 12, 9]])
    converted.model.eval()
    with torch.no_grad():
        theirs = reference(input_ids=input_ids).logits
        ours = converted.model(input_ids=input_ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True


def test_weights_folder_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no tensors"):
        write_weights_folder([], tmp_path)
    with pytest.raises(ValueError, match="given twice"):
        write_weights_folder([("a", torch.zeros(1)), ("a", torch.ones(1))], tmp_path)
    with pytest.raises(ValueError, match="Hub config"):
        list(hub_named_tensors(torch.nn.Linear(2, 2)))
