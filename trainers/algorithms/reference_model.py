"""The frozen reference of the preference objectives (DPO, KTO), kept as TRL's trainers keep it.

The reference is, in order: the ``ref_model`` the user gave; the policy's base with its new LoRA adapters disabled
(a new adapter starts at zero, so the base is the initial policy); or a frozen copy of the policy's checkpoint
(also for an adapter the model came with: a folder, a PeftModel, as TRL's "ref" adapter copy). With
``precompute_ref_log_probs`` and no ``ref_model``, no copy is kept: the policy itself, before training, gives the
log-probs once. TR-DPO's ``sync_ref_model`` mixes the policy into a kept copy (trainers/algorithms/reference_sync.py).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import FunctionType, MethodType

import torch
from datasets import IterableDataset

from hfnative.models.compute_dtype import keep_linear_weights_in
from hfnative.models.decoder import Transformer

from ..loop.arguments import LIGER_DEPRECATION, mixed_precision_dtype
from ..running.model_card import write_model_card
from ..running.model_loading import disable_dropout
from .reference_sync import mix_into_reference, sync_due


def reference_source(model, ref_model) -> tuple[object, bool]:
    """(what to load as the reference, whether the user gave it): ``ref_model``, else the policy's own source (a
    native model object copied, not shared)."""
    if ref_model is not None and ref_model is model:
        raise ValueError(
            "`model` and `ref_model` cannot be the same object. In most cases you should omit `ref_model` and "
            "we'll initialize it to a copy of `model` for you."
        )
    if ref_model is not None:
        return ref_model, True
    return (copy.deepcopy(model) if isinstance(model, Transformer) else model), False


def refuse_sync_with_new_adapters(args, peft_config) -> None:
    """TRL refuses sync_ref_model with PEFT: the reference is the base with the adapter disabled."""
    from .dpo_config import UnsupportedSettings

    if peft_config is not None and args.sync_ref_model:
        raise UnsupportedSettings(
            "You passed `sync_ref_model=True` while using a PEFT model: with PEFT the reference is the base model "
            "with the adapter disabled, so there is no separate reference model to synchronize. Use "
            "`sync_ref_model=False`, or full fine-tuning for a synchronized reference."
        )


def refuse_sync_without_reference(args, reference) -> None:
    """TRL's GRPO and RLOO refusals of ``sync_ref_model`` with no reference model to synchronize (``reference``: the
    objective's ReferenceModel, None with beta=0.0)."""
    name = type(args).__name__.removesuffix("Config") + "Trainer"
    if reference is None:
        raise ValueError(
            "You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model is not used during "
            f"training. Consequently, {name} does not create a `ref_model` instance, and there is nothing to "
            "synchronize. Please set `sync_ref_model=False`, or set `beta` to a non-zero value."
        )
    if reference.is_base:
        raise ValueError(
            "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. With PEFT, "
            f"{name} does not keep a separate reference model in memory; instead, it recovers reference behavior "
            "by temporarily disabling the adapter. As a result, there is no standalone `ref_model` instance to "
            "synchronize. Use `sync_ref_model=False`, or opt for full fine-tuning if you need a synced reference model."
        )


def frozen_for_autocast(model, args) -> None:
    """A frozen native model the trainer loaded or copied (a reference, a teacher) that runs under the trainer's
    autocast (``bf16``, ``fp16``): its linear weights kept in the autocast dtype, which is what autocast computes
    with, so the same outputs with half those weights' memory and no cast of them each forward
    (``hfnative.models.compute_dtype``)."""
    dtype = mixed_precision_dtype(args)
    if dtype is not None and isinstance(model, Transformer):
        keep_linear_weights_in(model, dtype)


@contextmanager
def router_loss_off(model):
    """A forward of ``model`` that adds no router load-balancing loss (a reference or KL pass of the policy)."""
    enabled = getattr(model, "aux_loss_enabled", False)
    model.aux_loss_enabled = False
    try:
        yield
    finally:
        model.aux_loss_enabled = enabled


