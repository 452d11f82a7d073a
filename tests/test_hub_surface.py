"""What TRL users' callbacks and scripts read on ``trainer.model`` and ``trainer.accelerator``.

Oracles: transformers' own model loaded from what we save, peft's own model with the same LoraConfig,
and TRL's SFTTrainer running the same TRL callback on the same data.
"""

import contextlib
import io
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback, pipeline

import hfnative
from hfnative.converters.hub_model import NativeCausalLM
from test_sft_vs_trl import MODEL, _config, _dataset

PROMPTS = ["Once upon a time", "The cat sat", "Hello"]


def _sft(module, tmp_path, steps=3, **extra):
    config = _config(module, tmp_path / module.__name__, 1, **extra)
    config.max_steps = steps
    return module.SFTTrainer(
        model=MODEL, args=config, train_dataset=_dataset("prompt-completion"),
        processing_class=AutoTokenizer.from_pretrained(MODEL),
    )


def _greedy(model, tokenizer):
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)


def test_trained_model_has_transformers_surface(tmp_path):
    trainer = _sft(hfnative, tmp_path)
    trainer.train()
    model = trainer.model
    reference = AutoModelForCausalLM.from_pretrained(MODEL)
    assert type(model.config) is type(reference.config) and model.config.vocab_size == reference.config.vocab_size
    assert model.generation_config.to_dict() == reference.generation_config.to_dict()
    assert {"trl", "sft"} <= set(model.model_tags)
    assert model.num_parameters() == reference.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == reference.num_parameters(exclude_embeddings=True)
    assert model.get_input_embeddings().weight.shape == reference.get_input_embeddings().weight.shape
    assert model.device == torch.device("cpu") and model.dtype == torch.float32 and model.can_generate()

    # save_pretrained writes a folder transformers loads, with our logits; generate = transformers' generate
    model.save_pretrained(tmp_path / "saved")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits, rtol=0, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    assert torch.equal(_greedy(model, tokenizer), _greedy(loaded, tokenizer))

    # weights change -> generation follows them (no stale copy)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(-1.0)
        loaded.get_input_embeddings().weight.mul_(-1.0)
    assert torch.equal(_greedy(model, tokenizer), _greedy(loaded, tokenizer))


