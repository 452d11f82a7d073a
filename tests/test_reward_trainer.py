"""hfnative's RewardTrainer against TRL's on the same tiny model, data, order and seed (fp32).

- A causal-LM checkpoint gets the same new score head in both (transformers' init under the run's seed).
- 3 training steps agree with TRL per step (loss, grad_norm, learning_rate and every logged metric: accuracy,
  margin, min/mean/max_reward, num_tokens) within 1e-5 relative at step 1 and 1e-4 after: conversational rows with
  an explicit prompt; text rows with an implicit prompt, a margin column and center_rewards_coefficient, with
  gradient accumulation; LoRA (task_type SEQ_CLS: the score head trained in full); evaluation (eval_* metrics).
- The same on a GPT-NeoX model (no native implementation: transformers' own classifier), plain and with LoRA.
- The saved folder is a Hub *ForSequenceClassification folder (a PEFT adapter folder with LoRA) that transformers
  (peft) loads and that scores as the trained model; model objects train natively; the config has TRL's fields and
  defaults; the CLI's `reward` command trains and saves one.
- A reward model trained and saved here drives GRPOTrainer, scoring as transformers' classifier of the same folder.
- DDP and FSDP2 (2 gloo processes, tests/_reward_layout_worker.py) log what one process logs on the same batches.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GPTNeoXConfig

import hfnative
from hfnative.converters.hub_model import NativeSequenceClassifier

trl = pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data" / "preference.jsonl"
STEPS = 3
PER_STEP_KEYS = ("loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def _rows(n: int) -> list[dict]:
    with open(DATA) as f:
        return [json.loads(line) for line in f][:n]


def _text_implicit_rows(n: int) -> list[dict]:
    """The shipped rows as plain text with the prompt inside each completion, and a margin per pair."""
    rows = []
    for index, row in enumerate(_rows(n)):
        prompt = f"Question: {row['prompt'][-1]['content']}\nAnswer:"
        rows.append({"chosen": prompt + " " + row["chosen"][0]["content"],
                     "rejected": prompt + " " + row["rejected"][0]["content"], "margin": 0.25 * (index % 3)})
    return rows


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The tiny causal checkpoint with a scaled embedding, so rewards and their differences are not all near 0."""
    root = tmp_path_factory.mktemp("reward-model")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(root)
    AutoTokenizer.from_pretrained(MODEL).save_pretrained(root)
    return str(root)


@pytest.fixture(scope="module")
def neox_path(tmp_path_factory):
    """A causal LM without a native implementation (GPT-NeoX): it scores through transformers' own classifier."""
    root = tmp_path_factory.mktemp("reward-neox")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5, initializer_range=0.2,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return str(root)


def _config(module, output_dir, **extra):
    settings = dict(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=STEPS,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=4, learning_rate=5e-3,
        lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.01, max_length=96, gradient_checkpointing=False,
        seed=5,
    )
    return module.RewardConfig(**{**settings, **extra})


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")


def _trainer(module, model, tmp_path, case):
    rows = _text_implicit_rows(24) if case == "text-implicit-margin" else _rows(24)
    extra, peft_config, eval_rows = {}, None, None
    if case == "text-implicit-margin":
        extra = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, center_rewards_coefficient=0.1)
    elif case == "lora":
        peft_config, extra = _lora_config(), dict(learning_rate=2e-2)
    elif case == "lora-cloned-template":  # the template adds a token: its rows train (trainable_token_indices)
        from test_clone_chat_template import _source

        source = tmp_path / "template" if (tmp_path / "template").exists() else _source(tmp_path / "template", True)
        peft_config, extra = _lora_config(), dict(learning_rate=2e-2, chat_template_path=str(source))
    elif case == "fallback-lora":  # peft itself, on transformers' module
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query_key_value"],
                                 task_type="SEQ_CLS")
        extra = dict(learning_rate=2e-2)
    elif case == "evaluation":
        eval_rows = _rows(31)[24:]
        extra = dict(eval_strategy="steps", eval_steps=STEPS, per_device_eval_batch_size=3)
    return module.RewardTrainer(
        model=model, args=_config(module, tmp_path / module.__name__, **extra), train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
        processing_class=AutoTokenizer.from_pretrained(MODEL), peft_config=peft_config,
    )


def _train_logs(module, model_path, tmp_path, case):
    trainer = _trainer(module, model_path, tmp_path, case)
    if case in ("lora", "fallback-lora", "lora-cloned-template") and module is trl:  # peft's random initial A (and
        trainer.model.save_pretrained(str(tmp_path / "initial-adapter"))  # the resized rows), given to both
    elif case == "fallback-lora":
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(trainer.model, load_file(str(tmp_path / "initial-adapter" / "adapter_model.safetensors")))
    elif case in ("lora", "lora-cloned-template"):
        from hfnative.converters.peft import load_adapter_weights

        load_adapter_weights(trainer.converted, tmp_path / "initial-adapter")
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "loss" in entry or "eval_loss" in entry]


