"""GKDTrainer and DistillationTrainer against TRL (the oracle) on the shipped tiny student and teacher.

The loss equals TRL's generalized JSD (GKDTrainer.generalized_jsd_loss on transformers' logits, and
DistillationTrainer's chunked divergence on transformers' hidden states); the fused gradients equal autograd through
materialized logits; GKD off-policy and Distillation fed the same fixed completions match TRL per step; seeded
on-policy runs repeat; a LoRA student generates with its adapters; the teacher loads as a path or a model and is
sharded like the student under FSDP2; a teacher with another vocabulary is refused; the ``gkd`` / ``distillation``
commands and examples/distillation.py run.
"""

import dataclasses
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

import hfnative
from hfnative.trainers.running import cli
from hfnative.trainers.algorithms import distillation as kd

trl = pytest.importorskip("trl")


from trl.experimental.gkd import GKDConfig as TRLGKDConfig  # noqa: E402
from trl.experimental.gkd import GKDTrainer as TRLGKDTrainer  # noqa: E402
from trl.trainer.distillation_trainer import _chunked_divergence_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STUDENT = str(ROOT / "examples" / "tiny-qwen3")
TEACHER = str(ROOT / "examples" / "tiny-qwen3-teacher")
DATA = ROOT / "examples" / "data"
STEPS = 5
EOS = 2  # <|im_end|>


def _rows(name: str, n: int) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _quick(**extra) -> dict:
    return dict(use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, logging_steps=1, save_strategy="no",
                learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=0.2, weight_decay=0.01, **extra)


def _gkd(module_config, module_trainer, tmp_path, rows, teacher=TEACHER, data_collator=None, **extra):
    args = module_config(output_dir=str(tmp_path / module_trainer.__module__), **_quick(**extra))
    return module_trainer(model=STUDENT, teacher_model=teacher, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(STUDENT), data_collator=data_collator)


def _losses_of(log_history: list[dict]) -> list[dict]:
    """The training steps' entries without hfnative's perf/ metrics (timings and memory differ from run to run)."""
    return [{k: v for k, v in entry.items() if not k.startswith("perf/")} for entry in log_history if "loss" in entry]


def _losses(trainer) -> list[dict]:
    return _losses_of(trainer.state.log_history)


@pytest.fixture(scope="module")
def gkd_trainer(tmp_path_factory):
    """An off-policy GKDTrainer on the tiny student and teacher, and one prepared batch of 4 conversations."""
    trainer = _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path_factory.mktemp("gkd"), _rows("sft_messages.jsonl", 4),
                   lmbda=0.0, max_steps=1)
    batch = trainer._prepare_inputs(trainer.data_collator(_rows("sft_messages.jsonl", 4)))
    return trainer, batch


def _transformers_outputs(batch):
    """transformers' student and teacher on the batch: (student, teacher) final hidden states and logits."""
    outputs = []
    for path in (STUDENT, TEACHER):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
        outputs.append((out.hidden_states[-1], out.logits, model.lm_head.weight.detach()))
    return outputs


# --- the loss and its gradients -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_equals_trl_generalized_jsd(gkd_trainer, beta, temperature):
    trainer, batch = gkd_trainer
    objective = trainer.objective
    objective.beta, objective.loss_temperature = beta, temperature
    try:
        with torch.no_grad():
            ours, _ = objective.loss(trainer.model, batch, None)
    finally:
        objective.beta, objective.loss_temperature = trainer.args.beta, 1.0
    (student_hidden, student_logits, student_head), (teacher_hidden, teacher_logits, teacher_head) = _transformers_outputs(batch)
    labels = batch["shift_labels"]
    theirs = TRLGKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels=labels, beta=beta, temperature=temperature)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6, rel=1e-6)
    chunked, _, _ = _chunked_divergence_loss(student_hidden, teacher_hidden, student_head, teacher_head,
                                             (labels != -100).long(), beta, temperature=temperature)
    assert ours.item() == pytest.approx(chunked.item(), abs=1e-6, rel=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_gradients_equal_materialized_logits(gkd_trainer, beta):
    trainer, batch = gkd_trainer
    model, teacher, objective = trainer.model, trainer.objective.teacher, trainer.objective
    objective.beta, objective.loss_temperature = beta, 2.0
    try:
        model.zero_grad(set_to_none=True)
        objective.loss(model, batch, None)[0].backward()
        fused = {name: p.grad.clone() for name, p in model.named_parameters()}
    finally:
        objective.beta, objective.loss_temperature = trainer.args.beta, 1.0
    model.zero_grad(set_to_none=True)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        teacher_logits = teacher(**inputs).logits
    student_logits = model(**inputs).logits  # [B, S, V] through the head, autograd end to end
    TRLGKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels=batch["shift_labels"], beta=beta,
                                       temperature=2.0).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    model.zero_grad(set_to_none=True)


