"""chat_template_path naming a tokenizer folder whose cloning changes the vocabulary, against TRL's SFTTrainer (its
clone_chat_template): the folder's special tokens added to the tokenizer, the model's token rows resized to the
vocabulary rounded up to a multiple of 64 (grown: new rows at the old rows' mean; cut: rows past the end dropped),
placeholder tokens up to the rows. The kept rows are the old ones and the new rows lie at the old rows' mean (drawn
with a covariance of 1e-9 times theirs: TRL's draw and ours differ in the last digits, so TRL then trains from ours);
per step the logs equal TRL's; the saved tokenizer, config and embeddings are TRL's. Under LoRA the new rows train
through peft's trainable_token_indices, as TRL trains them, natively."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

import hfnative
from test_sft_vs_trl import MODEL, STEPS, _assert_same_logs, _config, _dataset

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKEN = "<|tool_start|>"
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + NEW_TOKEN
            + "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")


def _source(folder: Path, new_token: bool) -> str:
    """The tiny tokenizer as a template folder: a template that writes NEW_TOKEN into every message (when added)."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    if new_token:
        tokenizer.add_special_tokens({"additional_special_tokens": [NEW_TOKEN]})
        tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def _model_with_rows(folder: Path, rows: int) -> str:
    """The tiny Qwen3 with ``rows`` embedding rows (more than its tokenizer's 1,024 tokens), untied."""
    config = Qwen3Config.from_pretrained(MODEL)
    config.vocab_size, config.tie_word_embeddings = rows, False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(MODEL) / name, folder / name)
    return str(folder)


def _trainer(module, model: str, source: str, out: Path):
    return module.SFTTrainer(model=model, args=_config(module, out, 1, chat_template_path=source, save_strategy="no"),
                             train_dataset=_dataset("messages"), processing_class=AutoTokenizer.from_pretrained(model))


def _train(trainer):
    trainer.train()
    trainer.save_model()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _token_rows(trainer) -> list[torch.Tensor]:
    """The embedding's and an untied head's [rows, D] weights."""
    model = trainer.model
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings().weight
    return [embedding] + ([head.weight] if head is not None and head.weight is not embedding else [])


