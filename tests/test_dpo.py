"""hfnative's DPOTrainer against TRL's on the same tiny model, data, order and settings (fp32).

- Every loss type (and weighted mixes, label smoothing, f-divergences, WPO weighting, LD-DPO): loss and
  every logged metric equal TRL's on one batch within 1e-5 (the reference's log-probs given with the batch, at
  log-ratios where every compared number is of a sane size).
- 5 training steps agree with TRL per step within 1e-4 relative: with a frozen copy of the checkpoint as the
  reference (and gradient accumulation), with LoRA (the base with adapters disabled), with a separate
  ref_model (and TR-DPO syncing, then evaluation), with precomputed reference log-probs, on text rows, and
  on a MoE model (aux_loss).
- The fused log-prob head's gradients equal materialized logits' within 1e-6.
- Tokenization and batches equal TRL's for explicit / implicit prompts, text / conversational rows.
- Bad settings get TRL's errors; the CLI (one process) and examples/dpo.py under torchrun (two processes)
  train the same LoRA adapter on the shipped data, step for step.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

import hfnative
from hfnative.data.preference import PreferenceCollator, prepare_preference_dataset
from hfnative.losses import IGNORE_INDEX
from hfnative.models.head import OutputHead, TokenLogprobs

trl = pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data" / "preference.jsonl"
STEPS = 5


def _rows(n: int) -> list[dict]:
    with open(DATA) as f:
        return [json.loads(line) for line in f][:n]


def _text_rows(n: int) -> list[dict]:
    """The shipped rows as plain text: "Question: ...\\nAnswer:" prompts and " ..." completions."""
    return [
        {"prompt": f"Question: {r['prompt'][-1]['content']}\nAnswer:", "chosen": " " + r["chosen"][0]["content"],
         "rejected": " " + r["rejected"][0]["content"]}
        for r in _rows(n)
    ]


def _implicit(rows: list[dict]) -> list[dict]:
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny checkpoint scaled up (so logits, rewards and accuracies are not all near zero) as the policy,
    and a perturbed copy as a separate reference, both saved to disk."""
    root = tmp_path_factory.mktemp("dpo-models")
    torch.manual_seed(0)
    paths = {}
    for name, noise in (("policy", 0.0), ("reference", 0.1)):
        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(8.0)
            for param in model.parameters():
                param.add_(noise * torch.randn_like(param))
        model.save_pretrained(root / name)
        AutoTokenizer.from_pretrained(MODEL).save_pretrained(root / name)
        paths[name] = str(root / name)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    moe = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                         num_experts_per_tok=2, router_aux_loss_coef=0.5, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(moe).save_pretrained(root / "moe")
    tokenizer.save_pretrained(root / "moe")
    paths["moe"] = str(root / "moe")
    # scaled less, for the one-batch loss test: WPO's weights exp(mean log p - log sum p^2) ~0.3 each, not e^-10
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
    model.save_pretrained(root / "loss-policy")
    tokenizer.save_pretrained(root / "loss-policy")
    paths["loss-policy"] = str(root / "loss-policy")
    return paths


def _config(module, output_dir, **extra):
    settings = dict(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=4, learning_rate=2e-3,
        lr_scheduler_type="cosine", warmup_steps=0.2, weight_decay=0.01, max_length=48, gradient_checkpointing=False,
    )
    return module.DPOConfig(**{**settings, **extra})


def _trainer(module, model, tmp_path, rows, ref_model=None, peft_config=None, eval_rows=None, **extra):
    return module.DPOTrainer(
        model=model, ref_model=ref_model, args=_config(module, tmp_path / module.__name__, **extra),
        train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
        processing_class=AutoTokenizer.from_pretrained(MODEL), peft_config=peft_config,
    )


# --- every loss type on one batch ---------------------------------------------------------------------

