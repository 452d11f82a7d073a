"""compute_metrics in evaluation: every trainer of TRL 1.16 that calls it (SFT, DPO, KTO, RewardTrainer, GKD and the
experimental ORPO and CPO) runs beside hfnative's on the same model, rows and eval batch size (4 eval rows in batches
of 3: a last batch of one). The EvalPrediction each hands the user's function has the same shapes and values (fp32
round-off), and what the function returns is logged as eval_<name> with the same value.

What TRL hands it, per trainer: SFT, DPO, KTO and GKD a plain forward's logits [N, S, V] and labels (DPO and KTO the
input ids), padded across batches with -100; RewardTrainer the rewards [N, 1] (chosen rows, then rejected) and
label_ids=(); ORPO and CPO each batch's logged mean logits (chosen, rejected) and zeros. A dataset whose length is not a
multiple of the batch size has its last batch's rows cut to that remainder (accelerate's gather_for_metrics).
TRL's GKD batches are left-padded and hfnative's right-padded: there the rows' label positions are compared.
(GRPO, RLOO and DistillationTrainer take no compute_metrics; TRL's OnlineDPOTrainer takes one, but its evaluation fails
on a prompt-only batch, and hfnative refuses evaluation there.)
"""

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfnative

trl = pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
DATA = ROOT / "examples" / "data"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _jsonl(name: str) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f]


def _datasets(name: str) -> tuple[list[dict], list[dict]]:
    if name == "KTO":
        pairs = _jsonl("preference.jsonl")[:4]
        rows = [{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in pairs]
        rows += [{"prompt": r["prompt"], "completion": r["rejected"], "label": False} for r in pairs]
        return rows, rows[2:6]
    rows = _jsonl("sft_messages.jsonl" if name in ("SFT", "GKD") else "preference.jsonl")
    return rows[:4], rows[8:12]


def _class(module, name: str):
    if module is hfnative:
        return getattr(hfnative, name)
    for path in ("trl", "trl.experimental.orpo", "trl.experimental.cpo", "trl.experimental.gkd"):
        found = getattr(importlib.import_module(path), name, None)
        if found is not None:
            return found
    raise AttributeError(name)


def _evaluate(module, name: str, tmp_path) -> tuple[dict, dict]:
    """The trainer's evaluate() with a compute_metrics that keeps what it is handed; (that, the metrics)."""
    seen = {}

    def compute_metrics(prediction):
        seen["predictions"], seen["label_ids"] = np.asarray(prediction.predictions), prediction.label_ids
        return {"my_metric": float(np.asarray(prediction.predictions, dtype=np.float64).mean())}

    train, evaluation = _datasets(name)
    # a reward model is made from the checkpoint's name (its new score head drawn alike under the seed)
    model = MODEL if name == "Reward" else AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    extra = {"teacher_model": AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)} if name == "GKD" else {}
    args = _class(module, f"{name}Config")(
        output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none", max_steps=1,
        per_device_train_batch_size=2, per_device_eval_batch_size=3, save_strategy="no", seed=3,
    )
    trainer = _class(module, f"{name}Trainer")(
        model=model, args=args, train_dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(evaluation),
        processing_class=AutoTokenizer.from_pretrained(MODEL), compute_metrics=compute_metrics, **extra,
    )
    return seen, trainer.evaluate()