# --- per-step parity with TRL ---------------------------------------------------------------------------


@pytest.mark.parametrize("accumulation", [1, 2])
def test_gkd_off_policy_matches_trl_per_step(tmp_path, accumulation):
    rows = _rows("sft_messages.jsonl", 3 * accumulation * STEPS)
    extra = dict(lmbda=0.0, max_steps=STEPS, per_device_train_batch_size=3, gradient_accumulation_steps=accumulation)
    theirs = _gkd(TRLGKDConfig, TRLGKDTrainer, tmp_path, rows, **extra)
    theirs.train()
    ours = _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path, rows, **extra)
    ours.train()
    mine, reference = _losses(ours), _losses(theirs)
    assert len(mine) == len(reference) == STEPS
    for a, b in zip(mine, reference):
        assert set(a) == set(b)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-12)
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (b["step"], key)


def test_trl_collator_batches_train_as_trl(tmp_path):
    """A data_collator that returns TRL's GKD batch (trl's DataCollatorForChatML: left-padded ids, labels, and the
    prompts as 'prompts' / 'prompt_attention_mask' tensors, no prompt lists): off-policy, equal to TRL's GKD per
    step; on-policy (lmbda=1), the student generates from those prompt tensors the completions it generates from
    its own collator's batches (the same losses, seeded)."""
    from trl.experimental.utils import DataCollatorForChatML

    rows = _rows("sft_messages.jsonl", 6)
    extra = dict(max_steps=3, per_device_train_batch_size=2, max_length=256)
    theirs = _gkd(TRLGKDConfig, TRLGKDTrainer, tmp_path, rows, lmbda=0.0, **extra)
    theirs.train()
    collator = DataCollatorForChatML(tokenizer=AutoTokenizer.from_pretrained(STUDENT), max_length=256)
    ours = _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path, rows, lmbda=0.0, data_collator=collator, **extra)
    ours.train()
    for a, b in zip(_losses(ours), _losses(theirs), strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (b["step"], key)
    on_policy = dict(lmbda=1.0, max_new_tokens=5, **extra)
    with_trl_batches = _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path, rows, data_collator=collator, **on_policy)
    with_trl_batches.train()
    own = _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path, rows, **on_policy)
    own.train()
    for a, b in zip(_losses(with_trl_batches), _losses(own), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    batch = own.data_collator(rows[:2])  # our own batches carry TRL's keys too
    assert batch["prompts"].shape == batch["prompt_attention_mask"].shape
    assert [row[m.bool()].tolist() for row, m in zip(batch["prompts"], batch["prompt_attention_mask"])] == batch["prompt_ids"]


def _fixed_completions() -> dict[tuple, list[int]]:
    """Each shipped prompt's dataset completion (tokenized, with the EOS), by the prompt's token ids."""
    tokenizer = AutoTokenizer.from_pretrained(STUDENT)
    rows = _rows("sft_prompt_completion.jsonl", 60)
    return {tuple(tokenizer(r["prompt"])["input_ids"]): tokenizer(r["completion"])["input_ids"] + [EOS] for r in rows}


def _distill(module, tmp_path, rows, teacher=TEACHER, **extra):
    args = module.DistillationConfig(output_dir=str(tmp_path / module.__name__), **_quick(**extra))
    return module.DistillationTrainer(model=STUDENT, teacher_model=teacher, args=args, train_dataset=Dataset.from_list(rows),
                                      processing_class=AutoTokenizer.from_pretrained(STUDENT))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_distillation_with_fixed_completions_matches_trl_per_step(monkeypatch, tmp_path, accumulation):
    fixed = _fixed_completions()
    monkeypatch.setattr(trl.DistillationTrainer, "_generate_single_turn",
                        lambda self, prompt_ids, *args, **kwargs: [fixed[tuple(p)] for p in prompt_ids])
    monkeypatch.setattr(kd._DistillationObjective, "generate", lambda self, model, prompts, sampling: [fixed[tuple(p)] for p in prompts])
    rows = _rows("sft_prompt_completion.jsonl", 3 * accumulation * STEPS)
    extra = dict(max_steps=STEPS, per_device_train_batch_size=3, gradient_accumulation_steps=accumulation, beta=0.5,
                 temperature=1.5)
    theirs = _distill(trl, tmp_path, rows, **extra)
    theirs.train()
    ours = _distill(hfnative, tmp_path, rows, **extra)
    ours.train()
    mine, reference = _losses(ours), _losses(theirs)
    assert len(mine) == len(reference) == STEPS
    for a, b in zip(mine, reference):
        assert set(a) == set(b) - {"step_time"}
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-12)
        assert a["num_tokens"] == b["num_tokens"]
        # entropy is a per-micro-batch mean: TRL shuffles the step's rows before splitting them
        keys = ["loss", "grad_norm"] + [k for k in b if k.startswith("completions/")] + ["entropy"] * (accumulation == 1)
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (b["step"], key)


