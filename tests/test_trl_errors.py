"""The errors TRL users' code and tests match on: for each bad argument or dataset, hfnative raises the
exception type TRL 1.16 (or transformers' Trainer) raises, at the same moment, with a message that holds
TRL's key phrase; where TRL only warns, hfnative warns with the same phrase. Each case runs TRL itself on
the same input too, so the phrase is TRL's and not a copy that drifted.
"""

import json
import logging
import re
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

import hfnative

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data"


def _rows(name: str, n: int = 8) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _text() -> Dataset:
    return Dataset.from_list(_rows("sft_text.jsonl"))


def _prompt_completion() -> Dataset:
    return Dataset.from_list(_rows("sft_prompt_completion.jsonl"))


def _config(module, tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                    disable_tqdm=True, max_steps=1, save_strategy="no", max_length=64, per_device_train_batch_size=2)
    return module.SFTConfig(**{**settings, **overrides})


def _build(module, tmp_path, config=None, **kwargs):
    """An SFTTrainer on the tiny model; the config is made first, outside any pytest.raises, since TRL's
    SFTConfig accepts every value these cases get wrong."""
    args = _config(module, tmp_path, **(config or {}))
    kwargs.setdefault("train_dataset", _text())
    kwargs.setdefault("processing_class", AutoTokenizer.from_pretrained(MODEL))
    return lambda: module.SFTTrainer(model=kwargs.pop("model", MODEL), args=args, **kwargs)


def _modules():
    trl = pytest.importorskip("trl")
    return (trl, hfnative)  # TRL first: building our config resets accelerate's state a live TRL trainer reads


def _loss_on_all_logits(outputs, labels, num_items_in_batch=None):
    return outputs.logits.sum()


CASES = [
    # id, SFTConfig overrides, SFTTrainer arguments, TRL's exception type, TRL's key phrase
    ("no-train-dataset", {}, {"train_dataset": None}, ValueError, r"`train_dataset` is required"),
    ("no-train-dataset-but-eval", {}, {"train_dataset": None, "eval_dataset": "text"}, ValueError,
     r"`train_dataset` is required"),
    ("train-dataset-not-a-dataset", {}, {"train_dataset": "train.jsonl"}, TypeError,
     r"`train_dataset` must be a `Dataset` or `IterableDataset`, got `str`"),
    ("padding-free-without-packing", {"padding_free": True}, {}, ValueError,
     r"When `padding_free=True` without packing, `max_length` is not enforced"),
    ("unknown-packing-strategy", {"packing": True, "packing_strategy": "first_fit"}, {}, ValueError,
     r"Invalid packing strategy 'first_fit'"),
    ("packing-without-max-length", {"packing": True, "max_length": None}, {}, ValueError,
     r"When packing is enabled, `max_length` can't be `None`"),
    ("unknown-loss-type", {"loss_type": "foo"}, {}, ValueError, r"Invalid `loss_type` foo passed"),
    ("unknown-truncation-mode", {"truncation_mode": "middle"}, {}, ValueError, r"Unsupported truncation mode: middle"),
    ("dataset-text-field-missing", {"dataset_text_field": "txt"}, {}, KeyError, r"txt"),
    ("assistant-only-loss-on-text", {"assistant_only_loss": True}, {}, ValueError,
     r"You set `assistant_only_loss=True`, but the dataset is not conversational"),
    ("assistant-only-loss-on-prompt-completion", {"assistant_only_loss": True}, {"train_dataset": "prompt-completion"},
     ValueError, r"You set `assistant_only_loss=True`, but the dataset is not conversational"),
    ("eos-token-not-in-vocab", {"eos_token": "<|nope|>"}, {}, ValueError,
     r"The specified `eos_token` \('<\|nope\|>'\) is not found in the vocabulary"),
    ("pad-token-not-in-vocab", {"pad_token": "<|nope|>"}, {}, ValueError,
     r"The specified `pad_token` \('<\|nope\|>'\) is not found in the vocabulary"),
    ("formatting-func-with-completion-only-loss", {}, {"train_dataset": "prompt-completion",
     "formatting_func": lambda row: row["prompt"]}, ValueError,
     r"A formatting function was provided while `completion_only_loss=True`, which is incompatible"),
    ("dft-with-compute-loss-func", {"loss_type": "dft"}, {"compute_loss_func": _loss_on_all_logits}, ValueError,
     r"You passed a `compute_loss_func` together with `loss_type='dft'`"),
    ("padding-free-with-custom-collator", {"padding_free": True, "max_length": None},
     {"data_collator": lambda rows: rows}, ValueError,
     r"Passing a custom data collator is not supported when using padding-free"),
    ("processing-class-not-a-tokenizer", {}, {"processing_class": "Qwen/Qwen3-0.6B"}, TypeError,
     r"The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`"),
    ("dataset-with-transform", {}, {"train_dataset": "with_transform"}, ValueError,
     r"SFTTrainer cannot prepare a dataset that uses `Dataset.with_transform\(\)`"),
    ("eval-strategy-without-eval-dataset", {"eval_strategy": "steps", "eval_steps": 1}, {}, ValueError,
     r"You have set `args.eval_strategy` to .* but you didn't pass an `eval_dataset`"),
    ("vision-dataset", {}, {"train_dataset": "images"}, ValueError,
     r"The dataset appears to be vision-related \(contains 'image' or 'images' keys\)"),
    ("selective-checkpointing-without-checkpointing",
     {"gradient_checkpointing": False, "gradient_checkpointing_kwargs": {"selective": True}}, {}, ValueError,
     r"`gradient_checkpointing_kwargs=\{'selective': True\}` requires `gradient_checkpointing=True`"),
    ("liger-fused-linear-cross-entropy",
     {"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": True}}, {}, ValueError,
     r'`liger_kernel_config=\{"fused_linear_cross_entropy": True\}` is not supported'),
    ("peft-config-not-a-peft-config", {}, {"peft_config": "lora"}, TypeError,
     r"`peft_config` must be a `peft.PeftConfig` instance"),
    ("quantization-config-twice", {"model_init_kwargs": {"quantization_config": {"load_in_4bit": True}}},
     {"quantization_config": {"load_in_4bit": True}}, ValueError,
     r"You set `quantization_config` both as a trainer argument and in `args.model_init_kwargs`"),
    ("skip-prepare-with-masks-but-no-labels", {"dataset_kwargs": {"skip_prepare_dataset": True}},
     {"train_dataset": "masks-without-labels"}, ValueError, r"has mask columns but no 'labels'"),
]