@pytest.mark.parametrize("case", ["grown-tied", "cut-untied"])
def test_cloning_resizes_the_vocabulary_as_trl(case, tmp_path):
    if case == "grown-tied":  # 1,024 tokens + 1 -> 1,088 rows, 63 placeholders; the new token in every message
        model, source, rows = MODEL, _source(tmp_path / "source", new_token=True), 1088
    else:  # 1,152 rows for 1,024 tokens -> cut to 1,024, no placeholder
        model, source, rows = _model_with_rows(tmp_path / "wide", 1152), _source(tmp_path / "source", False), 1024
    ours_trainer = _trainer(hfnative, model, source, tmp_path / "ours")
    theirs_trainer = _trainer(trl, model, source, tmp_path / "trl")  # last: its accelerate state is the one in place
    old_rows = min(1024, rows)
    for mine, reference in zip(_token_rows(ours_trainer), _token_rows(theirs_trainer), strict=True):
        assert mine.shape == reference.shape == (rows, 64)
        assert torch.equal(mine[:old_rows], reference[:old_rows])  # the kept rows as they were
        if rows > 1024:  # the new rows: near the old rows' mean, as TRL's (each a random draw of its own)
            mean = mine[:1024].mean(0)
            assert (mine[1024:] - mean).abs().max() <= 1e-4 and (reference[1024:] - mean).abs().max() <= 1e-4
            with torch.no_grad():  # TRL trains from our draw, so the steps can be compared exactly
                reference[1024:] = mine[1024:]
    theirs, ours = _train(theirs_trainer), _train(ours_trainer)
    _assert_same_logs(ours, theirs)
    assert len(ours) == STEPS

    ours_tokenizer, theirs_tokenizer = ours_trainer.processing_class, theirs_trainer.processing_class
    assert ours_tokenizer.get_vocab() == theirs_tokenizer.get_vocab() and len(ours_tokenizer.get_vocab()) == rows
    assert ours_tokenizer.chat_template == theirs_tokenizer.chat_template
    for folder in ("trl", "ours"):
        saved = json.loads((tmp_path / folder / "config.json").read_text())
        assert saved["vocab_size"] == rows, folder
        assert len(AutoTokenizer.from_pretrained(str(tmp_path / folder)).get_vocab()) == rows, folder
    mine, reference = (load_file(str(tmp_path / folder / "model.safetensors")) for folder in ("ours", "trl"))
    assert set(mine) == set(reference)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in reference:
            assert mine[key].shape == reference[key].shape == (rows, 64), key
            torch.testing.assert_close(mine[key], reference[key], rtol=0, atol=1e-3, msg=key)
    # the resized model loads in transformers and predicts as the trained one does
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    text = ours_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    ids = torch.tensor([ours_tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected = ours_trainer.native_model(ids).logits
        assert (reloaded(ids).logits - expected).abs().max() <= 1e-4


def _lora_trainer(module, model: str, source: str, out: Path, peft_config):
    return module.SFTTrainer(model=model, args=_config(module, out, 1, chat_template_path=source, save_strategy="no"),
                             train_dataset=_dataset("messages"), processing_class=AutoTokenizer.from_pretrained(model),
                             peft_config=peft_config)


def test_cloning_that_adds_tokens_under_lora_trains_their_rows_as_trl(tmp_path):
    """An untied model: as TRL, the new tokens' embedding rows train through trainable_token_indices and the head in
    full (lm_head added to modules_to_save), natively. From TRL's initial adapter (its resized rows with it), the
    steps equal TRL's; the saved adapter holds TRL's tensors (the resized embedding layers whole, as peft saves them
    when the vocabulary changed) and config, and loads in peft over the resized base with our logits."""
    peft = pytest.importorskip("peft")
    from hfnative.converters.peft import load_adapter_weights

    model, source = _model_with_rows(tmp_path / "untied", 1024), _source(tmp_path / "source", new_token=True)
    configs = [peft.LoraConfig(r=4, target_modules=["q_proj"]) for _ in range(2)]
    ours_trainer = _lora_trainer(hfnative, model, source, tmp_path / "ours", configs[0])
    theirs_trainer = _lora_trainer(trl, model, source, tmp_path / "trl", configs[1])
    new_rows = list(range(1024, 1088))
    for config in configs:  # the user's LoraConfig, changed in place as TRL changes it
        assert config.trainable_token_indices == {"embed_tokens": new_rows} and config.modules_to_save == ["lm_head"]
    assert type(ours_trainer.native_model).__module__.startswith("hfnative")  # native, not transformers' fallback
    theirs_trainer.model.save_pretrained(str(tmp_path / "initial"))
    load_adapter_weights(ours_trainer.converted, tmp_path / "initial")
    theirs, ours = _train(theirs_trainer), _train(ours_trainer)
    _assert_same_logs(ours, theirs)

    mine, reference = (load_file(str(tmp_path / folder / "adapter_model.safetensors")) for folder in ("ours", "trl"))
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in reference.items()}
    delta = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    torch.testing.assert_close(mine[delta], reference[delta], rtol=0, atol=1e-3)
    ours_config, theirs_config = (json.loads((tmp_path / f / "adapter_config.json").read_text()) for f in ("ours", "trl"))
    for key in ("trainable_token_indices", "modules_to_save", "target_modules"):
        assert ours_config[key] == theirs_config[key], key

    base = AutoModelForCausalLM.from_pretrained(model)
    base.resize_token_embeddings(1088)  # drawn anew: the saved embedding layers replace the draw
    reloaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "ours")).eval()
    ids = torch.tensor([[1024, 5, 1030, 7, 1087]])
    with torch.no_grad():
        expected = ours_trainer.native_model(ids).logits
        assert (reloaded(input_ids=ids).logits - expected).abs().max() <= 1e-4