def test_log_completions_writes_trls_tables(monkeypatch, tmp_path):
    """log_completions=True: each log's latest prompts and completions (as text, without special tokens) written to
    output_dir/completions/completions_{step:05d}.parquet, equal to TRL's on the same completions."""
    import pandas as pd

    fixed = _fixed_completions()
    monkeypatch.setattr(trl.DistillationTrainer, "_generate_single_turn",
                        lambda self, prompt_ids, *args, **kwargs: [fixed[tuple(p)] for p in prompt_ids])
    monkeypatch.setattr(kd._DistillationObjective, "generate", lambda self, model, prompts, sampling: [fixed[tuple(p)] for p in prompts])
    rows = _rows("sft_prompt_completion.jsonl", 12)
    extra = dict(max_steps=2, per_device_train_batch_size=3, gradient_accumulation_steps=2, log_completions=True,
                 num_completions_to_print=2)
    for module in (trl, hfnative):
        _distill(module, tmp_path, rows, **extra).train()
    folders = {name: tmp_path / name / "completions" for name in ("trl", "hfnative")}
    names = sorted(p.name for p in folders["trl"].iterdir())
    assert names == sorted(p.name for p in folders["hfnative"].iterdir()) == ["completions_00001.parquet",
                                                                               "completions_00002.parquet"]
    for name in names:
        mine, theirs = (pd.read_parquet(folders[run] / name) for run in ("hfnative", "trl"))
        assert list(theirs.columns) == ["step", "prompt", "completion"] and len(theirs) == 6
        pd.testing.assert_frame_equal(mine, theirs)


def test_an_8bit_teacher_matches_trls_bitsandbytes_teacher(monkeypatch, tmp_path):
    """teacher_model_init_kwargs with BitsAndBytesConfig(load_in_8bit=True): the teacher's linears stored as
    bitsandbytes' int8 rows (hfnative.peft.Int8Weight), and the losses TRL's with bitsandbytes' 8-bit teacher on the
    same completions (to bitsandbytes' int8 activations)."""
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    from hfnative.peft import Int8Weight

    fixed = _fixed_completions()
    monkeypatch.setattr(trl.DistillationTrainer, "_generate_single_turn",
                        lambda self, prompt_ids, *args, **kwargs: [fixed[tuple(p)] for p in prompt_ids])
    monkeypatch.setattr(kd._DistillationObjective, "generate", lambda self, model, prompts, sampling: [fixed[tuple(p)] for p in prompts])
    rows = _rows("sft_prompt_completion.jsonl", 6)
    extra = dict(max_steps=2, per_device_train_batch_size=3, beta=0.5,
                 teacher_model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_8bit=True),
                                            "dtype": "float32"})
    theirs = _distill(trl, tmp_path, rows, **extra)
    theirs.train()
    ours = _distill(hfnative, tmp_path, rows, **extra)
    teacher = ours.objective.auxiliary_models["teacher"]
    assert sum(isinstance(p, Int8Weight) for p in teacher.parameters()) == 7 * len(teacher.layers)  # every projection
    ours.train()
    for a, b in zip(_losses(ours), _losses(theirs), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), b["step"]


def test_a_quantized_teacher_is_quantized_on_the_trainers_device(monkeypatch, tmp_path):
    """teacher_model_init_kwargs asking for an 8-bit base: the teacher loads on the host and its weights are quantized
    on the trainer's device (an adapter folder's base too: ``quantize_on``)."""
    seen, real = [], kd.resolve_model
    monkeypatch.setattr(kd, "resolve_model", lambda source, device, kwargs, **extra: seen.append(
        (device, extra.get("quantize_on"))) or real(source, device, kwargs, **extra))
    trainer = _distill(hfnative, tmp_path, _rows("sft_prompt_completion.jsonl", 3), max_steps=1,
                       teacher_model_init_kwargs={"load_in_8bit": True})
    assert seen == [(torch.device("cpu"), trainer.device)]


