"""The Trainer's optimizer step under pipeline parallel (``parallelism_config`` ``pp_size`` > 1, schedule
``pp_schedule``: "1f1b" or "gpipe").

The step's micro-batches (gradient_accumulation_steps of them) are the schedule's micro-batches: they are padded to
one sequence length (the added positions carry no label and change no loss), run through the stages together
(``hfnative.parallel.pipeline.Pipeline``), and each micro-batch's loss is the objective's, computed by
``compute_loss`` on the last stage from its normed hidden states through the head. The objective's frozen models
(DPO's reference) are split into the same stages and run first, forwards only, over the same micro-batches; the
objective reads their last stage's hidden states the same way. The step's loss is broadcast from the last stage,
and the logged metrics too, so every rank logs what one process logs.

Supported: the objectives that declare "pipeline_parallel" (the language-modeling objectives of Trainer and
SFTTrainer, and DPO), under PP alone or with data parallelism (FSDP2, HSDP, DDP); ``pipeline_conflicts`` names the
settings PP does not run, which the loop's one capability check refuses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfnative.models.decoder import CausalLMOutput

from ..running.distributed import pad_sequence_to_length
from .optimization import scales_fp16_loss

def pipeline_conflicts(trainer, evaluating: bool = False) -> list[str]:
    """The run's settings pipeline parallel does not run, each "what: what to do" (none when pp_size is 1); the
    objectives that run under it declare "pipeline_parallel" in ``supports`` (trainers/loop/capabilities.py)."""
    run = trainer.distributed
    if run is None or not run.dims.pp_enabled:
        return []
    args, pp = trainer.args, run.dims.pp
    refused = {
        "evaluation (eval_strategy / evaluate())": evaluating or args.eval_strategy != "no",
        "compute_loss_func": trainer.compute_loss_func is not None,
        "optimizer_in_backward=True": args.optimizer_in_backward,
        # the schedule runs backward from the unscaled loss
        "fp16=True on an accelerator (its loss scaling)": scales_fp16_loss(trainer),
        "LoRA / PEFT adapters (peft_config or an adapter folder)": (trainer.peft_config is not None
                                                                    or trainer.lora_settings is not None),
        "precompute_ref_log_probs=True": getattr(args, "precompute_ref_log_probs", False),
        "sync_ref_model=True": getattr(args, "sync_ref_model", False),
        # the schedule runs the step's forwards and backwards itself (compute_loss overrides are honoured)
        f"an override of training_step ({type(trainer).__name__}.training_step)": _overrides_training_step(trainer),
    }
    conflicts = [f"{setting} with pipeline parallelism (pp_size={pp}): drop it, or set pp_size=1"
                 for setting, used in refused.items() if used]
    if run.plan.pp_schedule == "1f1b" and args.gradient_accumulation_steps < pp:
        conflicts.append(
            f"pp_schedule='1f1b' with gradient_accumulation_steps={args.gradient_accumulation_steps} < pp_size={pp} "
            "(it needs at least one micro-batch per stage): raise gradient_accumulation_steps (the schedule's "
            "micro-batches), or set pp_schedule='gpipe'"
        )
    return conflicts


def _overrides_training_step(trainer) -> bool:
    """Whether ``trainer``'s class replaces the Trainer's training_step (the Trainer: the class built on
    PipelineMixin)."""
    base = next((cls for cls in type(trainer).__mro__ if PipelineMixin in cls.__bases__), None)
    return base is not None and type(trainer).training_step is not base.training_step


class _LastStageModel:
    """The model as the objective's loss reads it on the last stage, whose forward the pipeline ran: a call returns
    those hidden states [B, S, D], with the head's loss on them when ``head_loss`` is given; ``output`` is the head."""

    def __init__(self, model, hidden_BSD: torch.Tensor):
        self._model, self._hidden_BSD = model, hidden_BSD

    def __call__(self, *args, head_loss=None, **kwargs) -> CausalLMOutput:
        out = CausalLMOutput(self._hidden_BSD, self._model.output)
        if head_loss is not None:
            out.head_output = self._model.output(self._hidden_BSD, loss=head_loss)
        return out

    def __getattr__(self, name):  # training, output, args, ...
        return getattr(self._model, name)


