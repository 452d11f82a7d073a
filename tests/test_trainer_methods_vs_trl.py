"""transformers' Trainer methods that training scripts call around train(): the metrics files (log_metrics,
save_metrics, save_state, as the alignment handbook's and transformers' example scripts do), predict, the
optimizer's groups and learning rates, the trainable-parameter count, TRL's create_model_card.

Oracle: TRL's SFTTrainer running the same calls on the same data and settings.
"""

import contextlib
import io
import json

import numpy as np
import pytest
from transformers import AutoTokenizer, TrainerCallback

import hfnative
from test_sft_vs_trl import MODEL, _config, _dataset

trl = pytest.importorskip("trl")


def _script(module, tmp_path):
    """A training script's calls, as the alignment handbook's run_sft.py makes them; what each returned."""
    data = _dataset("prompt-completion")
    config = _config(module, tmp_path / module.__name__, 1, eval_strategy="no")
    config.max_steps = 2
    seen = []

    class InTrain(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(trainer.is_in_train)

    trainer = module.SFTTrainer(model=MODEL, args=config, train_dataset=data.select(range(12)),
                                eval_dataset=data.select(range(12, 19)), processing_class=AutoTokenizer.from_pretrained(MODEL),
                                callbacks=[InTrain()])
    seen.append(trainer.is_in_train)
    result = trainer.train()
    seen.append(trainer.is_in_train)
    with trainer.compute_loss_context_manager(), trainer.autocast_smart_context_manager():
        pass
    metrics = dict(result.metrics, train_samples=12)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    evaluated = trainer.evaluate()
    trainer.save_metrics("eval", evaluated)
    predicted = trainer.predict(trainer.eval_dataset)  # prepared: TRL's predict takes no raw rows
    trainer.create_model_card(model_name="tiny-sft", tags=["handbook"])
    group = trainer.get_optimizer_group(next(p for p in trainer.model.parameters() if p.requires_grad))
    setup = dict(in_train=seen, total_batch=trainer.get_total_train_batch_size(trainer.args),
                 sizes=(trainer.get_tp_size(), trainer.get_cp_size(), trainer.get_sp_size()),
                 examples=trainer.num_examples(trainer.get_train_dataloader()),
                 engines=(trainer.is_deepspeed_enabled, trainer.is_fsdp_enabled, trainer.is_model_parallel))
    return dict(
        trainer=trainer, printed=printed.getvalue(), predicted=predicted, group=group, setup=setup,
        files={name: json.loads((tmp_path / module.__name__ / name).read_text())
               for name in ("train_results.json", "eval_results.json", "all_results.json", "trainer_state.json")},
        card=(tmp_path / module.__name__ / "README.md").read_text(),
    )


def test_script_calls_around_train_match_trl(tmp_path):
    ours, theirs = _script(hfnative, tmp_path), _script(trl, tmp_path)

    # metrics files: the same keys, the same step count and losses
    for name in ("train_results.json", "eval_results.json", "all_results.json"):
        assert ours["files"][name].keys() == theirs["files"][name].keys(), name
    assert ours["files"]["all_results.json"]["train_samples"] == 12
    for key in ("train_loss", "eval_loss"):
        assert ours["files"]["all_results.json"][key] == pytest.approx(theirs["files"]["all_results.json"][key], rel=1e-4)
    assert ours["files"]["trainer_state.json"]["global_step"] == theirs["files"]["trainer_state.json"]["global_step"] == 2
    assert ours["printed"].splitlines()[0] == theirs["printed"].splitlines()[0] == "***** train metrics *****"
    assert [line.split("=")[0] for line in ours["printed"].splitlines()] == \
        [line.split("=")[0] for line in theirs["printed"].splitlines()]

    # predict: the evaluation logits and labels of every row, the loss under the test_ prefix
    mine, reference = ours["predicted"], theirs["predicted"]
    assert mine.metrics.keys() == reference.metrics.keys()
    assert mine.metrics["test_loss"] == pytest.approx(reference.metrics["test_loss"], rel=1e-4)
    assert mine.predictions.shape == reference.predictions.shape and mine.predictions.shape[0] == 7
    np.testing.assert_array_equal(mine.label_ids, reference.label_ids)
    scored = reference.label_ids != -100
    np.testing.assert_allclose(mine.predictions[scored], reference.predictions[scored], rtol=1e-4, atol=1e-4)

    # optimizer groups, learning rates, trainable parameters, decayed parameters
    ours_trainer, trl_trainer = ours["trainer"], theirs["trainer"]
    assert ours_trainer.get_learning_rates() == pytest.approx(trl_trainer.get_learning_rates())
    assert ours_trainer.get_num_trainable_parameters() == trl_trainer.get_num_trainable_parameters()

    def decayed(trainer):
        names = set(trainer.get_decay_parameter_names(trainer.model))
        return sum(p.numel() for name, p in trainer.model.named_parameters() if name in names)

    assert decayed(ours_trainer) == decayed(trl_trainer) > 0
    sizes = [[sum(p.numel() for p in params) for params in t.get_optimizer_group()] for t in (ours_trainer, trl_trainer)]
    assert sizes[0] == sizes[1]
    assert ours["group"]["weight_decay"] == theirs["group"]["weight_decay"]
    assert type(ours_trainer).get_optimizer_cls_and_kwargs(ours_trainer.args)[0] is \
        type(trl_trainer).get_optimizer_cls_and_kwargs(trl_trainer.args)[0]

    # what the trainer says of its setup: in train() or not, the global batch, parallel sizes, rows
    assert ours["setup"] == theirs["setup"]
    assert ours["setup"]["in_train"] == [False, True, True, False]

    # TRL's model card: in output_dir, under the name and with the tags given
    for card in (ours["card"], theirs["card"]):
        assert "model_name: tiny-sft" in card and "- handbook" in card


def test_prediction_loss_only_and_before_an_optimizer(tmp_path):
    """prediction_loss_only, as transformers' evaluation loop: predict gives no predictions, the loss only, and
    evaluate does not call compute_metrics (TRL's trainer on the same call is the oracle); raw rows given to predict
    are prepared as evaluation rows. The optimizer's helpers before one exists: transformers' error."""
    calls = []
    outputs = {}
    for module in (hfnative, trl):
        config = _config(module, tmp_path / module.__name__, 1, prediction_loss_only=True)
        data = _dataset("prompt-completion")
        trainer = module.SFTTrainer(model=MODEL, args=config, train_dataset=data, eval_dataset=data.select(range(4)),
                                    processing_class=AutoTokenizer.from_pretrained(MODEL),
                                    compute_metrics=lambda prediction: calls.append(prediction) or {"called": 1.0})
        with pytest.raises(ValueError, match="optimizer is None"):
            trainer.get_learning_rates()
        outputs[module.__name__] = (trainer.evaluate(), trainer.predict(trainer.eval_dataset))
    assert calls == []
    (ours_eval, ours), (theirs_eval, theirs) = outputs["hfnative"], outputs["trl"]
    assert "eval_called" not in ours_eval and ours_eval["eval_loss"] == pytest.approx(theirs_eval["eval_loss"], rel=1e-4)
    assert ours.predictions is None and ours.label_ids is None and theirs.predictions is None
    assert ours.metrics.keys() == theirs.metrics.keys()
    assert ours.metrics["test_loss"] == pytest.approx(theirs.metrics["test_loss"], rel=1e-4)
    assert ours_eval.keys() == theirs_eval.keys()  # evaluated before training: eval_model_preparation_time too
    raw = _dataset("prompt-completion").select(range(4))
    assert hfnative.SFTTrainer(model=MODEL, args=_config(hfnative, tmp_path / "raw", 1, prediction_loss_only=True),
                               train_dataset=raw, processing_class=AutoTokenizer.from_pretrained(MODEL)
                               ).predict(raw).metrics["test_loss"] == pytest.approx(ours.metrics["test_loss"], rel=1e-4)


def test_memory_metrics_as_transformers_reports_them(tmp_path):
    """skip_memory_metrics=False: transformers' memory tracker's figures under the same names (the init stage's with
    the train metrics, in the log too; eval_ and test_ ones in what evaluate and predict return), TRL's trainer on
    the same calls the oracle for the names; the values are this process's resident memory (bytes)."""
    reported = {}
    for module in (hfnative, trl):
        config = _config(module, tmp_path / module.__name__, 1, skip_memory_metrics=False, eval_strategy="no")
        config.max_steps = 1
        data = _dataset("prompt-completion")
        trainer = module.SFTTrainer(model=MODEL, args=config, train_dataset=data.select(range(8)),
                                    eval_dataset=data.select(range(8, 11)),
                                    processing_class=AutoTokenizer.from_pretrained(MODEL))
        train = trainer.train().metrics
        reported[module.__name__] = dict(train=train, logged=trainer.state.log_history[-1], eval=trainer.evaluate(),
                                         test=trainer.predict(trainer.eval_dataset).metrics)
    ours, theirs = reported["hfnative"], reported["trl"]
    memory = lambda metrics: {key for key in metrics if "_mem_" in key}  # noqa: E731
    for stage in ("train", "logged", "eval", "test"):
        assert memory(ours[stage]) == memory(theirs[stage]), stage
    assert {"init_mem_cpu_alloc_delta", "before_init_mem_cpu", "train_mem_cpu_peaked_delta"} <= memory(ours["train"])
    assert {"eval_mem_cpu_alloc_delta", "eval_mem_cpu_peaked_delta"} == memory(ours["eval"])
    assert {"test_mem_cpu_alloc_delta", "test_mem_cpu_peaked_delta"} == memory(ours["test"])
    assert ours["train"]["before_init_mem_cpu"] > 2**20 and ours["train"]["train_mem_cpu_peaked_delta"] >= 0


def test_full_eval_in_bf16_as_trl(tmp_path):
    """bf16_full_eval: evaluate() outside training casts the model to bf16 in place, as transformers' evaluation
    loop does (TRL's trainer the oracle): the same dtype afterwards and the eval loss within bf16's error."""
    import torch

    results = {}
    for module in (hfnative, trl):
        data = _dataset("prompt-completion")
        trainer = module.SFTTrainer(model=MODEL, args=_config(module, tmp_path / module.__name__, 1, bf16_full_eval=True),
                                    train_dataset=data, eval_dataset=data.select(range(6)),
                                    processing_class=AutoTokenizer.from_pretrained(MODEL))
        results[module.__name__] = (trainer.evaluate()["eval_loss"], next(trainer.model.parameters()).dtype)
    (loss, dtype), (their_loss, their_dtype) = results["hfnative"], results["trl"]
    assert dtype == their_dtype == torch.bfloat16
    assert loss == pytest.approx(their_loss, rel=1e-2)

    # a 4-bit (QLoRA) base cannot be cast: refused when the trainer is made, not at its first evaluate()
    from peft import LoraConfig

    with pytest.raises(ValueError, match="bf16_full_eval=True with a 4-bit"):
        hfnative.SFTTrainer(model=MODEL, args=_config(hfnative, tmp_path / "qlora", 1, bf16_full_eval=True,
                                                      model_init_kwargs={"load_in_4bit": True}),
                            train_dataset=_dataset("prompt-completion"), peft_config=LoraConfig(r=4, target_modules="all-linear"),
                            processing_class=AutoTokenizer.from_pretrained(MODEL))


def test_overrides_of_hooks_the_loop_never_calls_are_refused(tmp_path):
    """A subclass overriding transformers' evaluation_loop or _get_train_sampler (hooks hfnative's loop never calls)
    is refused when made, by name and with what to override instead; floating_point_ops, which the loop calls, is
    honoured (state.total_flos counts what the override returns); end() after training is transformers' call."""

    class OwnEvaluation(hfnative.SFTTrainer):
        def evaluation_loop(self, *args, **kwargs):
            raise AssertionError("never reached")

        def _get_train_sampler(self, dataset=None):
            raise AssertionError("never reached")

    data = _dataset("prompt-completion").select(range(6))
    with pytest.raises(ValueError, match=r"OwnEvaluation\.evaluation_loop: .*override prediction_step.*"
                                         r"OwnEvaluation\._get_train_sampler: override get_train_dataloader"):
        OwnEvaluation(model=str(tmp_path / "never-loaded"), args=_config(hfnative, tmp_path, 1), train_dataset=data)

    class OneFlopPerBatch(hfnative.SFTTrainer):
        def floating_point_ops(self, inputs):
            return 1.0

    config = _config(hfnative, tmp_path / "flops", 2)
    config.max_steps = 3
    trainer = OneFlopPerBatch(model=MODEL, args=config, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(MODEL))
    trainer.train()
    assert trainer.state.total_flos == 3 * 2  # steps x micro-batches
    trainer.end()
