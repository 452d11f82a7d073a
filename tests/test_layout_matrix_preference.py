"""DPO, GKD (off-policy and on-policy) and on-policy distillation under DDP, FSDP2, tensor parallel (tp=2), context
parallel (cp=2) and expert parallel (ep=2, Qwen3-MoE student and teacher) on 2 CPU processes, and FSDP2 x TP2 on 4
(gloo), each against one process over the same global batches: 3 steps whose losses, grad norms and logged metrics
agree within 1e-5 relative (fp32).

What runs is the user's path: the reference model (a frozen copy of the checkpoint) or precomputed reference
log-probs, the teacher, and generation (sampled, with per-row streams, or greedy) on the live weights; the completions
each rank generated are compared with the ones the single process generated. The MoE cells add the router's
load-balancing loss (coefficient 0.5): the logged and trained value is the whole batch's, as one process takes it.
One launch per process count runs the cells; the single-process references run here.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

import _layout_matrix_preference_worker as worker
from _launch import logged_abs_tolerance, torchrun
from hfnative.trainers.algorithms import distillation as kd

# logged metrics near zero (rewards and margins at the first step, where policy = reference) carry fp32 round-off
ABSOLUTE = 1e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE student and teacher (another initialization), router_aux_loss_coef 0.5; DPO's dense policy."""
    directory = tmp_path_factory.mktemp("moe_models")
    tokenizer = AutoTokenizer.from_pretrained(worker.DENSE["student"])
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.5,
                            max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    for seed, name in ((0, "moe"), (1, "moe-teacher")):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(directory / name))
        tokenizer.save_pretrained(str(directory / name))
    # DPO's dense policy: the shipped model's embeddings x3, so its next-token distributions are far from uniform and
    # the chosen and rejected log-probs' gradients do not nearly cancel (which magnifies fp32 round-off)
    policy = AutoModelForCausalLM.from_pretrained(worker.DENSE["student"], dtype=torch.float32)
    with torch.no_grad():
        policy.model.embed_tokens.weight.mul_(3.0)
    policy.save_pretrained(str(directory / "dpo-policy"))
    tokenizer.save_pretrained(str(directory / "dpo-policy"))
    return directory


@pytest.fixture(scope="module")
def launched(tmp_path_factory, models_dir):
    out = tmp_path_factory.mktemp("layout_matrix_preference")
    for processes in sorted({layout[2] for layout in worker.LAYOUTS.values()}):
        cells = [cell for cell, (_, layout, _, _) in worker.CELLS.items() if worker.LAYOUTS[layout][2] == processes]
        torchrun("_layout_matrix_preference_worker.py", [str(out), str(models_dir), *cells], processes, timeout=1800)
    return out


_references: dict = {}


def _reference(cell: str, models_dir: Path, tmp_path) -> tuple[list[dict], list[dict]]:
    """One process over the same global batches (cells that differ only in layout share it): its log history and
    the completions it generated."""
    algorithm, layout, kind, settings = worker.CELLS[cell]
    _, ranks, _ = worker.LAYOUTS[layout]
    key = (algorithm, kind, json.dumps(settings, sort_keys=True), ranks)
    if key not in _references:
        trainer = worker.trainer_for(cell, str(tmp_path / "reference"), str(models_dir), ranks)
        generated = []
        if isinstance(trainer.objective, kd._DistillationObjective):
            worker.record_completions(trainer.objective, generated)
        trainer.train()
        _references[key] = (trainer.state.log_history, generated)
    return _references[key]


def _by_rank(calls: list[dict], ranks: int) -> list[list[list[int]]]:
    """Each generation call's completions cut as the data-parallel ranks held them."""
    out = []
    for call in calls:
        size = len(call["completions"]) // ranks
        out.append([call["completions"][r * size : (r + 1) * size] for r in range(ranks)])
    return out


@pytest.mark.parametrize("cell", list(worker.CELLS))
def test_cell_trains_like_one_process(launched, models_dir, cell, tmp_path):
    algorithm, layout, kind, settings = worker.CELLS[cell]
    _, ranks, processes = worker.LAYOUTS[layout]
    reference_logs, reference_calls = _reference(cell, models_dir, tmp_path)
    logs = json.loads((launched / cell / "log.json").read_text())
    steps, expected = [e for e in logs if "loss" in e], [e for e in reference_logs if "loss" in e]
    assert len(steps) == len(expected) == worker.STEPS
    worst = 0.0
    for mine, theirs in zip(steps, expected):
        assert set(mine) == set(theirs), (cell, theirs["step"])
        for key, value in theirs.items():
            if isinstance(value, float) and key not in ("step_time", "epoch") and not key.startswith("perf/"):
                tolerance = dict(rel=1e-5) if key in ("loss", "grad_norm") else dict(rel=1e-5, abs=logged_abs_tolerance(key, theirs, ABSOLUTE))
                assert mine[key] == pytest.approx(value, **tolerance), (cell, theirs["step"], key)
                if key in ("loss", "grad_norm"):
                    worst = max(worst, abs(mine[key] - value) / abs(value))
    if kind == "moe" and algorithm == "dpo":
        assert all(e["aux_loss"] > 0 for e in steps)
    # the optimizer read summed gradients: a tensor-parallel replica's (the norms') partial sums were reduced first
    for r in range(processes):
        counts = json.loads((launched / cell / f"partial-gradients-rank{r}.json").read_text())
        assert len(counts) == worker.STEPS and not any(counts), (cell, r, counts)
    evaluations, expected_evaluations = [e for e in logs if "eval_loss" in e], [e for e in reference_logs if "eval_loss" in e]
    assert len(evaluations) == len(expected_evaluations) == (settings.get("eval_strategy", "no") != "no")
    for mine, theirs in zip(evaluations, expected_evaluations):
        for key, value in theirs.items():
            if key.startswith("eval_") and not key.endswith(("runtime", "per_second")):
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=ABSOLUTE), (cell, key)
    # generation: every rank completed its data-parallel rank's rows as the one process did (the cp or tp ranks of a
    # data-parallel rank: the same rows)
    calls = [json.loads((launched / cell / f"completions-rank{r}.json").read_text()) for r in range(processes)]
    assert all(len(rank_calls) == len(reference_calls) for rank_calls in calls)
    expected_by_rank = _by_rank(reference_calls, ranks)
    for index, reference_call in enumerate(reference_calls):
        for rank in range(processes):
            call = calls[rank][index]
            assert call["teacher"] == reference_call["teacher"]
            assert call["completions"] == expected_by_rank[index][rank * ranks // processes], (cell, index, rank)
    if algorithm == "distillation" or settings.get("lmbda", 0) > 0:
        assert reference_calls, cell  # the on-policy cells generate
    print(f"{cell}: max relative difference of loss and grad_norm {worst:.2e}")
