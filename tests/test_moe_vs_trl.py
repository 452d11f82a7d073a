"""MoE SFT against TRL's SFTTrainer at default settings: the router's load-balancing auxiliary loss
is added as TRL adds it (coef from the model config, / accumulation steps), and 0.0 turns it off.

Per step: loss, grad_norm, aux_loss, entropy and mean_token_accuracy agree within 1e-4 relative. LoRA whose
target_modules reach the experts ("all-linear") trains through peft on transformers' module, as under TRL: the same
parameters train and the steps agree. LoRA with explicit target_parameters on the stacked expert tensors (the way
gpt-oss is fine-tuned with TRL) trains natively, with the same steps and parameter names as TRL + peft.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig, MixtralConfig, Qwen3MoeConfig

import hfnative
from test_sft_vs_trl import MODEL, STEPS, _assert_same_logs, _config, _dataset

TOKENIZER = AutoTokenizer.from_pretrained(MODEL)
COMMON = dict(vocab_size=len(TOKENIZER), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
# a large coefficient so the aux term moves the loss and the gradients visibly
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                        num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.5),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                     router_aux_loss_coef=0.5),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe_model(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[request.param]()).save_pretrained(str(directory))
    TOKENIZER.save_pretrained(str(directory))
    return directory


def _run(module, model_dir, tmp_path, peft_config=None, **extra):
    trainer = module.SFTTrainer(
        model=str(model_dir),
        args=_config(module, tmp_path / module.__name__, 2, **extra),
        train_dataset=_dataset("text"),
        processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
        peft_config=peft_config,
    )
    if peft_config is not None:  # TRL's random initial LoRA A, given to both
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        initial = tmp_path / "initial-adapter"
        if initial.exists():
            set_peft_model_state_dict(trainer.model, load_file(str(initial / "adapter_model.safetensors")))
        else:
            trainer.model.save_pretrained(str(initial))
    trainer.train()
    trained = sorted(name for name, parameter in trainer.model.named_parameters() if parameter.requires_grad)
    return [entry for entry in trainer.state.log_history if "loss" in entry], trained


@pytest.mark.parametrize("coef", [None, 0.0], ids=["config-coef", "off"])
def test_moe_logs_match_trl_with_aux_loss(moe_model, coef, tmp_path):
    trl = pytest.importorskip("trl")
    theirs, _ = _run(trl, moe_model, tmp_path, router_aux_loss_coef=coef)
    ours, _ = _run(hfnative, moe_model, tmp_path, router_aux_loss_coef=coef)
    _assert_same_logs(ours, theirs)
    if coef is None:
        assert all(entry["aux_loss"] > 0 for entry in theirs)
        for mine, reference in zip(ours, theirs):
            assert mine["aux_loss"] == pytest.approx(reference["aux_loss"], rel=1e-4)
    else:
        assert not any("aux_loss" in entry for entry in ours + theirs)
    assert len(ours) == STEPS


def test_lora_on_the_experts_trains_as_peft_does(tmp_path_factory, tmp_path):
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    directory = tmp_path_factory.mktemp("qwen3_moe-lora")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS["qwen3_moe"]()).save_pretrained(str(directory))
    TOKENIZER.save_pretrained(str(directory))
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    theirs, their_trained = _run(trl, directory, tmp_path, peft_config=peft.LoraConfig(**lora), learning_rate=1e-2)
    ours, our_trained = _run(hfnative, directory, tmp_path, peft_config=peft.LoraConfig(**lora), learning_rate=1e-2)
    _assert_same_logs(ours, theirs)
    assert our_trained == their_trained and any(".mlp.experts." in name for name in their_trained)


EXPERT_LORA = {
    "gpt_oss": (lambda: GptOssConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=8),
                dict(target_modules="all-linear", target_parameters=["1.mlp.experts.gate_up_proj",
                                                                     "1.mlp.experts.down_proj"])),
    "qwen3_moe": (CONFIGS["qwen3_moe"], dict(target_modules=["q_proj", "v_proj"],
                                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
}


@pytest.mark.parametrize("family", sorted(EXPERT_LORA))
def test_lora_on_stacked_experts_trains_natively_as_peft_does(family, tmp_path_factory, tmp_path):
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from hfnative.peft import expert_lora_modules

    make_config, targets = EXPERT_LORA[family]
    directory = tmp_path_factory.mktemp(f"{family}-expert-lora")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config()).save_pretrained(str(directory))
    TOKENIZER.save_pretrained(str(directory))
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, **targets)
    theirs, their_trained = _run(trl, directory, tmp_path, peft_config=peft.LoraConfig(**lora), learning_rate=1e-2)
    trainer = hfnative.SFTTrainer(model=str(directory), args=_config(hfnative, tmp_path / "ours", 2, learning_rate=1e-2),
                                  train_dataset=_dataset("text"),
                                  processing_class=AutoTokenizer.from_pretrained(str(directory)),
                                  peft_config=peft.LoraConfig(**lora))
    assert expert_lora_modules(trainer.converted.model), "the experts' adapters should be native"
    ours, our_trained = _run(hfnative, directory, tmp_path, peft_config=peft.LoraConfig(**lora), learning_rate=1e-2)
    _assert_same_logs(ours, theirs)
    assert our_trained == their_trained
    assert any(".mlp.experts." in name and "lora_B" in name for name in their_trained)


def test_aux_loss_coef_on_a_dense_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        _run(hfnative, MODEL, tmp_path, router_aux_loss_coef=0.1)
