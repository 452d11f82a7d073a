"""``trainer.model`` under LoRA has peft's names, with peft itself as the oracle.

- For every native family (and DoRA, rsLoRA, modules_to_save on the head and embedding, a reward model's score
  head): the peft model over transformers' module and hfnative's ``trainer.model`` list the same
  ``named_parameters`` (names, shapes, requires_grad), ``state_dict`` keys and ``named_modules``; every tensor
  but peft's random lora_A init is equal (the base, zero lora_B, DoRA magnitudes).
- What trains is what the names show: lora_A is the engine's own Parameter; a fused Hub tensor (Phi-3's
  qkv_proj lora_B) reads as the concatenation of the native parts after an update; the base stays bit-equal.
- TRL's own PEFT tests for SFT, GRPO and RLOO (selecting parameters by transformers' names, ``base_layer``,
  ``get_parameter``, ``isinstance(trainer.model, PeftModel)``) run unchanged on TRL's trainer and on ours, also
  for an architecture on the transformers fallback (GPT-NeoX: there ``trainer.model`` is the PeftModel that trains).
"""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import hfnative
from hf_configs import save_hf_model
from hfnative.converters.hub_model import attach_hub_surface
from hfnative.converters.loading import load_pretrained
from hfnative.converters.peft import apply_lora
from hfnative.converters.peft_surface import peft_surface
from test_distributed_trainer import fallback_model  # noqa: F401  (GPT-NeoX: no native model, LoRA through peft)
from test_sft_lora import MODEL, _rows

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CASES = {
    "llama-gqa": dict(target_modules="all-linear"),
    "llama-mha-tied-llama3": dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    "mistral-gqa-window": dict(target_modules=["q_proj", "o_proj", "down_proj"], use_dora=True),
    "qwen2-gqa": dict(target_modules="all-linear", bias="lora_only"),
    "qwen3-mha-tied-bias": dict(target_modules="all-linear", modules_to_save=["embed_tokens"]),
    "qwen3moe-topk-norm": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=["lm_head"]),
    "mixtral-top2": dict(target_modules=["q_proj", "v_proj"], use_rslora=True),
    "phi3-gqa": dict(target_modules="all-linear", use_dora=True),
    "gemma3-softcap-linear-untied": dict(target_modules="all-linear", modules_to_save=["lm_head"]),
    "olmo3-sliding-gqa": dict(target_modules="all-linear"),
    "gptoss-alternating-yarn": dict(target_modules="all-linear"),
}


def _is_random_init(name: str) -> bool:
    return ".lora_A." in name  # peft draws lora_A from its own generator; every other tensor is determined


def _native_surface(directory, settings, classifier: bool = False):
    converted = load_pretrained(str(directory), num_labels=1) if classifier else load_pretrained(str(directory))
    apply_lora(converted, settings)
    attach_hub_surface(converted.model, converted, adapter_settings=settings)
    return converted, peft_surface(converted, settings)


def _assert_same_names_and_values(theirs, ours):
    their_params = dict(theirs.named_parameters())
    our_params = dict(ours.named_parameters())
    assert list(our_params) == list(their_params)
    for name, value in their_params.items():
        mine = our_params[name]
        assert mine.shape == value.shape and mine.requires_grad == value.requires_grad, name
        if not _is_random_init(name):
            torch.testing.assert_close(mine.detach().float(), value.detach().float(), rtol=1e-6, atol=1e-6, msg=name)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [name for name, _ in ours.named_modules()] == [name for name, _ in theirs.named_modules()]
    assert ours.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()


@pytest.mark.parametrize("checkpoint", list(CASES))
def test_names_and_tensors_equal_peft(checkpoint, tmp_path):
    save_hf_model(checkpoint, tmp_path / "base")
    fields = dict(r=2, lora_alpha=4, task_type="CAUSAL_LM", **CASES[checkpoint])
    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")), LoraConfig(**fields))
    converted, ours = _native_surface(tmp_path / "base", LoraConfig(**fields))
    assert isinstance(ours, PeftModel) and type(ours).__mro__[2] is type(theirs)
    _assert_same_names_and_values(theirs, ours)
    for name, _ in theirs.named_modules():  # get_submodule resolves every module name, with the same children
        assert [n for n, _ in ours.get_submodule(name).named_children()] == [n for n, _ in theirs.get_submodule(name).named_children()]


@pytest.mark.parametrize("checkpoint, indices", [
    ("qwen3-mha-tied-bias", [3, 5, 7]),  # the tied head's token adapter shares the embedding's rows
    ("llama-gqa", {"embed_tokens": [1, 2], "lm_head": [4, 9]}),
])
def test_token_rows_names_equal_peft(checkpoint, indices, tmp_path):
    """trainable_token_indices: peft's token_adapter names (trainable_tokens_delta, base_layer) over the native rows."""
    save_hf_model(checkpoint, tmp_path / "base")
    fields = dict(r=2, lora_alpha=4, task_type="CAUSAL_LM", target_modules=["q_proj"], trainable_token_indices=indices)
    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")), LoraConfig(**fields))
    converted, ours = _native_surface(tmp_path / "base", LoraConfig(**fields))
    _assert_same_names_and_values(theirs, ours)
    delta = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"
    assert ours.get_parameter(delta) is converted.model.tok_embeddings.token_rows.values


