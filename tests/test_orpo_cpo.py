"""hfnative's ORPOTrainer and CPOTrainer against TRL's experimental ones on the same tiny model, data, order and seed
(fp32, gradient accumulation 2): ORPO (conversational rows, implicit prompts, with and without LoRA, a MoE model with
its router loss) and every CPO loss type (text and chat rows; label smoothing; AlphaPO; LoRA) for 2 steps — loss, grad_norm and every metric TRL logs equal
within 1e-5 relative at step 1 and 1e-4 at step 2 — and the tokenized rows equal TRL's. The configs' fields and
defaults equal TRL's; bad settings are refused by name; DDP and FSDP2 on 2 gloo processes equal one process.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

import hfnative

trl = pytest.importorskip("trl")
from trl.experimental.cpo import CPOConfig as TRLCPOConfig, CPOTrainer as TRLCPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOConfig as TRLORPOConfig, ORPOTrainer as TRLORPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
MODEL = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data" / "preference.jsonl"
STEPS = 2
SKIPPED = ("epoch", "step", "step_time")


def _rows(n: int) -> list[dict]:
    with open(DATA) as f:
        return [json.loads(line) for line in f][:n]


def _text_rows(n: int) -> list[dict]:
    return [
        {"prompt": f"Question: {r['prompt'][-1]['content']}\nAnswer:", "chosen": " " + r["chosen"][0]["content"],
         "rejected": " " + r["rejected"][0]["content"]}
        for r in _rows(n)
    ]


def _implicit(rows: list[dict]) -> list[dict]:
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    """The tiny checkpoint with its embeddings x3 (next-token distributions far from uniform), saved to disk."""
    root = tmp_path_factory.mktemp("orpo-cpo-models")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
    model.save_pretrained(root / "policy")
    AutoTokenizer.from_pretrained(MODEL).save_pretrained(root / "policy")
    return str(root / "policy")


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE asking for its router logits (TRL then adds router_aux_loss_coef x the load-balancing loss)."""
    root = tmp_path_factory.mktemp("orpo-cpo-moe")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
                            num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5, output_router_logits=True,
                            max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "moe")
    tokenizer.save_pretrained(root / "moe")
    return str(root / "moe")


def _settings(output_dir, **extra) -> dict:
    return dict(output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                max_steps=STEPS, logging_steps=1, save_strategy="no", per_device_train_batch_size=2,
                gradient_accumulation_steps=2, learning_rate=2e-3, lr_scheduler_type="cosine", warmup_steps=1,
                weight_decay=0.01, max_length=64, gradient_checkpointing=False, seed=3, **extra)


# case -> (algorithm, config settings, rows, LoRA)
CASES = {
    "orpo": ("orpo", dict(beta=0.2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=3), "messages",
             False),
    "orpo-lora-implicit": ("orpo", dict(beta=0.1, padding_value=7), "implicit", True),
    "cpo-hinge": ("cpo", dict(loss_type="hinge", beta=0.05), "text", False),
    "cpo-ipo": ("cpo", dict(loss_type="ipo", beta=0.5), "messages", False),
    "cpo-simpo": ("cpo", dict(loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=0.5), "text", False),
    "cpo-alphapo": ("cpo", dict(loss_type="alphapo", beta=2.0, alpha=0.25), "text", False),
    "cpo-sigmoid-lora": ("cpo", dict(label_smoothing=0.1, cpo_alpha=0.3), "messages", True),
    "orpo-moe": ("orpo", dict(beta=0.2), "messages", False),
}


def _data(kind: str) -> list[dict]:
    return {"messages": _rows(16), "implicit": _implicit(_rows(16)), "text": _text_rows(16)}[kind]


