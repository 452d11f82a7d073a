"""hfnative's KTOTrainer against TRL's on the same tiny model, data, order and settings (fp32).

- Two training steps agree with TRL per step (loss, grad norm, every logged metric: kl, entropy, num_tokens, logits/*,
  rewards/*, logps/*, aux_loss), within 1e-5 relative at step 1 and 1e-4 after updates: a frozen copy of the
  checkpoint as the reference with gradient accumulation (micro-batches with no undesirable row) and
  apo_zero_unpaired with desirable / undesirable weights, LoRA (the base with adapters disabled) on paired rows
  unpaired as TRL does, a separate ref_model with TR-DPO syncing and evaluation, and a MoE model (TRL adds the
  router's load-balancing loss) with precomputed reference log-probs.
- Tokenization, the mismatched KL completions and batches equal TRL's for unpaired / paired, text / conversational
  rows; the desirable / undesirable weight advice is TRL's.
- Bad settings get TRL's errors; the config has TRL's fields and defaults; ``hfnative-train kto`` trains and saves.
- DDP (MoE, router loss), FSDP2 (KL across the ranks, accumulation) and tensor parallel (tp=2) on 2 gloo processes train
  like one process over the same global batches (tests/_kto_layout_worker.py).
"""

import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

import hfnative
from _launch import assert_logged_close
from hfnative.data.unpaired_preference import UnpairedPreferenceCollator, prepare_unpaired_preference_dataset

trl = pytest.importorskip("trl")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data" / "preference.jsonl"
STEPS = 2  # the first step, and one after an update


def _paired(n: int) -> list[dict]:
    with open(DATA) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _unpaired(n: int, text: bool = False, seed: int = 0) -> list[dict]:
    """Unpaired rows from the shipped pairs: each pair's chosen or rejected completion, picked at random."""
    picks = random.Random(seed)
    rows = []
    for pair in _paired(n):
        label = picks.random() < 0.5
        completion = pair["chosen"] if label else pair["rejected"]
        if text:
            rows.append({"prompt": f"Question: {pair['prompt'][-1]['content']}\nAnswer:",
                         "completion": " " + completion[0]["content"], "label": label})
        else:
            rows.append({"prompt": pair["prompt"], "completion": completion, "label": label})
    return rows


