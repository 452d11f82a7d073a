"""The public attributes TRL users' code reads on a trainer, read on TRL 1.16's trainer and on hfnative's built from
the same arguments: OnlineDPOTrainer's reward_weights / reward_func_names / reward_processing_classes, use_vllm and
the sampling settings, eos_token_ids and the GenerationConfig TRL builds (with generation_kwargs); GKDTrainer's
generation_config and generation_kwargs; GKDTrainer's and DistillationTrainer's teacher_model (transformers' surface:
config, a call's logits equal to the teacher's own). (GRPOTrainer.get_high_entropy_mask on TRL's tests' stand-in:
tests/test_grpo.py.)
"""

import os
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import hfnative

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")
from test_grpo import MODEL  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _length_reward(completions, **kwargs):
    return [float(len(str(completion))) for completion in completions]


def _generation_settings(config: GenerationConfig) -> dict:
    return {key: value for key, value in config.to_dict().items() if not key.startswith("_")}


def _online_dpo(module, tmp_path, **extra):
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    config_class, trainer_class = (OnlineDPOConfig, OnlineDPOTrainer) if module is trl else (
        hfnative.OnlineDPOConfig, hfnative.OnlineDPOTrainer)
    args = config_class(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                        max_steps=1, max_new_tokens=6, save_strategy="no", **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_class(model=MODEL, reward_funcs=[_length_reward, _length_reward], args=args,
                             train_dataset=Dataset.from_list([{"prompt": "Hello there"}] * 4),
                             processing_class=AutoTokenizer.from_pretrained(MODEL))


@pytest.mark.parametrize("extra", [
    dict(),
    dict(reward_weights=[0.5, 2.0], temperature=0.7, top_p=0.8, top_k=5, min_p=0.1, repetition_penalty=1.3,
         gradient_checkpointing=True, generation_kwargs={"do_sample": True, "top_k": 4}),
], ids=["defaults", "settings"])
def test_online_dpo_attributes_are_trls(extra, tmp_path):
    theirs, ours = _online_dpo(trl, tmp_path, **extra), _online_dpo(hfnative, tmp_path, **extra)
    assert isinstance(ours.reward_weights, torch.Tensor) and ours.reward_weights.dtype == theirs.reward_weights.dtype
    assert torch.equal(ours.reward_weights, theirs.reward_weights)
    assert ours.reward_func_names == theirs.reward_func_names
    assert ours.reward_processing_classes == theirs.reward_processing_classes
    names = ("use_vllm", "num_generations", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "vllm_mode",
             "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_model_impl", "max_length", "eos_token_ids",
             "generation_kwargs")
    assert {name: getattr(ours, name) for name in names} == {name: getattr(theirs, name) for name in names}
    assert isinstance(ours.generation_config, GenerationConfig)
    assert _generation_settings(ours.generation_config) == _generation_settings(theirs.generation_config)


def _teacher_trainer(module, name: str, tmp_path, **extra):
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    if module is trl:
        config_class, trainer_class = (GKDConfig, GKDTrainer) if name == "GKD" else (trl.DistillationConfig,
                                                                                    trl.DistillationTrainer)
    else:
        config_class, trainer_class = getattr(hfnative, f"{name}Config"), getattr(hfnative, f"{name}Trainer")
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}] * 4
    if name == "Distillation":
        rows = [{"prompt": [{"role": "user", "content": "Hi"}]}] * 4
    args = config_class(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                        max_steps=1, save_strategy="no", **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_class(model=AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
                             teacher_model=AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32), args=args,
                             train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(MODEL))


@pytest.mark.parametrize("extra", [dict(), dict(max_new_tokens=7, temperature=0.6, gradient_checkpointing=True)],
                         ids=["defaults", "settings"])
def test_gkd_generation_config_is_trls(extra, tmp_path):
    theirs, ours = _teacher_trainer(trl, "GKD", tmp_path, **extra), _teacher_trainer(hfnative, "GKD", tmp_path, **extra)
    assert isinstance(ours.generation_config, GenerationConfig)
    assert _generation_settings(ours.generation_config) == _generation_settings(theirs.generation_config)
    assert ours.generation_kwargs == theirs.generation_kwargs


@pytest.mark.parametrize("name", ["GKD", "Distillation"])
def test_teacher_model_is_the_teacher(name, tmp_path):
    theirs, ours = _teacher_trainer(trl, name, tmp_path), _teacher_trainer(hfnative, name, tmp_path)
    assert ours.teacher_model.config.to_dict() == theirs.teacher_model.config.to_dict()
    assert not any(parameter.requires_grad for parameter in ours.teacher_model.parameters())
    input_ids = torch.tensor([[1, 5, 9, 14, 2]])
    with torch.no_grad():
        expected = theirs.teacher_model(input_ids).logits
        torch.testing.assert_close(ours.teacher_model(input_ids).logits, expected, atol=1e-5, rtol=1e-5)