@pytest.mark.parametrize("name", ["SFT", "DPO", "KTO", "Reward", "ORPO", "CPO", "GKD"])
def test_compute_metrics_gets_what_trl_hands_it(name, tmp_path):
    theirs, their_metrics = _evaluate(trl, name, tmp_path)
    ours, our_metrics = _evaluate(hfnative, name, tmp_path)
    assert ours["predictions"].shape == theirs["predictions"].shape
    if name == "Reward":
        assert ours["label_ids"] == theirs["label_ids"] == ()
    else:
        assert ours["label_ids"].shape == theirs["label_ids"].shape
    if name == "GKD":  # left-padded rows there, right-padded here: each row's label positions
        for row in range(len(theirs["label_ids"])):
            their_positions, our_positions = theirs["label_ids"][row] != -100, ours["label_ids"][row] != -100
            assert np.array_equal(theirs["label_ids"][row][their_positions], ours["label_ids"][row][our_positions])
            np.testing.assert_allclose(ours["predictions"][row][our_positions],
                                       theirs["predictions"][row][their_positions], atol=1e-4)
    else:
        if name != "Reward":
            assert np.array_equal(ours["label_ids"], theirs["label_ids"])
        np.testing.assert_allclose(ours["predictions"], theirs["predictions"], atol=1e-4, rtol=1e-4)
        assert our_metrics["eval_my_metric"] == pytest.approx(their_metrics["eval_my_metric"], rel=1e-4, abs=1e-7)
    assert our_metrics["eval_loss"] == pytest.approx(their_metrics["eval_loss"], rel=1e-4, abs=1e-6)


def _evaluation_settings(module, name: str, tmp_path) -> dict:
    """What compute_metrics is handed, and what evaluate / predict return, under transformers' evaluation settings:
    include_for_metrics (inputs and losses), batch_eval_metrics (called per batch), eval_do_concat_batches=False (a
    list per batch), eval_accumulation_steps (no change to the values)."""
    calls = []

    def compute_metrics(prediction, compute_result=None):
        calls.append(dict(compute_result=compute_result, predictions=prediction.predictions,
                          label_ids=prediction.label_ids, losses=prediction.losses, inputs=prediction.inputs))
        return {"calls": len(calls), "first": torch.as_tensor(np.asarray(prediction.predictions[0])).flatten()[0]}

    train, evaluation = _datasets(name)
    args = _class(module, f"{name}Config")(
        output_dir=str(tmp_path / module.__name__), use_cpu=True, bf16=False, report_to="none", max_steps=1,
        per_device_train_batch_size=2, per_device_eval_batch_size=3, save_strategy="no", seed=3,
        include_for_metrics=["inputs", "loss"], eval_accumulation_steps=1,
    )
    trainer = _class(module, f"{name}Trainer")(
        model=AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32), args=args,
        train_dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(evaluation),
        processing_class=AutoTokenizer.from_pretrained(MODEL), compute_metrics=compute_metrics,
    )
    seen = {}
    for setting, changes in (("whole", {}), ("listed", {"eval_do_concat_batches": False}),
                             ("per_batch", {"batch_eval_metrics": True})):
        for field, value in changes.items():
            setattr(trainer.args, field, value)
        metrics = trainer.evaluate()
        seen[setting] = (calls[:], metrics)
        calls.clear()
        for field in changes:
            setattr(trainer.args, field, getattr(type(trainer.args), field))
    trainer.args.batch_eval_metrics = True
    seen["predict"] = (calls, trainer.predict(trainer.eval_dataset))
    return seen


def _as_array(value):
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


