"""GaLore and APOLLO by transformers' names (optim="galore_adamw", "apollo_adamw", their _layerwise forms, ...), with
``optim_target_modules`` in transformers' module names: the parameters they project are those transformers' Trainer
picks, the steps equal TRL's SFTTrainer running galore_torch / apollo_torch on the same batches, and a checkpoint
(whose projectors are written as plain fields) resumes to the uninterrupted run's steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

import hfnative

pytest.importorskip("galore_torch")
pytest.importorskip("apollo_torch")

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
STEPS = 5


def _rows(n: int = 24) -> list[dict]:
    with open(ROOT / "examples" / "data" / "sft_messages.jsonl") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _trainer(module, output_dir, model=MODEL, **extra):
    settings = dict(output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                    max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=3,
                    learning_rate=3e-3, lr_scheduler_type="constant", max_length=64, seed=3)
    settings.update(extra)
    return module.SFTTrainer(model=model, args=module.SFTConfig(**settings), train_dataset=Dataset.from_list(_rows()),
                             processing_class=AutoTokenizer.from_pretrained(MODEL))


CASES = [
    ("galore_adamw", "rank=4,update_proj_gap=2", ["attn", "mlp"]),
    ("galore_adafactor", "rank=4,update_proj_gap=2,proj_type=left", "all-linear"),
    ("apollo_adamw", "rank=4,update_proj_gap=2", [r".*\.mlp\..*", "q_proj"]),  # random projections, seeded
    ("galore_adamw_layerwise", "rank=4,update_proj_gap=2", ["attn", "mlp"]),
    ("apollo_adamw_layerwise", "rank=4,proj=svd,scale_type=tensor", ["self_attn"]),
]


@pytest.mark.parametrize("optim, optim_args, targets", CASES)
def test_steps_and_weights_equal_trls(optim, optim_args, targets, tmp_path):
    """Per-step losses and the trained weights equal TRL's. Layerwise: each parameter stepped inside backward
    (hfnative's optimizer-in-backward, which the name turns on); TRL logs a grad norm of 0 there (its hooks free the
    gradients first), hfnative the real one, so only losses and weights are compared for those."""
    trl = pytest.importorskip("trl")
    extra = dict(optim=optim, optim_args=optim_args, optim_target_modules=targets)
    if optim.endswith("layerwise"):
        extra["max_grad_norm"] = 0.0
    runs = {}
    for module in (trl, hfnative):
        trainer = _trainer(module, tmp_path / module.__name__, **extra)
        trainer.train()
        trainer.save_model()
        runs[module.__name__] = trainer
    ours, theirs = runs["hfnative"], runs["trl"]
    assert ours.args.optimizer_in_backward is optim.endswith("layerwise")
    ours_steps = [e for e in ours.state.log_history if "loss" in e]
    trl_steps = [e for e in theirs.state.log_history if "loss" in e]
    assert len(ours_steps) == len(trl_steps) == STEPS
    for mine, reference in zip(ours_steps, trl_steps):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5), mine["step"]
        if not optim.endswith("layerwise"):
            assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), mine["step"]
    from safetensors.torch import load_file

    ours_weights = load_file(str(tmp_path / "hfnative" / "model.safetensors"))
    trl_weights = load_file(str(tmp_path / "trl" / "model.safetensors"))
    assert set(ours_weights) == set(trl_weights)
    for name, value in trl_weights.items():  # to 1% of one step's update (lr 3e-3): round-off, not a term
        torch.testing.assert_close(ours_weights[name], value, rtol=0, atol=3e-5, msg=name)


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory):
    """A tiny Qwen3 with its own output head (all-linear then projects the head too)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    directory = tmp_path_factory.mktemp("untied")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return str(directory)


@pytest.mark.parametrize("targets", [["attn", "mlp"], "all-linear", r".*\.(q|v)_proj", ["down_proj"],
                                     ["model.layers.1.mlp.up_proj"]])
