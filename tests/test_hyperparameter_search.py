"""Trainer.hyperparameter_search with optuna, against transformers' Trainer running the same search: the same
sampler (seeded TPE) draws the same learning rates, each trial's evaluations report the same intermediate values
(losses equal to fp32 round-off), a pruner stops the same trials, the best run is the same, and each trial's
checkpoints go to output_dir/run-{number}. model_init may take the trial.

Not compared: a drawn ``seed``. hfnative orders a trial's data by its own seed; transformers orders it by the global
generator seeded before the trial's arguments are set (the previous trial's seed)."""

import optuna
import pytest
import torch
import transformers
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfnative
from test_sft_vs_trl import MODEL, _rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data() -> Dataset:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    ids = [tokenizer(row["text"])["input_ids"][:16] for row in _rows("sft_text.jsonl", 40)]
    return Dataset.from_list([{"input_ids": i, "labels": i} for i in ids if len(i) == 16])


def _search(module, tmp_path, pruner=None):
    """Three trials of a learning-rate search; (best run, each trial's state, parameters, value, intermediate
    values, the trial seeds model_init saw, the output folders)."""
    data = _data()
    seen = []

    def model_init(trial):
        seen.append(trial is not None)
        return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

    args = module.TrainingArguments(
        output_dir=str(tmp_path / module.__name__), use_cpu=True, report_to="none", max_steps=3,
        per_device_train_batch_size=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=3,
        logging_steps=1, disable_tqdm=True, seed=7)
    trainer = module.Trainer(model_init=model_init, args=args, train_dataset=data.select(range(12)),
                             eval_dataset=data.select(range(12, 16)))
    storage = optuna.storages.InMemoryStorage()

    def space(trial):
        return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True),
                "gradient_accumulation_steps": trial.suggest_int("gradient_accumulation_steps", 1, 2)}

    best = trainer.hyperparameter_search(hp_space=space, n_trials=3, direction="minimize",
                                         sampler=optuna.samplers.TPESampler(seed=0), pruner=pruner, storage=storage,
                                         study_name="search")
    trials = optuna.load_study(study_name="search", storage=storage).trials
    folders = sorted(p.name for p in (tmp_path / module.__name__).iterdir() if p.is_dir())
    return best, [(t.state, t.params, t.value, dict(t.intermediate_values)) for t in trials], seen, folders


def _assert_same_trials(ours, theirs):
    assert len(ours) == len(theirs) == 3
    for (state, params, value, steps), (their_state, their_params, their_value, their_steps) in zip(ours, theirs):
        assert state == their_state and params == their_params
        assert (value is None) == (their_value is None) and (value is None or value == pytest.approx(their_value, rel=1e-5))
        assert steps.keys() == their_steps.keys()
        assert list(steps.values()) == pytest.approx(list(their_steps.values()), rel=1e-5)


def test_search_as_transformers_runs_it(tmp_path):
    ours, theirs = _search(hfnative, tmp_path), _search(transformers, tmp_path)
    (best, trials, seen, folders), (their_best, their_trials, their_seen, their_folders) = ours, theirs
    _assert_same_trials(trials, their_trials)
    assert best.run_id == their_best.run_id and best.hyperparameters == their_best.hyperparameters
    assert best.objective == pytest.approx(their_best.objective, rel=1e-5)
    assert seen == their_seen == [False, True, True, True]  # model_init(None) when the trainer is made, then each trial
    assert folders == their_folders == ["run-0", "run-1", "run-2"]
    assert (tmp_path / "hfnative" / "run-1" / "checkpoint-3" / "model.safetensors").is_file()


def test_a_pruner_stops_the_trials_transformers_stops(tmp_path):
    pruner = optuna.pruners.ThresholdPruner(upper=6.68)  # the first evaluation of two of the three trials is above
    (_, trials, _, _), (_, their_trials, _, _) = _search(hfnative, tmp_path, pruner), _search(transformers, tmp_path, pruner)
    _assert_same_trials(trials, their_trials)
    assert [t[0] for t in trials].count(optuna.trial.TrialState.PRUNED) == 2


def test_search_needs_model_init_and_optuna_backend(tmp_path):
    args = hfnative.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = hfnative.Trainer(model=MODEL, args=args, train_dataset=_data())
    with pytest.raises(RuntimeError, match="pass your model through a model_init function"):
        trainer.hyperparameter_search(n_trials=1)
    with pytest.raises(ValueError, match="backend='ray'.*with optuna"):
        trainer.hyperparameter_search(n_trials=1, backend="ray")


def test_model_init_model_gets_neftune_as_transformers(tmp_path):
    """train() remakes the model with model_init before NEFTune's hook goes on its embeddings (transformers' order):
    the noised run's losses equal transformers' Trainer's, and differ from a run without noise."""
    data = _data()

    def losses(module, alpha):
        args = module.TrainingArguments(output_dir=str(tmp_path / f"{module.__name__}-{alpha}"), use_cpu=True,
                                        report_to="none", max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                                        save_strategy="no", disable_tqdm=True, neftune_noise_alpha=alpha)
        trainer = module.Trainer(model_init=lambda: AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
                                 args=args, train_dataset=data)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    noised = losses(hfnative, 5.0)
    assert noised == pytest.approx(losses(transformers, 5.0), rel=1e-5)
    assert noised != pytest.approx(losses(hfnative, None), rel=1e-4)
