"""Pipeline parallel (parallelism_config pp_size / pp_schedule) for SFTTrainer and DPOTrainer, against one process.

Cells (tests/_pipeline_worker.py; one 2-process and one 4-process gloo launch): SFT under PP2 with the GPipe and the
1F1B schedule (and 1F1B with activation checkpointing), PP2 x FSDP2, PP2 x replication and PP4 (GPipe, a block per
stage) on 4 processes, DPO (its reference a frozen copy, split into the same stages) under
PP2 1F1B and PP2 x FSDP2; each 3 steps of 2 accumulated micro-batches (the schedule's micro-batches) over the same
global batches as one process; per-step loss and grad norm within 1e-5 relative of one process's (measured
<= ~1e-6), and every logged metric (SFT's entropy and token accuracy, DPO's rewards, log-probs, logits) too. The PP2 (GPipe) checkpoint at step 2 resumes under FSDP2 on 2 processes,
and the PP2 x FSDP2 one on one process (here): the resumed step equals the uninterrupted one-process step, and the
checkpoints' Hub-format weights (gathered from the stages) equal one process's at the same step.
The refusals (other objectives, DPO's precomputed reference, evaluation, optimizer_in_backward, a training_step
override, TP/CP/EP with PP, tied embeddings, 1F1B with fewer micro-batches than stages) are checked without a launch.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

import _pipeline_worker as worker
from _launch import torchrun
from hfnative.parallel import ParallelDims
from hfnative.parallel.pipeline import check_pipeline_model, stage_layer_ids

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOLERANCE = WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The one-process runs here train with one intra-op thread, as each launched rank does (OMP_NUM_THREADS=1): on
    these tiny models a second thread only waits at every op's barrier."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 4-block Qwen3 with untied embeddings (hidden 32) and the shipped tiny tokenizer."""
    directory = tmp_path_factory.mktemp("pipeline_model")
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "examples" / "tiny-qwen3"))
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def launched(tmp_path_factory, model_dir) -> Path:
    out = tmp_path_factory.mktemp("pipeline_cells")
    for processes in (2, 4):
        cells = [cell for cell, (_, layout, _, _) in worker.CELLS.items() if worker.LAYOUTS[layout][2] == processes]
        torchrun("_pipeline_worker.py", [str(out), str(model_dir), *cells], processes, timeout=600,
                 HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory, model_dir) -> dict[str, Path]:
    """One process over the same global batches, per algorithm: its output folder (log.json; SFT's checkpoint-2)."""
    folders = {}
    for algorithm in ("sft", "dpo"):
        out = folders[algorithm] = tmp_path_factory.mktemp(f"pipeline_reference_{algorithm}")
        trainer = worker.trainer_for(str(out), str(model_dir), save=algorithm == "sft", algorithm=algorithm)
        trainer.train()
        (out / "log.json").write_text(json.dumps(trainer.state.log_history))
    return folders


@pytest.fixture(scope="module")
def reference(references) -> Path:
    return references["sft"]


def _steps(folder: Path) -> list[dict]:
    return [entry for entry in json.loads((folder / "log.json").read_text()) if "loss" in entry]


def _assert_steps_match(mine: list[dict], theirs: list[dict], where: str, resumed: bool = False) -> None:
    assert [e["step"] for e in mine] == [e["step"] for e in theirs], where
    for step, expected in zip(mine, theirs):
        assert {k for k in step if not k.startswith("perf/")} == {k for k in expected if not k.startswith("perf/")}
        assert "perf/fwd_bwd_s" in step and "perf/trained_tok_s_wall_clock" in step, where
        # (SFT's num_tokens is a running total of the run, which restarts when a run resumes, in any layout)
        keys = [key for key, value in expected.items() if isinstance(value, float) and key not in ("epoch", "step")
                and not key.startswith("perf/") and not (resumed and key == "num_tokens")]
        assert {"loss", "grad_norm"} <= set(keys)
        for key in keys:
            assert step[key] == pytest.approx(expected[key], rel=TOLERANCE, abs=1e-7), (where, step["step"], key)


@pytest.mark.parametrize("cell", ["pp2-gpipe", "pp2-1f1b", "pp2xfsdp2", "dpo-pp2-1f1b", "dpo-pp2xfsdp2", "pp4-gpipe",
                                  "pp2xddp", "pp2-1f1b-checkpointed"])