# --- on-policy runs -------------------------------------------------------------------------------------


def _on_policy_logs(tmp_path, seed: int) -> list[dict]:
    # log_completions on the real sampled path too (its tables are compared with TRL's on fixed completions above)
    trainer = _distill(hfnative, tmp_path, _rows("sft_prompt_completion.jsonl", 8), max_steps=2, seed=seed,
                       per_device_train_batch_size=2, gradient_accumulation_steps=2, max_completion_length=6,
                       log_completions=True, num_completions_to_print=0)
    trainer.train()
    return _losses(trainer)


def test_seeded_on_policy_runs_repeat(tmp_path):
    first, again, other = _on_policy_logs(tmp_path, 7), _on_policy_logs(tmp_path, 7), _on_policy_logs(tmp_path, 8)
    assert first == again
    assert [e["loss"] for e in first] != [e["loss"] for e in other]


def test_gkd_on_policy_and_sequence_kd_generate(monkeypatch, tmp_path):
    """lmbda=1: every micro-batch is completed by the student (live weights); seq_kd with lmbda=0: by the teacher."""
    calls = []
    generate = kd._DistillationObjective.generate

    def recorded(self, model, prompts, sampling):
        completions = generate(self, model, prompts, sampling)
        calls.append((model is self.teacher, len(prompts), [len(c) for c in completions]))
        return completions

    monkeypatch.setattr(kd._DistillationObjective, "generate", recorded)
    rows = _rows("sft_messages.jsonl", 8)
    logs = []
    for settings in (dict(lmbda=1.0), dict(lmbda=1.0), dict(lmbda=0.0, seq_kd=True)):
        trainer = _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path, rows, max_steps=2, per_device_train_batch_size=2,
                       max_new_tokens=5, **settings)
        trainer.train()
        logs.append(_losses(trainer))
    assert logs[0] == logs[1]  # seeded
    assert [teacher for teacher, _, _ in calls] == [False] * 4 + [True] * 2
    assert all(n == 2 and all(1 <= length <= 5 for length in lengths) for _, n, lengths in calls)


def test_lora_student_generates_with_its_adapters_and_evaluates(monkeypatch, tmp_path):
    seen = []
    generate = kd._DistillationObjective.generate

    def recorded(self, model, prompts, sampling):
        seen.append(sorted({name.split(".")[-1] for name, _ in model.named_parameters() if "lora" in name}))
        return generate(self, model, prompts, sampling)

    monkeypatch.setattr(kd._DistillationObjective, "generate", recorded)
    rows = _rows("sft_prompt_completion.jsonl", 8)
    args = hfnative.DistillationConfig(output_dir=str(tmp_path / "lora"), **_quick(max_steps=2, per_device_train_batch_size=2,
                                                                                    max_completion_length=4))
    trainer = hfnative.DistillationTrainer(model=STUDENT, teacher_model=TEACHER, args=args, train_dataset=Dataset.from_list(rows),
                                           eval_dataset=Dataset.from_list(rows[:4]),
                                           peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all("lora" in name for name in changed)
    assert seen and all(names for names in seen)  # the model that generated carries the adapters
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_entropy", "eval_completions/mean_length", "eval_num_tokens"} <= set(metrics)
    assert 1 <= metrics["eval_completions/mean_length"] <= 4


# --- the teacher --------------------------------------------------------------------------------------------


def test_teacher_as_path_or_model(gkd_trainer, tmp_path):
    trainer, batch = gkd_trainer
    with torch.no_grad():
        expected = trainer.objective.loss(trainer.model, batch, None)[0].item()
    teachers = [AutoModelForCausalLM.from_pretrained(TEACHER), hfnative.load_pretrained(TEACHER).model]
    for teacher in teachers:
        other = _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path, _rows("sft_messages.jsonl", 4), teacher=teacher,
                     lmbda=0.0, max_steps=1)
        with torch.no_grad():
            assert other.objective.loss(other.model, batch, None)[0].item() == pytest.approx(expected, abs=1e-7)
    config = hfnative.GKDConfig(output_dir=str(tmp_path / "by-name"), teacher_model_name_or_path=TEACHER,
                                teacher_model_init_kwargs={"dtype": "bfloat16"}, **_quick(lmbda=0.0))
    by_name = hfnative.GKDTrainer(model=STUDENT, args=config, train_dataset=Dataset.from_list(_rows("sft_messages.jsonl", 4)))
    assert next(by_name.objective.teacher.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in by_name.objective.teacher.parameters())
    with pytest.raises(ValueError, match="already instantiated"):
        _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path, _rows("sft_messages.jsonl", 4), teacher=teachers[0],
             teacher_model_init_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="needs a teacher"):
        _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path, _rows("sft_messages.jsonl", 4), teacher=None)


