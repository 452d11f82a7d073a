"""TRL 1.16's warnings, word for word: each case builds TRL's config or trainer and hfnative's on the same inputs
(some evaluate with compute_metrics), catches what both emit (warnings and log records), and finds TRL's whole message
among ours. Where hfnative's advice differs (use_liger_kernel: TRL points at transformers' Hub kernels, hfnative's loss
is already fused) TRL's first sentence is compared. (tests/test_trl_errors.py compares SFT's errors and a few
warnings by their key phrases.)
"""

import json
import logging
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

import hfnative

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")
from test_compute_metrics_vs_trl import _class  # noqa: E402  (TRL's or hfnative's trainer and config classes)

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _jsonl(name: str, n: int) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f][:n]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _messages(build) -> list[str]:
    """Every warning and WARNING log record ``build()`` emits (TRL's "[RANK n] " log prefix dropped)."""
    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build()
    finally:
        root.removeHandler(records)
    return [re.sub(r"^\[RANK \d+\] ", "", text) for text in [str(w.message) for w in caught] + records.messages]


def _config(module, name, tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none",
                    disable_tqdm=True, max_steps=1, save_strategy="no", per_device_train_batch_size=2)
    return _class(module, f"{name}Config")(**{**settings, **overrides})


def _trainer(module, name, tmp_path, config=None, rows=None, evaluate=False, **kwargs):
    """A function that builds the trainer (and evaluates it with a compute_metrics when asked)."""
    pairs = _jsonl("preference.jsonl", 4)
    if rows is None:
        rows = {"SFT": _jsonl("sft_messages.jsonl", 4), "GKD": _jsonl("sft_messages.jsonl", 4), "GRPO": [
            {"prompt": r["prompt"]} for r in pairs], "KTO": [
            {"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
            for i, r in enumerate(pairs)]}.get(name, pairs)
    if name == "GKD":
        kwargs["teacher_model"] = MODEL
    if name == "GRPO":
        kwargs["reward_funcs"] = lambda completions, **_: [float(len(str(c))) for c in completions]
    model = kwargs.pop("model", MODEL)

    def build():
        args = _config(module, name, tmp_path, **(config or {}))
        trainer = _class(module, f"{name}Trainer")(
            model=model() if callable(model) else model, args=args, train_dataset=Dataset.from_list(rows),
            eval_dataset=Dataset.from_list(rows) if evaluate else None,
            processing_class=AutoTokenizer.from_pretrained(MODEL),
            **({"compute_metrics": lambda prediction: {}} if evaluate else {}), **kwargs)
        if evaluate:
            trainer.evaluate()

    return build


def _tiny_moe_with_router_logits(tmp_path) -> str:
    """A Qwen3-MoE whose config asks for router logits with a router_aux_loss_coef of 0.0."""
    folder = tmp_path / "moe"
    if not folder.exists():
        tokenizer = AutoTokenizer.from_pretrained(MODEL)
        config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
                                num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
                                output_router_logits=True, max_position_embeddings=256)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def _legacy_reward_rows() -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    return [{"chosen_input_ids": tokenizer(r["chosen"][0]["content"])["input_ids"],
             "rejected_input_ids": tokenizer(r["rejected"][0]["content"])["input_ids"]}
            for r in _jsonl("preference.jsonl", 4)]


