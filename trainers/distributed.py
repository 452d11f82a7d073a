"""The trainer as one rank of a distributed run (torchrun, ``accelerate launch``, ``hfnative-train
--num_processes N``).

A process launched with ``WORLD_SIZE`` > 1 joins the process group (gloo on CPU, NCCL on GPU), turns
the launch's settings into one layout (``trainers/parallel_plan.py``: transformers' ``fsdp`` /
``parallelism_config``, accelerate's config) and builds the named device mesh. The trainer then:
  - parallelizes every model it trains or runs frozen through ``hfnative.parallel.parallelize``
    (TP → activation checkpointing → compile → FSDP2), loading each rank's slice straight from the
    checkpoint when it can;
  - reads its data-parallel rank's batches (accelerate's ``BatchSamplerShard`` split); with context
    parallel (cp > 1) each batch is then split along the sequence over the cp ranks (its collator's
    output goes through ``hfnative.parallel.context_parallel.split_batch``: shifted labels from the
    whole sequence, load-balanced chunks, the ring-attention plan);
  - divides each step's summed loss by the label tokens of the whole step over all data-parallel and
    context-parallel ranks (gradients are summed across ranks), so every layout trains the same model;
  - reduces logged losses and metrics over those ranks, logs and writes from rank 0.
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers.trainer_callback import TrainerState

from hfnative.losses import IGNORE_INDEX
from hfnative.parallel.teardown import end_process_group

logger = logging.getLogger(__name__)


def launched_world_size() -> int:
    """The number of processes the launcher started (1 when not launched by torchrun / accelerate)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DistributedRun:
    """This process's place in the run: the layout, the mesh and the data-parallel group."""

    plan: object  # trainers.parallel_plan.ParallelPlan
    mesh: object  # DeviceMesh with dims (dp_replicate, dp_shard, tp)
    rank: int
    world_size: int
    local_rank: int
    _dp_mesh: object = field(default=None, repr=False)
    _loss_mesh: object = field(default=None, repr=False)

    @property
    def dims(self):
        return self.plan.dims

    @property
    def dp_mesh(self):
        if self._dp_mesh is None:
            self._dp_mesh = self.dims.dp_mesh(self.mesh)
        return self._dp_mesh

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def loss_mesh(self):
        """The ranks holding different tokens of a step (data parallel x context parallel), flattened."""
        if self._loss_mesh is None:
            self._loss_mesh = self.dims.loss_mesh(self.mesh)
        return self._loss_mesh

    @property
    def loss_ranks(self) -> int:
        return self.dims.dp_size * self.dims.cp

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.mesh)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks holding different tokens: the data-parallel ranks, times the
        context-parallel ranks that split each sequence (in place; returned). The tp ranks of a group hold
        the same values and take no part."""
        if self.loss_ranks > 1:
            dist.all_reduce(tensor, group=self.loss_mesh.get_group())
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_object(self, value):
        """rank 0's ``value``, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


_ends_at_exit = False


def start_distributed(args, device: torch.device) -> DistributedRun | None:
    """Join the launched run (None for a single process): the process group, the layout, the mesh."""
    from .parallel_plan import resolve_parallel_plan

    world_size = launched_world_size()
    if world_size <= 1:
        resolve_parallel_plan(args, 1)  # refuses what no layout can honour; says when a setting is a no-op here
        return None

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    global _ends_at_exit
    if not _ends_at_exit:
        # whoever started the group (here, or accelerate for a ParallelismConfig), it ends before the interpreter
        # finalizes, and gloo's worker threads are idle by then: otherwise a rank can abort after its work is done
        # (hfnative/parallel/teardown.py says why)
        atexit.register(end_process_group)
        _ends_at_exit = True
    plan = resolve_parallel_plan(args, world_size)
    mesh = plan.dims.build_mesh(device.type)
    run = DistributedRun(plan, mesh, dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", 0)))
    if run.is_main:
        logger.info("distributed run: %d processes, %s", world_size, plan.describe())
    return run


def pad_sequence_to_multiple(inputs: dict, multiple: int) -> dict:
    """Pad every [B, S] tensor of a batch at the end to a sequence length divisible by ``multiple`` (tensor
    parallel splits the sequence over its ranks). The added positions change nothing: attention is causal, they
    carry no label, padding masks mark them padding, and position ids run on past the last token."""
    length = inputs["input_ids"].shape[1]
    extra = -length % multiple
    if extra == 0:
        return inputs
    fill = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0, "completion_mask": 0,
            "assistant_masks": 0, "input_ids": 0}
    padded = dict(inputs)
    for key, value in inputs.items():
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != length:
            continue
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, extra + 1, dtype=value.dtype, device=value.device)
        else:
            tail = torch.full((value.shape[0], extra), fill.get(key, 0), dtype=value.dtype, device=value.device)
        padded[key] = torch.cat([value, tail], dim=1)
    return padded