DATASETS = {
    "text": _text,
    "prompt-completion": _prompt_completion,
    "with_transform": lambda: _text().with_transform(lambda batch: batch),
    "images": lambda: Dataset.from_list([{"text": "a picture", "images": []}]),
    "masks-without-labels": lambda: Dataset.from_list([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}]),
}


def _with_datasets(kwargs: dict) -> dict:
    """A case's arguments with the datasets it names built (afresh for each trainer)."""
    return {k: DATASETS[v]() if k.endswith("dataset") and isinstance(v, str) and v in DATASETS else v
            for k, v in kwargs.items()}


@pytest.mark.parametrize("config, kwargs, error, phrase", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_same_error_as_trl(config, kwargs, error, phrase, tmp_path):
    if "peft_config" in kwargs:
        pytest.importorskip("peft")
    for module in _modules():
        build = _build(module, tmp_path, config, **_with_datasets(kwargs))
        with pytest.raises(error, match=phrase):
            build()


def test_peft_model_with_a_peft_config(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    for module in _modules():
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(MODEL), peft.LoraConfig(r=2))
        build = _build(module, tmp_path, model=model, peft_config=peft.LoraConfig(r=2))
        with pytest.raises(ValueError, match=r"You passed a `PeftModel` instance together with a `peft_config`"):
            build()


def test_metric_for_best_model_not_among_the_metrics(tmp_path):
    config = dict(eval_strategy="steps", eval_steps=1, metric_for_best_model="nope")
    for module in _modules():
        trainer = _build(module, tmp_path, config, eval_dataset=_text())()
        with pytest.raises(KeyError, match=r"is set to 'eval_nope', which is not found in the evaluation metrics"):
            trainer.train()


def test_evaluate_without_an_eval_dataset(tmp_path):
    for module in _modules():
        trainer = _build(module, tmp_path)()
        with pytest.raises(ValueError, match=r"Trainer: evaluation requires an eval_dataset"):
            trainer.evaluate()


def test_unknown_row_format_is_a_key_error_and_a_value_error_naming_the_row(tmp_path):
    build = _build(hfnative, tmp_path, {"dataset_text_field": "txt"})
    with pytest.raises(ValueError, match=r"Row 0 .*dataset_text_field") as caught:
        build()
    assert isinstance(caught.value, KeyError) and str(caught.value).startswith("Row 0")


@pytest.mark.parametrize(
    "config, phrase",
    [
        ({"loss_type": "chunked_nll"}, r"`loss_type='chunked_nll'` is deprecated"),
        ({"pad_token": "<|endoftext|>"}, r"`pad_token` is deprecated"),
        ({"truncation_mode": "keep_end"}, r"The `'keep_end'` truncation mode is deprecated"),
        ({"packing_strategy": "bfd-requeue"}, r"The `bfd-requeue` packing strategy has been renamed to `bfd_split`"),
    ],
    ids=["chunked_nll", "pad_token", "keep_end", "bfd-requeue"],
)
def test_same_deprecation_warning_as_trl(config, phrase, tmp_path):
    for module in _modules():
        with pytest.warns(FutureWarning, match=phrase):
            _config(module, tmp_path, **config)


def test_compute_loss_func_is_deprecated_as_in_trl(tmp_path):
    for module in _modules():
        build = _build(module, tmp_path, compute_loss_func=_loss_on_all_logits)
        with pytest.warns(FutureWarning, match=r"`compute_loss_func` is deprecated"):
            build()


@pytest.mark.parametrize(
    "config, kwargs, phrase",
    [
        ({"padding_free": True, "max_length": None, "per_device_train_batch_size": 1}, {},
         r"You are using a per_device_train_batch_size of 1 with padding-free training"),
        ({"padding_free": True, "packing": True, "packing_strategy": "wrapped"}, {},
         r"You are passing `padding_free=True` with the 'wrapped' packing strategy, which is not recommended"),
        ({"model_init_kwargs": {"dtype": "float32"}}, {"model": "transformers"},
         r"already instantiated.*`model_init_kwargs` will be ignored"),
    ],
    ids=["padding-free-batch-of-one", "padding-free-wrapped", "model-init-kwargs-ignored"],
)
def test_same_warning_as_trl(config, kwargs, phrase, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    for module in _modules():
        if kwargs.get("model") == "transformers":
            kwargs = {**kwargs, "model": AutoModelForCausalLM.from_pretrained(MODEL)}
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            _build(module, tmp_path, config, **kwargs)()
        assert any(re.search(phrase, record.getMessage()) for record in caplog.records), (module.__name__, caplog.text)


def test_quantization_config_argument_reaches_model_loading(tmp_path):
    """TRL 1.16's `quantization_config=` trainer argument: merged into model_init_kwargs (a quantized base then
    needs a peft_config, as QLoRA does)."""
    build = _build(hfnative, tmp_path, quantization_config={"load_in_4bit": True})
    with pytest.raises(ValueError, match=r"quantization_config quantizes a frozen base for LoRA: pass a peft_config"):
        build()


# --- where hfnative differs from TRL on purpose ------------------------------------------------------------


def test_label_smoothing_is_refused_since_it_is_not_implemented(tmp_path):
    """TRL deprecates it (a FutureWarning) and still smooths; hfnative would silently not, so it refuses."""
    build = _build(hfnative, tmp_path, {"label_smoothing_factor": 0.1})
    with pytest.raises(ValueError, match=r"`label_smoothing_factor` is deprecated in `SFTTrainer`"):
        build()


def test_batch_size_below_one_is_refused_by_the_config(tmp_path):
    """transformers fails only once training starts (torch's "batch_size should be a positive integer value")."""
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=0; it must be at least 1"):
        _config(hfnative, tmp_path, per_device_train_batch_size=0)


# --- transformers' Trainer checks, on hfnative.Trainer ---------------------------------------------


def _plain_trainer_cases(tmp_path):
    import torch

    args = hfnative.TrainingArguments(str(tmp_path / "plain"), use_cpu=True, report_to="none")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return [
        (RuntimeError, "requires either a `model` or `model_init`", dict(args=args)),
        (RuntimeError, "Passing both `optimizers` and `optimizer_cls_and_kwargs`",
         dict(model=MODEL, args=args, optimizers=(optimizer, None), optimizer_cls_and_kwargs=(torch.optim.SGD, {}))),
        (RuntimeError, "Passing a `model_init` is incompatible with providing the `optimizers`",
         dict(model_init=lambda: MODEL, args=args, optimizers=(optimizer, None))),
    ]


def test_plain_trainer_construction_errors_match_transformers(tmp_path):
    import transformers

    for error, phrase, kwargs in _plain_trainer_cases(tmp_path):
        with pytest.raises(error, match=re.escape(phrase)):
            hfnative.Trainer(**kwargs)
        if "model" not in kwargs and "model_init" not in kwargs:  # transformers checks this one first too
            with pytest.raises(error, match=re.escape(phrase)):
                transformers.Trainer(args=transformers.TrainingArguments(str(tmp_path / "hf"), use_cpu=True, report_to="none"))


def test_plain_trainer_train_without_dataset(tmp_path):
    args = hfnative.TrainingArguments(str(tmp_path / "plain"), use_cpu=True, report_to="none", max_steps=1)
    trainer = hfnative.Trainer(model=MODEL, args=args)
    with pytest.raises(ValueError, match=re.escape("Trainer: training requires a train_dataset.")):
        trainer.train()
