"""LoRA / DoRA / QLoRA through SFTTrainer, against TRL + peft on the same initial adapter weights."""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfnative
from hfnative.converters.peft import load_adapter_weights

peft = pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
STEPS = 5


def _rows(n=24):
    with open(ROOT / "examples" / "data" / "sft_messages.jsonl") as f:
        return [json.loads(line) for line in f][:n]


def _config(module, output_dir, **extra):
    settings = dict(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=1e-2, max_length=96,
    )
    return module.SFTConfig(**{**settings, **extra})


def _lora(**extra):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM", **extra)


def _losses(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("variant", [{}, {"use_dora": True}, {"use_rslora": True, "bias": "lora_only"}])
def test_lora_training_matches_trl_and_peft(variant, tmp_path):
    trl = pytest.importorskip("trl")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    theirs = trl.SFTTrainer(model=MODEL, args=_config(trl, tmp_path / "trl"), train_dataset=Dataset.from_list(_rows()),
                            processing_class=tokenizer, peft_config=_lora(**variant))
    theirs.model.save_pretrained(str(tmp_path / "initial-adapter"))  # peft's random initial A (and magnitudes)
    theirs.train()

    ours = hfnative.SFTTrainer(model=MODEL, args=_config(hfnative, tmp_path / "ours"), train_dataset=Dataset.from_list(_rows()),
                               processing_class=tokenizer, peft_config=_lora(**variant))
    load_adapter_weights(ours.converted, tmp_path / "initial-adapter")
    ours.train()

    for mine, reference in zip(_losses(ours), _losses(theirs), strict=True):
        for key in ("loss", "grad_norm", "mean_token_accuracy"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (reference["step"], key)
        assert mine["num_tokens"] == reference["num_tokens"]


def test_adapter_export_loads_in_peft_and_base_is_untouched(tmp_path):
    original = load_file(str(Path(MODEL) / "model.safetensors"))
    trainer = hfnative.SFTTrainer(model=MODEL, args=_config(hfnative, tmp_path / "out"), train_dataset=_rows(),
                                  peft_config=_lora())
    trainer.train()
    trainer.save_model()
    out = tmp_path / "out"
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "model.safetensors").exists()
    assert "library_name: peft" in (out / "README.md").read_text()

    # the frozen base is bit-identical; every adapter matrix moved away from its start
    native = dict(trainer.native_model.named_parameters())  # the engine's own names
    assert torch.equal(native["layers.0.attention.wq.weight"], original["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(native["tok_embeddings.weight"], original["model.embed_tokens.weight"])
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)

    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL), str(out)).eval()
    ids = torch.tensor([[1, 40, 50, 60, 2, 7, 9]])
    trainer.model.eval()
    with torch.no_grad():
        assert (reloaded(ids).logits - trainer.model(ids).logits).abs().max() <= 1e-5


def test_training_continues_from_an_adapter_folder(tmp_path):
    first = hfnative.SFTTrainer(model=MODEL, args=_config(hfnative, tmp_path / "first", max_steps=2), train_dataset=_rows(),
                                peft_config=_lora(use_dora=True))
    first.train()
    first.save_model()
    again = hfnative.SFTTrainer(model=str(tmp_path / "first"), args=_config(hfnative, tmp_path / "again", max_steps=2),
                                train_dataset=_rows())
    ids = torch.tensor([[1, 40, 50, 60, 2]])
    first.model.eval()
    again.model.eval()
    with torch.no_grad():
        assert (first.model(ids).logits - again.model(ids).logits).abs().max() <= 1e-6  # the adapter was loaded, not re-initialised
    again.train()
    again.save_model()
    config = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert config["use_dora"] and config["base_model_name_or_path"] == MODEL


