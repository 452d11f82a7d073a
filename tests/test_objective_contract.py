"""The objective contract (trainers/loop/objective.py): objectives see the run only through their ObjectiveContext, the
loop reduces every normalizer and divides, and the capability check refuses, in one message, what an objective
does not declare.

The refusals are checked on a context whose layout is a real ParallelDims (no process group is needed to decide),
the normalizer reduction on one process against its formula, and the source of every objective class by an AST
scan: no objective names the trainer or reads a private attribute of its context.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from hfnative.parallel.dims import ParallelDims
from hfnative.trainers.algorithms.async_grpo import AsyncGRPOObjective
from hfnative.trainers.algorithms.distillation import OnPolicyDistillationObjective
from hfnative.trainers.algorithms.dpo import DPOObjective
from hfnative.trainers.algorithms.gkd import GKDObjective
from hfnative.trainers.algorithms.grpo import GRPOObjective
from hfnative.trainers.loop.objective import (
    FEATURES,
    LanguageModelingObjective,
    Normalizer,
    UnsupportedLayoutError,
    check_supported,
    count_label_tokens,
    features_used,
)
from hfnative.trainers.algorithms.rloo import RLOOObjective
from hfnative.trainers.algorithms.sft import SFTObjective

ROOT = Path(__file__).resolve().parents[1]


class FakeObjective:
    """Only what the check reads: ``supports`` and ``generates()``."""

    def __init__(self, supports, generates=False):
        self.supports, self._generates = frozenset(supports), generates

    def generates(self):
        return self._generates


def context(world_size=1, eval_strategy="no", **sizes):
    layout = ParallelDims(world_size=world_size, **sizes) if world_size > 1 else None
    return SimpleNamespace(world_size=world_size, layout=layout, args=SimpleNamespace(eval_strategy=eval_strategy))


def test_the_features_a_run_uses():
    assert features_used(FakeObjective(FEATURES), context()) == []
    assert features_used(FakeObjective(FEATURES), context(eval_strategy="steps")) == ["evaluation"]
    assert features_used(FakeObjective(FEATURES, generates=True), context(world_size=2, dp_shard=2)) == [
        "multi_process", "multi_process_generation"]
    assert features_used(FakeObjective(FEATURES), context(world_size=4, dp_shard=2, tp=2)) == [
        "multi_process", "tensor_parallel"]
    assert features_used(FakeObjective(FEATURES), context(world_size=2, dp_shard=1, cp=2)) == [
        "multi_process", "context_parallel"]
    assert features_used(FakeObjective(FEATURES), context(world_size=2, dp_shard=2, ep=2)) == [
        "multi_process", "expert_parallel"]


def test_one_message_names_the_objective_every_missing_feature_and_what_to_do():
    data_parallel_only = FakeObjective({"multi_process", "evaluation"})
    with pytest.raises(UnsupportedLayoutError) as refused:
        check_supported(data_parallel_only, context(world_size=4, dp_shard=1, tp=2, cp=2), algorithm="SomeTrainer")
    message = str(refused.value)
    assert message.startswith("SomeTrainer does not support ")
    assert "tensor parallelism (tp_size > 1): set tp_size=1" in message
    assert "context parallelism (cp_size > 1): set cp_size=1" in message
    # FSDP2 with evaluation: fine
    check_supported(data_parallel_only, context(world_size=2, dp_shard=2, eval_strategy="steps"))
    check_supported(FakeObjective(DPOObjective.supports), context(world_size=4, dp_shard=1, tp=2, cp=2))
    # async GRPO trains in every layout (tests/test_async_grpo_layouts.py) but does not evaluate
    check_supported(FakeObjective(AsyncGRPOObjective.supports, generates=True), context(world_size=4, dp_shard=2, tp=2))
    with pytest.raises(UnsupportedLayoutError, match="evaluation .*set eval_strategy='no'"):
        check_supported(FakeObjective(AsyncGRPOObjective.supports, generates=True), context(eval_strategy="steps"))
    with pytest.raises(UnsupportedLayoutError, match="generating completions in a multi-process run"):
        check_supported(FakeObjective({"multi_process"}, generates=True), context(world_size=2, dp_shard=2))
    # GKD and on-policy distillation generate in every layout (tests/test_layout_matrix_preference.py)
    for objective in (GKDObjective, OnPolicyDistillationObjective):
        check_supported(FakeObjective(objective.supports, generates=True), context(world_size=4, dp_shard=2, tp=2))
        check_supported(FakeObjective(objective.supports, generates=True), context(world_size=2, dp_shard=1, cp=2))


def test_declared_capabilities():
    everything = set(FEATURES)
    # the language-modeling objectives and DPO run under pipeline parallelism (tests/test_pipeline_parallel.py)
    assert set(LanguageModelingObjective.supports) == set(SFTObjective.supports) == everything
    assert {"tensor_parallel", "context_parallel", "expert_parallel", "pipeline_parallel"} <= set(DPOObjective.supports)
    # GRPO and RLOO: every other layout and evaluation (tests/test_rl_layouts.py, test_grpo.py)
    assert set(GRPOObjective.supports) == set(RLOOObjective.supports) == everything - {"pipeline_parallel"}
    assert set(AsyncGRPOObjective.supports) == everything - {"evaluation", "pipeline_parallel"}
    for objective in (DPOObjective, GRPOObjective, GKDObjective, OnPolicyDistillationObjective, AsyncGRPOObjective):
        assert set(objective.supports) <= everything, objective


def test_normalizers_say_what_they_count():
    batches = [{"shift_labels": __import__("torch").tensor([[1, -100, 3], [-100, -100, 7]])}] * 2
    assert count_label_tokens(batches) == Normalizer(6, "label_tokens")
    assert count_label_tokens([{"input_ids": None}]) is None
    assert Normalizer.micro_batches([{}, {}, {}]) == Normalizer(3, "micro_batches")
    assert Normalizer(5, "completion_tokens").counts_tokens and not Normalizer(5, "pairs").counts_tokens
    assert Normalizer.tokens_per_micro_batch([4, 6]) == Normalizer((4.0, 6.0), "completion_tokens_per_micro_batch")
    assert Normalizer.summed_micro_batches([{}, {}]) == Normalizer(2, "summed_micro_batches")
    with pytest.raises(ValueError, match="unit 'tokens'"):
        Normalizer(5, "tokens")


def test_the_loop_reduces_and_divides_on_one_process():
    from hfnative.parallel.groups import DataParallelGroup
    from hfnative.trainers.running.distributed import DistributedMixin

    loop = SimpleNamespace(distributed=None, data_parallel=DataParallelGroup(None, "cpu"), device="cpu")

    def step(normalizer, micro_batches):
        out = DistributedMixin._step_normalizer(loop, normalizer, micro_batches)
        return out.items, out.divisor, out.logged_share

    # an item count is handed to every micro-batch's loss as num_items_in_batch; nothing more is divided
    assert step(Normalizer(40, "label_tokens"), 3) == ([40] * 3, 1, 1.0)
    # a micro-batch mean is divided by the step's micro-batches (over every data-parallel rank: here one)
    assert step(Normalizer.micro_batches([{}] * 3), 3) == ([None] * 3, 3, 1.0)
    # a mean over another count than the step's micro-batches (PPO: accelerate's gradient_accumulation_steps)
    assert step(Normalizer(4, "micro_batches"), 2) == ([None] * 2, 4, 1.0)
    # per-micro-batch token counts: each micro-batch its own count (averaged over one rank), then a mean
    assert step(Normalizer.tokens_per_micro_batch([7, 5.5]), 2) == ([7.0, 5.5], 2, 1.0)
    # ... each a mean over another count than the step's micro-batches (PPO's accumulation steps, several optimizer
    # steps in one step of the loop)
    assert step(Normalizer.tokens_per_micro_batch([7, 5.5, 3, 4], means_over=2), 4) == ([7.0, 5.5, 3.0, 4.0], 2, 1.0)
    # summed micro-batch means: nothing divided over one rank, the logs count their mean
    assert step(Normalizer.summed_micro_batches([{}] * 4), 4) == ([None] * 4, 1, 0.25)
    # none: transformers' Trainer, each loss divided by this rank's micro-batches
    assert step(None, 4) == ([None] * 4, 4, 1.0)
    with pytest.raises(ValueError, match="2 counts for a step of 3"):
        step(Normalizer.tokens_per_micro_batch([1, 2]), 3)


def _objective_classes(tree: ast.Module) -> list[ast.ClassDef]:
    """The classes of ``tree`` whose base is an objective (a base class named ``...Objective``, here or imported)."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            and any(str(getattr(base, "id", getattr(base, "attr", ""))).endswith("Objective") for base in node.bases)]


