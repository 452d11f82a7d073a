"""Architectures without a native implementation train through transformers' own module
(converters/fallback.py) under hfnative's loop; TRL's SFTTrainer on the same checkpoint and data is the
oracle (per-step loss, grad_norm, entropy, accuracy within 1e-5 relative, fp32), transformers' own
forward the oracle for the wrapper's losses, and per-document runs the oracle for packed rows.
"""

import json
import math
import logging
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Cohere2Config,
    Gemma2Config,
    GptOssConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GraniteConfig,
    Lfm2Config,
    PhiConfig,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

import hfnative
from hfnative.converters import fallback
from hfnative.converters.fallback import TransformersCausalLM
from hfnative.converters.fallback_packing import masks_separate_documents
from hfnative.converters.loading import CheckpointError, UnsupportedModelError
from hfnative.models.decoder import Transformer
from hfnative.parallel import apply_activation_checkpointing, apply_compile
from hfnative.trainers.running.model_loading import resolve_model

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = AutoTokenizer.from_pretrained(str(ROOT / "examples" / "tiny-qwen3"))
STEPS = 3
SPECIAL = dict(pad_token_id=TOKENIZER.pad_token_id, eos_token_id=TOKENIZER.eos_token_id, bos_token_id=None)
COMMON = dict(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2, **SPECIAL)
# initializer_range 0.2: logits far from uniform, so a wrong head or mask shows in the loss
CONFIGS = {
    "cohere2": lambda: Cohere2Config(**COMMON, num_key_value_heads=2, sliding_window=6, logit_scale=0.5),
    "gpt_neox": lambda: GPTNeoXConfig(**COMMON, rotary_pct=0.5),
}
FALLBACK_LOG = "trains through transformers' own modeling code"


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request, tmp_path_factory) -> Path:
    return _save(request.param, CONFIGS[request.param](), tmp_path_factory)


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory) -> Path:
    return _save("gpt_neox", CONFIGS["gpt_neox"](), tmp_path_factory)


def _save(name, config, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    TOKENIZER.save_pretrained(str(directory))
    return directory


def _rows(name: str) -> Dataset:
    with open(ROOT / "examples" / "data" / name) as f:
        return Dataset.from_list([json.loads(line) for line in f][:24])


def _config(module, output_dir, **extra):
    settings = dict(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=3, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=0.2, weight_decay=0.01, max_length=64,
    )
    return module.SFTConfig(**{**settings, **extra})


def _run(module, model, tmp_path, data="sft_messages.jsonl", trainer_class=None, peft_config=None, **extra):
    trainer_class = trainer_class or module.SFTTrainer
    trainer = trainer_class(model=str(model), args=_config(module, tmp_path / module.__name__, **extra),
                            train_dataset=_rows(data), processing_class=AutoTokenizer.from_pretrained(str(model)),
                            peft_config=peft_config)
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "loss" in entry]


def _assert_same_logs(ours, theirs, rel=1e-5):
    assert len(ours) == len(theirs) == STEPS
    for mine, reference in zip(ours, theirs):
        assert mine["num_tokens"] == reference["num_tokens"]
        assert mine["learning_rate"] == pytest.approx(reference["learning_rate"], rel=1e-12)
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
            assert mine[key] == pytest.approx(reference[key], rel=rel, abs=1e-7), (reference["step"], key)


# --- training against TRL -------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_trains_like_trl(model_dir, packing, tmp_path, caplog):
    trl = pytest.importorskip("trl")
    extra = dict(packing=True) if packing else dict(assistant_only_loss=True)
    _, theirs = _run(trl, model_dir, tmp_path, **extra)
    fallback._warned.clear()
    with caplog.at_level(logging.WARNING, logger="hfnative.converters.fallback"):
        trainer, ours = _run(hfnative, model_dir, tmp_path, **extra)
    assert isinstance(trainer.model, TransformersCausalLM)
    assert trainer.model.checkpointed_layers == {0, 1}  # TRL's default gradient_checkpointing=True
    _assert_same_logs(ours, theirs)
    warnings = [r.getMessage() for r in caplog.records if FALLBACK_LOG in r.getMessage()]
    assert len(warnings) == 1 and "is not supported by hfnative's native models" in warnings[0]