def test_qlora_trains_adapters_on_an_nf4_base(tmp_path):
    pytest.importorskip("torchao")
    trainer = hfnative.SFTTrainer(
        model=MODEL,
        args=_config(hfnative, tmp_path / "q", max_steps=3, model_init_kwargs={"load_in_4bit": True}),
        train_dataset=_rows(),
        peft_config=_lora(),
    )
    frozen = trainer.model.layers[0].attention.wq.weight
    assert type(frozen).__name__ == "NF4Tensor" or type(frozen.data).__name__ == "NF4Tensor"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    losses = [e["loss"] for e in _losses(trainer.train() and trainer)]
    assert all(torch.isfinite(torch.tensor(losses)))
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_lora_on_an_8bit_base_matches_trl_with_bitsandbytes(tmp_path):
    """load_in_8bit: TRL quantizes the base with bitsandbytes' LLM.int8 (its int8 activations, fp16 gradients);
    hfnative stores the same int8 rows and computes on their values in fp32. Losses agree to bitsandbytes' own
    rounding, the base stays int8 and unchanged, and the saved adapter has TRL's tensors."""
    trl = pytest.importorskip("trl")
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    from hfnative.peft import Int8Weight

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    quantized = {"quantization_config": BitsAndBytesConfig(load_in_8bit=True), "dtype": torch.float32}
    theirs = trl.SFTTrainer(model=MODEL, args=_config(trl, tmp_path / "trl", model_init_kwargs=quantized),
                            train_dataset=Dataset.from_list(_rows()), processing_class=tokenizer, peft_config=_lora())
    theirs.model.save_pretrained(str(tmp_path / "initial-adapter"))
    theirs.train()
    theirs.save_model()

    ours = hfnative.SFTTrainer(model=MODEL, args=_config(hfnative, tmp_path / "ours", model_init_kwargs={"load_in_8bit": True}),
                               train_dataset=Dataset.from_list(_rows()), processing_class=tokenizer, peft_config=_lora())
    load_adapter_weights(ours.converted, tmp_path / "initial-adapter")
    frozen = {n: p.data_int8.clone() for n, p in ours.model.named_parameters() if isinstance(p, Int8Weight)}
    assert len(frozen) == 2 * 7  # every projection of both layers
    ours.train()
    ours.save_model()

    for mine, reference in zip(_losses(ours), _losses(theirs), strict=True):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-4), reference["step"]
        assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=2e-2), reference["step"]  # fp16 there
    after = dict(ours.model.named_parameters())
    assert all(isinstance(after[n], Int8Weight) and torch.equal(after[n].data_int8, rows) for n, rows in frozen.items())
    mine, reference = (load_file(str(tmp_path / run / "adapter_model.safetensors")) for run in ("ours", "trl"))
    assert mine.keys() == reference.keys()
    assert not (tmp_path / "ours" / "model.safetensors").exists()


def test_qlora_without_peft_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="peft_config"):
        hfnative.SFTTrainer(model=MODEL, args=_config(hfnative, tmp_path, model_init_kwargs={"load_in_4bit": True}),
                            train_dataset=_rows())


def test_lora_with_fused_loss_compile_and_optimizer_in_backward(tmp_path):
    """Every engine option on a LoRA run reproduces the plain LoRA run (itself checked against TRL+peft)."""
    def losses(name, **options):
        args = _config(hfnative, tmp_path / name, **{"max_grad_norm": 0.0, "fused_loss": False, **options})
        trainer = hfnative.SFTTrainer(model=MODEL, args=args, train_dataset=_rows(), peft_config=_lora(use_dora=True))
        trainer.train()
        return [(e["loss"], e["grad_norm"]) for e in _losses(trainer)]

    plain = losses("plain")
    for name, options in {
        "fused": dict(fused_loss=True),
        "in_backward": dict(optimizer_in_backward=True),
        "all": dict(fused_loss=True, optimizer_in_backward=True, torch_compile=True, activation_checkpointing=True),
    }.items():
        for (loss, grad_norm), (plain_loss, plain_grad_norm) in zip(losses(name, **options), plain, strict=True):
            assert loss == pytest.approx(plain_loss, rel=1e-5), name
            assert grad_norm == pytest.approx(plain_grad_norm, rel=1e-4), name
