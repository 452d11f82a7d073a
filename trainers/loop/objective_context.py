"""The context the loop hands an objective: what it may use of its run (the trainer itself stays private)."""

from __future__ import annotations

import torch

from .metric_averages import MetricAverages


class ObjectiveContext:
    """What an objective may use of its run, handed to it by the loop (the trainer stays private).

    ``args`` (the run's config, TRL's names), ``device``, ``model`` (the policy), ``processing_class`` and
    ``tokenizer``, ``state`` (transformers' TrainerState: global_step, num_input_tokens_seen), ``data_collator``
    (the user's, or None before the default is made), ``rank`` (this process in the run), ``broadcast(tensor)``
    (the first rank's tensor on every rank), ``layout`` (the run's ParallelDims, None on one process),
    ``data_parallel`` (gathers and reductions over the data-parallel ranks);
    ``autocast()``, ``prepare_inputs(batch)`` (the loop's own batch preparation: shifted labels, padding for the
    layout, the attention plan, the device), ``metrics(mode)`` (the sink logged at the next log), ``record_generation``
    (a generation call's time and tokens, for the perf/ metrics), ``data_shard()``
    and ``make_dataloader(...)`` (this rank's share of a dataset), ``micro_batches_in_step`` (this rank's, in the
    step being trained), ``uses_adapters`` / ``trains_new_adapters`` (LoRA on the policy; a peft_config given),
    ``resize_vocabulary(rows)`` (the policy's token rows, as TRL's clone_chat_template resizes them).
    """

    def __init__(self, trainer):
        self._trainer = trainer

    # --- the run -----------------------------------------------------------------------------------------
    @property
    def args(self):
        return self._trainer.args

    @property
    def device(self) -> torch.device:
        return self._trainer.device

    @property
    def model(self):
        return self._trainer.native_model

    @property
    def processing_class(self):
        return self._trainer.processing_class

    @property
    def tokenizer(self):
        processing_class = self._trainer.processing_class
        return getattr(processing_class, "tokenizer", processing_class)

    @property
    def state(self):
        """transformers' TrainerState (None while the trainer is being built)."""
        return getattr(self._trainer, "state", None)

    @property
    def data_collator(self):
        return self._trainer.data_collator

    @property
    def rank(self) -> int:
        run = self._trainer.distributed
        return 0 if run is None else run.rank

    @property
    def world_size(self) -> int:
        run = self._trainer.distributed
        return 1 if run is None else run.world_size

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The first rank's ``tensor`` on every rank of the run (each passes one of the same shape and dtype), on
        ``tensor``'s device; the tensor itself on one process."""
        run = self._trainer.distributed
        if run is None:
            return tensor
        return run.broadcast(tensor.to(self.device).contiguous()).to(tensor.device)

    @property
    def layout(self):
        run = self._trainer.distributed
        return None if run is None else run.dims

    @property
    def data_parallel(self):
        return self._trainer.data_parallel

    @property
    def uses_adapters(self) -> bool:
        model = self._trainer.native_model
        return self._trainer.lora_settings is not None or getattr(model, "_has_adapters", lambda: False)()

    def resize_vocabulary(self, rows: int) -> None:
        """The policy's token rows resized (TRL's clone_chat_template: ``ModelMixin._resize_vocabulary``)."""
        self._trainer._resize_vocabulary(rows)

    @property
    def trains_new_adapters(self) -> bool:
        return getattr(self._trainer, "peft_config", None) is not None

    @property
    def micro_batches_in_step(self) -> int:
        return self._trainer._current_accumulation_steps

    @property
    def context_parallel(self):
        """The ranks splitting each sequence (hfnative.parallel.groups.ContextParallelGroup): ``size``, a differentiable
        ``sum`` over their chunks, and ``split`` for a batch made after the collator (e.g. generated completions)."""
        return self._trainer.context_parallel

    # --- the router's load-balancing loss (MoE) -----------------------------------------------------------------
    @property
    def router_loss_ranks(self) -> int:
        """How many ranks' tokens one router load-balancing loss is taken over (their MoE layers' ``token_group``,
        set for every data- and context-parallel layout): each rank's loss is its share of theirs; 1 otherwise."""
        for module in self._trainer.native_model.modules():
            group = getattr(module, "token_group", None)
            if group is not None:
                return torch.distributed.get_world_size(group)
        return 1

    def router_loss(self, aux_loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """The term a micro-batch adds to its loss for the router's load-balancing loss ``aux_loss`` (the model's:
        this rank's share of the whole batch's when ``router_loss_ranks`` > 1), so that the step trains, and logs,
        the mean over its micro-batches of the whole batch's router loss, as one process: the loop divides a loss
        given no item count by the step's micro-batches over the ranks (a micro-batch mean), divides nothing
        otherwise, and sums the ranks' losses; evaluation averages its data-parallel ranks' losses (a micro-batch
        mean's also divided by the cp ranks, whose summed losses it takes)."""
        ranks = self.router_loss_ranks
        if not self._trainer.native_model.training:  # an item-normalized loss is summed over the cp ranks
            return aux_loss * (ranks if num_items_in_batch is None else ranks // self.context_parallel.size)
        # the loop divides the micro-batch's loss by the step's divisor (1 for an item count); each rank's term is its
        # share of the whole batch's router loss over the step's micro-batches
        return aux_loss * (self._trainer._loss_divisor / self.micro_batches_in_step)

    def whole_router_loss(self, aux_loss: torch.Tensor) -> torch.Tensor:
        """The whole batch's router loss for the logs: the metrics average the ranks' values."""
        return aux_loss.detach() * self.router_loss_ranks

    # --- what the loop does for every objective ---------------------------------------------------------------
    def autocast(self):
        return self._trainer._autocast()

    def prepare_inputs(self, batch: dict) -> dict:
        return self._trainer._prepare_inputs(batch)

    def metrics(self, mode: str = "train") -> MetricAverages:
        return self._trainer._metrics[mode]

    def record_generation(self, seconds: float, tokens: int) -> None:
        """One generation call's wall time and the tokens it generated on this rank, for the step's perf/ metrics."""
        self._trainer._performance.record_generation(seconds, tokens)

    def data_shard(self) -> dict:
        return self._trainer._data_shard()

    def make_dataloader(self, dataset, batch_size: int, collate_fn, *, seed: int, shuffle: bool, drop_last: bool = False,
                        grouped_by_length: tuple[list[int], int] | None = None,
                        rebalanced: tuple[list[int], int] | None = None):
        from .data_loading import make_dataloader, worker_options

        return make_dataloader(dataset, batch_size, collate_fn, seed=seed, shuffle=shuffle, drop_last=drop_last,
                               workers=worker_options(self.args), grouped_by_length=grouped_by_length,
                               rebalanced=rebalanced,
                               **self.data_shard())

    def drop_unused_columns(self, dataset):
        return self._trainer._drop_unused_columns(dataset)


__all__ = ["ObjectiveContext"]