class PipelineTraining:
    """``trainer.model``'s stage and its schedule, and the objective's frozen models' (built once per model)."""

    def __init__(self, trainer):
        self.model = trainer.native_model
        self.pipeline = _pipeline_of(trainer, self.model)
        self.frozen = {name: _pipeline_of(trainer, model)
                       for name, model in trainer.objective.auxiliary_models.items() if model is not None}

    def step(self, trainer, batches: list[dict], num_items: list) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (on the host, completed there by
        ``trainer._complete_on_host``: padded to one length here, then planned and moved, so the attention plans come
        from host tensors; ``num_items``: each one's ``num_items_in_batch``); returns the step's loss (the sum of the
        micro-batches'), on every rank."""
        rows = {batch["input_ids"].shape[0] for batch in batches}
        if len(rows) > 1:
            raise ValueError(
                f"pipeline parallelism (pp_size > 1) runs a step's micro-batches with one number of rows; this step's "
                f"have {sorted(rows)} (an epoch's last batch is smaller): set dataloader_drop_last=True, or a dataset "
                "size divisible by per_device_train_batch_size"
            )
        length = max(batch["input_ids"].shape[1] for batch in batches)
        batches = [trainer._prepare_inputs(_without_plan(pad_sequence_to_length(batch, length))) for batch in batches]

        frozen_models = trainer.objective.auxiliary_models

        def loss_of(hidden_BSD: torch.Tensor, index: int) -> torch.Tensor:
            stage = _LastStageModel(self.model, hidden_BSD)
            kept = dict(frozen_models)
            # the objective calls its frozen models as it calls the policy: their last stage's outputs, already run
            frozen_models.update({name: _LastStageModel(kept[name], outputs[index])
                                  for name, outputs in frozen_outputs.items()})
            try:
                loss = trainer.compute_loss(stage, batches[index], num_items_in_batch=num_items[index])
            finally:
                frozen_models.update(kept)
            return loss / trainer._loss_divisor

        self.model.train()
        trainer._optimizer_mode("train")
        with trainer._autocast(), trainer._activation_offloading():
            frozen_outputs = {name: pipeline.forward(batches) for name, pipeline in self.frozen.items()}
            return self.pipeline.run(batches, loss_of)

    def from_last_stage(self, value):
        """The last stage's ``value`` (any picklable object) on every stage."""
        box = [value]
        dist.broadcast_object_list(box, src=self.pipeline.last_stage_rank, group=self.pipeline.group)
        return box[0]


class PipelineMixin:
    """The Trainer's side of pipeline parallel: the step through the stages, and the logged metrics from the last
    stage."""

    @property
    def _pipeline_parallel(self):
        """``self.model``'s PipelineTraining under pipeline parallel, else None ."""
        run = getattr(self, "distributed", None)
        if run is None or not run.dims.pp_enabled:
            return None
        pipeline = self.__dict__.get("_pipeline_training")
        if pipeline is None or pipeline.model is not self.model:
            pipeline = self.__dict__["_pipeline_training"] = PipelineTraining(self)
        return pipeline

    def _pipeline_step(self, batches: list[dict], num_items) -> None:
        """One optimizer step's forward and backward through the pipeline (every micro-batch together)."""
        self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
        # (perf/fwd_bwd_s: the whole schedule; its forwards and backwards interleave, so no perf/fwd_s is taken)
        with self._performance.timed("fwd_bwd"):
            loss = self._pipeline_parallel.step(self, batches, num_items)
        if self.args.logging_nan_inf_filter:  # on the device: no host read of the loss
            mean = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            loss = torch.where(torch.isfinite(loss), loss, mean)
        self._tr_loss += loss
        self.state.total_flos += sum(self.floating_point_ops(b) for b in batches)

    def _pop_metrics(self, mode: str) -> dict:
        """The objective's metrics since the last log, reduced over the ranks; under pipeline parallel the last
        stage's (where the losses are computed), on every rank."""
        metrics = self._metrics[mode].pop(self._reduce_metrics)
        pipeline = self._pipeline_parallel
        return metrics if pipeline is None else pipeline.from_last_stage(metrics)


def _pipeline_of(trainer, model):
    from hfnative.parallel.fsdp import mixed_precision_policy
    from hfnative.parallel.pipeline import Pipeline

    run = trainer.distributed
    dtype = mixed_precision_policy(run.plan.mixed_precision).param_dtype or next(model.parameters()).dtype
    return Pipeline(model, run.dims.pp_mesh(run.mesh), run.plan.pp_schedule, trainer.device, dtype)


def _without_plan(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if key != "attention_plan"}


__all__ = ["PipelineMixin", "PipelineTraining", "pipeline_conflicts"]