def _build(side: str, case: str, model_path: str, tmp_path):
    algorithm, settings, kind, lora = CASES[case]
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0) if lora else None
    if side == "trl":
        config, trainer = (TRLORPOConfig, TRLORPOTrainer) if algorithm == "orpo" else (TRLCPOConfig, TRLCPOTrainer)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    else:
        config, trainer = ((hfnative.ORPOConfig, hfnative.ORPOTrainer) if algorithm == "orpo"
                           else (hfnative.CPOConfig, hfnative.CPOTrainer))
        model = model_path
    torch.manual_seed(0)
    evaluating = settings.get("eval_strategy", "no") != "no"
    return trainer(model=model, args=config(**_settings(tmp_path / side, **settings)),
                   train_dataset=Dataset.from_list(_data(kind)), processing_class=AutoTokenizer.from_pretrained(MODEL),
                   eval_dataset=Dataset.from_list(_rows(24)[16:]) if evaluating else None, peft_config=peft_config)


def _steps(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _evaluations(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "eval_loss" in entry]


@pytest.mark.parametrize("case", list(CASES))
def test_trains_like_trl(policy, moe_policy, case, tmp_path):
    lora = CASES[case][3]
    policy = moe_policy if case.endswith("moe") else policy
    theirs = _build("trl", case, policy, tmp_path)
    if lora:  # peft's random initial A, given to both
        theirs.model.save_pretrained(str(tmp_path / "initial-adapter"))
    theirs.train()
    ours = _build("ours", case, policy, tmp_path)  # built after TRL's run: TRL's trainer resets accelerate's state
    if lora:
        from hfnative.converters.peft import load_adapter_weights

        load_adapter_weights(ours.converted, tmp_path / "initial-adapter")
    # the tokenized rows: TRL's sequences and prompt masks
    for mine, trl_row in zip(ours.train_dataset, theirs.train_dataset):
        for side in ("chosen", "rejected"):
            assert mine[f"{side}_input_ids"] == trl_row[f"{side}_input_ids"]
            assert trl_row[f"{side}_labels"][: mine[f"{side}_prompt_length"]] == [-100] * mine[f"{side}_prompt_length"]
            assert trl_row[f"{side}_labels"][mine[f"{side}_prompt_length"]:] == mine[f"{side}_input_ids"][mine[f"{side}_prompt_length"]:]
    if case.endswith("moe"):  # the router's loss is in both losses
        assert ours.objective.aux_loss_coef == theirs.aux_loss_coef == 0.5 and ours.model.aux_loss_enabled
        assert ours.aux_loss_enabled is theirs.aux_loss_enabled is True
    ours.train()
    expected, got = _steps(theirs), _steps(ours)
    assert len(expected) == len(got) == STEPS
    worst = {}
    for step, (mine, trl_entry) in enumerate(zip(got, expected)):
        tolerance = 1e-5 if step == 0 else 1e-4
        keys = [k for k in trl_entry if k not in SKIPPED and not k.startswith("perf/")]
        assert set(keys) <= set(mine), sorted(set(keys) - set(mine))
        for key in keys:
            assert mine[key] == pytest.approx(trl_entry[key], rel=tolerance, abs=1e-6), (case, step + 1, key)
            if trl_entry[key] != 0:
                worst[key] = max(worst.get(key, 0.0), abs(mine[key] - trl_entry[key]) / abs(trl_entry[key]))
    assert expected[0]["grad_norm"] > 0 and expected[-1]["loss"] != expected[0]["loss"]
    evaluations, expected_evaluations = _evaluations(ours), _evaluations(theirs)
    assert len(evaluations) == len(expected_evaluations) == (CASES[case][1].get("eval_strategy", "no") != "no")
    for mine, trl_entry in zip(evaluations, expected_evaluations):
        keys = [k for k in trl_entry if k.startswith("eval_") and not k.endswith(("runtime", "per_second"))]
        assert len(keys) > 5 and set(keys) <= set(mine), sorted(set(keys) - set(mine))
        for key in keys:
            assert mine[key] == pytest.approx(trl_entry[key], rel=1e-4, abs=1e-6), (case, key)
            worst[key] = max(worst.get(key, 0.0), abs(mine[key] - trl_entry[key]) / max(abs(trl_entry[key]), 1e-12))
    key = max(worst, key=worst.get)
    print(f"{case}: max relative difference {worst[key]:.2e} ({key}) "
          f"(loss {worst['loss']:.2e}, grad_norm {worst['grad_norm']:.2e})")


# --- configs and bad settings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ORPOConfig", "CPOConfig"])
def test_config_has_trls_fields_and_defaults(name):
    trl_class = TRLORPOConfig if name == "ORPOConfig" else TRLCPOConfig
    theirs, ours = trl_class("unused", use_cpu=True), getattr(hfnative, name)("unused", use_cpu=True)
    names = {f.name for f in dataclasses.fields(theirs)} - {"accelerator_config"}
    assert names <= {f.name for f in dataclasses.fields(ours)}
    assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs, n) for n in names}
    alphapo = (TRLCPOConfig("u", use_cpu=True, loss_type="alphapo"), hfnative.CPOConfig("u", use_cpu=True, loss_type="alphapo"))
    assert (alphapo[1].loss_type, alphapo[1].cpo_alpha) == (alphapo[0].loss_type, alphapo[0].cpo_alpha) == ("simpo", 0.0)
    from hfnative.trainers import CPOConfig, CPOTrainer, ORPOConfig, ORPOTrainer  # noqa: F401  (both import paths)


