"""Pipeline parallel for the native decoder, on ``torch.distributed.pipelining``.

Each pp rank keeps one stage of the model (``split_into_stage``): a contiguous run of the blocks, the first stage
also the embedding, the last the final norm and the head; the blocks the other stages hold leave a parameterless
``BlockOnAnotherStage`` in their place, so every parameter keeps the whole model's name (a checkpoint written under
one layout loads under any other). The stage is then sharded like a whole model (FSDP2 over its own data-parallel
ranks, ``mesh["dp_shard"]`` of its pp index).

``Pipeline.run`` runs one optimizer step's micro-batches through a schedule ("gpipe": every forward, then every
backward; "1f1b": one forward, one backward in the steady state, so at most ``stages`` micro-batches' activations are
kept). The last stage computes each micro-batch's loss from its normed hidden states through the head (the fused
loss; no logits are kept between stages). The gradients are summed over the micro-batches: each loss is already
divided by the whole step's count.

Shapes: B batch, S sequence, D model dim.
"""

from __future__ import annotations

import math

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import _ScheduleForwardOnly

from hfnative.models.decoder import BlockOnAnotherStage, Transformer

from .replica import whole_tensor

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_layer_ids(n_layers: int, num_stages: int) -> list[range]:
    """The blocks of each stage: contiguous runs, as even as possible (the first stages take one more)."""
    if n_layers < num_stages:
        raise ValueError(f"pp_size={num_stages} stages need at least as many blocks; the model has {n_layers}: "
                         f"set pp_size <= {n_layers}")
    size, extra = divmod(n_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + size + (stage < extra))
    return [range(start, stop) for start, stop in zip(bounds, bounds[1:])]


def check_pipeline_model(model: nn.Module) -> None:
    """Refuse, naming the setting, a model pipeline parallel cannot split."""
    if not isinstance(model, Transformer):
        raise ValueError(f"pipeline parallelism (pp_size > 1) needs hfnative's native model; {type(model).__name__} "
                         "(transformers' own module) can only be sharded with FSDP2: set pp_size=1")
    if model.args.moe is not None:
        raise ValueError("pipeline parallelism (pp_size > 1) with a Mixture-of-Experts model is not supported (the "
                         "router's load-balancing loss spans every stage's blocks): set pp_size=1")
    if model.output is not None and model.tok_embeddings is not None and (
            model.output.base_projection() is model.tok_embeddings.weight):
        raise ValueError("pipeline parallelism (pp_size > 1) with tied input and output embeddings "
                         "(tie_word_embeddings) is not supported: the first stage holds the embedding and the last "
                         "the head; set pp_size=1, or use a model with untied embeddings")


def split_into_stage(model: Transformer, stage: int, num_stages: int) -> Transformer:
    """Keep only stage ``stage`` of ``num_stages`` of ``model`` (in place; the other blocks are freed). Returns it."""
    check_pipeline_model(model)
    kept = stage_layer_ids(len(model.layers), num_stages)[stage]
    for layer_id, block in enumerate(model.layers):
        if layer_id not in kept:
            model.layers[layer_id] = BlockOnAnotherStage(layer_id, block.is_sliding)
    if stage != 0:
        model.tok_embeddings = None
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    model.pipeline_stage = (stage, num_stages)
    return model