def _text_pairs(n: int) -> list[dict]:
    return [{"chosen": f"Question: {r['prompt'][-1]['content']}\nAnswer: {r['chosen'][0]['content']}",
             "rejected": f"Question: {r['prompt'][-1]['content']}\nAnswer: {r['rejected'][0]['content']}"}
            for r in _paired(n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny checkpoint with sharper next-token distributions as the policy, a perturbed copy as a separate
    reference, and a tiny Qwen3-MoE (router_aux_loss_coef 0.5), saved to disk."""
    root = tmp_path_factory.mktemp("kto-models")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    paths = {}
    for name, noise in (("policy", 0.0), ("reference", 0.05)):
        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(4.0)
            for param in model.parameters():
                param.add_(noise * torch.randn_like(param))
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = str(root / name)
    moe = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                         num_experts_per_tok=2, router_aux_loss_coef=0.5, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(moe).save_pretrained(root / "moe")
    tokenizer.save_pretrained(root / "moe")
    paths["moe"] = str(root / "moe")
    return paths


def _config(module, output_dir, **extra):
    settings = dict(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=4, learning_rate=2e-3,
        lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.01, max_length=48, gradient_checkpointing=False,
        beta=0.05,  # rewards: beta x differences of ~60-nat float32 sums, so their round-off stays under 1e-6
    )
    return module.KTOConfig(**{**settings, **extra})


def _trainer(module, model, tmp_path, rows, ref_model=None, peft_config=None, eval_rows=None, **extra):
    return module.KTOTrainer(
        model=model, ref_model=ref_model, args=_config(module, tmp_path / module.__name__, **extra),
        train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
        processing_class=AutoTokenizer.from_pretrained(MODEL), peft_config=peft_config,
    )


# --- training, step by step ----------------------------------------------------------------------------

CASES = {
    # micro-batches of 2 rows: some have no undesirable (or no desirable) row, whose metrics TRL leaves out
    "copy-accumulation-apo-zero": dict(gradient_accumulation_steps=2, per_device_train_batch_size=2,
                                       loss_type="apo_zero_unpaired", desirable_weight=0.8, undesirable_weight=1.2),
    # paired text rows, unpaired as TRL does (desirable rows first); the reference (and its KL log-probs) is the base
    # with the adapters disabled
    "lora-paired-text": dict(learning_rate=2e-2),
    "separate-ref": dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5, eval_strategy="steps",
                         eval_steps=STEPS, per_device_eval_batch_size=3),
    # TRL adds the router's load-balancing loss (coefficient 0.5); the reference's log-probs precomputed
    "moe-precompute": dict(per_device_train_batch_size=2, precompute_ref_log_probs=True, desirable_weight=1.3),
}


def _train_logs(module, models, tmp_path, case):
    extra = dict(CASES[case])
    # the MoE case's reference log-probs are precomputed over every row: few rows (transformers' MoE is slow on CPU)
    rows = _text_pairs(12) if "paired-text" in case else _unpaired(6 if case.startswith("moe") else 24)
    ref_model, peft_config = None, None
    if case.startswith("lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    elif case == "separate-ref":
        ref_model = models["reference"] if module is hfnative else AutoModelForCausalLM.from_pretrained(models["reference"])
    model = models["moe"] if case.startswith("moe") else models["policy"]
    trainer = _trainer(module, model, tmp_path, rows, ref_model=ref_model, peft_config=peft_config,
                       eval_rows=_unpaired(31, seed=1)[24:] if "eval_strategy" in extra else None, **extra)
    if peft_config is not None and module is trl:  # peft's random initial A, given to both
        trainer.model.save_pretrained(str(tmp_path / "initial-adapter"))
    elif peft_config is not None:
        from hfnative.converters.peft import load_adapter_weights

        load_adapter_weights(trainer.converted, tmp_path / "initial-adapter")
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry or "eval_loss" in entry]
    return [{k: v for k, v in entry.items() if not k.startswith("perf/")} for entry in logs]  # hfnative's own


WORST: dict[str, float] = {}  # the largest relative difference of loss / grad_norm seen, per case (printed)


def _assert_close(mine: float, reference: float, step: int, where):
    relative = 1e-5 if step == 1 else 1e-4
    assert mine == pytest.approx(reference, rel=relative, abs=1e-6), (where, step, mine, reference)
    if where[1] in ("loss", "grad_norm", "eval_loss") and reference != 0:
        WORST[where[0]] = max(WORST.get(where[0], 0.0), abs(mine - reference) / abs(reference))


@pytest.mark.parametrize("case", list(CASES))
def test_training_matches_trl_per_step(models, tmp_path, case):
    theirs = _train_logs(trl, models, tmp_path, case)
    ours = _train_logs(hfnative, models, tmp_path, case)
    if "eval_strategy" in CASES[case]:  # evaluated after the last step: eval_-prefixed metrics
        (evaluation,), (reference,) = ([e for e in logs if "eval_loss" in e] for logs in (ours, theirs))
        expected = {key for key in reference if not key.endswith(("runtime", "per_second"))}
        assert expected <= set(evaluation), sorted(expected - set(evaluation))
        for key in expected:
            _assert_close(evaluation[key], reference[key], 2, (case, key))
        ours, theirs = ([e for e in logs if "eval_loss" not in e] for logs in (ours, theirs))
    assert len(ours) == len(theirs) == STEPS
    for mine, reference in zip(ours, theirs):
        step = reference["step"]
        names = {key for key in mine if not key.startswith("perf/")}  # every key TRL logs, and our perf/ ones
        assert names == set(reference), (case, step, names ^ set(reference))
        assert mine["num_tokens"] == reference["num_tokens"], step
        for key, value in reference.items():
            if isinstance(value, float) and key != "epoch":
                _assert_close(mine[key], value, step, (case, key))
        if case.startswith("moe"):
            assert mine["aux_loss"] > 0
    if case == "separate-ref":
        assert theirs[0]["kl"] > 0.1  # the KL reference point is in the loss (not clamped away)
    if case in ("copy-accumulation-apo-zero", "separate-ref"):
        assert theirs[-1]["rewards/chosen"] != theirs[0]["rewards/chosen"]  # the policy moved
    print(f"{case}: max relative difference of loss and grad_norm {WORST.get(case, 0.0):.2e}")


# --- data: tokenization, mismatched completions, batches --------------------------------------------------

FORMATS = {
    "conversational": lambda: _unpaired(14),
    "text": lambda: _unpaired(14, text=True),
    "paired-conversational": lambda: _paired(7),
    "paired-text-implicit": lambda: _text_pairs(7),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tokenization_and_batches_match_trl(fmt):
    rows = FORMATS[fmt]()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    args = trl.KTOConfig(output_dir="unused", use_cpu=True, max_length=40, per_device_train_batch_size=3)
    owner = SimpleNamespace(_tokenizer=tokenizer, calculate_KL=True, desirable_weight=1.0, undesirable_weight=1.0)
    reference = trl.KTOTrainer._prepare_dataset(owner, Dataset.from_list(rows), tokenizer, args, "eval")
    ours = prepare_unpaired_preference_dataset(Dataset.from_list(rows), tokenizer, max_length=40, kl_group_size=3)
    assert len(ours) == len(reference) and len(ours) > 6
    for key in ("prompt_ids", "completion_ids", "KL_completion_ids", "label"):
        assert ours[key] == reference[key], key
    assert ours["KL_completion_ids"] != ours["completion_ids"]
    collate = trl.trainer.kto_trainer.DataCollatorForUnpairedPreference(pad_token_id=tokenizer.pad_token_id, max_length=40)
    batch = collate([reference[i] for i in range(5)])
    our_batch = UnpairedPreferenceCollator(tokenizer.pad_token_id, max_length=40)([ours[i] for i in range(5)])
    assert set(batch) == set(our_batch)
    for key in batch:
        assert torch.equal(batch[key], our_batch[key]), key


@pytest.mark.parametrize("weights", [dict(), dict(desirable_weight=2.0), dict(undesirable_weight=0.45)])
def test_weight_advice_is_trls(weights, caplog):
    """TRL's range check of desirable_weight / undesirable_weight on an unbalanced train set: the same advice, or
    none when one weight lies in its range."""
    rows = [{"prompt": "Say", "completion": f" {word}", "label": i % 4 != 0} for i, word in enumerate("abcdefghijkl")]
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    args = trl.KTOConfig(output_dir="unused", use_cpu=True, **weights)
    owner = SimpleNamespace(_tokenizer=tokenizer, calculate_KL=False, desirable_weight=args.desirable_weight,
                            undesirable_weight=args.undesirable_weight)
    with caplog.at_level(logging.WARNING):
        trl.KTOTrainer._prepare_dataset(owner, Dataset.from_list(rows), tokenizer, args, "train")
    theirs = [r.getMessage() for r in caplog.records if "desirable" in r.getMessage()]
    from hfnative.data.unpaired_preference import desirability_warning

    ours = desirability_warning([r["label"] for r in rows], args.desirable_weight, args.undesirable_weight)
    assert len(theirs) == (ours is not None)
    if ours is not None:
        assert theirs[0].endswith(ours)


def test_malformed_rows_name_their_index():
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rows = _unpaired(4, text=True)
    rows[2]["label"] = None
    with pytest.raises(ValueError, match="unpaired preference row 2: expected a boolean 'label'"):
        prepare_unpaired_preference_dataset(rows, tokenizer)
    rows = [{**row, "completion": [{"role": "assistant", "content": "x"}]} for row in _unpaired(4, text=True)]
    with pytest.raises(ValueError, match="unpaired preference row 0: 'prompt' and 'completion' must both be"):
        prepare_unpaired_preference_dataset(rows, tokenizer)
    with pytest.raises(ValueError, match="expected 'prompt', 'completion' and 'label'"):
        prepare_unpaired_preference_dataset([{"completion": "x", "label": True}], tokenizer)


# --- settings ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "settings, error, message",
    [
        (dict(per_device_train_batch_size=1), ValueError, r"Actual \(not effective\) batch size must be > 1"),
        (dict(train_sampling_strategy="random"), ValueError, "requires `train_sampling_strategy='sequential'`"),
        (dict(loss_type="bco"), ValueError, "Unknown loss type: bco"),
        (dict(precompute_ref_log_probs=True, sync_ref_model=True), ValueError, "sync_ref_model=True"),
        (dict(router_aux_loss_coef=0.5), ValueError, "not a Mixture-of-Experts model"),
    ],
)
def test_bad_settings_are_refused(tmp_path, settings, error, message):
    with pytest.raises(error, match=message):
        _trainer(hfnative, MODEL, tmp_path, _unpaired(6), **settings)


def test_context_and_expert_parallel_are_refused_with_what_to_do():
    """Context and expert parallel are refused in one message with what to do (the check the loop makes when
    launched); data and tensor parallel are not."""
    from hfnative.trainers.algorithms.kto import KTOObjective
    from hfnative.trainers.loop.objective import UnsupportedLayoutError, check_supported

    objective = SimpleNamespace(supports=KTOObjective.supports, generates=lambda: False)
    layout = SimpleNamespace(tp_enabled=True, cp_enabled=True, ep_enabled=True)
    context = SimpleNamespace(world_size=8, layout=layout, args=SimpleNamespace(eval_strategy="steps"))
    with pytest.raises(UnsupportedLayoutError) as refused:
        check_supported(objective, context, algorithm="KTOTrainer")
    assert str(refused.value) == ("KTOTrainer does not support context parallelism (cp_size > 1): set cp_size=1; "
                                  "expert parallelism (ep_size > 1): set ep_size=1")
    supported = SimpleNamespace(tp_enabled=True, cp_enabled=False, ep_enabled=False)
    check_supported(objective, SimpleNamespace(world_size=8, layout=supported, args=context.args))


def test_kl_free_loss_takes_any_sampling_and_batch(tmp_path):
    trainer = _trainer(hfnative, MODEL, tmp_path, _unpaired(6), loss_type="apo_zero_unpaired",
                       per_device_train_batch_size=1, train_sampling_strategy="random")
    assert "KL_completion_ids" not in trainer.train_dataset.column_names


def test_reference_refusals(tmp_path):
    from peft import LoraConfig

    with pytest.raises(NotImplementedError, match="sync_ref_model=True"):
        _trainer(hfnative, MODEL, tmp_path, _unpaired(6), sync_ref_model=True,
                 peft_config=LoraConfig(r=2, target_modules=["q_proj"]))
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    with pytest.raises(ValueError, match="cannot be the same object"):
        _trainer(hfnative, model, tmp_path, _unpaired(6), ref_model=model)


def test_config_has_trls_fields_and_defaults():
    theirs, ours = trl.KTOConfig("unused", use_cpu=True), hfnative.KTOConfig("unused", use_cpu=True)
    names = {f.name for f in dataclasses.fields(theirs)} - {"accelerator_config"}
    assert names <= {f.name for f in dataclasses.fields(ours)}
    assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs, n) for n in names}
    assert ours.learning_rate == 1e-6 and ours.loss_type == "kto" and ours.train_sampling_strategy == "sequential"
    from hfnative.trainers import KTOConfig, KTOTrainer  # noqa: F401  (both import paths)


# --- CLI ------------------------------------------------------------------------------------------------------

def test_cli_trains_and_saves(tmp_path):
    """``hfnative-train kto`` on the shipped paired data (unpaired as TRL does), two steps, a saved model."""
    from hfnative.trainers.running import cli

    out = tmp_path / "cli"
    cli.main(["kto", "--model_name_or_path", MODEL, "--dataset_name", str(DATA), "--output_dir", str(out),
              "--use_cpu", "--no_bf16", "--max_steps", "2", "--logging_steps", "1", "--report_to", "none",
              "--disable_tqdm", "--learning_rate", "1e-2", "--max_length", "48", "--per_device_train_batch_size", "2",
              "--save_strategy", "no"])
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    AutoModelForCausalLM.from_pretrained(str(out))


# --- layouts: DDP and FSDP2 on 2 gloo processes against one process ---------------------------------------------

@pytest.fixture(scope="module")
def layout_logs(models, tmp_path_factory):
    import _kto_layout_worker as worker

    out = tmp_path_factory.mktemp("kto-layouts")
    models_dir = str(Path(models["policy"]).parent)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "_kto_layout_worker.py"), str(out), models_dir, *worker.CELLS]
    result = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE)),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]
    return worker, out, models_dir


@pytest.mark.parametrize("cell", ["kto-fsdp2", "apo-zero-ddp-moe", "kto-tp2", "kto-lora-tp2"])
def test_layout_trains_like_one_process(layout_logs, cell, tmp_path):
    worker, out, models_dir = layout_logs
    layout, _, _ = worker.CELLS[cell]
    reference = worker.trainer_for(cell, str(tmp_path / "one-process"), models_dir, ranks=worker.LAYOUTS[layout][1])
    reference.train()
    expected = [e for e in reference.state.log_history if "loss" in e]
    steps = [e for e in json.loads((out / cell / "log.json").read_text()) if "loss" in e]
    assert len(steps) == len(expected) == worker.STEPS
    worst = 0.0
    for mine, theirs in zip(steps, expected):
        keys = {k for k in theirs if not k.startswith("perf/")}
        assert keys <= set(mine), (cell, keys - set(mine))
        assert_logged_close(mine, theirs, (cell, theirs["step"]))
        worst = max(worst, *(abs(mine[k] - theirs[k]) / abs(theirs[k]) for k in ("loss", "grad_norm")))
    print(f"{cell}: max relative difference of loss and grad_norm {worst:.2e}")
    if cell == "kto-fsdp2":
        assert expected[0]["kl"] > 0  # the KL estimate over both data-parallel ranks' rows is in the loss
    if "moe" in cell:
        assert all(e["aux_loss"] > 0 for e in steps)