def test_cloning_that_adds_tokens_under_lora_on_a_tied_model(tmp_path):
    """A tied model, where TRL fails (its fused head reads the bias of peft's token wrapper on lm_head, and peft's
    forward cannot run a trained copy of a tied head): the new rows train in the embedding and, tied, in the head
    (lm_head stays out of modules_to_save), natively; the old rows stay as they were; the saved adapter loads in peft
    over the resized base with our logits."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj"])
    trainer = _lora_trainer(hfnative, MODEL, _source(tmp_path / "source", new_token=True), tmp_path / "ours", config)
    assert config.trainable_token_indices == {"embed_tokens": list(range(1024, 1088))} and config.modules_to_save is None
    table = trainer.native_model.tok_embeddings.weight.detach().clone()
    rows = trainer.native_model.tok_embeddings.token_rows
    start = rows.values.detach().clone()
    assert _train(trainer)
    assert torch.equal(trainer.native_model.tok_embeddings.weight, table)
    assert not torch.equal(rows.values, start)
    ids = torch.tensor([[1024, 5, 7]])  # the new token, in every message of the data
    with torch.no_grad():
        expected = trainer.native_model(ids).logits
    base = AutoModelForCausalLM.from_pretrained(MODEL)
    base.resize_token_embeddings(1088)
    reloaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "ours")).eval()
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - expected).abs().max() <= 1e-4
    # the folder as the model keeps training its adapter: the base resized to the folder's rows, which it restores
    again = hfnative.SFTTrainer(model=str(tmp_path / "ours"), args=_config(hfnative, tmp_path / "again", 1),
                                train_dataset=_dataset("messages"))
    assert again.native_model.tok_embeddings.weight.shape[0] == 1088
    with torch.no_grad():
        assert (again.native_model(ids).logits - expected).abs().max() <= 1e-6


def test_a_refused_peft_config_changes_nothing(tmp_path):
    """A peft_config refused (a target module the model lacks) speaks before the template is cloned: the tokenizer
    and the LoraConfig are as they were."""
    peft = pytest.importorskip("peft")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    vocab, template = tokenizer.get_vocab(), tokenizer.chat_template
    config = peft.LoraConfig(r=4, target_modules=["no_such_proj"])
    with pytest.raises(ValueError, match="no_such_proj"):
        hfnative.SFTTrainer(model=MODEL, args=_config(hfnative, tmp_path / "ours", 1, chat_template_path=_source(
            tmp_path / "source", new_token=True)), train_dataset=_dataset("messages"), processing_class=tokenizer,
            peft_config=config)
    assert tokenizer.get_vocab() == vocab and tokenizer.chat_template == template
    assert config.trainable_token_indices is None and config.modules_to_save is None


def test_eos_token_and_a_cloned_eos_reach_the_generation_config_as_trls(tmp_path):
    """SFTConfig(eos_token=...) and a template folder with another EOS: the tokenizer's EOS, the config's and the
    generation config's eos_token_id (in memory and saved) are TRL's."""
    source = tmp_path / "source"
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(str(source))
    seen = {}
    for settings in (dict(eos_token="<|endoftext|>"), dict(chat_template_path=str(source))):
        for module in (hfnative, trl):  # TRL last: its accelerate state is the one in place
            out = tmp_path / f"{module.__name__}-{sorted(settings)[0]}"
            trainer = module.SFTTrainer(model=MODEL, args=_config(module, out, 1, max_steps=1, **settings),
                                        train_dataset=_dataset("messages"),
                                        processing_class=AutoTokenizer.from_pretrained(MODEL))
            trainer.train()
            trainer.save_model()
            saved = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
            seen[module, sorted(settings)[0]] = (trainer.processing_class.eos_token, trainer.model.config.eos_token_id,
                                                 trainer.model.generation_config.eos_token_id, saved)
        assert seen[hfnative, sorted(settings)[0]] == seen[trl, sorted(settings)[0]], settings
    assert seen[trl, "eos_token"][0] == "<|endoftext|>" and isinstance(seen[trl, "eos_token"][2], list)


def test_the_draw_of_new_rows_leaves_the_random_stream_as_it_was():
    """The mean-row draw runs on a forked stream: training draws after it (dropout, NEFTune) are the seed's, as under
    TRL, which clones before its Trainer seeds."""
    from hfnative.converters.loading import load_pretrained
    from hfnative.models.vocabulary import resize_vocabulary

    model = load_pretrained(MODEL).model
    torch.manual_seed(0)
    before = torch.get_rng_state()
    resize_vocabulary(model, 1088)
    assert torch.equal(torch.get_rng_state(), before)
    assert model.tok_embeddings.weight.shape == (1088, 64) and model.args.vocab_size == 1088


def test_a_model_object_given_is_resized_with_the_same_rows(tmp_path):
    """A transformers model given as ``model``: TRL's clone resizes that object; here the native copy is resized and
    the object holds the same rows at once (the trained ones after train())."""
    given = AutoModelForCausalLM.from_pretrained(MODEL)
    trainer = hfnative.SFTTrainer(model=given, args=_config(hfnative, tmp_path / "ours", 1,
                                                             chat_template_path=_source(tmp_path / "source", True)),
                                  train_dataset=_dataset("messages"), processing_class=AutoTokenizer.from_pretrained(MODEL))
    ours = trainer.native_model.get_input_embeddings().weight
    assert given.get_input_embeddings().weight.shape == ours.shape == (1088, 64)
    assert torch.equal(given.get_input_embeddings().weight, ours.detach())
    assert given.config.vocab_size == 1088


def test_gkd_applies_the_template_and_eos_token(tmp_path):
    """GKDConfig is an SFTConfig: its chat_template_path (a .jinja file) and eos_token apply, as under TRL's
    GKDTrainer (an SFTTrainer); its generation stops at the new EOS."""
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE.replace(NEW_TOKEN, ""))
    args = hfnative.GKDConfig(output_dir=str(tmp_path / "gkd"), use_cpu=True, bf16=False, report_to="none",
                              max_steps=1, chat_template_path=str(template), eos_token="<|endoftext|>")
    trainer = hfnative.GKDTrainer(model=MODEL, teacher_model=MODEL, args=args, train_dataset=_dataset("messages"),
                                  processing_class=AutoTokenizer.from_pretrained(MODEL))
    tokenizer = trainer.processing_class
    assert tokenizer.chat_template == template.read_text() and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id in trainer.objective.rollout.stop_ids