class Pipeline:
    """This rank's stage of ``model`` (split by ``split_into_stage``) and the schedule that runs a step through it.

    pp_mesh: the 1-D mesh of the stages (``ParallelDims.pp_mesh``); schedule: a key of SCHEDULES.
    hidden_dtype: the dtype of the hidden states passed between stages (the parameters' compute dtype).
    """

    def __init__(self, model: Transformer, pp_mesh: DeviceMesh, schedule: str, device: torch.device,
                 hidden_dtype: torch.dtype):
        if schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={schedule!r}: expected one of {sorted(SCHEDULES)}")
        assert model.pipeline_stage is not None, "split the model with split_into_stage first"
        self.model, self.schedule_name, self.device, self.hidden_dtype = model, schedule, device, hidden_dtype
        self.stage_index, self.num_stages = model.pipeline_stage
        self.group = pp_mesh.get_group()
        self.last_stage_rank = dist.get_global_rank(self.group, self.num_stages - 1)
        self._schedules: dict[tuple, object] = {}

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _schedule(self, count: int, B: int, S: int, loss_fn):
        """The schedule for ``count`` micro-batches of [B, S] tokens (stages and schedules are built per shape: the
        tensors passed between stages are allocated from it); loss_fn None: forwards only."""
        if loss_fn is None:
            name = "forward"
        else:
            # 1F1B needs a micro-batch per stage to fill the pipeline; a shorter step (an epoch's last) runs as
            # GPipe, which computes the same gradients in another order
            name = self.schedule_name if count >= self.num_stages else "gpipe"
        key = (name, count, B, S)
        if key not in self._schedules:
            D = self.model.args.dim
            # (requires_grad: the gradients of the hidden states go back from stage to stage)
            hidden = torch.empty(B, S, D, dtype=self.hidden_dtype, device="meta", requires_grad=loss_fn is not None)
            inputs = torch.empty(B, S, dtype=torch.long, device="meta") if self.is_first else hidden
            stage = PipelineStage(self.model, self.stage_index, self.num_stages, self.device, input_args=inputs,
                                  output_args=hidden, group=self.group)
            self._schedules.clear()  # one shape's buffers at a time
            if loss_fn is None:
                self._schedules[key] = _ScheduleForwardOnly(stage, count)
            else:
                self._schedules[key] = SCHEDULES[name](stage, count, loss_fn=loss_fn, scale_grads=False)
        schedule = self._schedules[key]
        schedule._loss_fn = loss_fn
        return schedule

    @staticmethod
    def _inputs(micro_batches: list[dict], is_first: bool) -> tuple[list, list]:
        args = [(batch["input_ids"],) if is_first else () for batch in micro_batches]
        kwargs = [{name: batch.get(name) for name in ("attention_mask", "position_ids", "attention_plan")}
                  for batch in micro_batches]
        return args, kwargs

    def _shape(self, micro_batches: list[dict]) -> tuple[int, int]:
        B, S = micro_batches[0]["input_ids"].shape
        if any(tuple(batch["input_ids"].shape) != (B, S) for batch in micro_batches):
            raise ValueError(
                "pipeline parallelism (pp_size > 1) runs a step's micro-batches in one shape: "
                f"got {[tuple(batch['input_ids'].shape) for batch in micro_batches]}"
            )
        return B, S

    @torch.no_grad()
    def forward(self, micro_batches: list[dict]) -> list[torch.Tensor] | None:
        """Forwards only (a frozen model: a reference), no graph: the last stage's normed hidden states [B, S, D] of
        each micro-batch on the last stage, None on the others. micro_batches: as ``run``'s."""
        schedule = self._schedule(len(micro_batches), *self._shape(micro_batches), None)
        args, kwargs = self._inputs(micro_batches, self.is_first)
        schedule._stage.has_backward = False
        schedule._stage.clear_runtime_states()
        schedule._step_microbatches(args, kwargs)
        return list(schedule._stage.output_chunks) if self.is_last else None

    def run(self, micro_batches: list[dict], loss_fn: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one optimizer step's micro-batches through the pipeline.

        micro_batches: each the model's inputs (``input_ids`` [B, S], ``attention_mask``, ``position_ids``,
            ``attention_plan``), all of one shape, on every stage.
        loss_fn(hidden_BSD, index): the loss of micro-batch ``index`` from the last stage's normed hidden states.
        Returns the sum of the micro-batches' losses (detached), on every stage.
        """
        schedule = self._schedule(len(micro_batches), *self._shape(micro_batches), loss_fn)
        args, kwargs = self._inputs(micro_batches, self.is_first)
        losses: list[torch.Tensor] = []
        # what the schedule's step() does before the micro-batches it would split itself (ours come split: each
        # carries its own attention plan)
        schedule._stage.has_backward = True
        schedule._stage.clear_runtime_states()
        schedule._step_microbatches(args, kwargs, list(range(len(micro_batches))), losses, return_outputs=False)
        total = (torch.stack([loss.detach() for loss in losses]).sum() if self.is_last
                 else torch.zeros((), device=self.device))
        total = total.to(torch.float32)
        dist.broadcast(total, src=self.last_stage_rank, group=self.group)
        return total


def clip_grad_norm_over_stages(parameters: list[torch.Tensor], max_norm: float, pp_group) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the parameters of every pipeline stage (each rank passes its own):
    the 2-norm of all their gradients, and each gradient scaled by ``max_norm / norm`` when that is below 1. Returns
    the norm (a plain tensor)."""
    from .grad_norm import clip_grads_to, total_grad_norm

    norm = total_grad_norm(parameters)  # this stage's, over every shard
    squared = norm.double() ** 2
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt().to(norm.dtype)
    clip_grads_to(parameters, max_norm, total)
    return total