def test_new_score_head_is_transformers(model_path, tmp_path):
    theirs, ours = _trainer(trl, model_path, tmp_path, "conversational"), _trainer(hfnative, model_path, tmp_path, "conversational")
    assert torch.equal(ours.model.output.weight, theirs.model.score.weight)
    assert ours.model.config.pad_token_id == theirs.model.config.pad_token_id is not None


@pytest.mark.parametrize("case", ["conversational", "text-implicit-margin", "lora", "evaluation", "fallback",
                                  "fallback-lora", "lora-cloned-template"])
def test_training_matches_trl_per_step(model_path, neox_path, tmp_path, case):
    model = neox_path if case.startswith("fallback") else model_path
    _, theirs = _train_logs(trl, model, tmp_path, case)
    trainer, ours = _train_logs(hfnative, model, tmp_path, case)
    if case == "evaluation":  # evaluated after the last step: eval_-prefixed metrics
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
        tolerance = 1e-5 if step == 1 else 1e-4
        keys = PER_STEP_KEYS
        if case == "lora-cloned-template":
            # the new token is in every row, chosen and rejected alike: a shift of every reward, which the loss does
            # not see, follows its near-zero gradient's round-off (AdamW takes steps of the learning rate's size on
            # it). The rewards are compared by their differences, which the loss does see
            keys = PER_STEP_KEYS[:4]
            for low, high in (("min_reward", "max_reward"), ("min_reward", "mean_reward")):
                assert mine[high] - mine[low] == pytest.approx(reference[high] - reference[low], rel=tolerance, abs=1e-7)
        for key in keys:
            assert mine[key] == pytest.approx(reference[key], rel=tolerance, abs=1e-7), (case, step, key, mine[key], reference[key])
    assert theirs[-1]["margin"] != theirs[0]["margin"]  # the model moved
    if case.startswith("lora"):  # the adapter folder: peft loads it onto transformers' classifier, which scores the same
        from peft import PeftModel

        trainer.save_model(str(tmp_path / "adapter"))
        base = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32)
        if case == "lora-cloned-template":  # resized as the run was (the folder holds the resized embedding whole)
            assert trainer.model.peft_config["default"].trainable_token_indices == {"embed_tokens": list(range(1024, 1088))}
            base.resize_token_embeddings(1088)
        base.config.pad_token_id = trainer.processing_class.pad_token_id
        reloaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        with torch.no_grad():
            expected = trainer.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            assert (reloaded(**batch).logits - expected).abs().max().item() <= 1e-5
    if case == "conversational":  # the saved folder: a Hub sequence classifier that scores as the trained model
        out = tmp_path / "saved"
        trainer.save_model(str(out))
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["Qwen3ForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}
        reloaded, info = AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32,
                                                                            output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        with torch.no_grad():
            expected = trainer.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            got = reloaded.eval()(**batch).logits
        assert (got - expected).abs().max().item() <= 1e-5


def test_config_has_trls_fields_and_defaults():
    theirs, ours = trl.RewardConfig("unused", use_cpu=True), hfnative.RewardConfig("unused", use_cpu=True)
    names = {f.name for f in dataclasses.fields(theirs)} - {"accelerator_config"}
    assert names <= {f.name for f in dataclasses.fields(ours)}
    assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs, n) for n in names}
    assert ours.learning_rate == 1e-4 and ours.max_length == 1024 and ours.center_rewards_coefficient is None


