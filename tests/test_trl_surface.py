"""What a TRL user's code reads on the trainer and the model, asserted against TRL's trainer beside ours.

Each check is one function run on TRL's object and on hfnative's (the import is the only difference):
- ``trainer.aux_loss_enabled`` (SFT, DPO, GRPO, RLOO; a dense model and a tiny MoE, the config's coefficient and 0.0), the
  config's ``output_router_logits`` after SFT's construction, and the setter turning the aux_loss term off;
- ``trainer.accelerator``: rank, device and the collectives scripts call, equal to TRL's; assignment is kept; under
  a 2-process gloo launch, torch.distributed's ranks and collectives on the trainer's process group;
- ``model.lm_head`` / ``get_output_embeddings()``: weight [V, D] equal to transformers', the embedding's own
  parameter when tied, logits equal transformers' ``lm_head`` on the same hidden states;
- GKD's statics: ``generalized_jsd_loss`` equal to TRL's on random logits (beta, temperature, reduction, labels,
  num_items_in_batch) with the same gradients; ``generate_on_policy_outputs`` equal to TRL's (EOS masking);
- SFT's padding-free batches: the same keys and tensors as TRL's collator (cu_seq_lens_q/k, max_length_q/k and
  seq_idx are TRL 1.16's own).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3MoeConfig

import hfnative
from hf_configs import CONFIGS, make_hf_model
from hfnative.converters.hub_model import attach_hub_surface
from hfnative.converters.loading import load_pretrained
from test_sft_vs_trl import MODEL, _config, _dataset

trl = pytest.importorskip("trl")
from trl.experimental.gkd import GKDTrainer as TRLGKDTrainer  # noqa: E402

TOKENIZER = AutoTokenizer.from_pretrained(MODEL)
PREFERENCE_ROWS = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
                   {"prompt": "Two plus two is", "chosen": " four.", "rejected": " five."}] * 2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(TOKENIZER), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
                            num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    TOKENIZER.save_pretrained(str(directory))
    return str(directory)


def _sft(module, model, tmp_path, **extra):
    config = _config(module, tmp_path / module.__name__, 1, **extra)
    return module.SFTTrainer(model=model, args=config, train_dataset=_dataset("text").select(range(6)),
                             processing_class=AutoTokenizer.from_pretrained(model))


def _dpo(module, model, tmp_path, **extra):
    settings = dict(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                    disable_tqdm=True, max_steps=1, logging_steps=1, save_strategy="no", per_device_train_batch_size=2,
                    max_length=32, gradient_checkpointing=False)
    return module.DPOTrainer(model=model, args=module.DPOConfig(**{**settings, **extra}),
                             train_dataset=Dataset.from_list(PREFERENCE_ROWS),
                             processing_class=AutoTokenizer.from_pretrained(model))


def _length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def _online(trainer_name):
    def build(module, model, tmp_path, **extra):
        settings = dict(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                        disable_tqdm=True, max_steps=1, save_strategy="no", per_device_train_batch_size=2,
                        num_generations=2, max_completion_length=4)
        config = getattr(module, f"{trainer_name}Config")(**{**settings, **extra})
        return getattr(module, f"{trainer_name}Trainer")(
            model=model, reward_funcs=_length_reward, args=config,
            train_dataset=Dataset.from_list([{"prompt": row["prompt"]} for row in PREFERENCE_ROWS]),
            processing_class=AutoTokenizer.from_pretrained(model))
    return build


# --- aux_loss_enabled --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [_sft, _dpo, _online("GRPO"), _online("RLOO")], ids=["sft", "dpo", "grpo", "rloo"])
@pytest.mark.parametrize("model, coef", [("dense", None), ("moe", None), ("moe", 0.0)],
                         ids=["dense", "moe-config-coef", "moe-off"])
def test_aux_loss_enabled_is_trls(build, model, coef, moe_model, tmp_path):
    path = MODEL if model == "dense" else moe_model
    theirs = build(trl, path, tmp_path, router_aux_loss_coef=coef)
    ours = build(hfnative, path, tmp_path, router_aux_loss_coef=coef)
    assert ours.aux_loss_enabled is theirs.aux_loss_enabled is (model == "moe" and coef is None)
    text_theirs, text_ours = theirs.model.config.get_text_config(), ours.model.config.get_text_config()
    for key in ("output_router_logits", "router_aux_loss_coef"):  # SFT writes both into the config; DPO neither
        assert getattr(text_ours, key, None) == getattr(text_theirs, key, None), key


def test_turning_aux_loss_off_drops_the_term_as_trl(moe_model, tmp_path):
    logs = {}
    for module in (trl, hfnative):
        trainer = _sft(module, moe_model, tmp_path, max_steps=1)
        trainer.aux_loss_enabled = False
        assert trainer.aux_loss_enabled is False
        trainer.train()
        logs[module.__name__] = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert "aux_loss" not in logs["trl"] and "aux_loss" not in logs["hfnative"]
    assert logs["hfnative"]["loss"] == pytest.approx(logs["trl"]["loss"], rel=1e-5)


# --- accelerator -------------------------------------------------------------------------------------------------


def _accelerator_reading(trainer) -> dict:
    """What scripts and callbacks read on ``trainer.accelerator`` in one process."""
    accelerator = trainer.accelerator
    values = torch.arange(6.0).reshape(2, 3)
    with accelerator.split_between_processes(["a", "b", "c"]) as share:
        split = list(share)
    accelerator.wait_for_everyone()
    return {
        "ranks": (accelerator.is_main_process, accelerator.is_local_main_process, accelerator.process_index,
                  accelerator.local_process_index, accelerator.num_processes),
        "device": accelerator.device,
        "distributed_type": accelerator.distributed_type,
        "gather": accelerator.gather(values).tolist(),
        "gather_for_metrics": accelerator.gather_for_metrics(values).tolist(),
        "reduce": accelerator.reduce(values, reduction="sum").tolist(),
        "pad_across_processes": accelerator.pad_across_processes(values, dim=1).tolist(),
        "split": split,
        "unwrap_is_model": accelerator.unwrap_model(trainer.model) is trainer.model,
        "is_accelerate": type(accelerator).__module__.startswith("accelerate"),
    }


def test_accelerator_reads_as_trls_and_is_settable(tmp_path):
    theirs, ours = _sft(trl, MODEL, tmp_path), _sft(hfnative, MODEL, tmp_path)
    assert _accelerator_reading(ours) == _accelerator_reading(theirs)
    replacement = object()
    ours.accelerator = replacement
    assert ours.accelerator is replacement


# --- lm_head / get_output_embeddings ------------------------------------------------------------------------------


def _head_reading(model) -> dict:
    head = model.lm_head
    return {
        "same_module": head is model.get_output_embeddings(),
        "shape": tuple(head.weight.shape),
        "features": (head.in_features, head.out_features),
        "bias": head.bias,
        "tied": head.weight is model.get_input_embeddings().weight,
    }


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied-llama3", "qwen3-gqa"])
def test_lm_head_is_transformers_like(name, tmp_path):
    reference = make_hf_model(name)
    assert reference.config.tie_word_embeddings == CONFIGS[name]().tie_word_embeddings
    reference.save_pretrained(tmp_path / name)
    converted = load_pretrained(tmp_path / name)
    native = attach_hub_surface(converted.model, converted)
    assert _head_reading(native) == _head_reading(reference)
    assert torch.equal(native.lm_head.weight, reference.lm_head.weight)
    hidden = torch.randn(2, 5, reference.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(native.lm_head(hidden), reference.lm_head(hidden), rtol=0, atol=1e-6)
        torch.testing.assert_close(native.get_output_embeddings()(hidden), reference.get_output_embeddings()(hidden),
                                   rtol=0, atol=1e-6)


def test_trainer_model_lm_head_as_trls(tmp_path):
    theirs, ours = _sft(trl, MODEL, tmp_path), _sft(hfnative, MODEL, tmp_path)
    assert _head_reading(ours.model) == _head_reading(theirs.model)
    assert torch.equal(ours.model.lm_head.weight, theirs.model.lm_head.weight)


# --- GKD's static helpers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_generalized_jsd_loss_equals_trls(beta, temperature):
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 7, 19) * 3, torch.randn(3, 7, 19) * 3
    labels = torch.randint(0, 19, (3, 7))
    labels[0, :4] = labels[2, :] = -100  # a masked prompt, and a row with no label tokens
    cases = [dict(reduction=r) for r in ("batchmean", "sum", "mean", "none")]
    cases += [dict(labels=labels, reduction=r) for r in ("batchmean", "sum", "mean", "none")]
    cases += [dict(labels=labels, num_items_in_batch=torch.tensor(11))]
    for case in cases:
        outputs = {}
        for name, trainer in (("trl", TRLGKDTrainer), ("ours", hfnative.GKDTrainer)):
            s, t = student.clone().requires_grad_(), teacher.clone().requires_grad_()
            loss = trainer.generalized_jsd_loss(s, t, beta=beta, temperature=temperature, **case)
            loss.sum().backward()
            outputs[name] = (loss.detach(), s.grad, t.grad)
        for theirs, ours in zip(outputs["trl"], outputs["ours"]):
            assert ours.shape == theirs.shape, case
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: {m}")


def test_generalized_jsd_loss_bad_input_is_refused():
    logits = torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match="reduction='avg'"):
        hfnative.GKDTrainer.generalized_jsd_loss(logits, logits, reduction="avg")
    with pytest.raises(ValueError, match="beta=1.5"):
        hfnative.GKDTrainer.generalized_jsd_loss(logits, logits, beta=1.5)
    with pytest.raises(ValueError, match="same shape"):
        hfnative.GKDTrainer.generalized_jsd_loss(logits, logits[..., :4])


def _prompts() -> dict:
    TOKENIZER.padding_side = "left"
    batch = TOKENIZER(["Once upon a time", "The cat sat on", "Hello"], return_tensors="pt", padding=True)
    return {"prompts": batch["input_ids"], "prompt_attention_mask": batch["attention_mask"]}


def test_generate_on_policy_outputs_equals_trls(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(MODEL).eval()
    native = _sft(hfnative, MODEL, tmp_path).model.eval()
    inputs = _prompts()
    greedy = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=TOKENIZER.pad_token_id, eos_token_id=None)
    free = TRLGKDTrainer.generate_on_policy_outputs(model, inputs, greedy)[0][:, inputs["prompts"].shape[1]:]
    # stop tokens each row reaches at a different step (and one row never), as a list as Llama 3's are
    stops = [int(free[0, 1]), int(free[1, 3])]
    assert int(free[2, 0]) not in stops
    configs = [greedy, GenerationConfig(**{**greedy.to_diff_dict(), "eos_token_id": stops}),
               GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.9, top_k=0,
                                pad_token_id=TOKENIZER.pad_token_id, eos_token_id=stops[0])]
    for config in configs:
        results = []
        for generate, on in ((TRLGKDTrainer.generate_on_policy_outputs, model),
                             (hfnative.GKDTrainer.generate_on_policy_outputs, model),
                             (hfnative.GKDTrainer.generate_on_policy_outputs, native)):
            torch.manual_seed(3)
            results.append(generate(on, inputs, config))
        for result in results[1:]:
            for theirs, ours in zip(results[0], result):
                assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), config
    sequences, mask, labels = results[0]
    assert (labels[:, :inputs["prompts"].shape[1]] == -100).all() and mask.shape == sequences.shape
    with pytest.raises(ValueError, match="prompt_attention_mask"):
        hfnative.GKDTrainer.generate_on_policy_outputs(model, {"prompts": inputs["prompts"]}, greedy)


# --- SFT's padding-free batches ------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [dict(padding_free=True, max_length=None), dict(packing=True, packing_strategy="bfd"),
                                      dict(padding_free=True, max_length=None, pad_to_multiple_of=8)], ids=["padding-free", "bfd", "x8"])
def test_padding_free_batches_equal_trls(settings, tmp_path):
    trainers = {module.__name__: _sft(module, MODEL, tmp_path, per_device_train_batch_size=3, **settings)
                for module in (trl, hfnative)}
    rows = [trainers["trl"].train_dataset[i] for i in range(3)]
    theirs, ours = (trainers[name].data_collator(rows) for name in ("trl", "hfnative"))
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"} <= set(theirs)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert (torch.equal(ours[key], value) and ours[key].dtype == value.dtype) if torch.is_tensor(value) \
            else ours[key] == value, key


def test_accelerator_on_two_processes_is_the_trainers_process_group(tmp_path):
    """Under torchrun (2 processes, gloo): ranks, device and collectives of ``trainer.accelerator`` are
    torch.distributed's on the group the trainer started (tests/_accelerator_worker.py)."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(here))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(here / "_accelerator_worker.py"), str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    readings = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, reading in enumerate(readings):
        assert reading["ranks"] == reading["torch_ranks"] == [rank == 0, rank == 0, rank, rank, 2]
        assert reading["world_process_zero"] == (rank == 0) and torch.device(reading["device"]).type == "cpu"
        assert reading["gather"] == reading["all_gather"] == reading["gather_for_metrics"] == [1.0, 1.0, 2.0, 2.0]
        assert reading["reduce_sum"] == [3.0, 3.0] and reading["padded"] == 2 and reading["unwrap_is_model"]
    assert readings[0]["split"] == ["a", "b"] and readings[1]["split"] == ["c", "d"]