def gather_stages(state: dict[str, torch.Tensor], pp_group) -> dict[str, torch.Tensor]:
    """Every stage's whole tensors merged on the CPU of global rank 0 (an empty dict on every other rank), one tensor
    at a time: no rank ever holds more than one whole tensor on its device beyond its own shards.

    state: this rank's stage, as ``get_model_state_dict`` gives it unmerged (FSDP2's DTensor shards, or whole
        tensors); the same names in the same order on every rank of the stage. Each tensor is made whole (a
        collective over the stage's own ranks) just before it is used, then sent as bytes by the pipeline group that
        holds global rank 0 to that rank, which copies it to the CPU. Every rank calls this.
    """
    here, first = dist.get_rank(pp_group), dist.get_global_rank(pp_group, 0)
    merged_here = first == 0  # the pipeline group whose first stage's rank writes the model
    layout = [(name, tensor.dtype, tuple(tensor.shape), _transfer_device_type(tensor, pp_group))
              for name, tensor in state.items()]
    layouts = [None] * dist.get_world_size(pp_group) if merged_here and here == 0 else None
    if merged_here:
        dist.gather_object(layout, layouts, dst=first, group=pp_group)
    merged: dict[str, torch.Tensor] = {}
    for (name, _, _, device_type), tensor in zip(layout, state.values()):
        whole = whole_tensor(tensor.detach())
        if not merged_here:
            continue
        if here == 0:
            merged[name] = whole.to("cpu", copy=True)
        else:
            dist.send(_as_bytes(whole.to(_this_rank(device_type))), dst=first, group=pp_group)
    if not (merged_here and here == 0):
        return {}
    for stage in range(1, len(layouts)):
        source = dist.get_global_rank(pp_group, stage)
        for name, dtype, shape, device_type in layouts[stage]:
            received = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=_this_rank(device_type))
            dist.recv(received, src=source, group=pp_group)
            merged[name] = received.cpu().view(dtype).reshape(shape)  # a later stage's name wins, as in the model
    return merged


def _transfer_device_type(tensor: torch.Tensor, group) -> str:
    """The device type a tensor travels between stages on: the one its whole tensor is made on when the group's
    backend carries it (gloo: the CPU; nccl: CUDA; "cuda:nccl,cpu:gloo": both), else the other one."""
    backend = str(dist.get_backend(group))
    device_type = tensor.device_mesh.device_type if isinstance(tensor, DTensor) else tensor.device.type
    if device_type == "cpu" and "gloo" not in backend:
        return "cuda"
    if device_type != "cpu" and "gloo" in backend and "nccl" not in backend:
        return "cpu"
    return device_type


def _this_rank(device_type: str) -> torch.device:
    """This process's device of that type (its own GPU: each rank sends and receives on its own)."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's storage as a flat uint8 tensor (any dtype, bool and 0-d included: what every backend sends)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


__all__ = ["Pipeline", "SCHEDULES", "check_pipeline_model", "clip_grad_norm_over_stages", "gather_stages",
           "split_into_stage", "stage_layer_ids"]