def test_moe_trains_like_trl_with_the_router_aux_loss(tmp_path_factory, tmp_path):
    trl = pytest.importorskip("trl")
    config = Qwen2MoeConfig(**COMMON, num_key_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5)
    model_dir = _save("qwen2_moe", config, tmp_path_factory)
    _, theirs = _run(trl, model_dir, tmp_path, data="sft_text.jsonl")
    _, ours = _run(hfnative, model_dir, tmp_path, data="sft_text.jsonl")
    _assert_same_logs(ours, theirs)
    for mine, reference in zip(ours, theirs):
        assert mine["aux_loss"] == pytest.approx(reference["aux_loss"], rel=1e-5)


def test_prompt_tuning_trains_like_trl_and_saves_an_adapter(neox_dir, tmp_path):
    """Prompt-completion rows (the first label is -100): the same tokens are scored as in TRL / peft."""
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")

    def prompt_tuning():
        return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, prompt_tuning_init="TEXT",
                                       prompt_tuning_init_text="The quick brown fox", tokenizer_name_or_path=str(neox_dir))

    settings = dict(data="sft_prompt_completion.jsonl", learning_rate=3e-2)
    _, theirs = _run(trl, neox_dir, tmp_path, peft_config=prompt_tuning(), **settings)
    trainer, ours = _run(hfnative, neox_dir, tmp_path, peft_config=prompt_tuning(), **settings)
    _assert_same_logs(ours, theirs)
    assert trainer.model is trainer.native_model.peft_model  # as under TRL, trainer.model is the PeftModel
    assert [n for n, p in trainer.model.named_parameters() if p.requires_grad] == ["prompt_encoder.default.embedding.weight"]
    trainer.save_model()
    out = tmp_path / "hfnative"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    assert not (out / "model.safetensors").exists()
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(neox_dir)), str(out))
    trained = trainer.model.prompt_encoder["default"].embedding.weight
    assert torch.equal(reloaded.prompt_encoder["default"].embedding.weight, trained)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(neox_dir)

    # the adapter folder as `model`: its base loads, the prompt keeps training
    again = hfnative.SFTTrainer(model=str(out), args=_config(hfnative, tmp_path / "again"),
                                train_dataset=_rows("sft_prompt_completion.jsonl"))
    prompt = again.model.prompt_encoder["default"].embedding.weight
    assert prompt.requires_grad and torch.equal(prompt, trained)
    with torch.no_grad():  # resuming reads the adapter back
        prompt.zero_()
    again._load_model_weights(out)
    assert torch.equal(prompt, trained)


# --- saving, reloading, resuming --------------------------------------------------------------------


def test_checkpoints_load_in_transformers_and_resume(neox_dir, tmp_path):
    trainer, logs = _run(hfnative, neox_dir, tmp_path, save_strategy="steps", save_steps=1, gradient_checkpointing=False)
    run_dir = tmp_path / "hfnative"
    checkpoint = run_dir / f"checkpoint-{STEPS}"
    reloaded = AutoModelForCausalLM.from_pretrained(str(checkpoint), use_safetensors=True)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trainer.model(ids).logits, rtol=0, atol=1e-5)
    trainer.save_model()
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in run_dir.iterdir()}
    AutoModelForCausalLM.from_pretrained(str(run_dir), use_safetensors=True)

    resumed = hfnative.SFTTrainer(model=str(neox_dir), args=_config(hfnative, run_dir, gradient_checkpointing=False),
                                  train_dataset=_rows("sft_messages.jsonl"))
    resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-2"))
    last = [entry for entry in resumed.state.log_history if "loss" in entry][-1]
    assert last["step"] == STEPS and last["loss"] == pytest.approx(logs[-1]["loss"], rel=1e-6)

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["embed_out.renamed"] = tensors.pop("embed_out.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): \['embed_out.weight'\][\s\S]*embed_out.renamed"):
        resumed._load_model_weights(broken)