@pytest.mark.parametrize("settings, message", [
    (dict(loss_type="kto_pair"), "kto_pair has been removed"),
    (dict(loss_type="robust"), "Unknown loss type: robust"),
    (dict(is_encoder_decoder=True), r"is_encoder_decoder=True: encoder-decoder \(seq2seq\) models are out of scope"),
])
def test_bad_settings_are_refused(settings, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        hfnative.CPOTrainer(model=MODEL, args=hfnative.CPOConfig(**_settings(tmp_path, **settings)),
                            train_dataset=Dataset.from_list(_text_rows(4)), eval_dataset=Dataset.from_list(_text_rows(2)))


def test_declared_layouts():
    """DDP / FSDP2 (multi_process) and evaluation; the loop refuses tensor, context and expert parallelism."""
    from hfnative.trainers.algorithms.cpo import CPOObjective
    from hfnative.trainers.algorithms.orpo import ORPOObjective

    assert ORPOObjective.supports == CPOObjective.supports == {"multi_process", "multi_process_generation", "evaluation"}


@pytest.mark.parametrize("name", ["ORPO", "CPO"])
def test_generate_during_eval_logs_trls_game_log(name, tmp_path, monkeypatch):
    """generate_during_eval=True: at each evaluation eval_batch_size prompts of the eval set are completed by the
    policy with sampling (up to max_length tokens in all, the same rows for the same seed and step) and logged to W&B
    as TRL's table game_log (Prompt, Policy); without wandb or comet installed it is refused with TRL's message."""
    import wandb

    from hfnative.trainers.rollout.component import Rollout

    tables = []  # the tables made for W&B (wandb.init, which the W&B callback calls, rebinds wandb.log)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    class RecordedTable(wandb.Table):  # a wandb.Table still (W&B's own code checks the type of what it logs)
        def __init__(self, *args, dataframe=None, **kwargs):
            tables.append(dataframe)
            super().__init__(*args, dataframe=dataframe, **kwargs)

    monkeypatch.setattr(wandb, "Table", RecordedTable)
    calls, sample = [], Rollout.sample
    monkeypatch.setattr(Rollout, "sample", lambda self, prompts, sampling, model=None: calls.append((prompts, sampling))
                        or sample(self, prompts, sampling, model))
    rows = _text_rows(6)
    settings = {**_settings(tmp_path, generate_during_eval=True, eval_strategy="steps", eval_steps=1,
                            per_device_eval_batch_size=3), "report_to": ["wandb"], "max_length": 48}
    trainer = getattr(hfnative, f"{name}Trainer")(model=MODEL, args=getattr(hfnative, f"{name}Config")(**settings),
                                                  train_dataset=Dataset.from_list(rows),
                                                  eval_dataset=Dataset.from_list(rows[:4]))
    trainer.train()
    assert len(tables) == len(calls) == STEPS  # one evaluation a step
    trainer.predict(Dataset.from_list(rows[:4]))  # predict() logs one too, as TRL's (its evaluation loop)
    assert len(tables) == len(calls) == STEPS + 1
    prompts = {r["prompt"] for r in rows[:4]}
    tokenized = {tuple(trainer.processing_class(p, add_special_tokens=False)["input_ids"]) for p in prompts}
    generation = trainer.model.generation_config
    defaults = transformers.GenerationConfig._get_default_generation_params()  # what generate() fills in
    expected = [defaults[name] if getattr(generation, name) is None else getattr(generation, name)
                for name in ("top_k", "top_p", "temperature")]
    for frame, (prompt_ids, sampling) in zip(tables, calls):
        assert list(frame.columns) == ["Prompt", "Policy"] and len(frame) == len(prompt_ids) == 3
        assert set(frame["Prompt"]) <= prompts and frame["Prompt"].is_unique
        assert {tuple(ids) for ids in prompt_ids} <= tokenized
        assert sampling.max_new_tokens == 48 - max(len(ids) for ids in prompt_ids)  # max_length in all, as generate's
        assert [sampling.top_k, sampling.top_p, sampling.temperature] == expected and sampling.do_sample
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None)
    with pytest.raises(ValueError, match="requires Weights and Biases or Comet to be installed"):
        getattr(hfnative, f"{name}Trainer")(model=MODEL, args=getattr(hfnative, f"{name}Config")(**settings),
                                            train_dataset=Dataset.from_list(rows))