# what an objective must not divide by (nor, for the loop's own divisor, scale by): the run's rank counts (and a
# process group's ``size``)
RANK_COUNTS = ("world_size", "dp_size", "num_processes", "micro_batches_in_step")
GROUPS = ("data_parallel", "context_parallel")
REDUCTIONS = ("sum", "all_reduce")


def _rank_count(node: ast.AST, names: set[str], attrs=RANK_COUNTS) -> bool:
    """Whether ``node`` holds a rank count: ``...world_size``, ``...micro_batches_in_step``, ``<group>.size``, or a
    name assigned one as it is."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Attribute) and (inner.attr in attrs or (
                "size" in attrs and inner.attr == "size" and isinstance(inner.value, ast.Attribute)
                and inner.value.attr in GROUPS)):
            return True
        if isinstance(inner, ast.Name) and inner.id in names:
            return True
    return False


def _is_reduction(node: ast.AST, names: set[str]) -> bool:
    """An all-reduce over ranks: ``<group>.sum(...)``, ``torch.distributed.all_reduce(...)``, or a name assigned one."""
    for inner in ast.walk(node):
        if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr in REDUCTIONS
                and isinstance(inner.func.value, ast.Attribute) and inner.func.value.attr in GROUPS + ("distributed",)):
            return True
        if isinstance(inner, ast.Name) and inner.id in names:
            return True
    return False


def _normalizing_offences(cls: ast.ClassDef, filename: str) -> list[str]:
    """Each place a method of ``cls`` divides by a rank count, scales by the loop's micro-batch count, or divides
    a value all-reduced over the ranks: normalizing is the loop's (``Normalizer``). Rank counts used for sizing (a
    product, or a name holding one) are not normalizing."""
    offences = []
    for method in (node for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
        counts, micro_batches, reduced = set(), set(), set()
        for node in ast.walk(method):  # names assigned a rank count as it is, or an all-reduce's result
            if isinstance(node, ast.Assign):
                targets = {t.id for t in node.targets if isinstance(t, ast.Name)}
                if isinstance(node.value, ast.Attribute) and _rank_count(node.value, set()):
                    counts |= targets
                    if node.value.attr == "micro_batches_in_step":
                        micro_batches |= targets
                if _is_reduction(node.value, reduced):
                    reduced |= targets
        for node in ast.walk(method):
            if not isinstance(node, ast.BinOp):
                continue
            where = f"{filename}:{node.lineno} {cls.name}.{method.name}"
            if isinstance(node.op, (ast.Div, ast.FloorDiv)) and _rank_count(node.right, counts, RANK_COUNTS + ("size",)):
                offences.append(f"{where} divides by a rank count")
            elif isinstance(node.op, ast.Mult) and any(_rank_count(side, micro_batches, ("micro_batches_in_step",))
                                                       for side in (node.left, node.right)):
                offences.append(f"{where} scales by the loop's micro-batch count")
            elif isinstance(node.op, (ast.Div, ast.FloorDiv)) and (
                    _is_reduction(node.left, reduced) or _is_reduction(node.right, reduced)):
                offences.append(f"{where} divides an all-reduced value")
    return offences


def offences_in(source: str, filename: str) -> list[str]:
    """Every place an objective class of ``source`` names the trainer, reads a private attribute of its context, or
    normalizes over the ranks itself."""
    offences = []
    for cls in _objective_classes(ast.parse(source)):
        for node in ast.walk(cls):
            if isinstance(node, ast.Name) and node.id == "trainer":
                offences.append(f"{filename}:{node.lineno} {cls.name} names `trainer`")
            if isinstance(node, ast.Attribute) and node.attr in ("trainer", "_trainer"):
                offences.append(f"{filename}:{node.lineno} {cls.name} reads .{node.attr}")
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "context"):
                offences.append(f"{filename}:{node.lineno} {cls.name} reads context.{node.attr}")
        offences += _normalizing_offences(cls, filename)
    return offences


def test_no_objective_reaches_into_the_trainer():
    paths = sorted((ROOT / "trainers").rglob("*.py"))
    found = {c.name for p in paths for c in _objective_classes(ast.parse(p.read_text()))}
    assert {"SFTObjective", "DPOObjective", "GKDObjective", "OnPolicyDistillationObjective", "GRPOObjective",
            "RLOOObjective", "AsyncGRPOObjective"} <= found  # the scan sees every objective
    offences = [o for p in paths for o in offences_in(p.read_text(), p.name)]
    assert not offences, "\n".join(offences)


def test_the_scan_sees_an_objective_that_reaches_into_the_trainer():
    source = (
        "class MineObjective(LanguageModelingObjective):\n"
        "    def loss(self, model, inputs, n):\n"
        "        return self.context._trainer._metrics\n"
        "class DeeperObjective(MineObjective):\n"
        "    def micro_batches(self, it, count):\n"
        "        return trainer._data_shard()\n"
        "class NotOne:\n"
        "    def f(self):\n"
        "        return self.trainer\n"
    )
    assert offences_in(source, "x.py") == [
        "x.py:3 MineObjective reads ._trainer", "x.py:3 MineObjective reads context._trainer",
        "x.py:6 DeeperObjective names `trainer`",
    ]


def test_the_scan_sees_an_objective_that_normalizes_over_the_ranks_itself():
    """The three ways objectives once normalized by hand (GRPO's all-reduced token count, async GRPO's division by
    the data-parallel size, online DPO's gradient scaled to undo the loop's division) each fail the scan; the same
    quantities through the loop's Normalizer, and the rank counts used for sizing, do not."""
    source = (
        "class GatheringObjective(Objective):\n"
        "    def split(self, batch, pieces):\n"
        "        totals = self.context.data_parallel.sum(torch.tensor([tokens, float(pieces)]))\n"
        "        return (totals[0] / totals[1]).item()\n"
        "class DividingObjective(Objective):\n"
        "    def rank_share(self, whole):\n"
        "        return float(loss_mask(whole).sum()) / self.context.data_parallel.size\n"
        "class RescalingObjective(Objective):\n"
        "    def loss(self, model, inputs, n):\n"
        "        scale = self.context.micro_batches_in_step\n"
        "        return loss + (scale - 1) * (loss - loss.detach())\n"
        "class CleanObjective(Objective):\n"
        "    def normalizer(self, batches):\n"
        "        return Normalizer.tokens_per_micro_batch([b['tokens'] for b in batches])\n"
        "    def train_dataloader(self, dataset, collator):\n"
        "        prompts = self.args.per_device_train_batch_size * self.context.data_parallel.size // self.args.G\n"
        "        return prompts / 2\n"
    )
    assert offences_in(source, "x.py") == [
        "x.py:4 GatheringObjective.split divides an all-reduced value",
        "x.py:7 DividingObjective.rank_share divides by a rank count",
        "x.py:11 RescalingObjective.loss scales by the loop's micro-batch count",
    ]
