"""Online DPO against TRL 1.16's experimental OnlineDPOTrainer run beside us.

On fixed completions (TRL's model.generate patched to return them, ours given them by the rollout engine) both
trainers sample the same pairs, score them with the same reward functions and train the same steps: the per-step
loss, grad norm and every metric TRL logs are compared. A short sampled run (the native engine) trains too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import hfnative  # noqa: E402
from _launch import assert_logged_close  # noqa: E402
from test_grpo import MODEL, save_reward_model  # noqa: E402

EOS = 2  # tiny-qwen3's <|im_end|>
PAD = 0
MAX_NEW = 8


def fixed_completion(prompt_ids: list[int], index: int) -> list[int]:
    """A completion that depends only on the prompt and its row (of the 2B block layout): most end with EOS at
    various lengths, some run to max_new_tokens without one."""
    seed = sum(prompt_ids) + 7 * index
    if seed % 4 == 0:  # cut at the length limit: exactly max_new_tokens, no EOS
        return [10 + (seed * 5 + 31 * k) % 300 for k in range(MAX_NEW)]
    length = 1 + seed % (MAX_NEW - 1)
    return [10 + (seed * 3 + 17 * k) % 300 for k in range(length)] + [EOS]


def even_tokens(completion_ids, **kwargs):
    """Fraction of even token ids; None (no opinion) when the first token is a multiple of 7."""
    return [None if ids[0] % 7 == 0 else sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]


def near_target_length(completions, target, **kwargs):
    """Reads the dataset's `target` column: 1 / (1 + |characters - target|) (an assistant message's content)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 / (1.0 + abs(len(text) - t)) for text, t in zip(texts, target)]


def _prompts(n: int = 8, chat: bool = False) -> list[dict]:
    words = ["sky", "fox", "robot", "count", "blue", "grass", "tree", "sun"]
    texts = [f"Tell me about the {words[i % len(words)]} number {i}" + " again" * (i % 3) for i in range(n)]
    if chat:
        return [{"prompt": [{"role": "user", "content": text}], "target": 5 + 3 * i} for i, text in enumerate(texts)]
    return [{"prompt": text, "target": 5 + 3 * i} for i, text in enumerate(texts)]


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _settings(tmp_path, name, **extra):
    settings = dict(
        output_dir=str(tmp_path / name), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, max_steps=2,
        logging_steps=1, save_strategy="no", per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_new_tokens=MAX_NEW, max_length=20, learning_rate=1e-2, seed=0, gradient_checkpointing=False,
    )
    return {**settings, **extra}


def _reward_funcs(tmp_path, with_model: bool) -> list:
    funcs = [even_tokens, near_target_length]
    if with_model:
        folder = tmp_path / "reward-model"
        funcs.append(str(folder) if folder.exists() else save_reward_model(folder))
    return funcs


def _run_trl(tmp_path, monkeypatch, with_model, chat=False, lora=False, **extra):
    import transformers
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        completions = [fixed_completion(ids, i) for i, ids in enumerate(rows)]
        width = max(len(c) for c in completions)
        padded = torch.tensor([c + [PAD] * (width - len(c)) for c in completions])
        return torch.cat([input_ids, padded.to(input_ids.device)], dim=1)

    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "generate", generate)
    losses = []
    original_step = OnlineDPOTrainer.training_step

    def training_step(self, *args, **kwargs):
        loss = original_step(self, *args, **kwargs)
        losses.append(float(loss))
        return loss

    monkeypatch.setattr(OnlineDPOTrainer, "training_step", training_step)
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = OnlineDPOTrainer(model=MODEL, reward_funcs=_reward_funcs(tmp_path, with_model),
                                   args=OnlineDPOConfig(**_settings(tmp_path, "trl", **extra)),
                                   train_dataset=Dataset.from_list(_prompts(chat=chat)), processing_class=tokenizer,
                                   peft_config=_lora() if lora else None)
        if lora:  # peft's random initial A, given to both
            trainer.model.save_pretrained(str(tmp_path / "initial-adapter"))
        trainer.train()
    logs = trainer.state.log_history[:-1]
    accumulation = trainer.args.gradient_accumulation_steps
    for step, log in enumerate(logs):  # TRL logs the loss rounded to 4 digits: the steps' own values instead
        log["loss"] = sum(losses[step * accumulation : (step + 1) * accumulation])
    return logs


