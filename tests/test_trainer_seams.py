"""What TRL users override and plug in keeps working on hfnative's one loop: a ``compute_loss``
override written against transformers models (``model(**inputs).loss``), and a custom callback
that reads the logs and stops training. TRL's SFTTrainer running the same code is the oracle."""

import pytest
from transformers import AutoTokenizer, TrainerCallback

import hfnative
from test_sft_vs_trl import MODEL, STEPS, _config, _dataset


def _with_override(module):
    class OverridingTrainer(module.SFTTrainer):
        calls = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            type(self).calls += 1
            outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
            assert outputs.logits.shape[:2] == inputs["input_ids"].shape
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    return OverridingTrainer


@pytest.mark.parametrize("accumulation", [1, 2])
def test_compute_loss_override_takes_effect_and_matches_trl(accumulation, tmp_path):
    trl = pytest.importorskip("trl")
    logs = {}
    for module in (trl, hfnative):
        trainer_class = _with_override(module)
        trainer = trainer_class(
            model=MODEL,
            args=_config(module, tmp_path / module.__name__, accumulation),
            train_dataset=_dataset("prompt-completion"),
            processing_class=AutoTokenizer.from_pretrained(MODEL),
        )
        trainer.train()
        assert trainer_class.calls == STEPS * accumulation
        logs[module.__name__] = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs["hfnative"]) == len(logs["trl"]) == STEPS
    for mine, reference in zip(logs["hfnative"], logs["trl"]):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-4), (reference["step"], key)


class StopAfterThreeSteps(TrainerCallback):
    def __init__(self):
        self.logged, self.steps_ended = [], 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_ended += 1
        if state.global_step == 3:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))


def test_custom_callback_sees_logs_and_stops_training(tmp_path):
    callback = StopAfterThreeSteps()
    trainer = hfnative.SFTTrainer(
        model=MODEL,
        args=_config(hfnative, tmp_path, 1),
        train_dataset=_dataset("messages"),
        callbacks=[callback],
    )
    result = trainer.train()
    assert result.global_step == 3 and callback.steps_ended == 3
    step_logs = [entry for entry in callback.logged if "loss" in entry]
    assert len(step_logs) == 3
    for entry in step_logs:
        assert {"loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens", "epoch"} <= set(entry)
    assert [entry["num_tokens"] for entry in step_logs] == sorted(entry["num_tokens"] for entry in step_logs)


def test_objective_auxiliary_models_are_loaded_frozen_and_placed_like_the_policy(tmp_path):
    from hfnative.trainers.algorithms.sft import SFTObjective

    class WithTeacher(SFTObjective):
        def __init__(self, context):
            super().__init__(context)
            self.auxiliary_models["teacher"] = MODEL

    class TeacherTrainer(hfnative.SFTTrainer):
        def _make_objective(self):
            return WithTeacher(self.context)  # an objective is built on the trainer's context

    trainer = TeacherTrainer(model=MODEL, args=_config(hfnative, tmp_path, 1), train_dataset=_dataset("text"))
    teacher = trainer.objective.auxiliary_models["teacher"]
    assert type(teacher) is type(trainer.model) and teacher is not trainer.model
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert {p.device for p in teacher.parameters()} == {trainer.device}
    for (name, theirs), ours in zip(teacher.state_dict().items(), trainer.model.state_dict().values()):
        assert (theirs == ours).all(), name  # same checkpoint, same weights