def test_pipeline_trains_like_one_process(launched, references, cell):
    steps, expected = _steps(launched / cell), _steps(references[worker.CELLS[cell][0]])
    assert len(steps) == len(expected) == worker.STEPS
    _assert_steps_match(steps, expected, cell)


def test_on_policy_trainers_refuse_pipeline_parallel_under_fsdp2(launched):
    """GRPO, RLOO, async GRPO, GKD and on-policy distillation built under PP2 x FSDP2 on 4 processes refuse in the one
    capability check, naming pipeline parallelism and what to do (they once crashed gathering a rollout replica from
    a pipeline stage before the check ran)."""
    errors = json.loads((launched / "on-policy-refusals" / "refusals.json").read_text())
    assert sorted(errors) == sorted(worker.ON_POLICY)
    for name, error in errors.items():
        assert error.startswith(f"UnsupportedLayoutError: {name} does not support pipeline parallelism (pp_size > 1): "
                                "set pp_size=1"), (name, error)


def test_pipeline_checkpoint_resumes_under_fsdp2(launched, reference):
    resumed = _steps(launched / "fsdp2-from-pp2-gpipe")
    _assert_steps_match(resumed[worker.SAVED_AT:], _steps(reference)[worker.SAVED_AT:], "FSDP2 from PP2", resumed=True)


def test_pipeline_checkpoint_resumes_on_one_process(launched, reference, model_dir, tmp_path):
    checkpoint = launched / "pp2xfsdp2" / f"checkpoint-{worker.SAVED_AT}"
    trainer = worker.trainer_for(str(tmp_path), str(model_dir), save=False)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    resumed = [entry for entry in trainer.state.log_history if "loss" in entry]
    _assert_steps_match(resumed[worker.SAVED_AT:], _steps(reference)[worker.SAVED_AT:], "one process from PP2 x FSDP2",
                        resumed=True)


@pytest.mark.parametrize("cell", ["pp2-gpipe", "pp2xfsdp2"])
def test_pipeline_checkpoint_holds_every_stage(launched, reference, cell):
    """The Hub-format weights of a PP checkpoint: every stage's tensors, equal to one process's at the same step
    within 1e-5 (weights of at most ~0.1 after 2 AdamW steps of lr 3e-3; measured <= ~2e-6, from the FSDP2 ranks'
    other summation order)."""
    name = f"checkpoint-{worker.SAVED_AT}/model.safetensors"
    mine, theirs = load_file(str(launched / cell / name)), load_file(str(reference / name))
    assert set(mine) == set(theirs)
    for key, expected in theirs.items():
        assert (mine[key] - expected).abs().max() <= WEIGHT_TOLERANCE, key


# --- refusals --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("other", ["tp", "cp", "ep"])
def test_pipeline_with_tp_cp_ep_is_refused(other):
    with pytest.raises(ValueError, match=f"pp=2 with {other}=2.*set {other}_size=1, or pp_size=1"):
        ParallelDims(dp_shard=-1 if other != "ep" else 2, world_size=4 if other != "ep" else 8, pp=2, **{other: 2})