def _run_ours(tmp_path, with_model, chat=False, lora=False, **extra):
    from datasets import Dataset
    from hfnative.converters.peft import load_adapter_weights
    from hfnative.generation import Rollouts

    trainer = hfnative.OnlineDPOTrainer(model=MODEL, reward_funcs=_reward_funcs(tmp_path, with_model),
                                        args=hfnative.OnlineDPOConfig(**_settings(tmp_path, "ours", **extra)),
                                        train_dataset=Dataset.from_list(_prompts(chat=chat)),
                                        peft_config=_lora() if lora else None)
    if lora:
        assert trainer.ref_model is None  # the base with the adapters off
        load_adapter_weights(trainer.converted, tmp_path / "initial-adapter")

    def generate(prompts, sampling):
        completions = [fixed_completion(list(p), i) for i, p in enumerate(prompts)]
        finish = ["stop" if c[-1] == EOS else "length" for c in completions]
        return Rollouts(completions, [[0.0] * len(c) for c in completions], finish)

    trainer.objective.engine.generate = generate
    trainer.train()
    return trainer.state.log_history[:-1]


def assert_steps_equal(ours: list[dict], theirs: list[dict]) -> list[float]:
    """Every key TRL logged, ours equal to it: 1e-5 relative at step 1 (the same weights), 1e-4 after an update
    (the update magnifies round-off where gradients are near zero). Returns each step's largest relative
    difference (over values above 1e-3)."""
    assert len(ours) == len(theirs) == 2
    worst = [0.0, 0.0]
    for step, (mine, reference) in enumerate(zip(ours, theirs), start=1):
        names = set(reference) - {"epoch"}
        assert names <= set(mine), f"step {step}: missing {sorted(names - set(mine))}"
        tolerance = 1e-5 if step == 1 else 1e-4
        for name in sorted(names):
            assert mine[name] == pytest.approx(reference[name], abs=1e-6, rel=tolerance), (step, name)
            if abs(reference[name]) > 1e-3:
                worst[step - 1] = max(worst[step - 1], abs(mine[name] - reference[name]) / abs(reference[name]))
    return worst


@pytest.mark.parametrize(
    "extra",
    [
        dict(loss_type="sigmoid", beta=0.1, missing_eos_penalty=1.0, reward_weights=[1.0, 0.5, 2.0]),
        dict(loss_type="ipo", beta=0.5, gradient_accumulation_steps=1, per_device_train_batch_size=4, chat=True,
             lora=True, reward_weights=[0.5, 1.0, 1.0]),
    ],
    ids=lambda extra: "-".join(f"{k}={v}" for k, v in extra.items()),
)
def test_training_equals_trl_on_fixed_completions(tmp_path, monkeypatch, extra):
    with_model = len(extra.get("reward_weights") or []) == 3
    theirs = _run_trl(tmp_path, monkeypatch, with_model, **extra)
    ours = _run_ours(tmp_path, with_model, **extra)
    worst = assert_steps_equal(ours, theirs)
    print(f"largest relative difference against TRL: step 1 {worst[0]:.1e}, step 2 {worst[1]:.1e}")
    for key in ("objective/kl", "objective/scores_margin", "val/contain_eos_token", "beta", "rewards/accuracies"):
        assert key in theirs[0]


# --- the pieces ----------------------------------------------------------------------------------------------

def test_pairs_and_losses_follow_trls_rules():
    from hfnative.trainers.algorithms.online_dpo import online_dpo_losses, pick_pairs

    chosen, rejected = pick_pairs(torch.tensor([1.0, 0.0, 2.0, 3.0, 0.0, 2.0]))  # ties go to the first
    assert chosen.tolist() == [3, 1, 2] and rejected.tolist() == [0, 4, 5]
    c, r = torch.tensor([0.3, -0.2]), torch.tensor([0.1, 0.4])
    torch.testing.assert_close(online_dpo_losses(c, r, 0.1, "sigmoid"), -torch.nn.functional.logsigmoid(0.1 * (c - r)))
    torch.testing.assert_close(online_dpo_losses(c, r, 0.5, "ipo"), (c - r - 1 / (2 * 0.5)) ** 2)