def test_teacher_sharded_like_the_student_under_fsdp2(tmp_path):
    """Off-policy GKD on 2 torchrun processes (FSDP2, gloo) equals one process over the same global batches."""
    import _kd_distributed_worker as worker

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "tests" / "_kd_distributed_worker.py"), str(tmp_path / "fsdp")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    launched = json.loads((tmp_path / "fsdp" / "result.json").read_text())
    assert launched["sharded"] == {"student": True, "teacher": True}
    reference = hfnative.GKDTrainer(model=STUDENT, teacher_model=TEACHER, args=worker.config(str(tmp_path / "one"), 2 * worker.PER_DEVICE),
                                    train_dataset=Dataset.from_list(worker.rows()))
    reference.train()
    ours, theirs = _losses_of(launched["log_history"]), _losses(reference)
    assert len(ours) == len(theirs) == worker.STEPS
    for a, b in zip(ours, theirs):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (b["step"], key)


def test_teacher_with_another_vocabulary_is_refused(tmp_path):
    config = Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "teacher")
    with pytest.raises(ValueError, match="vocab_size 1024 but the teacher model has vocab_size 512"):
        _distill(hfnative, tmp_path, _rows("sft_prompt_completion.jsonl", 4), teacher=str(tmp_path / "teacher"))
    with pytest.raises(ValueError, match="vocab_size 1024 but the teacher model has vocab_size 512"):
        _gkd(hfnative.GKDConfig, hfnative.GKDTrainer, tmp_path, _rows("sft_messages.jsonl", 4), teacher=str(tmp_path / "teacher"))


def test_configs_have_trl_fields_and_defaults():
    for theirs, ours in [(trl.DistillationConfig, hfnative.DistillationConfig), (TRLGKDConfig, hfnative.GKDConfig)]:
        names = {f.name for f in dataclasses.fields(theirs) if f.init} - {"output_dir"}
        a, b = theirs(output_dir="x", use_cpu=True), ours(output_dir="x", use_cpu=True)
        assert {name: getattr(b, name) for name in names} == {name: getattr(a, name) for name in names}
    with pytest.raises(ValueError, match="beta must be in"):
        hfnative.DistillationConfig(output_dir="x", beta=1.5, use_cpu=True)
    with pytest.raises(ValueError, match="lmbda must be in the range"):
        hfnative.GKDConfig(output_dir="x", lmbda=-0.1, use_cpu=True)


# --- command line and example -------------------------------------------------------------------------------

QUICK_FLAGS = ["--model_name_or_path", STUDENT, "--teacher_model_name_or_path", TEACHER, "--use_cpu", "--bf16", "false",
               "--report_to", "none", "--disable_tqdm", "--max_steps", "2", "--per_device_train_batch_size", "2",
               "--logging_steps", "1", "--save_strategy", "no"]


@pytest.mark.parametrize("command, data, extra", [
    ("distillation", "sft_prompt_completion.jsonl", ["--max_completion_length", "4"]),
    ("gkd", "sft_messages.jsonl", ["--lmbda", "0.5", "--max_new_tokens", "4", "--max_length", "64"]),
])
def test_cli_commands_train(tmp_path, command, data, extra):
    out = tmp_path / command
    assert cli.main([command, *QUICK_FLAGS, "--dataset_name", str(DATA / data), "--output_dir", str(out), *extra]) == 0
    state = json.loads((out / "trainer_state.json").read_text()) if (out / "trainer_state.json").exists() else None
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert state is None or state["global_step"] == 2


def test_cli_needs_a_teacher(tmp_path, capsys):
    flags = [f for f in QUICK_FLAGS if f not in ("--teacher_model_name_or_path", TEACHER)]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["distillation", *flags, "--dataset_name", str(DATA / "sft_prompt_completion.jsonl"),
                  "--output_dir", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "--teacher_model_name_or_path" in capsys.readouterr().err


def test_example_script_runs(tmp_path, monkeypatch):
    argv = ["examples/distillation.py", *QUICK_FLAGS, "--dataset_name", str(DATA / "sft_prompt_completion.jsonl"),
            "--max_completion_length", "4", "--output_dir", str(tmp_path / "example")]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(ROOT / "examples" / "distillation.py"), run_name="__main__")
    assert (tmp_path / "example" / "model.safetensors").exists()