# --- the wrapper against transformers' own forward ----------------------------------------------------------


def _packed_row(seed=0, lengths=(5, 3, 6)):
    generator = torch.Generator().manual_seed(seed)
    row = torch.randint(0, len(TOKENIZER), (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = row.clone()
    labels[positions == 0] = -100  # nothing in a document predicts its first token
    return row, positions, labels, lengths


def _per_document_loss(causal_lm, row, lengths):
    total, count, start = 0.0, 0, 0
    for n in lengths:
        document = row[:, start:start + n]
        labels = document.clone()
        labels[:, 0] = -100  # as in the packed row (with virtual tokens before it, peft would score it)
        total += causal_lm(input_ids=document, labels=labels, use_cache=False).loss * (n - 1)
        count, start = count + n - 1, start + n
    return total / count


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_rows_keep_documents_apart(neox_dir, implementation):
    causal_lm = AutoModelForCausalLM.from_pretrained(str(neox_dir), attn_implementation=implementation)
    model = TransformersCausalLM(causal_lm)
    row, positions, labels, lengths = _packed_row()
    expected = _per_document_loss(causal_lm, row, lengths)
    assert model.masks_separate_documents  # transformers' masks do it, from the position ids
    torch.testing.assert_close(model(row, position_ids=positions, labels=labels).loss, expected, rtol=1e-6, atol=0)
    model.masks_separate_documents = False  # one row per document instead
    torch.testing.assert_close(model(row, position_ids=positions, labels=labels).loss, expected, rtol=1e-6, atol=0)


def test_convolution_layers_run_packed_documents_as_rows():
    """LFM2's short convolutions see across document boundaries whatever the mask: documents run as rows."""
    config = Lfm2Config(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                        initializer_range=0.2, **SPECIAL)
    torch.manual_seed(0)
    causal_lm = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger convolution weights, so a leak across documents shows
        causal_lm.model.layers[0].conv.conv.weight.mul_(30)
    model = TransformersCausalLM(causal_lm)
    assert not model.masks_separate_documents
    row, positions, labels, lengths = _packed_row()
    expected = _per_document_loss(causal_lm, row, lengths)
    torch.testing.assert_close(model(row, position_ids=positions, labels=labels).loss, expected, rtol=1e-6, atol=0)
    with torch.no_grad():
        per_document = torch.cat([causal_lm(input_ids=d).logits for d in row.split(list(lengths), dim=1)], dim=1)
        torch.testing.assert_close(model(row, position_ids=positions).logits, per_document, rtol=0, atol=1e-5)
        model.masks_separate_documents = True  # what trusting transformers' packed masks would give
        leaked = model(row, position_ids=positions).logits
    assert (leaked - per_document).abs().max() > 1e-3  # 100x the tolerance above


def test_masks_that_ignore_positions_are_caught():
    """GPT-OSS's transformers masks do not read position_ids: the check at construction sees the leak."""
    config = GptOssConfig(**{**COMMON, "intermediate_size": 32}, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=4)
    torch.manual_seed(0)
    causal_lm = AutoModelForCausalLM.from_config(config).eval()
    assert masks_separate_documents(causal_lm)  # only attention layers...
    model = TransformersCausalLM(causal_lm)
    assert not model.masks_separate_documents  # ...but a packed row leaks, so documents run as rows
    row, positions, labels, lengths = _packed_row()
    expected = _per_document_loss(causal_lm, row, lengths)
    torch.testing.assert_close(model(row, position_ids=positions, labels=labels).loss, expected, rtol=1e-6, atol=0)


def test_prompt_tuning_scores_the_tokens_peft_scores(neox_dir):
    """Virtual tokens come first; packed documents each get them (one row each). Oracle: peft's forward with
    labels, each row's first label -100 (hfnative does not score a row's first token; see the fallback docs)."""
    peft = pytest.importorskip("peft")
    causal_lm = AutoModelForCausalLM.from_pretrained(str(neox_dir))
    peft_model = peft.get_peft_model(causal_lm, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    model = TransformersCausalLM(peft_model)
    assert not model.logits_from_transformers
    row, positions, labels, lengths = _packed_row()
    expected = _per_document_loss(peft_model, row, lengths)
    torch.testing.assert_close(model(row, position_ids=positions, labels=labels).loss, expected, rtol=1e-6, atol=0)
    padded = torch.stack([row[0, :5], row[0, 8:13]])
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    targets = padded.masked_fill(mask == 0, -100)
    targets[:, 0] = -100
    expected = peft_model(input_ids=padded, attention_mask=mask, labels=targets).loss
    torch.testing.assert_close(model(padded, attention_mask=mask, labels=targets).loss, expected, rtol=1e-6, atol=0)

    prefix = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(neox_dir)),
                                 peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with pytest.raises(ValueError, match="gradient_checkpointing=False"):
        apply_activation_checkpointing(TransformersCausalLM(prefix), "full")


def test_moe_router_aux_loss_is_transformers(tmp_path):
    config = Qwen3MoeConfig(**{**COMMON, "initializer_range": 0.02}, num_key_value_heads=2, head_dim=8, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    causal_lm = AutoModelForCausalLM.from_config(config).eval()
    model = TransformersCausalLM(causal_lm)
    assert model.args.moe.aux_loss_coef == 0.5
    model.aux_loss_enabled = True
    ids = torch.randint(0, len(TOKENIZER), (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ours = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    theirs = causal_lm(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_router_logits=True)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=0)


HEADS = {  # what transformers' causal LMs do to their logits besides lm_head's matrix
    "lm_head bias": lambda: PhiConfig(**COMMON),
    "logits_scaling": lambda: GraniteConfig(**COMMON, logits_scaling=4.0),
    "final_logit_softcapping": lambda: Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0),
}


@pytest.mark.parametrize("head", sorted(HEADS))
def test_head_folds_what_transformers_does_to_the_logits(head):
    torch.manual_seed(0)
    causal_lm = AutoModelForCausalLM.from_config(HEADS[head]()).eval()
    model = TransformersCausalLM(causal_lm)
    assert not model.logits_from_transformers
    ids = torch.randint(0, len(TOKENIZER), (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, causal_lm(input_ids=ids).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(ids, labels=ids).loss, causal_lm(input_ids=ids, labels=ids).loss, rtol=1e-6, atol=0)


class _OffsetLogits(GPTNeoXForCausalLM):
    """A head no fold expresses: transformers' logits plus a constant per vocabulary entry."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + torch.linspace(0, 3, out.logits.shape[-1])
        return out


def test_logits_the_head_cannot_express_come_from_transformers(neox_dir):
    causal_lm = _OffsetLogits.from_pretrained(str(neox_dir))
    model = TransformersCausalLM(causal_lm)
    assert model.logits_from_transformers
    ids = torch.randint(0, len(TOKENIZER), (2, 7))
    expected = torch.nn.functional.cross_entropy(causal_lm(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(model(ids, labels=ids).loss, expected, rtol=1e-6, atol=0)
    assert not TransformersCausalLM(GPTNeoXForCausalLM.from_pretrained(str(neox_dir))).logits_from_transformers


# --- activation checkpointing and compile on the wrapper --------------------------------------------------


def _loss_and_grads(model, ids, positions=None):
    model.zero_grad(set_to_none=True)
    loss = model(ids, position_ids=positions, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode, checkpointed", [("full", {0, 1}), ("selective", {0})])
def test_activation_checkpointing_is_exact_and_recomputes(neox_dir, mode, checkpointed):
    ids = torch.randint(0, len(TOKENIZER), (2, 11))
    loss, grads = _loss_and_grads(TransformersCausalLM(AutoModelForCausalLM.from_pretrained(str(neox_dir))), ids)
    model = apply_activation_checkpointing(TransformersCausalLM(AutoModelForCausalLM.from_pretrained(str(neox_dir))), mode)
    assert model.checkpointed_layers == checkpointed
    calls = [0, 0]
    for index, layer in enumerate(model.layers):  # a sublayer runs again when its layer is recomputed
        layer.mlp.register_forward_pre_hook(lambda module, args, index=index: calls.__setitem__(index, calls[index] + 1))
    ac_loss, ac_grads = _loss_and_grads(model.train(), ids)
    assert torch.equal(ac_loss, loss)
    for name in grads:
        torch.testing.assert_close(ac_grads[name], grads[name], rtol=0, atol=0)
    assert calls == [2 if i in checkpointed else 1 for i in range(2)]


needs_compile = pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported() or not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile is unavailable here (no dynamo support or no C++ compiler)",
)


@needs_compile
def test_compiled_wrapper_matches_eager(neox_dir):
    torch._dynamo.reset()
    eager = TransformersCausalLM(AutoModelForCausalLM.from_pretrained(str(neox_dir)))
    compiled = apply_compile(TransformersCausalLM(AutoModelForCausalLM.from_pretrained(str(neox_dir))))
    assert list(compiled.state_dict()) == list(eager.state_dict())
    row, positions, _, _ = _packed_row()  # one case (compiling is slow on CPU): a packed row, its mask a kwarg
    loss, grads = _loss_and_grads(eager, row, positions)
    c_loss, c_grads = _loss_and_grads(compiled, row, positions)
    torch.testing.assert_close(c_loss, loss, rtol=0, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], rtol=0, atol=1e-5)


# --- what falls back, what stays native ------------------------------------------------------------------


def test_peft_models_take_the_native_route_when_they_can(tmp_path):
    peft = pytest.importorskip("peft")
    config = Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    loaded = resolve_model(lora, torch.device("cpu"), {})
    assert isinstance(loaded.model, Transformer) and loaded.lora_settings.r == 4  # native LoRA
    ids = torch.randint(0, len(TOKENIZER), (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, lora(input_ids=ids).logits, rtol=0, atol=1e-5)

    for tied in (True, False):  # with trainable token rows (a tied head applying the embedding's), natively too
        torch.manual_seed(1)
        base = AutoModelForCausalLM.from_config(Qwen3Config(**{**COMMON, "tie_word_embeddings": tied},
                                                            num_key_value_heads=2, head_dim=8))
        rows = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                         trainable_token_indices=sorted(set(ids[0].tolist()))[:3]))
        with torch.no_grad():
            for name, param in rows.named_parameters():
                if "trainable_tokens_delta" in name:
                    param.add_(torch.randn_like(param))
        loaded = resolve_model(rows, torch.device("cpu"), {})
        assert isinstance(loaded.model, Transformer) and loaded.lora_settings.trainable_token_indices is not None
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(ids).logits, rows(input_ids=ids).logits, rtol=0, atol=1e-5)

    ia3 = peft.get_peft_model(AutoModelForCausalLM.from_config(config), peft.IA3Config(task_type="CAUSAL_LM"))
    loaded = resolve_model(ia3, torch.device("cpu"), {})
    assert isinstance(loaded.model, TransformersCausalLM) and loaded.model.peft_model is ia3
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, ia3(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_what_cannot_fall_back_is_refused(neox_dir, tmp_path):
    not_causal = tmp_path / "classifier"
    shutil.copytree(neox_dir, not_causal)
    config = json.loads((not_causal / "config.json").read_text())
    (not_causal / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForSequenceClassification"]}))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForSequenceClassification.*not a causal language model"):
        resolve_model(str(not_causal), torch.device("cpu"), {})

    missing = tmp_path / "missing"
    shutil.copytree(neox_dir, missing)
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["gpt_neox.layers.1.mlp.dense_h_to_4h.weight"]
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors: \['gpt_neox.layers.1.mlp.dense_h_to_4h.weight'\]"):
        resolve_model(str(missing), torch.device("cpu"), {})


# --- rollouts (GRPO / RLOO on a model without a native implementation) ----------------------------------------


def test_transformers_rollouts_and_grpo_on_a_fallback_model(tmp_path_factory, tmp_path):
    """A Cohere 2 model (no native implementation) generates through transformers' generate behind the rollout
    interface: each sampled token's log-prob is a full forward's log_softmax(logits / temperature) at its position,
    completions stop after the first stop token, a seed repeats the samples; GRPOTrainer and RLOOTrainer train on
    it from real rollouts."""
    from hfnative.converters.fallback_generation import TransformersRolloutEngine
    from hfnative.generation import SamplingParams

    import hfnative

    model_dir = _save("cohere2-rollouts", CONFIGS["cohere2"](), tmp_path_factory)
    model = resolve_model(str(model_dir), torch.device("cpu"), {}).model
    assert isinstance(model, TransformersCausalLM)
    engine = TransformersRolloutEngine(model)
    prompts = [TOKENIZER(text)["input_ids"] for text in ("Tell me a story", "Count to three please", "Hi")]
    stop = TOKENIZER.eos_token_id
    sampling = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, eos_token_id=stop, seed=3)
    first = engine.generate(prompts, sampling)
    assert first == engine.generate(prompts, sampling)
    with torch.no_grad():
        for prompt, completion, logprobs in zip(prompts, first.completion_ids, first.logprobs):
            assert completion and (stop not in completion[:-1])
            logits = model.hf_model(torch.tensor([prompt + completion])).logits[0].double()
            expected = torch.log_softmax(logits[len(prompt) - 1 : -1] / 0.8, dim=-1)
            chosen = expected.gather(1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), chosen, atol=1e-4, rtol=0)

    rows = Dataset.from_list([{"prompt": f"Write note {i}:"} for i in range(16)])
    for config_class, trainer_class in ((hfnative.GRPOConfig, hfnative.GRPOTrainer), (hfnative.RLOOConfig, hfnative.RLOOTrainer)):
        args = config_class(output_dir=str(tmp_path / trainer_class.__name__), use_cpu=True, bf16=False, report_to="none",
                            disable_tqdm=True, max_steps=2, logging_steps=1, save_strategy="no",
                            per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                            learning_rate=1e-2, beta=0.04, gradient_checkpointing=False)
        trainer = trainer_class(model=str(model_dir), reward_funcs=lambda completions, **kw: [len(c) / 10.0 for c in completions],
                                args=args, train_dataset=rows, processing_class=TOKENIZER)
        assert isinstance(trainer.objective.engine, TransformersRolloutEngine)
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert len(logs) == 2 and all(math.isfinite(entry["grad_norm"]) and entry["grad_norm"] > 0 for entry in logs)
        assert logs[-1]["kl"] > 0  # the policy moved from the reference


@pytest.mark.parametrize("family,trainer", [("cohere2", "GRPO"), ("gpt_neox", "GRPO"), ("qwen2_moe", "RLOO")])
def test_rl_trainers_equal_trl_on_fixed_rollouts(family, trainer, tmp_path_factory, tmp_path, monkeypatch):
    """GRPO and RLOO on models without a native implementation (a MoE one with its router loss) against TRL's, the
    same completions fixed per prompt: every logged metric over two steps (test_grpo's comparison)."""
    pytest.importorskip("trl")
    import test_grpo
    import test_rloo

    configs = dict(CONFIGS, qwen2_moe=lambda: Qwen2MoeConfig(
        **COMMON, num_key_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.5))
    model_dir = str(_save(f"{family}-rl", configs[family](), tmp_path_factory))
    runs = test_grpo if trainer == "GRPO" else test_rloo
    extra = dict(loss_type="dapo", beta=0.04) if trainer == "GRPO" else {}
    theirs = runs._run_trl(tmp_path, monkeypatch, model=model_dir, **extra)
    fallback._warned.clear()
    ours = runs._run_ours(tmp_path, model=model_dir, **extra)
    test_grpo.assert_two_steps_equal(ours, theirs)
    if family == "qwen2_moe":
        assert all(entry["aux_loss"] > 0 for entry in ours)