@contextlib.contextmanager
def _transformers_warnings():
    """The records transformers' loggers emit at WARNING or above inside the block."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)


def _pipeline_and_generate(model, tokenizer) -> tuple[str, torch.Tensor]:
    text = pipeline("text-generation", model=model, tokenizer=tokenizer)(
        PROMPTS[0], max_new_tokens=6, do_sample=False)[0]["generated_text"]
    return text, model.generate(**tokenizer(PROMPTS[1], return_tensors="pt"), max_new_tokens=4, do_sample=False)


def test_trained_model_in_a_pipeline_as_transformers_own(tmp_path):
    """trainer.model goes into transformers' text-generation pipeline and generate() as transformers' own model does:
    the class name the pipeline checks (transformers' for the architecture), the same text, and nothing logged; a
    LoRA model as peft's does (PeftModelForCausalLM)."""
    peft = pytest.importorskip("peft")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    trainer = _sft(hfnative, tmp_path, steps=1)
    trainer.train()
    model = trainer.model.eval()
    with _transformers_warnings() as ours:
        ours_out = _pipeline_and_generate(model, tokenizer)
    model.save_pretrained(tmp_path / "saved")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert isinstance(model, NativeCausalLM) and type(model).__name__ == type(reference).__name__ == "Qwen3ForCausalLM"
    with _transformers_warnings() as theirs:
        theirs_out = _pipeline_and_generate(reference, tokenizer)
    assert [r.getMessage()[:120] for r in ours] == [r.getMessage()[:120] for r in theirs] == []
    assert ours_out[0] == theirs_out[0] and torch.equal(ours_out[1], theirs_out[1])

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    config = _config(hfnative, tmp_path / "lora", 1)
    config.max_steps = 1
    adapted = hfnative.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("prompt-completion"),
                                  processing_class=tokenizer, peft_config=lora)
    adapted.train()
    with _transformers_warnings() as ours:
        text = pipeline("text-generation", model=adapted.model.eval(), tokenizer=tokenizer)(
            PROMPTS[0], max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert isinstance(adapted.model, peft.PeftModelForCausalLM)
    assert type(adapted.model).__name__ == "PeftModelForCausalLM" and text.startswith(PROMPTS[0])
    assert [r.getMessage()[:120] for r in ours] == []


def test_model_object_given_gets_the_trained_weights(tmp_path):
    """TRL trains the transformers model object given as ``model`` in place, so scripts save or push that object
    after train(); hfnative trains a native copy and writes the trained weights into the object when train() ends:
    the object then equals the folder save_model() exports. A PeftModel object gets its trained adapters (peft's
    own load of the saved adapter folder is the oracle), its base untouched; an object the caller dropped is not
    kept alive by the trainer."""
    import gc

    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    initial = AutoModelForCausalLM.from_pretrained(MODEL).state_dict()

    def train(module, model, name, **extra):
        config = _config(module, tmp_path / name, 1, **extra)
        config.max_steps = 2
        trainer = module.SFTTrainer(model=model, args=config, train_dataset=_dataset("prompt-completion"),
                                    processing_class=tokenizer)
        trainer.train()
        return trainer

    theirs = AutoModelForCausalLM.from_pretrained(MODEL)
    train(trl, theirs, "trl")
    ours = AutoModelForCausalLM.from_pretrained(MODEL)
    train(hfnative, ours, "ours").save_model(str(tmp_path / "saved"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    for obj in (theirs, ours):  # TRL's object trained, and ours
        assert any(not torch.equal(value, initial[name]) for name, value in obj.state_dict().items())
    assert ours.state_dict().keys() == saved.keys()
    assert all(torch.equal(value, saved[name]) for name, value in ours.state_dict().items())

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(MODEL), lora)
    before = {name: value.clone() for name, value in adapted.state_dict().items()}
    train(hfnative, adapted, "lora").save_model(str(tmp_path / "adapter"))
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL), tmp_path / "adapter")
    expected = reloaded.state_dict()
    trainable = {name for name, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    for name, value in adapted.state_dict().items():
        assert torch.equal(value, expected[name]), name
        assert (name in trainable) == (not torch.equal(value, before[name])), name  # adapters trained, base as given

    trainer = train(hfnative, AutoModelForCausalLM.from_pretrained(MODEL), "dropped")
    gc.collect()
    assert trainer._given_model() is None


def test_rebuilding_from_config_round_trips_state_dict(tmp_path):
    trainer = _sft(hfnative, tmp_path, steps=1)
    model = trainer.model
    copy = type(model)(model.config)
    assert isinstance(copy, NativeCausalLM)
    copy.load_state_dict(model.state_dict())
    ids = torch.tensor([[3, 14, 15, 9]])
    with torch.no_grad():
        torch.testing.assert_close(copy.eval()(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)


def test_lora_model_surface_matches_peft(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    config = _config(hfnative, tmp_path / "run", 1)
    config.max_steps = 1
    trainer = hfnative.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("prompt-completion"),
                                  processing_class=AutoTokenizer.from_pretrained(MODEL), peft_config=lora)
    model = trainer.model
    reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(MODEL), lora)
    assert model.get_nb_trainable_parameters() == reference.get_nb_trainable_parameters()
    printed = [io.StringIO(), io.StringIO()]
    for out, m in zip(printed, (model, reference)):
        with contextlib.redirect_stdout(out):
            m.print_trainable_parameters()
    assert printed[0].getvalue() == printed[1].getvalue()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)

    trainer.train()
    ids = torch.tensor([[3, 14, 15, 9, 26]])
    model.eval()
    base = AutoModelForCausalLM.from_pretrained(MODEL)
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits, rtol=0, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    assert torch.equal(_greedy(model, tokenizer), _greedy(loaded, tokenizer))


