"""Evaluation datasets are prepared like the training dataset, and evaluate() names its metrics as
transformers does: a raw dataset given to evaluate() (any format SFT takes), a dict of eval datasets
({metric_key_prefix}_{name}_...), a name selecting one of them, and metric_key_prefix.

TRL's SFTTrainer, trained beside ours on the same tiny model and rows, is the oracle for the numbers.
"""

import json
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

import hfnative

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data"
SFT_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")


def _rows(name: str, n: int) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _raw(fmt: str) -> Dataset:
    if fmt == "messages":
        return Dataset.from_list(_rows("eval_messages.jsonl", 6))
    if fmt == "text":
        return Dataset.from_list(_rows("sft_text.jsonl", 5))
    if fmt == "prompt-completion":
        return Dataset.from_list(_rows("sft_prompt_completion.jsonl", 5))
    raise KeyError(fmt)


def _trainer(module, output_dir):
    """Three training steps (so the model predicts some tokens right) and two named eval datasets."""
    args = module.SFTConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=3,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-2, max_length=64,
    )
    trainer = module.SFTTrainer(
        model=MODEL,
        args=args,
        train_dataset=Dataset.from_list(_rows("sft_messages.jsonl", 12)),
        eval_dataset={"chat": _raw("messages"), "text": _raw("text")},
        processing_class=AutoTokenizer.from_pretrained(MODEL),
    )
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    trl = pytest.importorskip("trl")
    root = tmp_path_factory.mktemp("eval")
    # ours first: building TrainingArguments resets accelerate's global state, which a TRL trainer built
    # earlier would then find empty
    ours = _trainer(hfnative, root / "ours")
    return {"ours": ours, "trl": _trainer(trl, root / "trl")}


def _assert_close(ours: dict, theirs: dict, ours_prefix: str, their_prefix: str = "eval"):
    assert ours[f"{ours_prefix}_loss"] == pytest.approx(theirs[f"{their_prefix}_loss"], rel=1e-4)
    for name in ("entropy", "mean_token_accuracy"):
        assert ours[f"{ours_prefix}_{name}"] == pytest.approx(theirs[f"eval_{name}"], rel=1e-4, abs=1e-6), name
    assert ours[f"{ours_prefix}_num_tokens"] == theirs["eval_num_tokens"]


@pytest.mark.parametrize("fmt", ["messages", "text", "prompt-completion"])
def test_raw_dataset_given_to_evaluate_matches_trl(trainers, fmt):
    theirs = trainers["trl"].evaluate(eval_dataset=_raw(fmt))
    ours = trainers["ours"].evaluate(eval_dataset=_raw(fmt))
    if fmt == "messages":  # trained on chats, the model gets some of these tokens right: a real comparison
        assert theirs["eval_mean_token_accuracy"] > 0
    _assert_close(ours, theirs, "eval")
    timing = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    assert set(ours) == {"eval_loss", *timing, *(f"eval_{m}" for m in SFT_METRICS), "epoch"}


def test_dict_of_eval_datasets_names_each_metric_by_dataset(trainers):
    theirs = trainers["trl"].evaluate()
    ours = trainers["ours"].evaluate()
    for name in ("chat", "text"):
        for metric in ("loss", "runtime", "samples_per_second", "steps_per_second", *SFT_METRICS):
            assert f"eval_{name}_{metric}" in ours, (name, metric)
        assert ours[f"eval_{name}_loss"] == pytest.approx(theirs[f"eval_{name}_loss"], rel=1e-4)
        # TRL names the SFT metrics eval_* whatever the prefix, so in its merged dict the last dataset's win;
        # its log entry for each dataset still holds that dataset's values
        logged = next(e for e in reversed(trainers["trl"].state.log_history) if f"eval_{name}_loss" in e)
        _assert_close(ours, logged, f"eval_{name}", f"eval_{name}")
    assert not any(key.startswith(("eval_loss", "eval_entropy")) for key in ours)
    history = trainers["ours"].state.log_history
    assert {"eval_chat_loss", "eval_chat_mean_token_accuracy", "epoch", "step"} <= set(history[-2])
    assert {"eval_text_loss", "eval_text_mean_token_accuracy", "epoch", "step"} <= set(history[-1])


def test_evaluate_by_name_selects_that_eval_dataset(trainers):
    theirs = trainers["trl"].evaluate(eval_dataset="chat")
    ours = trainers["ours"].evaluate(eval_dataset="chat")
    _assert_close(ours, theirs, "eval")
    with pytest.raises(KeyError, match="chat"):
        trainers["ours"].evaluate(eval_dataset="no-such-dataset")


def test_metric_key_prefix_names_every_metric(trainers):
    ours = trainers["ours"].evaluate(eval_dataset=_raw("messages"), metric_key_prefix="test")
    assert {key.split("_", 1)[0] for key in ours if key != "epoch"} == {"test"}
    by_name = trainers["ours"].evaluate(eval_dataset="chat")
    for metric in ("loss", *SFT_METRICS):
        assert ours[f"test_{metric}"] == pytest.approx(by_name[f"eval_{metric}"], rel=1e-6)
    both = trainers["ours"].evaluate(eval_dataset={"a": _raw("messages"), "b": _raw("text")}, metric_key_prefix="test")
    assert both["test_a_loss"] == pytest.approx(by_name["eval_loss"], rel=1e-6) and "test_b_mean_token_accuracy" in both


def test_prepared_dataset_given_again_is_not_prepared_twice(trainers):
    trainer = trainers["ours"]
    prepared = trainer.eval_dataset["chat"]
    assert trainer.objective.prepare_eval_dataset(prepared).to_list() == prepared.to_list()
    assert trainer.evaluate(eval_dataset=prepared)["eval_loss"] == pytest.approx(
        trainer.evaluate(eval_dataset="chat")["eval_loss"], rel=1e-6
    )


def test_evaluate_without_an_eval_dataset_is_transformers_error(tmp_path):
    args = hfnative.SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_length=64)
    trainer = hfnative.SFTTrainer(model=MODEL, args=args, train_dataset=_rows("sft_text.jsonl", 4))
    with pytest.raises(ValueError, match="Trainer: evaluation requires an eval_dataset"):
        trainer.evaluate()
    with pytest.raises(KeyError, match="not a dict of named datasets"):
        trainer.evaluate(eval_dataset="chat")