LOSS_SETTINGS = [
    *[dict(loss_type=[name]) for name in (
        "sigmoid", "hinge", "ipo", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down",
        "discopop", "sft", "sigmoid_norm")],
    dict(loss_type=["exo_pair"], label_smoothing=1e-3),
    dict(loss_type=["robust"], label_smoothing=0.1),
    dict(loss_type=["aot"], label_smoothing=0.2),
    dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),  # MPO
    dict(loss_type=["sigmoid"], f_divergence_type="forward_kl"),
    dict(loss_type=["hinge"], f_divergence_type="js_divergence"),
    dict(loss_type=["ipo"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    dict(loss_type=["sigmoid", "ipo"], use_weighting=True),
    dict(loss_type=["sigmoid"], ld_alpha=0.5, beta=0.5),
]
TRL_ATTRIBUTES = dict(loss_type="loss_types", beta="beta", label_smoothing="label_smoothing", ld_alpha="ld_alpha",
                      f_divergence_type="f_divergence_type", f_alpha_divergence_coef="f_alpha_divergence_coef")


def _loss_settings(settings: dict, defaults) -> dict:
    names = ("loss_type", "loss_weights", "beta", "label_smoothing", "ld_alpha", "f_divergence_type",
             "f_alpha_divergence_coef", "use_weighting")
    return {name: settings.get(name, getattr(defaults, name)) for name in names}


# log-ratios per pair: |means| >> the float32 error of ~100-nat sums, none < -1.5 (exp(-x) in f-divergences), one pair wrong
CHOSEN_LOGRATIOS = (14.0, -1.0, 10.0, 20.0)
REJECTED_LOGRATIOS = (2.0, 9.0, -1.5, 12.0)


def _sequence_logps(model, batch) -> torch.Tensor:
    """Summed completion log-probs per row [2B] from materialized logits (only to place the reference's)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    token_logps = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return (token_logps * batch["completion_mask"][:, 1:]).sum(dim=1)


def test_every_loss_type_matches_trl_on_one_batch(models, tmp_path):
    rows = _rows(8)
    defaults = hfnative.DPOConfig(output_dir=str(tmp_path), use_cpu=True)
    # TRL first (building a trainer resets accelerate's state TRL reads); use_weighting=True makes its head
    # also compute log sum p^2, used only where a setting asks for weighting
    theirs = _trainer(trl, models["loss-policy"], tmp_path, rows, use_weighting=True)
    batch = theirs.data_collator([theirs.train_dataset[i] for i in range(4)])
    # the reference's log-probs given with the batch (the precomputed path both take) at chosen log-ratios
    chosen_logps, rejected_logps = _sequence_logps(theirs.model, batch).chunk(2, dim=0)
    batch["ref_chosen_logps"] = chosen_logps - torch.tensor(CHOSEN_LOGRATIOS)
    batch["ref_rejected_logps"] = rejected_logps - torch.tensor(REJECTED_LOGRATIOS)
    theirs.precompute_ref_logps = True
    theirs.model.train()
    references = []
    for settings in LOSS_SETTINGS:
        full = _loss_settings(settings, defaults)
        for name, attribute in TRL_ATTRIBUTES.items():
            setattr(theirs, attribute, full[name])
        theirs.loss_weights = full["loss_weights"] or [1.0] * len(full["loss_type"])
        theirs.use_weighting = full["use_weighting"]
        theirs._metrics["train"].clear()
        loss = theirs.compute_loss(theirs.model, theirs._prepare_inputs(dict(batch))).item()
        references.append((loss, {key: values[-1] for key, values in theirs._metrics["train"].items()}))

    ours = _trainer(hfnative, models["loss-policy"], tmp_path, rows)
    our_batch = ours.data_collator([ours.train_dataset[i] for i in range(4)])
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(batch[key], our_batch[key]), key
    ours.model.train()
    for settings, (reference_loss, reference) in zip(LOSS_SETTINGS, references):
        for name, value in _loss_settings(settings, defaults).items():
            setattr(ours.args, name, value)
        loss = ours.compute_loss(ours.model, ours._prepare_inputs(dict(batch))).item()
        metrics = ours._metrics["train"].pop()
        assert loss == pytest.approx(reference_loss, rel=1e-5, abs=1e-6), settings
        assert set(metrics) == set(reference), settings
        for key, value in reference.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (settings, key, metrics[key], value)
    accuracies = [reference["rewards/accuracies"] for _, reference in references]
    assert any(0.0 < a < 1.0 for a in accuracies)  # the batch tells the pairs apart


# --- training over 5 steps -----------------------------------------------------------------------------

PER_STEP_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


def _train_logs(module, models, tmp_path, case):
    rows = _rows(40) if case != "text" else _text_rows(40)
    extra, ref_model, peft_config = {}, None, None
    if case == "copy":
        extra = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2)
    elif case == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        extra = dict(learning_rate=2e-2)
    elif case == "separate-ref":
        ref_model = models["reference"] if module is hfnative else AutoModelForCausalLM.from_pretrained(models["reference"])
        extra = dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5, eval_strategy="steps",
                     eval_steps=STEPS, per_device_eval_batch_size=3)
    elif case == "precompute":
        extra = dict(precompute_ref_log_probs=True, loss_type=["sigmoid", "sft"])
    model = models["moe"] if case == "moe" else models["policy"]
    # beta 0.02: rewards near 0 carry beta x ~1e-5 (float32 error of ~100-nat log-prob sums), well under abs=1e-6
    trainer = _trainer(module, model, tmp_path, rows, ref_model=ref_model, peft_config=peft_config,
                       eval_rows=_rows(50)[40:] if "eval_strategy" in extra else None, beta=0.02, **extra)
    if case == "lora" and module is trl:  # peft's random initial A, given to both
        trainer.model.save_pretrained(str(tmp_path / "initial-adapter"))
    elif case == "lora":
        from hfnative.converters.peft import load_adapter_weights

        load_adapter_weights(trainer.converted, tmp_path / "initial-adapter")
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry or "eval_loss" in entry]


@pytest.mark.parametrize("case", ["copy", "lora", "separate-ref", "precompute", "text", "moe"])
def test_training_matches_trl_per_step(models, tmp_path, case):
    theirs = _train_logs(trl, models, tmp_path, case)
    ours = _train_logs(hfnative, models, tmp_path, case)
    if case == "separate-ref":  # evaluated after the last step: eval_-prefixed metrics
        (evaluation,), (reference,) = ([e for e in logs if "eval_loss" in e] for logs in (ours, theirs))
        for key in ("loss", *PER_STEP_KEYS[2:], "num_tokens"):
            assert evaluation[f"eval_{key}"] == pytest.approx(reference[f"eval_{key}"], rel=1e-4, abs=1e-6), key
        ours, theirs = ([e for e in logs if "eval_loss" not in e] for logs in (ours, theirs))
    assert len(ours) == len(theirs) == STEPS
    for mine, reference in zip(ours, theirs):
        step = reference["step"]
        assert mine["step"] == step
        assert mine["num_tokens"] == reference["num_tokens"], step
        assert mine["learning_rate"] == pytest.approx(reference["learning_rate"], rel=1e-12)
        for key in PER_STEP_KEYS:
            assert mine[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (case, step, key, mine[key], reference[key])
        if case == "moe":  # the router's load-balancing loss, weighted by the config's coefficient
            assert mine["aux_loss"] == pytest.approx(reference["aux_loss"], rel=1e-4), step
    assert theirs[-1]["rewards/margins"] != theirs[0]["rewards/margins"]  # the policy moved


# --- the fused head's gradients ---------------------------------------------------------------------------

def test_fused_logprob_gradients_equal_materialized_logits(models, tmp_path):
    trainer = _trainer(hfnative, models["policy"], tmp_path, _rows(8), ref_model=models["reference"],
                       loss_type=["sigmoid", "sft"])
    inputs = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    grads, losses = [], []
    for fused in (True, False):
        trainer.args.fused_loss = fused
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad.clone() for name, p in trainer.model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=0, atol=1e-6, msg=name)
    assert any(g.abs().max() > 1e-3 for g in grads[0].values())


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_head_statistics_equal_materialized_logits(softcap):
    """Mean logit, top-1 hits and log sum p^2 from the chunk loop equal those of full logits; the compact
    path (only label positions projected) equals projecting every position."""
    torch.manual_seed(0)
    head = OutputHead(16, 50, softcap=softcap)
    torch.nn.init.normal_(head.weight, std=2.0)
    hidden_BSD = torch.randn(3, 40, 16, requires_grad=True)
    targets_BS = torch.randint(0, 50, (3, 40))
    targets_BS[:, :7] = IGNORE_INDEX
    targets_BS[1, ::3] = IGNORE_INDEX
    statistics = ("mean_logits", "is_top1", "log_sum_sq_probs")
    runs = [head(hidden_BSD, loss=TokenLogprobs(targets_BS, fused=fused, statistics=statistics, compact=compact))
            for fused, compact in ((False, False), (True, False), (True, True))]
    logits_BSV = head(hidden_BSD).detach()
    valid_BS = targets_BS != IGNORE_INDEX
    expected = {"mean_logits": logits_BSV.mean(-1) * valid_BS, "is_top1": (logits_BSV.argmax(-1) == targets_BS) & valid_BS,
                "log_sum_sq_probs": torch.log((logits_BSV.softmax(-1) ** 2).sum(-1)) * valid_BS}
    upstream_BS = torch.randn(3, 40)
    reference_grad = None
    for logprobs_BS, _, stats in runs:
        for name, value in expected.items():
            torch.testing.assert_close(stats[name].float(), value.float(), rtol=0, atol=1e-5, msg=name)
        grad, = torch.autograd.grad((logprobs_BS * upstream_BS).sum(), hidden_BSD)
        reference_grad = grad if reference_grad is None else reference_grad
        torch.testing.assert_close(grad, reference_grad, rtol=1e-5, atol=1e-6)
    assert expected["is_top1"].any()


# --- data formats -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["conversational", "conversational-implicit", "text", "text-implicit"])
def test_tokenization_and_batches_match_trl(fmt):
    rows = _rows(12) if fmt.startswith("conversational") else _text_rows(12)
    rows = _implicit(rows) if fmt.endswith("implicit") else rows
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    args = trl.DPOConfig(output_dir="unused", use_cpu=True, max_length=40)
    reference = trl.DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), Dataset.from_list(rows), tokenizer,
                                                args, "train")
    ours = prepare_preference_dataset(Dataset.from_list(rows), tokenizer, max_length=40)
    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ours[key] == reference[key], key
    assert len(ours) == len(reference)
    assert all(len(ids) > 0 for ids in ours["prompt_ids"])
    collate = trl.trainer.dpo_trainer.DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=40)
    batch, our_batch = collate(list(reference)[:5]), PreferenceCollator(tokenizer.pad_token_id, max_length=40)(list(ours)[:5])
    assert set(batch) == set(our_batch)
    for key in batch:
        assert torch.equal(batch[key], our_batch[key]), key


def test_malformed_row_names_its_index():
    rows = _implicit(_text_rows(3))
    rows[2]["rejected"] = ""
    with pytest.raises(ValueError, match="preference row 2"):
        prepare_preference_dataset(rows, AutoTokenizer.from_pretrained(MODEL))


# --- settings TRL refuses ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "settings, error, message",
    [
        (dict(loss_type="exo_pair"), ValueError, "Label smoothing must be greater than 0.0"),
        (dict(loss_type="robust", label_smoothing=0.5), ValueError, r"\[0.0, 0.5\)"),
        (dict(loss_type="aot", use_weighting=True), NotImplementedError, "WPO-style weighting"),
        (dict(loss_type="aot_unpaired", use_weighting=True), ValueError, "WPO-style weighting"),
        (dict(loss_type="bco_pair", f_divergence_type="forward_kl"), ValueError, "only supported for the following"),
        (dict(loss_type="dpop"), ValueError, "Unknown loss type: dpop"),
        (dict(precompute_ref_log_probs=True, sync_ref_model=True), ValueError, "sync_ref_model=True"),
    ],
)
def test_bad_settings_are_refused(tmp_path, settings, error, message):
    with pytest.raises(error, match=message):
        _trainer(hfnative, MODEL, tmp_path, _rows(4), **settings)


def test_config_has_trls_fields_and_defaults():
    theirs, ours = trl.DPOConfig("unused", use_cpu=True), hfnative.DPOConfig("unused", use_cpu=True)
    names = {f.name for f in dataclasses.fields(theirs)} - {"accelerator_config"}
    assert names <= {f.name for f in dataclasses.fields(ours)}
    assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs, n) for n in names}
    assert ours.learning_rate == 1e-6 and ours.loss_type == ["sigmoid"] and ours.beta == 0.1


def test_bad_config_is_refused_when_built():
    with pytest.raises(ValueError, match="`loss_weights` must have the same length"):
        hfnative.DPOConfig(output_dir="unused", loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="cannot be the same object"):
        model = AutoModelForCausalLM.from_pretrained(MODEL)
        hfnative.DPOTrainer(model=model, ref_model=model, args=hfnative.DPOConfig(output_dir="unused", use_cpu=True),
                            train_dataset=Dataset.from_list(_rows(4)))


# --- CLI and example --------------------------------------------------------------------------------------

QUICK = ["--use_cpu", "--no_bf16", "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm",
         "--learning_rate", "1e-2", "--max_length", "64", "--seed", "3"]


def _logged_steps(folder: Path) -> list[dict]:
    state = json.loads((folder / "checkpoint-2" / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry]


def test_cli_and_example_on_two_processes_train_alike(tmp_path):
    """``hfnative-train dpo`` (one process, 2 pairs a step) and examples/dpo.py under torchrun (2 processes,
    1 pair each) train the same LoRA adapter on the shipped data, step for step, and write it."""
    from hfnative.trainers.running import cli

    lora = ["--use_peft", "--lora_r", "4", "--lora_dropout", "0.0", "--lora_target_modules", "q_proj", "v_proj"]
    common = ["--model_name_or_path", MODEL, "--dataset_name", str(DATA), *QUICK, *lora]
    cli.main(["dpo", *common, "--output_dir", str(tmp_path / "cli"), "--per_device_train_batch_size", "2"])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(ROOT / "examples" / "dpo.py"),
               *common, "--output_dir", str(tmp_path / "example"), "--per_device_train_batch_size", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    for out in ("cli", "example"):
        assert (tmp_path / out / "adapter_model.safetensors").is_file() and (tmp_path / out / "adapter_config.json").is_file()
    one, two = _logged_steps(tmp_path / "cli"), _logged_steps(tmp_path / "example")
    assert len(one) == len(two) == 2
    for single, launched in zip(one, two):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected", "entropy"):
            assert launched[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key
    assert one[1]["rewards/margins"] != 0.0