def test_accelerator_surface(tmp_path):
    trainer = _sft(hfnative, tmp_path, steps=1)
    accelerator = trainer.accelerator
    assert accelerator.is_main_process and accelerator.is_local_main_process
    assert (accelerator.num_processes, accelerator.process_index) == (1, 0)
    assert accelerator.device.type == "cpu"
    assert accelerator.unwrap_model(trainer.model) is trainer.model is trainer.model_wrapped
    values = torch.arange(4.0)
    assert torch.equal(accelerator.gather_for_metrics(values), values)
    with accelerator.split_between_processes(["a", "b", "c"]) as share:
        assert share == ["a", "b", "c"]
    accelerator.wait_for_everyone()
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()


class _RecordModels(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append((model.config.model_type, model.training))


def test_callbacks_receive_the_surface(tmp_path):
    recorder = _RecordModels()
    trainer = _sft(hfnative, tmp_path, steps=2)
    trainer.add_callback(recorder)
    trainer.train()
    assert recorder.seen == [("qwen3", True), ("qwen3", True)]


# --- TRL's own callbacks inside hfnative's trainer, against TRL's trainer running them ---------------


def test_trl_bema_callback_matches_trl(tmp_path):
    trl = pytest.importorskip("trl")
    from safetensors.torch import load_file

    saved = {}
    for module in (trl, hfnative):
        trainer = _sft(module, tmp_path, steps=4)
        trainer.add_callback(trl.BEMACallback(update_freq=1, update_after=1))
        trainer.train()
        saved[module.__name__] = load_file(str(tmp_path / module.__name__ / "bema" / "model.safetensors"))
    assert set(saved["hfnative"]) == set(saved["trl"])
    for key, reference in saved["trl"].items():
        torch.testing.assert_close(saved["hfnative"][key], reference, rtol=1e-4, atol=1e-5, msg=key)


def test_trl_log_completions_callback_matches_trl(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tables = {}
    eval_rows = Dataset.from_list([{"prompt": p, "completion": " done."} for p in PROMPTS])
    for module in (trl, hfnative):
        config = _config(module, tmp_path / module.__name__, 1, eval_strategy="steps", eval_steps=2,
                         per_device_eval_batch_size=2)
        config.max_steps = 2
        trainer = module.SFTTrainer(model=MODEL, args=config, train_dataset=_dataset("prompt-completion"),
                                    eval_dataset=eval_rows, processing_class=AutoTokenizer.from_pretrained(MODEL))
        callback = trl.LogCompletionsCallback(
            trainer, generation_config=GenerationConfig(max_new_tokens=5, do_sample=False), freq=1
        )
        trainer.add_callback(callback)
        trainer.train()
        tables[module.__name__] = callback.table
    assert [row[:2] for row in tables["hfnative"]] == [row[:2] for row in tables["trl"]]
    assert len(tables["hfnative"]) == 2 * len(PROMPTS)
    assert tables["hfnative"] == tables["trl"]


def test_trl_rich_progress_callback_runs(tmp_path):
    trl = pytest.importorskip("trl")
    pytest.importorskip("rich")
    trainer = _sft(hfnative, tmp_path, steps=2)
    trainer.add_callback(trl.RichProgressCallback())
    output = trainer.train()
    assert output.global_step == 2


def test_trainer_model_passed_to_a_new_trainer_keeps_its_hub_layout_and_tags(tmp_path):
    import yaml

    first = _sft(hfnative, tmp_path / "first", steps=1)
    first.train()
    first.model.add_model_tags(["my-tag"])
    config = _config(hfnative, tmp_path / "second", 1)
    config.max_steps = 1
    second = hfnative.SFTTrainer(model=first.model, args=config, train_dataset=_dataset("prompt-completion"),
                                 processing_class=AutoTokenizer.from_pretrained(MODEL))
    second.train()
    second.save_model()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "second")
    ids = torch.tensor([[3, 14, 15, 9]])
    with torch.no_grad():
        torch.testing.assert_close(second.model.eval()(ids).logits, loaded(ids).logits, rtol=0, atol=1e-5)
    card = (tmp_path / "second" / "README.md").read_text()
    tags = yaml.safe_load(card.split("---")[1])["tags"]
    assert {"my-tag", "trl", "sft", "hfnative"} <= set(tags)