def test_config_has_trls_fields_and_defaults():
    from trl.experimental.online_dpo import OnlineDPOConfig

    theirs, ours = OnlineDPOConfig("unused", use_cpu=True), hfnative.OnlineDPOConfig("unused", use_cpu=True)
    names = {f.name for f in dataclasses.fields(theirs)} - {"accelerator_config"}
    assert names <= {f.name for f in dataclasses.fields(ours)}
    assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs, n) for n in names}
    assert ours.beta == 0.1 and ours.learning_rate == 5e-7 and ours.temperature == 0.9
    assert not ours.remove_unused_columns
    assert hfnative.OnlineDPOConfig("unused", use_cpu=True, beta=[0.1, 0.2]).beta == [0.1, 0.2]
    with pytest.warns(UserWarning, match="max_new_tokens"):
        hfnative.OnlineDPOConfig("unused", use_cpu=True, max_new_tokens=64, max_length=64)
    from hfnative.trainers import OnlineDPOConfig as Config, OnlineDPOTrainer  # noqa: F401  (both import paths)

    assert Config is hfnative.OnlineDPOConfig


def test_every_config_field_is_honoured_refused_or_listed():
    """test_no_silent_settings' audit, on OnlineDPOConfig's own fields."""
    from test_no_silent_settings import names_read_by_the_library
    from hfnative.trainers.running.settings_check import CONFIG_NO_EFFECT, CONFIG_REFUSED, check_settings

    base = {f.name for f in dataclasses.fields(hfnative.TrainingArguments)}
    own = {f.name for f in dataclasses.fields(hfnative.OnlineDPOConfig)} - base
    read = names_read_by_the_library()
    assert not sorted(n for n in own if n not in read and n not in CONFIG_NO_EFFECT and n not in CONFIG_REFUSED)
    check_settings(hfnative.OnlineDPOConfig("unused", use_cpu=True))


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(loss_type="hinge"), "loss_type='hinge'"),
        (dict(use_vllm=True), "use_vllm=True"),
        (dict(vllm_structured_outputs_regex="[a-z]+"), "vllm_structured_outputs_regex="),
        (dict(generation_kwargs={"num_beams": 2}), "generation_kwargs\\['num_beams'\\]"),
        (dict(eval_strategy="steps"), "evaluation"),
        (dict(reward_model_path="some/reward-model"), "reward_model_path="),
    ],
)
def test_what_is_not_run_is_refused(tmp_path, settings, message):
    from datasets import Dataset

    eval_dataset = Dataset.from_list(_prompts(2)) if "eval_strategy" in settings else None
    with pytest.raises(ValueError, match=message):
        hfnative.OnlineDPOTrainer(model=MODEL, reward_funcs=[even_tokens],
                                  args=hfnative.OnlineDPOConfig(**_settings(tmp_path, "x", **settings)),
                                  train_dataset=Dataset.from_list(_prompts()), eval_dataset=eval_dataset)
    with pytest.raises(ValueError, match="reward_funcs"):
        hfnative.OnlineDPOTrainer(model=MODEL, args=hfnative.OnlineDPOConfig(**_settings(tmp_path, "x")),
                                  train_dataset=Dataset.from_list(_prompts()))


def test_reward_model_path_alone_is_the_reward(tmp_path):
    from datasets import Dataset

    folder = save_reward_model(tmp_path / "reward-model")
    trainer = hfnative.OnlineDPOTrainer(model=MODEL, args=hfnative.OnlineDPOConfig(**_settings(
        tmp_path, "x", reward_model_path=folder)), train_dataset=Dataset.from_list(_prompts()))
    assert len(trainer.reward_funcs) == 1 and isinstance(trainer.reward_funcs[0], torch.nn.Module)


# --- a sampled run ---------------------------------------------------------------------------------------------