def test_model_objects_train_natively(model_path, tmp_path):
    """A transformers classifier object (num_labels=1) and a native one are trained natively, scoring as the object."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    classifier = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32).eval()
    classifier.config.pad_token_id = tokenizer.pad_token_id
    trainer = hfnative.RewardTrainer(model=classifier, args=_config(hfnative, tmp_path), train_dataset=_rows(8),
                                     processing_class=tokenizer)
    # trained natively, under transformers' class name (what pipelines and Trainer read)
    assert isinstance(trainer.model, NativeSequenceClassifier) and type(trainer.model).__name__ == type(classifier).__name__
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        expected = classifier(**batch).logits
        assert (trainer.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits - expected).abs().max() <= 1e-5
    again = hfnative.RewardTrainer(model=trainer.model, args=_config(hfnative, tmp_path / "again"), train_dataset=_rows(8),
                                   processing_class=tokenizer)
    again.train()
    assert len([entry for entry in again.state.log_history if "loss" in entry]) == STEPS


def test_bad_input_is_refused(model_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    args = _config(hfnative, tmp_path)
    causal = AutoModelForCausalLM.from_pretrained(model_path)  # num_labels=2 by default
    with pytest.raises(ValueError, match="reward models require `num_labels=1`"):
        hfnative.RewardTrainer(model=causal, args=args, train_dataset=Dataset.from_list(_rows(4)), processing_class=tokenizer)
    rows = _rows(4)
    rows[2]["rejected"] = None
    with pytest.raises(ValueError, match="reward row 2: expected 'chosen' and 'rejected'"):
        hfnative.RewardTrainer(model=model_path, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


def test_cli_trains_and_saves_a_reward_model(model_path, tmp_path):
    from hfnative.trainers.running import cli

    cli.main(["reward", "--model_name_or_path", model_path, "--dataset_name", str(DATA), "--use_cpu", "--no_bf16",
              "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm",
              "--per_device_train_batch_size", "2", "--max_length", "96", "--output_dir", str(tmp_path / "cli")])
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"]
    AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "cli"))


def _grpo_rewards(reward_func, tmp_path, name: str) -> tuple:
    args = hfnative.GRPOConfig(
        output_dir=str(tmp_path / name), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        learning_rate=1e-2, seed=0, gradient_checkpointing=False,
    )
    prompts = Dataset.from_list([{"prompt": row["prompt"]} for row in _rows(8)])
    trainer = hfnative.GRPOTrainer(model=MODEL, reward_funcs=reward_func, args=args, train_dataset=prompts)
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "reward" in entry]


def test_trained_reward_model_drives_grpo(model_path, tmp_path):
    """A reward model trained by RewardTrainer and saved, given to GRPOTrainer by its folder: it scores natively, and
    the rewards GRPO logs equal those of transformers' AutoModelForSequenceClassification loaded from the folder."""
    reward_trainer = _trainer(hfnative, model_path, tmp_path, "conversational")
    reward_trainer.train()
    folder = tmp_path / "reward-model"
    reward_trainer.save_model(str(folder))
    grpo, native = _grpo_rewards(str(folder), tmp_path, "native")
    scorer = grpo.objective.rewards.functions[0]
    assert isinstance(scorer, NativeSequenceClassifier)
    _, reference = _grpo_rewards(AutoModelForSequenceClassification.from_pretrained(str(folder)), tmp_path, "reference")
    assert len(native) == len(reference) == 2
    for mine, theirs in zip(native, reference):
        for key in ("reward", "reward_std", "rewards/reward-model/mean", "rewards/reward-model/std"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    assert native[0]["reward_std"] > 0  # the trained model tells the completions apart


# --- layouts: DDP and FSDP2 on 2 gloo processes against one process ---------------------------------------------

@pytest.fixture(scope="module")
def layout_logs(model_path, tmp_path_factory):
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import _reward_layout_worker as worker

    out = tmp_path_factory.mktemp("reward-layouts")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(here / "_reward_layout_worker.py"), str(out), model_path, *worker.CELLS]
    result = subprocess.run(command, env=dict(__import__("os").environ, OMP_NUM_THREADS="1", PYTHONPATH=str(here)),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]
    return worker, out


@pytest.mark.parametrize("cell", ["ddp", "fsdp2-accumulation-eval"])
def test_layout_trains_like_one_process(layout_logs, model_path, cell, tmp_path):
    """Each rank's rewards, the loss, grad norm and every metric (min / mean / max_reward over both ranks' rewards,
    num_tokens summed over them) equal one process's on the same global batches, evaluation too."""
    worker, out = layout_logs
    reference = worker.trainer_for(cell, str(tmp_path / "one-process"), model_path, ranks=2)
    reference.train()
    expected = [e for e in reference.state.log_history if "loss" in e or "eval_loss" in e]
    logged = [e for e in json.loads((out / cell / "log.json").read_text()) if "loss" in e or "eval_loss" in e]
    assert len(logged) == len(expected) == worker.STEPS + ("eval_strategy" in worker.CELLS[cell][1])
    for mine, theirs in zip(logged, expected):
        keys = {k for k in theirs if not k.startswith("perf/") and "runtime" not in k and "per_second" not in k}
        assert keys <= set(mine), (cell, keys - set(mine))
        for key in keys:
            if isinstance(theirs[key], float) and key != "epoch":
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (cell, theirs["step"], key)
    trained = [e for e in expected if "loss" in e]
    assert trained[-1]["margin"] != trained[0]["margin"]