def test_mixed_row_kinds_name_the_row(tmp_path):
    rows = _text_rows(3)
    rows[1] = {**rows[1], "prompt": None}  # an implicit prompt in a row of a dataset with explicit ones
    rows[1]["chosen"] = ""
    with pytest.raises(ValueError, match="preference row 1"):
        hfnative.ORPOTrainer(model=MODEL, args=hfnative.ORPOConfig(**_settings(tmp_path)),
                             train_dataset=Dataset.from_list(rows))


# --- layouts: DDP and FSDP2 on 2 gloo processes against one process ---------------------------------------------

def test_layouts_train_like_one_process(policy, tmp_path):
    """Each rank's 2-pair micro-batch is one of the single process's 2 accumulated micro-batches (the loss is a
    mean of micro-batch means, as TRL's under DDP): 2 steps (and ORPO's evaluation under DDP) equal within 1e-5
    relative."""
    import _orpo_cpo_layout_worker as worker

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "_orpo_cpo_layout_worker.py"), str(tmp_path / "launched"), policy, *worker.CELLS]
    result = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE)),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    references = {}
    for cell, (algorithm, _, settings) in worker.CELLS.items():
        key = (algorithm, json.dumps(settings, sort_keys=True))
        if key not in references:
            trainer = worker.trainer_for(cell, str(tmp_path / "one" / cell), policy, layout=None)
            trainer.train()
            references[key] = _steps(trainer) + _evaluations(trainer)
        expected = references[key]
        logs = json.loads((tmp_path / "launched" / cell / "log.json").read_text())
        got = [e for e in logs if "loss" in e] + [e for e in logs if "eval_loss" in e]
        assert len(got) == len(expected) == worker.STEPS + (settings.get("eval_strategy", "no") != "no")
        for mine, theirs in zip(got, expected):
            assert set(mine) == set(theirs)
            for key_, value in theirs.items():
                if (isinstance(value, float) and key_ not in SKIPPED and not key_.startswith("perf/")
                        and not key_.endswith(("runtime", "per_second"))):
                    assert mine[key_] == pytest.approx(value, rel=1e-5, abs=1e-6), (cell, key_)


# --- CLI ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, extra", [("cpo", ["--loss_type", "simpo"])])
def test_cli_trains_and_saves(command, extra, tmp_path):
    """``hfnative-train cpo`` on the shipped data (``orpo`` is registered alike), two steps, a saved model
    transformers loads."""
    from hfnative.trainers.running import cli

    out = tmp_path / command
    cli.main([command, "--model_name_or_path", MODEL, "--dataset_name", str(DATA), "--output_dir", str(out),
              "--use_cpu", "--no_bf16", "--max_steps", "2", "--logging_steps", "1", "--report_to", "none",
              "--disable_tqdm", "--learning_rate", "1e-2", "--max_length", "64", "--per_device_train_batch_size", "2",
              "--save_strategy", "no", "--no_gradient_checkpointing", *extra])
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    AutoModelForCausalLM.from_pretrained(str(out))