class ReferenceModel:
    """An objective's reference: registers the frozen copy it needs in ``objective.auxiliary_models["ref_model"]``
    (the loop loads and places it), and runs it (or the policy's base) without a graph.

    ``source``: what the copy loads from (or a function making it, called only when a copy is kept); ``given``: the
    user gave it (always kept). The policy's base, its adapters disabled, is the reference when the run trains new
    adapters, and with ``base_of_loaded_adapters`` also for an adapter the model came with (TRL's GRPO and RLOO;
    DPO and KTO keep a frozen copy of such a policy instead)."""

    def __init__(self, objective, source, given: bool = False, base_of_loaded_adapters: bool = False):
        context = objective.context
        self.objective = objective
        self.is_base = context.uses_adapters and (context.trains_new_adapters or base_of_loaded_adapters)
        if given or (not self.is_base and not getattr(context.args, "precompute_ref_log_probs", False)):
            objective.auxiliary_models["ref_model"] = source() if isinstance(source, (FunctionType, MethodType)) else source

    @property
    def model(self):
        """The frozen reference model, or None (the policy's base, or the policy before training)."""
        return self.objective.auxiliary_models.get("ref_model")

    def ready(self) -> None:
        """The kept reference in the policy's dtype, dropout off in it too; under autocast, unless it is synchronized
        with the policy (TR-DPO mixes float32 weights) or is the user's own native model object, its linear weights in
        the autocast dtype (``frozen_for_autocast``)."""
        ref = self.model
        if ref is None:
            return
        args = self.objective.args
        policy_dtype = next(self.objective.context.model.parameters()).dtype
        if next(ref.parameters()).dtype != policy_dtype:
            ref.to(policy_dtype)
        if args.disable_dropout:
            disable_dropout(ref)
        if not getattr(args, "sync_ref_model", False) and "ref_model" not in self.objective.users_models:
            frozen_for_autocast(ref, args)

    @contextmanager
    def running(self):
        """The model whose forwards are the reference's: the kept copy, or the policy with its adapters disabled (or
        as it is, before training) and without its router loss."""
        ref = self.model
        if ref is not None:
            yield ref
            return
        policy = self.objective.context.model
        with router_loss_off(policy), policy.disable_adapter() if self.is_base else nullcontext():
            yield policy

    @torch.no_grad()
    def head_output(self, inputs: dict, head_loss):
        """The reference's head output for ``inputs`` (``Objective.forward``'s keys), without a graph."""
        with self.running() as model:
            return self.objective.forward(model, inputs, head_loss).head_output

    def after_optimizer_step(self) -> None:
        """TR-DPO: every ref_model_sync_steps steps, ref <- alpha * policy + (1 - alpha) * ref."""
        args, context = self.objective.args, self.objective.context
        if self.model is not None and sync_due(args, context.state.global_step + 1):  # the step just taken
            mix_into_reference(self.model, context.model, args.ref_model_mixup_alpha)

    def precompute(self, dataset, batch_size: int, columns) -> object:
        """``dataset`` with the reference's columns, from one pass in order: ``columns(inputs)`` -> {name: [B]}."""
        objective = self.objective
        context = objective.context
        if isinstance(dataset, IterableDataset):
            raise ValueError("`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a "
                             "map-style Dataset or set `precompute_ref_log_probs=False`.")
        state = context.state
        if state is not None and state.global_step > 0 and self.model is None and not self.is_base:
            raise ValueError(
                "Cannot compute reference log-probs for a dataset passed to `evaluate()` after training has started, "
                "because `precompute_ref_log_probs=True` and no `ref_model` was provided (full fine-tuning): the "
                "reference is only available before training. Provide this dataset as `eval_dataset` at "
                "initialization, pass an explicit `ref_model`, or set `precompute_ref_log_probs=False`."
            )
        collator = context.data_collator or objective.default_collator()
        values: dict[str, list[float]] = {}
        for start in range(0, len(dataset), batch_size):
            batch = collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            if "attention_plan" not in batch:  # not split yet (the default collator before it is the trainer's)
                batch = context.context_parallel.split(objective.whole_sequence_inputs(batch))
            inputs = context.prepare_inputs(batch)
            with context.autocast():
                for name, column in columns(inputs).items():
                    values.setdefault(name, []).extend(column.float().cpu().tolist())
        for name, column in values.items():
            dataset = dataset.add_column(name, column)
        return dataset


# TRL's DPO and KTO trainers' FutureWarning when compute_metrics gets logits recomputed for it (see EvaluationMixin)
PREFERENCE_LOGITS_FOR_METRICS_WARNING = (
    "`return_outputs=True`, and the logits it passes to `compute_metrics`, are deprecated and will be removed in "
    "v2.0.0. The fused LM head does not build the logits, so they are recomputed with an extra forward pass."
)


class ReferenceTrainer:
    """What the trainers with a reference model (DPO, KTO) share around it, mixed in before ``Trainer``: the
    reference's source taken at construction with TRL's checks, handed once to the objective, ``ref_model``, and
    the model card TRL refreshes in output_dir at every checkpoint."""

    def _take_reference_source(self, args, model, ref_model, peft_config) -> None:
        """Before ``Trainer.__init__``: the reference's source (and whether the user gave one), TRL's refusal of
        sync_ref_model with new adapters, the config's own checks, and TRL's use_liger_kernel deprecation."""
        self._ref_source, self._ref_given = reference_source(model, ref_model)
        refuse_sync_with_new_adapters(args, peft_config)
        args.check_for_trainer()
        if args.use_liger_kernel:
            warnings.warn(LIGER_DEPRECATION, FutureWarning, stacklevel=3)

    def _reference_for_objective(self):
        """The reference's source, once: the objective's auxiliary_models holds it from then on."""
        reference, self._ref_source = self._ref_source, None
        return reference

    @property
    def ref_model(self):
        """The frozen reference model (None when it is the policy with adapters disabled, or precomputed)."""
        return self.objective.auxiliary_models.get("ref_model")

    def _save_checkpoint(self) -> None:
        write_model_card(self, Path(self.args.output_dir))  # TRL refreshes output_dir's card at every checkpoint
        super()._save_checkpoint()


__all__ = ["PREFERENCE_LOGITS_FOR_METRICS_WARNING", "ReferenceModel", "ReferenceTrainer", "reference_source",
           "refuse_sync_with_new_adapters", "refuse_sync_without_reference", "router_loss_off"]