def test_targets_are_transformers_choice(targets, untied_model, tmp_path):
    """The projected parameters, in order, are those transformers' Trainer gives the target group (named here by
    their Hub keys): list entries as substrings / exact paths, a regex, all-linear with the untied head."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hfnative.converters.export import hub_state_dict_pieces

    hf_model = AutoModelForCausalLM.from_pretrained(untied_model)
    hf_args = TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to="none", optim="galore_adamw",
                                optim_target_modules=targets)
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(hf_args, hf_model)
    hf_names = {id(p): name for name, p in hf_model.named_parameters()}
    expected = [hf_names[id(p)] for p in kwargs["params"][1]["params"]]

    trainer = _trainer(hfnative, tmp_path / "ours", model=untied_model, optim="galore_adamw",
                       optim_target_modules=targets)
    native_to_hub = {piece.native_key: key for key, pieces in hub_state_dict_pieces(trainer.converted).items()
                     for piece in pieces}
    names = trainer._optim_target_names()
    assert [native_to_hub[name] for name in names] == expected
    if targets == "all-linear":
        assert "lm_head.weight" in expected
    optimizer = trainer.create_optimizer()
    assert [p for p in optimizer.param_groups[1]["params"]] == [dict(trainer.native_model.named_parameters())[n]
                                                                 for n in names]
    assert optimizer.param_groups[1]["rank"] == 128 and optimizer.param_groups[1]["update_proj_gap"] == 200


def test_checkpoint_resumes_to_the_uninterrupted_steps(tmp_path):
    """The projectors (GaLore's SVD bases, recomputed every 3 steps here) are written as plain fields and rebuilt on
    load: resumed at step 2, step 3 projects with the basis from the checkpoint, and steps 3-4 equal the run's."""
    extra = dict(optim="galore_adamw", optim_args="rank=4,update_proj_gap=3", optim_target_modules=["attn", "mlp"],
                 max_steps=4, save_strategy="steps", save_steps=2)
    whole = _trainer(hfnative, tmp_path / "run", **extra)
    whole.train()
    expected = {e["step"]: e for e in whole.state.log_history if "loss" in e}
    saved = torch.load(tmp_path / "run" / "checkpoint-2" / "optimizer.pt", weights_only=True)  # no objects inside
    assert any(isinstance(state.get("projector"), dict) for state in saved["state"].values())
    resumed = _trainer(hfnative, tmp_path / "run", **extra)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    got = {e["step"]: e for e in resumed.state.log_history if "loss" in e and e["step"] > 2}
    assert sorted(got) == [3, 4]
    for step, entry in got.items():
        for key in ("loss", "grad_norm"):
            assert entry[key] == pytest.approx(expected[step][key], rel=1e-6), (step, key)
    projector = next(state["projector"] for state in resumed.optimizer.state.values() if "projector" in state)
    assert type(projector).__module__.startswith("galore_torch") and projector.ortho_matrix is not None


def test_layerwise_turns_optimizer_in_backward_on_and_says_clipping_is_off(tmp_path):
    with pytest.warns(UserWarning, match="max_grad_norm=1.0 is not applied"):
        args = hfnative.SFTConfig(output_dir=str(tmp_path), use_cpu=True, optim="galore_adamw_layerwise",
                                  optim_target_modules=["attn"])
    assert args.optimizer_in_backward and args.max_grad_norm == 0.0


@pytest.mark.parametrize("extra, error, match", [
    (dict(optim="galore_adamw"), ValueError, "You need to define `optim_target_modules` to use galore_adamw"),
    (dict(optim="apollo_adamw", optim_target_modules=["nothing_like_this"]), ValueError, "No target modules found"),
    (dict(optim="galore_adamw_8bit", optim_target_modules=["attn"]), ValueError, "needs CUDA"),
])
def test_bad_settings_are_named(extra, error, match, tmp_path):
    trainer = _trainer(hfnative, tmp_path, **extra)
    with pytest.raises(error, match=match):
        trainer.train()
    assert not list(Path(tmp_path).glob("checkpoint-*"))


def test_lora_is_refused(tmp_path):
    from peft import LoraConfig

    trainer = hfnative.SFTTrainer(
        model=MODEL, train_dataset=Dataset.from_list(_rows()), processing_class=AutoTokenizer.from_pretrained(MODEL),
        peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        args=hfnative.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1,
                                optim="galore_adamw", optim_target_modules=["attn"]))
    with pytest.raises(ValueError, match="with LoRA adapters only the adapters train"):
        trainer.train()
