"""RewardTrainer on the reward models TRL 1.16 trains that need more than a checkpoint, TRL's trainer beside ours on
the same model, rows and seed (fp32, 2 steps): the per-step loss and grad norm, and which parameters moved.

- A peft PeftModel (LoRA with task_type SEQ_CLS) as the model: native LoRA on the native classifier, equal to TRL per
  step; the same adapter saved to a folder and passed by path trains too (its adapter keeps training, as a PeftModel
  does; TRL loads a folder through transformers, which freezes the LoRA weights and trains only the score head copy).
  On GPT-NeoX (no native model) the PeftModel trains in place through peft, and its folder onto transformers' own
  classifier.
- LoRA whose target_modules reach a Qwen3-MoE model's experts: peft adapts them (target_parameters on the fused expert
  tensors) on transformers' module, as under TRL; the same parameters train, equal per step.
- Every architecture that trains through transformers' own classifier (GPT-NeoX, Qwen2-MoE, Phi, Gemma 2; the other
  fallback families of tests/test_fallback.py, Cohere 2, LFM2 and Granite, have no *ForSequenceClassification class in
  transformers, so TRL cannot build their reward model either and hfnative refuses them saying so): with
  center_rewards_coefficient every parameter moves, under TRL and here, equal per step. Without it, the final norm's
  bias before a bias-free score head has a gradient of round-off under both (it shifts every reward alike, and the
  Bradley-Terry loss reads only differences), so whether gpt_neox.final_layer_norm.bias moves is decided by
  round-off, alike under TRL and here; the test checks that gradient on GPT-NeoX with a chat template from a file.
- chat_template_path naming a tokenizer folder takes its template and EOS as TRL's clone_chat_template does, and where
  TRL's clone changes the vocabulary (adds tokens, resizes the embeddings) so does hfnative.
"""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Gemma2Config,
    GPTNeoXConfig,
    PhiConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

import hfnative

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
TOKENIZER = AutoTokenizer.from_pretrained(MODEL)
COMMON = dict(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2,
              pad_token_id=TOKENIZER.pad_token_id, eos_token_id=TOKENIZER.eos_token_id, bos_token_id=None)
FALLBACK_FAMILIES = {
    "gpt_neox": lambda: GPTNeoXConfig(**COMMON, rotary_pct=0.5),
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, num_key_value_heads=2, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "phi": lambda: PhiConfig(**COMMON),
    "gemma2": lambda: Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=8),
}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows() -> list[dict]:
    with open(ROOT / "examples" / "data" / "preference.jsonl") as f:
        return [json.loads(line) for line in f][:8]


def _save(root: Path, config, chat_template: bool = True) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    if not chat_template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(root)
    return str(root)


def _train(module, model, tmp_path, peft_config=None, initial_adapter=None, tokenizer=MODEL, **extra):
    """(trainer, [(loss, grad_norm) per step], names of the parameters that did not move)."""
    args = module.RewardConfig(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                               disable_tqdm=True, max_steps=2, logging_steps=1, per_device_train_batch_size=4,
                               save_strategy="no", learning_rate=1e-2, seed=3, **extra)
    trainer = module.RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(_rows()),
                                   processing_class=AutoTokenizer.from_pretrained(tokenizer), peft_config=peft_config)
    if initial_adapter is not None:  # the other trainer's random initial LoRA A, given to both
        from safetensors.torch import load_file

        peft.set_peft_model_state_dict(trainer.model, load_file(str(initial_adapter / "adapter_model.safetensors")))
    elif peft_config is not None:
        trainer.model.save_pretrained(str(tmp_path / "initial-adapter"))
    before = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
    trainer.train()
    steps = [(log["loss"], log["grad_norm"]) for log in trainer.state.log_history if "loss" in log]
    unchanged = {name.removeprefix("module.") for name, parameter in trainer.model.named_parameters()
                 if torch.equal(before[name], parameter.detach())}
    return trainer, steps, unchanged