def test_sampled_run_trains_and_logs_finite_metrics(tmp_path):
    """The native engine samples (temperature, per-row streams), a reward callable scores: three steps, two different
    samples per prompt, a list of betas (one per epoch), every metric finite, no KL at the first step (the policy is
    its reference), the weights moved; resumed from its step-2 checkpoint, step 3 is the same."""
    from datasets import Dataset

    def build():
        args = hfnative.OnlineDPOConfig(**_settings(tmp_path, "sampled", max_steps=3, num_train_epochs=3,
                                                     per_device_train_batch_size=2, gradient_accumulation_steps=1,
                                                     beta=[0.1, 0.3], missing_eos_penalty=0.5, save_strategy="steps",
                                                     save_steps=2))
        return hfnative.OnlineDPOTrainer(model=MODEL, reward_funcs=near_target_length, args=args,
                                         train_dataset=Dataset.from_list(_prompts(4)))

    trainer = build()
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    made, generate_and_pair = [], trainer.objective.generate_and_pair
    trainer.objective.generate_and_pair = lambda rows, place: made.append(generate_and_pair(rows, place)) or made[-1]
    trainer.train()
    logs = trainer.state.log_history[:-1]
    assert len(logs) == 3
    for batch in made:  # each prompt's two samples differ (the rows draw from their own streams)
        B = batch["chosen_rows"].numel()
        assert not torch.equal(batch["input_ids"][:B], batch["input_ids"][B:])
        assert sorted(batch["chosen_rows"].tolist() + batch["rejected_rows"].tolist()) == list(range(2 * B))
    for log in logs:
        for key in ("loss", "grad_norm", "objective/kl", "objective/entropy", "objective/scores", "rewards/margins",
                    "logps/chosen", "val/contain_eos_token", "beta"):
            assert math.isfinite(log[key]), (key, log)
    assert [log["beta"] for log in logs] == [pytest.approx(0.1), pytest.approx(0.1), pytest.approx(0.3)]
    assert logs[0]["objective/entropy"] > 0
    assert logs[0]["objective/kl"] == pytest.approx(0, abs=1e-5)
    assert logs[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert logs[2]["objective/kl"] != 0
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    # resumed from checkpoint-2, the third step samples and trains as the uninterrupted run did
    assert (tmp_path / "sampled" / "README.md").exists()  # the model card, refreshed at the checkpoint as TRL's
    resumed = build()
    resumed.train(resume_from_checkpoint=str(tmp_path / "sampled" / "checkpoint-2"))
    third = resumed.state.log_history[-2]
    assert third["step"] == 3
    for key, value in logs[2].items():
        if not key.startswith("perf/"):
            assert third[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


# --- layouts: DDP and FSDP2 on 2 gloo processes against one process ------------------------------------------------

def test_layouts_train_like_one_process(tmp_path):
    """Each rank completes, scores and pairs its own 2 prompts; one process holds the 4 prompts in one micro-batch
    (the loss a mean over the pairs, the metrics means): 2 steps equal within 1e-5 relative. A third cell samples its
    completions with the native engine under FSDP2 and trains, every logged number finite."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import _online_dpo_worker as worker

    here = Path(__file__).resolve().parent
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(here / "_online_dpo_worker.py"), str(tmp_path / "launched"), *worker.CELLS, *worker.SAMPLED]
    result = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(here)),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    for cell in worker.CELLS:
        trainer = worker.trainer_for(cell, str(tmp_path / "one" / cell), layout=None)
        trainer.train()
        expected = trainer.state.log_history[:-1]
        got = [e for e in json.loads((tmp_path / "launched" / cell / "log.json").read_text()) if "loss" in e]
        assert len(got) == len(expected) == worker.STEPS
        assert expected[1]["objective/kl"] != 0 and expected[1]["loss"] != expected[0]["loss"]  # it trained
        for mine, theirs in zip(got, expected):
            keys = [k for k in theirs if not k.startswith("perf/")]
            assert set(keys) <= set(mine)
            assert_logged_close(mine, theirs, (cell, theirs["step"]))
    for cell in worker.SAMPLED:  # sampled under the layout: it trains, every logged number finite
        got = [e for e in json.loads((tmp_path / "launched" / cell / "log.json").read_text()) if "loss" in e]
        assert len(got) == worker.STEPS and got[1]["objective/kl"] != 0
        assert all(math.isfinite(value) for entry in got for value in entry.values()), got