@pytest.mark.parametrize("name", ["SFT", "DPO"])
def test_evaluation_settings_hand_compute_metrics_what_trl_does(name, tmp_path):
    ours, theirs = _evaluation_settings(hfnative, name, tmp_path), _evaluation_settings(trl, name, tmp_path)

    # include_for_metrics: each row's input ids (padded across batches with -100) and its batch's loss
    (mine,), my_metrics = ours["whole"][0], ours["whole"][1]
    (their,), their_metrics = theirs["whole"][0], theirs["whole"][1]
    assert mine["compute_result"] is their["compute_result"] is None
    assert np.array_equal(mine["inputs"], their["inputs"]) and np.array_equal(mine["label_ids"], their["label_ids"])
    np.testing.assert_allclose(mine["predictions"], their["predictions"], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(mine["losses"], their["losses"], rtol=1e-5)
    assert len(mine["losses"]) == 4  # one per evaluated sample: 3 + 1
    assert my_metrics["eval_loss"] == pytest.approx(their_metrics["eval_loss"], rel=1e-5)

    # eval_do_concat_batches=False: a list of each batch's arrays
    (mine,), (their,) = ours["listed"][0], theirs["listed"][0]
    for key in ("predictions", "label_ids", "inputs", "losses"):
        assert isinstance(mine[key], list) and isinstance(their[key], list) and len(mine[key]) == len(their[key]) == 2
        for my_batch, their_batch in zip(mine[key], their[key]):
            np.testing.assert_allclose(my_batch, their_batch, atol=1e-4, rtol=1e-4)

    # batch_eval_metrics: a call per batch (compute_result on the last), the batch as collated for "inputs", the
    # last call's result as the metrics; evaluate keeps no predictions, predict keeps them
    for setting in ("per_batch", "predict"):
        my_calls, their_calls = ours[setting][0], theirs[setting][0]
        assert [c["compute_result"] for c in my_calls] == [c["compute_result"] for c in their_calls] == [False, True]
        for mine, their in zip(my_calls, their_calls):
            np.testing.assert_allclose(_as_array(mine["predictions"]), _as_array(their["predictions"]), atol=1e-4)
            assert np.array_equal(_as_array(mine["label_ids"]), _as_array(their["label_ids"]))
            np.testing.assert_allclose(_as_array(mine["losses"]), _as_array(their["losses"]), rtol=1e-5)
            assert mine["inputs"].keys() == their["inputs"].keys()
            assert np.array_equal(_as_array(mine["inputs"]["input_ids"]), _as_array(their["inputs"]["input_ids"]))
    my_metrics, their_metrics = ours["per_batch"][1], theirs["per_batch"][1]
    assert my_metrics["eval_calls"] == their_metrics["eval_calls"] == 2
    assert my_metrics["eval_first"] == pytest.approx(their_metrics["eval_first"], abs=1e-4)
    my_output, their_output = ours["predict"][1], theirs["predict"][1]
    np.testing.assert_allclose(my_output.predictions, their_output.predictions, atol=1e-4, rtol=1e-4)
    assert my_output.metrics["test_calls"] == their_output.metrics["test_calls"] == 2


def test_per_batch_evaluation_settings_are_refused_over_ranks(tmp_path):
    """batch_eval_metrics and eval_do_concat_batches=False need each batch's predictions from every rank as it is
    made; a multi-process run gathers them when evaluation ends, so it refuses both, naming them (when the trainer is
    made if the loop evaluates, and at evaluate()); bf16_full_eval's in-place cast too."""
    from types import SimpleNamespace

    train, evaluation = _datasets("SFT")
    trainer = hfnative.SFTTrainer(
        model=MODEL, args=hfnative.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                             batch_eval_metrics=True, eval_do_concat_batches=False),
        train_dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(evaluation),
        processing_class=AutoTokenizer.from_pretrained(MODEL), compute_metrics=lambda p, compute_result: {})
    assert trainer._evaluation_conflicts(evaluating=True) == []
    trainer.distributed = SimpleNamespace(world_size=2)
    assert trainer._evaluation_conflicts(evaluating=False) == []  # eval_strategy="no": the loop never evaluates
    trainer.args.eval_strategy = "steps"  # when the trainer is made, if the loop will evaluate; at each evaluate()
    for evaluating in (False, True):
        conflicts = trainer._evaluation_conflicts(evaluating)
        assert [c.split("=")[0] for c in conflicts] == ["batch_eval_metrics", "eval_do_concat_batches"]
        assert all("2 processes" in c for c in conflicts)
    trainer.args.bf16_full_eval = True  # an in-place cast of one process's model
    assert trainer._evaluation_conflicts(False)[0].startswith("bf16_full_eval=True in a run of 2 processes")