class DistributedMixin:
    """The Trainer's side of a distributed run (``self.distributed``: a DistributedRun, or None for one process):
    rank-aware state, parallelizing each model, the data shard (and its sequence split over context-parallel
    ranks), and reductions over the data-parallel ranks."""

    @property
    def data_collator(self):
        return self.__dict__.get("_data_collator")

    @data_collator.setter
    def data_collator(self, collator):
        """With context parallel the collator's batches are split along the sequence over the cp ranks."""
        run = getattr(self, "distributed", None)
        if collator is not None and run is not None and run.dims.cp_enabled:
            collator = self._context_parallel_collator(collator)
        self.__dict__["_data_collator"] = collator

    def _context_parallel_collator(self, collator):
        from hfnative.parallel.context_parallel import ContextParallelCollator

        from .sft_trainer import SFTTrainer
        from .trainer import Trainer

        run = self.distributed
        if isinstance(collator, ContextParallelCollator):
            return collator
        if type(self)._make_objective not in (Trainer._make_objective, SFTTrainer._make_objective):
            raise ValueError(
                f"{type(self).__name__} with context parallelism (cp_size={run.dims.cp}): only the language-modeling "
                "objectives (Trainer, SFTTrainer) split their sequences over the cp ranks yet; set cp_size=1"
            )
        if getattr(self, "compute_loss_func", None) is not None:
            raise ValueError(
                f"compute_loss_func with context parallelism (cp_size={run.dims.cp}): each rank holds a slice of every "
                "sequence, so a loss over the model's outputs and labels cannot be computed there; set cp_size=1 or "
                "drop compute_loss_func"
            )
        model_args = getattr(self.model, "args", None)
        sliding = model_args is not None and any(layer.is_sliding for layer in self.model.layers)
        return ContextParallelCollator(
            collator, run.dims.cp, run.mesh["cp"].get_local_rank(), run.mesh["cp"].get_group(), multiple=run.dims.tp,
            sliding_window=model_args.sliding_window if sliding else None,
        )

    def _new_state(self, **fields) -> TrainerState:
        run = self.distributed
        return TrainerState(is_local_process_zero=run is None or run.local_rank == 0,
                            is_world_process_zero=run is None or run.is_main, **fields)

    def _may_load_sharded(self, model) -> bool:
        """Whether each rank may read just its slice of ``model``'s checkpoint: a Hub-format folder or id with
        nothing to add before parallelizing (adapters, quantization). Others are loaded whole, then sharded."""
        kwargs = self._model_init_kwargs
        return (isinstance(model, (str, os.PathLike)) and getattr(self, "peft_config", None) is None
                and not kwargs.get("load_in_4bit") and kwargs.get("quantization_config") is None)

    def _parallelize(self, model) -> None:
        from hfnative.parallel import parallelize
        from hfnative.peft.quantize import is_nf4

        run, args = self.distributed, self.args
        if run.dims.tp_enabled and any(is_nf4(p) for p in model.parameters()):
            raise ValueError(
                f"QLoRA (load_in_4bit / an NF4 base) cannot be split by tensor parallelism ({run.plan.describe()}): "
                "its 4-bit weights are kept whole on every rank; use data parallelism (FSDP2 / DDP) for QLoRA, "
                "or LoRA without quantization with tp_size > 1"
            )
        if not any(p.is_meta for p in model.parameters()):
            model.to(self.device)
        trainable = any(p.requires_grad for p in model.parameters())
        checkpointing = (args.checkpoint_activations or run.plan.activation_checkpointing) and trainable
        parallelize(
            model, run.dims, run.mesh,
            activation_checkpointing=args.activation_checkpointing_mode if checkpointing else None,
            compile=args.torch_compile or run.plan.compile, mixed_precision=run.plan.mixed_precision,
            reshard_after_forward=run.plan.reshard_after_forward, cpu_offload=run.plan.cpu_offload,
        )

    def prediction_step(self, model, inputs, prediction_loss_only=True, ignore_keys=None):
        """With context parallel: each batch's loss over its tokens on every cp rank (the ranks' sums divided by
        their label-token count), so evaluation reports the loss one process would."""
        run = self.distributed
        if run is None or not run.dims.cp_enabled:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not prediction_loss_only:
            raise ValueError(
                f"compute_metrics with context parallelism (cp_size={run.dims.cp}): each rank holds a slice of every "
                "sequence's logits; evaluate the loss only (drop compute_metrics) or set cp_size=1"
            )
        inputs = self._prepare_inputs(inputs)
        if "labels" not in inputs:
            return None, None, None
        group = run.mesh["cp"].get_group()
        count = (inputs["shift_labels"] != IGNORE_INDEX).sum()
        dist.all_reduce(count, group=group)
        with torch.no_grad(), self._autocast():
            loss = self.compute_loss(model, inputs, num_items_in_batch=count.clamp(min=1)).detach().clone()
        dist.all_reduce(loss, group=group)
        return loss, None, inputs.get("labels")

    def _data_shard(self) -> dict:
        run = self.distributed
        return {} if run is None else dict(num_shards=run.dp_size, shard_index=run.dp_rank)

    def _over_all_ranks(self, count: int | None) -> int | None:
        """A step's normalizer (label tokens) over every data-parallel (and context-parallel) rank."""
        if self.distributed is None or count is None:
            return count
        return int(self.distributed.sum_over_dp(torch.tensor(count, dtype=torch.int64, device=self.device)).item())

    def _summed_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Each rank's loss is its tokens' share of the step's loss: the step's loss is their sum."""
        if self.distributed is None:
            return value
        return self.distributed.sum_over_dp(value.detach().clone())

    def _reduce_metrics(self, values: torch.Tensor, summed: list[bool]) -> torch.Tensor:
        """Metrics over the data-parallel ranks: running totals summed, per-batch averages averaged."""
        if self.distributed is None:
            return values
        values = self.distributed.sum_over_dp(values.clone())
        divide = torch.tensor([1.0 if s else float(self.distributed.loss_ranks) for s in summed], dtype=values.dtype,
                              device=values.device)
        return values / divide


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's whole tensors under its native names, on the CPU of rank 0 (an empty dict on the other
    ranks); every rank must call it (the shards are gathered)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


__all__ = [
    "DistributedMixin",
    "DistributedRun",
    "full_state_dict",
    "launched_world_size",
    "pad_sequence_to_multiple",
    "start_distributed",
]
