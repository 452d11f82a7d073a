"""The trainer as one rank of a distributed run (torchrun, ``accelerate launch``, ``hfnative-train
--num_processes N``).

A process launched with ``WORLD_SIZE`` > 1 joins the process group (gloo on CPU, NCCL on GPU), turns
the launch's settings into one layout (``trainers/running/parallel_plan.py``: transformers' ``fsdp`` /
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
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers.trainer_callback import TrainerState

from hfnative.losses import IGNORE_INDEX
from hfnative.parallel.groups import ContextParallelGroup
from hfnative.parallel.teardown import end_process_group
from hfnative.peft.settings import is_quantization_requested

from ..loop.normalizers import MEAN_UNIT, PER_MICRO_BATCH_UNIT, SUM_UNIT

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

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """rank 0's ``tensor`` on every rank (each gives one of the same shape and dtype, on its device), in place."""
        dist.broadcast(tensor, src=0)
        return tensor

    def failure(self, error: BaseException, last_step: int, args) -> RankFailureError:
        """The error this rank raises when a collective failed or timed out (``is_collective_failure``): the ranks
        that did not report the failure too within ``answer_wait_s(args)`` seconds are named (they died, or are stuck
        outside the collective), with the last completed step."""
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        where = (f"rank {self.rank}: a collective failed in step {last_step + 1} (the last completed step is "
                 f"{last_step}; {type(error).__name__}: {first_line})")
        wait_s = answer_wait_s(args)
        try:
            silent = unanswering_ranks(self.rank, self.world_size, last_step, wait_s)
        except Exception as store_error:  # the rendezvous store went with the rank (or launcher) that hosted it
            return RankFailureError(
                f"{where}; the rendezvous store cannot be reached to ask the other ranks ({type(store_error).__name__}:"
                f" {store_error}): rank 0, or the launcher hosting the store, is gone. {_RESUME_HINT}"
            )
        if silent:
            named = ", ".join(str(rank) for rank in silent)
            return RankFailureError(
                f"{where}; rank{'s' if len(silent) > 1 else ''} {named} did not answer within {wait_s:.0f} s: dead, or "
                f"stuck outside the collective (ddp_timeout={args.ddp_timeout} s bounds a wait on a rank). "
                f"{_RESUME_HINT}"
            )
        return RankFailureError(
            f"{where}; every rank reached a failed collective, so none died: the ranks ran different collectives, or "
            f"one step took longer than ddp_timeout={args.ddp_timeout} s (raise it for slow steps or saves). "
            f"{_RESUME_HINT}"
        )


_RESUME_HINT = ("output_dir keeps only complete checkpoints; resume with resume_from_checkpoint=True once every rank "
                "runs again")
_FAILED_KEY = "hfnative/collective-failed/rank{rank}"
_BACKEND_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "timed out")