# id -> (a function of (module, tmp_path) that emits the warning, a phrase that picks TRL's message)
CASES = {
    "reward-legacy-columns": (lambda m, t: _trainer(m, "Reward", t, rows=_legacy_reward_rows()),
                              "Detected legacy dataset columns"),
    "sft-chunked-nll": (lambda m, t: lambda: _config(m, "SFT", t, loss_type="chunked_nll"), "chunked_nll"),
    "sft-pad-token": (lambda m, t: lambda: _config(m, "SFT", t, pad_token="<|endoftext|>"), "`pad_token` is deprecated"),
    "sft-keep-end": (lambda m, t: lambda: _config(m, "SFT", t, truncation_mode="keep_end"), "keep_end"),
    "sft-bfd-requeue": (lambda m, t: lambda: _config(m, "SFT", t, packing_strategy="bfd-requeue"), "bfd-requeue"),
    "dpo-pad-token": (lambda m, t: lambda: _config(m, "DPO", t, pad_token="<|endoftext|>"), "`pad_token` is deprecated"),
    "grpo-transformers-paged": (lambda m, t: lambda: _config(m, "GRPO", t, use_transformers_paged=True, num_generations=2),
                                "`use_transformers_paged` is deprecated"),
    "rloo-transformers-paged": (lambda m, t: lambda: _config(m, "RLOO", t, use_transformers_paged=True, num_generations=2),
                                "`use_transformers_paged` is deprecated"),
    "dpo-keep-end": (lambda m, t: lambda: _config(m, "DPO", t, truncation_mode="keep_end"), "keep_end"),
    "reward-pad-token": (lambda m, t: lambda: _config(m, "Reward", t, pad_token="<|endoftext|>"),
                         "`pad_token` is deprecated"),
    "sft-compute-loss-func": (lambda m, t: _trainer(m, "SFT", t, compute_loss_func=lambda o, labels, **_: o.logits.sum()),
                              "`compute_loss_func` is deprecated"),
    "sft-model-init-kwargs": (lambda m, t: _trainer(m, "SFT", t, config=dict(model_init_kwargs={"dtype": "float32"}),
                                                    model=lambda: AutoModelForCausalLM.from_pretrained(MODEL)),
                              "`model_init_kwargs` to the"),
    "sft-formatting-func-on-tokenized-rows": (lambda m, t: _trainer(m, "SFT", t, formatting_func=lambda row: "text", rows=[
        {"input_ids": AutoTokenizer.from_pretrained(MODEL)("hello world " * n)["input_ids"]} for n in range(1, 5)]),
        "already processed"),
    "sft-padding-free-batch-of-one": (lambda m, t: _trainer(m, "SFT", t, config=dict(
        padding_free=True, max_length=None, per_device_train_batch_size=1)), "per_device_train_batch_size of 1"),
    "sft-padding-free-wrapped": (lambda m, t: _trainer(m, "SFT", t, config=dict(
        padding_free=True, packing=True, packing_strategy="wrapped", max_length=64)), "'wrapped' packing strategy"),
    "dpo-padding-free": (lambda m, t: _trainer(m, "DPO", t, config=dict(padding_free=True)), "`padding_free=True`"),
    "orpo-max-length": (lambda m, t: _trainer(m, "ORPO", t, config=dict(max_length=None)), "`max_length` is not set"),
    "orpo-remove-unused-columns": (lambda m, t: _trainer(m, "ORPO", t, config=dict(max_length=64)),
                                   "remove_unused_columns=False"),
    "cpo-max-length": (lambda m, t: _trainer(m, "CPO", t, config=dict(max_length=None)), "`max_length` is not set"),
    "orpo-router-coef-zero": (lambda m, t: _trainer(m, "ORPO", t, config=dict(max_length=64),
                                                    model=_tiny_moe_with_router_logits(t)), "`router_aux_loss_coef`"),
    "gkd-covered-by-distillation": (lambda m, t: _trainer(m, "GKD", t, config=dict(lmbda=1.0, temperature=1.0)),
                                    "fully covered by `DistillationTrainer`"),
    "grpo-luspo": (lambda m, t: _trainer(m, "GRPO", t, config=dict(loss_type="luspo", num_generations=2,
                                                                   max_completion_length=4)), "'luspo'"),
    "grpo-vespo": (lambda m, t: _trainer(m, "GRPO", t, config=dict(
        loss_type="vespo", importance_sampling_level="sequence", num_generations=2, max_completion_length=4)), "VESPO"),
    "grpo-sequence-dapo": (lambda m, t: _trainer(m, "GRPO", t, config=dict(
        importance_sampling_level="sequence", num_generations=2, max_completion_length=4)), "sums per-token"),
    "sft-logits-for-metrics": (lambda m, t: _trainer(m, "SFT", t, evaluate=True), "`return_outputs=True`"),
    "dpo-logits-for-metrics": (lambda m, t: _trainer(m, "DPO", t, evaluate=True), "`return_outputs=True`"),
    "kto-logits-for-metrics": (lambda m, t: _trainer(m, "KTO", t, evaluate=True), "`return_outputs=True`"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trls_warning_word_for_word(case, tmp_path):
    make, phrase = CASES[case]
    theirs = [text for text in _messages(make(trl, tmp_path)) if phrase in text]
    assert theirs, f"TRL emitted no warning with {phrase!r}"
    ours = _messages(make(hfnative, tmp_path))
    for message in theirs:
        assert any(message in text for text in ours), (message, [text for text in ours if phrase in text])


@pytest.mark.parametrize("name, config", [("SFT", {}), ("DPO", {}), ("GRPO", dict(num_generations=2,
                                                                              max_completion_length=4))])
def test_use_liger_kernel_deprecation_opens_as_trls(name, config, tmp_path):
    first_sentence = "`use_liger_kernel=True` is deprecated and will be removed in v2.0.0."
    for module in (trl, hfnative):
        messages = _messages(_trainer(module, name, tmp_path, config=dict(use_liger_kernel=True, **config)))
        assert any(text.startswith(first_sentence) for text in messages), (module.__name__, messages)


def test_no_logits_warning_without_compute_metrics(tmp_path):
    """Evaluating without compute_metrics, neither TRL nor hfnative recomputes logits, nor warns."""
    for module in (trl, hfnative):
        def build(module=module):
            args = _config(module, "SFT", tmp_path)
            rows = Dataset.from_list(_jsonl("sft_messages.jsonl", 4))
            module.SFTTrainer(model=MODEL, args=args, train_dataset=rows, eval_dataset=rows,
                              processing_class=AutoTokenizer.from_pretrained(MODEL)).evaluate()
        assert not [text for text in _messages(build) if "return_outputs" in text]