def _assert_steps_equal(ours, theirs):
    assert len(ours) == len(theirs) == 2
    for (loss, grad_norm), (their_loss, their_grad_norm) in zip(ours, theirs):
        assert loss == pytest.approx(their_loss, rel=1e-4, abs=1e-6)
        assert grad_norm == pytest.approx(their_grad_norm, rel=1e-4, abs=1e-6)


def _peft_reward_model(model=MODEL, target_modules=("q_proj", "v_proj")):
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=torch.float32)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                     target_modules=list(target_modules), task_type="SEQ_CLS"))


def test_peft_model_and_adapter_folder_train(tmp_path):
    _, theirs, their_unchanged = _train(trl, _peft_reward_model(), tmp_path / "trl")
    trainer, ours, our_unchanged = _train(hfnative, _peft_reward_model(), tmp_path / "ours")
    _assert_steps_equal(ours, theirs)
    assert our_unchanged == their_unchanged
    assert any("base_layer" in name for name in their_unchanged) and not any("lora_" in name for name in their_unchanged)
    assert isinstance(trainer.model, peft.PeftModel)
    folder = tmp_path / "adapter"
    _peft_reward_model().save_pretrained(str(folder))
    _, from_folder, folder_unchanged = _train(hfnative, str(folder), tmp_path / "folder")
    assert from_folder[0][0] == pytest.approx(theirs[0][0], rel=1e-5)  # the same adapter and score head loaded
    _assert_steps_equal(from_folder, ours)  # and trained as the PeftModel is
    assert folder_unchanged == our_unchanged


def test_peft_model_and_adapter_folder_on_a_fallback_classifier_train(tmp_path):
    """GPT-NeoX (transformers' own classifier): the PeftModel trains in place through peft, as under TRL; its adapter
    folder loads onto transformers' classifier and trains the same way."""
    model = _save(tmp_path / "neox", FALLBACK_FAMILIES["gpt_neox"]())
    peft_model = lambda: _peft_reward_model(model, target_modules=("query_key_value",))  # noqa: E731
    _, theirs, their_unchanged = _train(trl, peft_model(), tmp_path / "trl")
    trainer, ours, our_unchanged = _train(hfnative, peft_model(), tmp_path / "ours")
    _assert_steps_equal(ours, theirs)
    assert our_unchanged == their_unchanged and isinstance(trainer.model, peft.PeftModel)
    folder = tmp_path / "adapter"
    peft_model().save_pretrained(str(folder))
    _, from_folder, folder_unchanged = _train(hfnative, str(folder), tmp_path / "folder")
    _assert_steps_equal(from_folder, ours)
    assert folder_unchanged == our_unchanged


def test_lora_on_moe_experts_trains_as_peft_does(tmp_path):
    config = Qwen3MoeConfig(**{**COMMON, "initializer_range": 0.02}, num_key_value_heads=2, head_dim=8,
                            moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    model = _save(tmp_path / "moe", config)
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                task_type="SEQ_CLS")
    _, theirs, their_unchanged = _train(trl, model, tmp_path / "trl", peft_config=peft.LoraConfig(**lora))
    trainer, ours, our_unchanged = _train(hfnative, model, tmp_path / "ours", peft_config=peft.LoraConfig(**lora),
                                          initial_adapter=tmp_path / "trl" / "initial-adapter")
    _assert_steps_equal(ours, theirs)
    assert our_unchanged == their_unchanged
    trained = {name for name, parameter in trainer.model.named_parameters() if parameter.requires_grad}
    assert any(".mlp.experts." in name and "lora_A" in name for name in trained)


@pytest.mark.parametrize("family", sorted(FALLBACK_FAMILIES))
def test_every_parameter_of_a_fallback_classifier_moves(family, tmp_path):
    model = _save(tmp_path / family, FALLBACK_FAMILIES[family]())
    _, theirs, their_unchanged = _train(trl, model, tmp_path / "trl", center_rewards_coefficient=0.1)
    _, ours, our_unchanged = _train(hfnative, model, tmp_path / "ours", center_rewards_coefficient=0.1)
    _assert_steps_equal(ours, theirs)
    assert our_unchanged == their_unchanged == set()