class RankFailureError(RuntimeError):
    """A distributed run's collective failed or timed out; the message names the ranks that did not answer and the
    last completed step."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` came from a collective that failed (a peer gone) or timed out."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(marker in text for marker in _BACKEND_MARKERS)


def answer_wait_s(args) -> float:
    """How long a rank that saw a collective fail waits for the others to report it too."""
    return float(min(args.ddp_timeout, 10))


def unanswering_ranks(rank: int, world_size: int, last_step: int, wait_s: float) -> list[int]:
    """The ranks that did not record a failed collective in the rendezvous store within ``wait_s`` seconds, after
    this rank recorded its own."""
    store = dist.distributed_c10d._get_default_store()
    store.set(_FAILED_KEY.format(rank=rank), str(last_step))
    silent = [other for other in range(world_size) if other != rank]
    deadline = time.monotonic() + wait_s
    while silent:
        silent = [other for other in silent if not store.check([_FAILED_KEY.format(rank=other)])]
        if not silent or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return silent


_ends_at_exit = False


def bound_collectives(timeout: timedelta) -> None:
    """A collective of this process waits at most ``timeout`` (ddp_timeout) for the other ranks, so a dead or hung rank
    fails the run instead of hanging it: in the groups that exist (the default group, whoever started it) and in
    those made later without a timeout of their own (the device mesh's dimensions and flattened dimensions, which
    would take torch's default, 30 minutes on gloo)."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    if isinstance(distributed_c10d.default_pg_nccl_timeout, timedelta):  # a timedelta where NCCL is built in
        distributed_c10d.default_pg_nccl_timeout = timeout
    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(timeout, group)


def _backend(device: torch.device, cpu_offload: bool) -> str:
    """The process group's backend: gloo on CPUs, NCCL on GPUs; with CPU offload also gloo for the CPU tensors (the
    offloaded gradients' norms and gathers), which NCCL cannot reduce."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def start_distributed(args, device: torch.device) -> DistributedRun | None:
    """Join the launched run (None for a single process): the process group, the layout, the mesh."""
    from .parallel_plan import resolve_parallel_plan

    world_size = launched_world_size()
    if world_size <= 1:
        resolve_parallel_plan(args, 1)  # refuses what no layout can honour; says when a setting is a no-op here
        return None

    plan = resolve_parallel_plan(args, world_size)
    if device.type == "cuda":  # also when another library started the group: object collectives use the current device
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=args.ddp_backend or _backend(device, plan.cpu_offload),
                                timeout=timedelta(seconds=args.ddp_timeout))
    bound_collectives(timedelta(seconds=args.ddp_timeout))
    global _ends_at_exit
    if not _ends_at_exit:
        # whoever started the group (here, or accelerate for a ParallelismConfig), it ends before the interpreter
        # finalizes, and gloo's worker threads are idle by then: otherwise a rank can abort after its work is done
        # (hfnative/parallel/teardown.py says why)
        atexit.register(end_process_group)
        _ends_at_exit = True
    mesh = plan.dims.build_mesh(device.type)
    run = DistributedRun(plan, mesh, dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", 0)))
    if run.is_main:
        logger.info("distributed run: %d processes, %s", world_size, plan.describe())
    return run


def pad_sequence_to_multiple(inputs: dict, multiple: int) -> dict:
    """Pad every [B, S] tensor of a batch at the end to a sequence length divisible by ``multiple`` (tensor
    parallel splits the sequence over its ranks); see ``pad_sequence_to_length``."""
    length = inputs["input_ids"].shape[1]
    return pad_sequence_to_length(inputs, length + -length % multiple)


def pad_sequence_to_length(inputs: dict, target: int) -> dict:
    """Pad every [B, S] tensor of a batch at the end to the sequence length ``target`` (>= S). The added positions
    change nothing: attention is causal, they carry no label, padding masks mark them padding, and position ids run
    on past the last token."""
    length = inputs["input_ids"].shape[1]
    extra = target - length
    if extra <= 0:
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


class _WholeSequenceInputs:
    """A collator whose batches the trainer's objective completes (``Objective.whole_sequence_inputs``: what is read
    from whole sequences, such as shifted targets) before the context-parallel split cuts them."""

    def __init__(self, trainer, collator):
        self.trainer, self.collator = trainer, collator

    def __call__(self, features):
        return self.trainer.objective.whole_sequence_inputs(self.collator(features))

    def __getattr__(self, name):  # the wrapped collator's settings (pad_token_id, ...)
        if name in ("collator", "trainer"):
            raise AttributeError(name)
        return getattr(self.collator, name)


@dataclass(frozen=True)
class StepNormalization:
    """A step's normalization on this rank, from its ``Normalizer``: each micro-batch's ``num_items_in_batch``
    (None for a micro-batch mean), what the loop divides each micro-batch's loss by before backward (1: nothing),
    and the share of that loss the logs count (1, or 1 / micro-batches for summed micro-batch means)."""

    items: list
    divisor: int
    logged_share: float = 1.0


class DistributedMixin:
    """The Trainer's side of a distributed run (``self.distributed``: a DistributedRun, or None for one process):
    rank-aware state, parallelizing each model, the data shard (and its sequence split over context-parallel
    ranks), and reductions over the data-parallel ranks."""

    # what transformers' Trainer says of its layout, for code that reads it
    is_deepspeed_enabled = False  # a DeepSpeed config runs as its FSDP2 layout: no DeepSpeed engine (parallel_plan.py)
    # no accelerate FSDP plugin: hfnative shards with FSDP2 itself, and save_model() gathers the whole model
    is_fsdp_enabled = False
    is_model_parallel = False  # no device_map spreading one model over devices
    place_model_on_device = True

    def get_tp_size(self) -> int:
        return self.distributed.dims.tp if self.distributed is not None else 1

    def get_cp_size(self) -> int:
        return self.distributed.dims.cp if self.distributed is not None else 1

    def get_sp_size(self) -> int:
        return 1  # sequence parallelism (DeepSpeed's Ulysses) is not a layout here; context parallelism is cp

    def get_total_train_batch_size(self, args=None) -> int:
        """Rows an optimizer step trains on: per-device batch x gradient accumulation x data-parallel ranks."""
        args = args or self.args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.data_parallel.size

    @property
    def data_collator(self):
        return self.__dict__.get("_data_collator")

    @data_collator.setter
    def data_collator(self, collator):
        """With context parallel the collator's batches are split along the sequence over the cp ranks."""
        run = getattr(self, "distributed", None)
        objective = self.__dict__.get("objective")
        splits = objective is None or objective.split_collated_batches
        if collator is not None and run is not None and run.dims.cp_enabled and splits:
            collator = self._context_parallel_collator(collator)
        self.__dict__["_data_collator"] = collator

    def _context_parallel_settings(self) -> dict:
        """split_batch's arguments for this run's cp ranks."""
        run = self.distributed
        model_args = getattr(self.native_model, "args", None)
        sliding = model_args is not None and any(layer.is_sliding for layer in self.native_model.layers)
        return dict(cp_size=run.dims.cp, cp_rank=run.mesh["cp"].get_local_rank(), group=run.mesh["cp"].get_group(),
                    multiple=run.dims.tp, sliding_window=model_args.sliding_window if sliding else None)

    def _context_parallel_collator(self, collator):
        from hfnative.parallel.context_parallel import ContextParallelCollator

        if isinstance(collator, ContextParallelCollator):
            return collator
        settings = self._context_parallel_settings()
        return ContextParallelCollator(_WholeSequenceInputs(self, collator), settings["cp_size"], settings["cp_rank"],
                                       settings["group"], multiple=settings["multiple"],
                                       sliding_window=settings["sliding_window"])

    @property
    def context_parallel(self) -> ContextParallelGroup:
        """The cp ranks' reductions and the batch split (see ContextParallelGroup)."""
        group = self.__dict__.get("_context_parallel_group")
        if group is None:
            run = getattr(self, "distributed", None)
            mesh = run.mesh["cp"] if run is not None and run.dims.cp_enabled else None
            group = self.__dict__["_context_parallel_group"] = ContextParallelGroup(mesh, self._split_sequences)
        return group

    def _split_sequences(self, batch: dict) -> dict:
        from hfnative.parallel.context_parallel import split_batch

        settings = self._context_parallel_settings()
        return split_batch(self.objective.whole_sequence_inputs(batch), settings.pop("cp_size"), settings.pop("cp_rank"),
                           settings.pop("group"), **settings)

    def _new_state(self, **fields) -> TrainerState:
        run = self.distributed
        return TrainerState(is_local_process_zero=run is None or run.local_rank == 0,
                            is_world_process_zero=run is None or run.is_main, **fields)

    def _may_load_sharded(self, model) -> bool:
        """Whether each rank may read just its slice of ``model``'s checkpoint: a Hub-format folder or id with
        nothing to add before parallelizing (adapters, quantization, token rows a cloned chat template may resize).
        Others are loaded whole, then sharded."""
        kwargs = self._model_init_kwargs
        if self.distributed.dims.pp_enabled:  # each stage keeps its blocks of the whole model, loaded first
            return False
        template = getattr(self.args, "chat_template_path", None)
        if template is not None and os.path.isdir(template):  # cloning it may resize the token rows, before sharding
            return False
        return (isinstance(model, (str, os.PathLike)) and getattr(self, "peft_config", None) is None
                and not is_quantization_requested(kwargs))

    def _parallelize(self, model) -> None:
        from hfnative.parallel import parallelize
        from hfnative.peft.quantize import is_quantized

        from .float8_plan import float8_training

        run, args = self.distributed, self.args
        if run.dims.tp_enabled and any(is_quantized(p) for p in model.parameters()):
            raise ValueError(
                f"a quantized base (load_in_4bit's NF4, load_in_8bit's int8) cannot be split by tensor parallelism "
                f"({run.plan.describe()}): its weights are kept whole on every rank; use data parallelism (FSDP2 / "
                "DDP) with a quantized base, or LoRA without quantization with tp_size > 1"
            )
        if not any(p.is_meta for p in model.parameters()):
            model.to(self.device)
        trainable = any(p.requires_grad for p in model.parameters())
        checkpointing = (args.checkpoint_activations or run.plan.activation_checkpointing) and trainable
        parallelize(
            model, run.dims, run.mesh, float8=float8_training(args) if trainable else None,
            activation_checkpointing=args.activation_checkpointing_mode if checkpointing else None,
            checkpoint_keeps=args.checkpoint_keeps,
            compile=self._compile_settings or False, mixed_precision=run.plan.mixed_precision,
            reshard_after_forward=run.plan.reshard_after_forward, cpu_offload=run.plan.cpu_offload,
        )

    def _data_shard(self) -> dict:
        run = self.distributed
        return {} if run is None else dict(num_shards=run.dp_size, shard_index=run.dp_rank)

    def _step_normalizer(self, normalizer, micro_batches: int) -> StepNormalization:
        """How the loop normalizes a step of ``micro_batches`` on this rank (``Normalizer``'s units).

        An item count is summed over the ranks holding different items (tokens: data x context parallel; sequences,
        pairs: data parallel); a micro-batch mean is divided by the step's micro-batches over the data-parallel
        ranks, times the context-parallel ranks (each holds the same micro-batch's mean, its sums taken over their
        chunks); per-micro-batch token counts are each averaged over the data-parallel ranks and handed to their
        micro-batch, whose loss is then divided as a micro-batch mean; summed micro-batch means are divided by the
        data-parallel and context-parallel ranks only, and logged as their mean; no normalizer: each loss is divided
        by this rank's micro-batches (transformers' Trainer)."""
        if normalizer is None:
            return StepNormalization([None] * micro_batches, micro_batches)
        cp = 1 if self.distributed is None else self.distributed.dims.cp
        if normalizer.unit == SUM_UNIT:
            return StepNormalization([None] * micro_batches, self.data_parallel.size * cp,
                                     logged_share=1 / normalizer.count)
        if normalizer.unit in (MEAN_UNIT, PER_MICRO_BATCH_UNIT):
            counts = normalizer.count if normalizer.per_micro_batch else ()
            if normalizer.per_micro_batch and len(counts) != micro_batches:
                raise ValueError(f"a per-micro-batch normalizer has {len(counts)} counts for a step of {micro_batches} "
                                 "micro-batches")
            # one collective: the micro-batches a mean is taken over (the normalizer's count), summed over the ranks,
            # and each per-micro-batch count summed
            means_over = (normalizer.means_over or len(counts)) if normalizer.per_micro_batch else normalizer.count
            totals = self.data_parallel.sum(torch.tensor([means_over, *counts], dtype=torch.float64)).tolist()
            items = [total / self.data_parallel.size for total in totals[1:]] or [None] * micro_batches
            return StepNormalization(items, int(totals[0]) * cp)
        integral = isinstance(normalizer.count, int)
        if self.distributed is None:
            return StepNormalization([normalizer.count] * micro_batches, 1)
        if (normalizer.counts_tokens and not self.args.average_tokens_across_devices
                and self.objective.follows_average_tokens_across_devices):
            # transformers' average_tokens_across_devices=False: each rank divides its loss by its own tokens and the
            # ranks' gradients are averaged (their sum over the data-parallel ranks, divided by their number); a
            # rank without a label token adds nothing (transformers would divide by 0)
            return StepNormalization([max(normalizer.count, 1)] * micro_batches, self.data_parallel.size)
        count = torch.tensor(normalizer.count, dtype=torch.int64 if integral else torch.float64)
        total = self.distributed.sum_over_dp(count.to(self.device)) if normalizer.counts_tokens else self.data_parallel.sum(count)
        total = int(total.item()) if integral else float(total.item())
        return StepNormalization([total] * micro_batches, 1)

    def _summed_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Each rank's loss is its tokens' share of the step's loss: the step's loss is their sum."""
        if self.distributed is None:
            return value
        return self.distributed.sum_over_dp(value.detach().clone())

    def _reduce_metrics(self, values: torch.Tensor, summed: list[bool]) -> torch.Tensor:
        """Metrics over the data-parallel ranks: running totals summed, per-batch averages averaged."""
        if self.distributed is None:
            return values
        # on the run's device: NCCL reduces no CPU tensor, and a window's first metrics may be host values
        values = self.distributed.sum_over_dp(values.to(self.device, copy=True))
        divide = torch.tensor([1.0 if s else float(self.distributed.loss_ranks) for s in summed], dtype=values.dtype,
                              device=values.device)
        return values / divide


__all__ = [
    "StepNormalization",
    "DistributedMixin",
    "DistributedRun",
    "RankFailureError",
    "bound_collectives",
    "is_collective_failure",
    "launched_world_size",
    "pad_sequence_to_length",
    "pad_sequence_to_multiple",
    "start_distributed",
]