def test_reward_model_names_equal_peft(tmp_path):
    save_hf_model("qwen2-gqa", tmp_path / "base")
    fields = dict(r=2, lora_alpha=4, task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"])
    torch.manual_seed(0)
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "base"), num_labels=1)
    hf.save_pretrained(str(tmp_path / "classifier"))  # one score head for both sides
    theirs = get_peft_model(AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "classifier")), LoraConfig(**fields))
    converted, ours = _native_surface(tmp_path / "classifier", LoraConfig(**fields), classifier=True)
    _assert_same_names_and_values(theirs, ours)
    assert "base_model.model.score.modules_to_save.default.weight" in dict(ours.named_parameters())


def test_the_names_show_what_trains(tmp_path):
    """Phi-3 fuses q/k/v and gate/up: lora_A is shared natively (one Parameter, peft's own), lora_B is read as
    the concatenation of the native parts, current after an optimizer step."""
    save_hf_model("phi3-gqa", tmp_path / "base")
    settings = LoraConfig(r=2, lora_alpha=4, target_modules=["qkv_proj", "o_proj"])
    converted, ours = _native_surface(tmp_path / "base", settings)
    native = converted.model
    prefix = "base_model.model.model.layers.0.self_attn."
    attention = native.layers[0].attention
    assert ours.get_parameter(prefix + "qkv_proj.lora_A.default.weight") is attention.wq.lora_A
    assert ours.get_parameter(prefix + "o_proj.lora_B.default.weight") is attention.wo.lora_B
    assert ours.get_parameter(prefix + "qkv_proj.base_layer.weight").requires_grad is False

    before = {name: p.detach().clone() for name, p in ours.named_parameters()}
    optimizer = torch.optim.SGD([p for p in native.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # lora_B starts at zero, so lora_A first moves on the second step
        optimizer.zero_grad()
        ours(input_ids=ids).logits.float().square().mean().backward()
        optimizer.step()

    qkv_B = ours.get_parameter(prefix + "qkv_proj.lora_B.default.weight")
    torch.testing.assert_close(qkv_B, torch.cat([attention.wq.lora_B, attention.wk.lora_B, attention.wv.lora_B]), rtol=0, atol=0)
    moved = {name for name, p in ours.named_parameters() if not torch.equal(p, before[name])}
    assert moved == {name for name in before if ".lora_" in name}  # every adapter tensor moved, no base tensor did


def _sft(module, tmp_path, model=MODEL):
    config = module.SFTConfig(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                              disable_tqdm=True, max_steps=2, logging_steps=1, save_strategy="no",
                              per_device_train_batch_size=4, learning_rate=1e-2, max_length=64)
    return module.SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(_rows(8)),
                             processing_class=AutoTokenizer.from_pretrained(MODEL), peft_config=LoraConfig())


def _rl(module, trainer_name, tmp_path):
    def reward_len(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    config_class = getattr(module, trainer_name.replace("Trainer", "Config"))
    config = config_class(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                          disable_tqdm=True, learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
                          max_completion_length=8, max_steps=2, save_strategy="no")
    prompts = Dataset.from_list([{"prompt": p} for p in ("The sky is", "Two plus two is", "Once upon a time")] * 2)
    trainer_class = getattr(module, trainer_name)
    return trainer_class(model=MODEL, reward_funcs=reward_len, args=config, train_dataset=prompts,
                         processing_class=AutoTokenizer.from_pretrained(MODEL), peft_config=LoraConfig())


def _trls_peft_test(trainer, model_id=MODEL):
    """TRL 1.16's test_training_peft_config (tests/test_rloo_trainer.py, test_grpo_trainer.py), as written there."""
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    assert isinstance(trainer.model, PeftModel)
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    checked = 0
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            assert torch.allclose(param, new_param), f"Parameter {n} has changed."
            checked += 1
        elif "base_layer" not in n:  # We expect the peft params to be different (except for the base layer)
            assert not torch.allclose(param, new_param), f"Parameter {n} has not changed."
            checked += 1
    return checked


@pytest.mark.parametrize("algorithm", ["SFTTrainer", "GRPOTrainer", "RLOOTrainer", "SFTTrainer-fallback"])
def test_trls_peft_test_passes_with_only_the_import_swapped(algorithm, fallback_model, tmp_path):
    trl = pytest.importorskip("trl")
    counts = []
    for module in (trl, hfnative):
        torch.manual_seed(0)
        if algorithm == "SFTTrainer-fallback":
            counts.append(_trls_peft_test(_sft(module, tmp_path, model=fallback_model), model_id=fallback_model))
            continue
        trainer = _sft(module, tmp_path) if algorithm == "SFTTrainer" else _rl(module, algorithm, tmp_path)
        counts.append(_trls_peft_test(trainer))
    assert counts[0] == counts[1] > 0  # the same parameters were checked on both sides


def test_trainer_model_is_the_surface_and_round_trips(tmp_path):
    trainer = _sft(hfnative, tmp_path)
    surface = trainer.model
    assert surface.native_model is trainer.native_model and trainer.model is surface
    assert surface.config is trainer.native_model.config and surface.lm_head is trainer.native_model.lm_head
    ids = torch.tensor([[1, 5, 9, 3]])
    torch.testing.assert_close(surface(input_ids=ids).logits, trainer.native_model(input_ids=ids).logits, rtol=0, atol=0)
    surface.eval()
    assert not trainer.native_model.training
    surface.save_pretrained(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    again = hfnative.SFTTrainer(model=surface, args=trainer.args, train_dataset=Dataset.from_list(_rows(8)),
                                processing_class=trainer.processing_class)
    assert again.native_model is trainer.native_model  # a trainer given trainer.model trains the same module