def _final_norm_gradients(trainer) -> tuple[float, float]:
    """(|grad| of gpt_neox.final_layer_norm's bias, of its weight) after one backward of the trainer's loss."""
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    trainer.compute_loss(trainer.model, inputs).backward()
    grads = {name.removeprefix("module."): p.grad for name, p in trainer.model.named_parameters()}
    return (grads["gpt_neox.final_layer_norm.bias"].norm().item(), grads["gpt_neox.final_layer_norm.weight"].norm().item())


def test_final_norm_bias_gets_no_gradient_under_trl_either(tmp_path):
    """GPT-NeoX, its tokenizer without a template and TRL's chat_template_path, no centering: the final norm's bias
    adds the same amount to every reward, which the Bradley-Terry loss does not see, so its gradient is round-off
    (which Adam's normalization may still turn into a step, or not where it is exactly 0) under TRL and here."""
    model = _save(tmp_path / "neox", FALLBACK_FAMILIES["gpt_neox"](), chat_template=False)
    for module in (trl, hfnative):
        args = module.RewardConfig(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False,
                                   report_to="none", per_device_train_batch_size=4, chat_template_path=MODEL)
        trainer = module.RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(_rows()),
                                       processing_class=AutoTokenizer.from_pretrained(model))
        bias, weight = _final_norm_gradients(trainer)
        assert weight > 1e-3 and bias <= 1e-6 * weight, (module.__name__, bias, weight)


def _template_folder(root: Path, eos_token: str, new_token: str | None = None) -> str:
    """The tiny tokenizer with another EOS (and an added token the model's vocabulary lacks), saved as a folder."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    tokenizer.eos_token = eos_token
    if new_token is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": [new_token]})
    tokenizer.save_pretrained(root)
    return str(root)


def test_chat_template_folder_sets_the_eos_as_trls_clone(tmp_path):
    """chat_template_path naming a tokenizer folder: the template and its EOS are taken, and the model config's
    eos_token_id follows, as TRL's clone_chat_template does (the vocabulary unchanged, so nothing is resized)."""
    folder = _template_folder(tmp_path / "source", eos_token="<|endoftext|>")
    seen = {}
    for module in (trl, hfnative):
        args = module.RewardConfig(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False,
                                   report_to="none", chat_template_path=folder)
        trainer = module.RewardTrainer(model=MODEL, args=args, train_dataset=Dataset.from_list(_rows()),
                                       processing_class=AutoTokenizer.from_pretrained(MODEL))
        seen[module] = (trainer.processing_class.eos_token, trainer.model.config.eos_token_id,
                        trainer.processing_class.chat_template)
    assert seen[hfnative] == seen[trl] and seen[trl][0] == "<|endoftext|>"


def test_chat_template_folder_that_changes_the_vocabulary_resizes_as_trls_clone(tmp_path):
    """Where TRL's clone adds the folder's special tokens and resizes the embeddings (1,025 tokens: 1,088 rows, with
    63 placeholder tokens), hfnative does the same to its classifier: the same tokenizer, rows and steps."""
    folder = _template_folder(tmp_path / "source", eos_token="<|im_end|>", new_token="<|tool_start|>")
    theirs_trainer, theirs, _ = _train(trl, MODEL, tmp_path, chat_template_path=folder)
    ours_trainer, ours, _ = _train(hfnative, MODEL, tmp_path, chat_template_path=folder)
    _assert_steps_equal(ours, theirs)
    assert ours_trainer.processing_class.get_vocab() == theirs_trainer.processing_class.get_vocab()
    assert "<|tool_start|>" in ours_trainer.processing_class.get_vocab()
    rows = [t.model.get_input_embeddings().weight.shape for t in (ours_trainer, theirs_trainer)]
    assert rows[0] == rows[1] == (1088, 64)