def test_pipeline_settings_are_checked():
    from hfnative.trainers.running.parallel_plan import parallelism_config_from

    config = parallelism_config_from({"dp_shard_size": 2, "pp_size": 2, "pp_schedule": "gpipe"})
    assert (config.pp_size, config.pp_schedule) == (2, "gpipe")
    with pytest.raises(ValueError, match="pp_schedule='interleaved'"):
        parallelism_config_from({"pp_size": 2, "pp_schedule": "interleaved"})
    with pytest.raises(ValueError, match="pp_size=0"):
        parallelism_config_from({"pp_size": 0})
    assert [list(r) for r in stage_layer_ids(5, 2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="pp_size=3 stages need at least as many blocks"):
        stage_layer_ids(2, 3)


def test_pipeline_refuses_tied_embeddings():
    from hfnative.converters.loading import load_pretrained

    model = load_pretrained(str(ROOT / "examples" / "tiny-qwen3")).model  # tie_word_embeddings: true
    with pytest.raises(ValueError, match="tied input and output embeddings"):
        check_pipeline_model(model)


def _pipeline_run(schedule: str = "1f1b"):
    dims = SimpleNamespace(pp_enabled=True, pp=2, cp_enabled=False, tp_enabled=False, ep_enabled=False)
    return SimpleNamespace(dims=dims, plan=SimpleNamespace(pp_schedule=schedule))


def test_pipeline_refuses_other_objectives_and_settings():
    """The loop's one capability check (Trainer._check_supported): the objectives that do not declare pipeline
    parallelism, and the settings it does not run, each named with what to do."""
    from hfnative.trainers.algorithms.distillation import OnPolicyDistillationObjective
    from hfnative.trainers.algorithms.dpo import DPOObjective
    from hfnative.trainers.algorithms.gkd import GKDObjective
    from hfnative.trainers.algorithms.grpo import GRPOObjective
    from hfnative.trainers.algorithms.kto import KTOObjective
    from hfnative.trainers.loop.objective import LanguageModelingObjective
    from hfnative.trainers.algorithms.rloo import RLOOObjective
    from hfnative.trainers.algorithms.sft import SFTObjective, SFTTrainer
    from hfnative.trainers.loop.trainer import Trainer

    def trainer(objective_class=LanguageModelingObjective, schedule="1f1b", cls=SFTTrainer, device="cpu", **settings):
        args = dict(eval_strategy="no", optimizer_in_backward=False, gradient_accumulation_steps=2, fp16=False)
        args.update(settings)
        run = _pipeline_run(schedule)
        context = SimpleNamespace(world_size=4, layout=run.dims, args=SimpleNamespace(**args))
        fake = cls.__new__(cls)
        objective = objective_class.__new__(objective_class)
        objective.__dict__.update(lmbda=0.5, seq_kd=False)  # GKD's generates() reads them
        fake.__dict__.update(distributed=run, args=context.args, objective=objective, context=context, compute_loss_func=None, compute_metrics=None, peft_config=None,
                             lora_settings=None, device=torch.device(device))
        return fake

    def check(fake):
        Trainer._check_supported(fake)

    check(trainer())
    check(trainer(SFTObjective))
    check(trainer(DPOObjective))
    for objective in (KTOObjective, GRPOObjective, RLOOObjective, GKDObjective, OnPolicyDistillationObjective):
        with pytest.raises(ValueError, match=r"does not support pipeline parallelism \(pp_size > 1\): set pp_size=1"):
            check(trainer(objective))
    with pytest.raises(ValueError, match=r"precompute_ref_log_probs=True with pipeline parallelism \(pp_size=2\)"):
        check(trainer(DPOObjective, precompute_ref_log_probs=True))
    with pytest.raises(ValueError, match="evaluation"):
        check(trainer(eval_strategy="steps"))
    with pytest.raises(ValueError, match="optimizer_in_backward"):
        check(trainer(optimizer_in_backward=True))
    check(trainer(fp16=True))  # a CPU trains fp16 unscaled
    with pytest.raises(ValueError, match=r"fp16=True on an accelerator \(its loss scaling\) with pipeline"):
        check(trainer(fp16=True, device="cuda"))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1 < pp_size=2.*pp_schedule='gpipe'"):
        check(trainer(gradient_accumulation_steps=1))
    check(trainer(schedule="gpipe", gradient_accumulation_steps=1))
    # every refusal of a run in one message
    with pytest.raises(ValueError, match="KTOTrainer does not support pipeline parallelism.*; evaluation.*; "
                                         "optimizer_in_backward=True"):
        check(trainer(KTOObjective, eval_strategy="steps", optimizer_in_backward=True, cls=_named("KTOTrainer")))

    class OwnStep(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            raise AssertionError("not run under pipeline parallel")

    with pytest.raises(ValueError, match=r"an override of training_step \(OwnStep.training_step\)"):
        check(trainer(cls=OwnStep))


def _named(name: str):
    from hfnative.trainers.algorithms.sft import SFTTrainer

    return type(name, (SFTTrainer,), {})


def test_stages_are_merged_on_rank_zero_one_tensor_at_a_time(tmp_path):
    """A save under pipeline parallelism: each stage's tensors (FSDP2 shards made whole, bf16, integer, bool and 0-d
    tensors) reach rank 0's CPU whole and exact, sent one at a time from the stage holding them; the other ranks
    get nothing."""
    torchrun("_gather_stages_worker.py", [str(tmp_path)], 4, timeout=120)
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["names"] and all(first["equal"].values()), first
    for rank in (1, 2, 3):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"empty": True}, rank
