"""Batches in the order transformers' Trainer produces them, resumable mid-epoch.

Epoch ``e`` visits the dataset in ``torch.randperm(n, Generator().manual_seed(seed + e))`` order
(accelerate's seedable sampler, which the Trainer uses), in batches of ``batch_size``. With several
data-parallel ranks, rank r takes the batches accelerate's ``BatchSamplerShard`` gives it (batch i goes
to rank i mod ranks; the last round is completed from the epoch's first batches), so a run launched with
torchrun or accelerate sees the batches transformers' Trainer would.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch.utils.data import DataLoader, Sampler

from hfnative.device_policy import host_to_device
from hfnative.losses import shift_labels

from ..running.distributed import pad_sequence_to_multiple


class EpochBatchSampler(Sampler):
    """Seeded per-epoch permutation cut into batches; ``skip`` drops the first batches once.

    ``grouped_by_length`` (``(lengths, group_batch)``, ``train_sampling_strategy="group_by_length"``): the order of
    transformers' LengthGroupedSampler, rows of similar lengths together (the permutation cut into mega-batches of
    ``group_batch`` x up to 50 rows, each sorted longest first, the longest row of all in the first batch), its
    permutation drawn from the same seeded generator as the plain order: transformers draws it from torch's global
    generator, so its order after a resume differs from the first run's; this one does not."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = False,
                 grouped_by_length: tuple[list[int], int] | None = None):
        self.num_samples, self.batch_size = num_samples, batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.grouped_by_length = grouped_by_length
        self.epoch, self.skip_batches = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.grouped_by_length is not None:
            from transformers.trainer_pt_utils import get_length_grouped_indices

            lengths, group_batch = self.grouped_by_length
            return get_length_grouped_indices(lengths, group_batch, generator=generator)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self):
        order = self.order()
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        skip, self.skip_batches = self.skip_batches, 0
        yield from batches[skip:]

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (0 if self.drop_last or rest == 0 else 1)


class ShardedEpochBatchSampler(Sampler):
    """This data-parallel rank's share of an EpochBatchSampler, through accelerate's own BatchSamplerShard
    (``even_batches``: every rank gets as many batches); ``skip`` drops this rank's first batches once."""

    def __init__(self, batches: EpochBatchSampler, num_shards: int, shard_index: int):
        self.batches, self.num_shards, self.shard_index = batches, num_shards, shard_index
        self.skip_batches = 0

    # the batch size and drop_last of the underlying sampler: what BatchSamplerShard reads
    @property
    def batch_size(self) -> int:
        return self.batches.batch_size

    @property
    def drop_last(self) -> bool:
        return self.batches.drop_last

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def _shard(self):
        from accelerate.data_loader import BatchSamplerShard

        return BatchSamplerShard(self.batches, self.num_shards, self.shard_index, split_batches=False, even_batches=True)

    def __iter__(self):
        skip, self.skip_batches = self.skip_batches, 0
        for index, batch in enumerate(self._shard()):
            if index >= skip:
                yield batch

    def __len__(self) -> int:
        return len(self._shard())


def has_length(dataset) -> bool:
    try:
        return len(dataset) is not None
    except (TypeError, NotImplementedError):
        return False


class RebalancedBatchSampler(Sampler):
    """transformers' BatchRebalanceSampler (``train_sampling_strategy="batch_rebalance"``): each step's rows over every
    data-parallel rank (per-device batch x accumulation x ranks) taken from the epoch's seeded permutation, sorted by
    length and cut into micro-batches of balanced cost (fewer rows where rows are long), this rank's
    ``grad_accum`` of them; ``skip_batches`` drops this rank's first micro-batches once. Its permutation is seeded
    with the data seed (transformers leaves the sampler's own default, 42, which is also TrainingArguments' seed)."""

    def __init__(self, lengths: list[int], batch_size: int, grad_accum: int, seed: int, drop_last: bool,
                 shuffle: bool = True, num_shards: int = 1, shard_index: int = 0):
        from transformers.trainer_pt_utils import BatchRebalanceSampler

        self.sampler = BatchRebalanceSampler(lengths, effective_batch_size=batch_size * grad_accum * num_shards,
                                             dp_size=num_shards, grad_accum=grad_accum, shuffle=shuffle, seed=seed,
                                             rank=shard_index, drop_last=drop_last)
        self.skip_batches = 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        skip, self.skip_batches = self.skip_batches, 0
        yield from itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)


def worker_options(args) -> dict:
    """The DataLoader's worker settings as transformers passes them: ``dataloader_num_workers`` and, with workers,
    ``dataloader_persistent_workers``, ``dataloader_prefetch_factor``, ``dataloader_multiprocessing_context`` and
    ``dataloader_in_order`` (torch's DataLoader arguments of those names)."""
    workers = args.dataloader_num_workers
    if workers == 0:
        if args.dataloader_persistent_workers:
            raise ValueError("dataloader_persistent_workers=True keeps the loader's worker processes between epochs, "
                             "but dataloader_num_workers=0 starts none; set dataloader_num_workers > 0 or leave "
                             "dataloader_persistent_workers False")
        return {"num_workers": 0}
    options = {"num_workers": workers, "persistent_workers": args.dataloader_persistent_workers,
               "in_order": args.dataloader_in_order}
    if args.dataloader_prefetch_factor is not None:
        options["prefetch_factor"] = args.dataloader_prefetch_factor
    if args.dataloader_multiprocessing_context is not None:
        options["multiprocessing_context"] = args.dataloader_multiprocessing_context
    return options


def make_dataloader(dataset, batch_size: int, collate_fn, *, seed: int, shuffle: bool, drop_last: bool = False,
                    workers: dict | None = None, num_shards: int = 1, shard_index: int = 0,
                    grouped_by_length: tuple[list[int], int] | None = None,
                    rebalanced: tuple[list[int], int] | None = None):
    """A DataLoader over a sized dataset (seeded epochs; ``grouped_by_length``: see EpochBatchSampler;
    ``rebalanced``: ``(lengths, grad_accum)``, see RebalancedBatchSampler) or an iterable one (stream order); with
    ``num_shards`` > 1, the batches of data-parallel rank ``shard_index`` only. ``workers``: the DataLoader's worker
    options (``worker_options``; None: none, the main process reads)."""
    workers = workers or {}
    if rebalanced is not None and has_length(dataset):
        lengths, grad_accum = rebalanced
        batch_sampler = RebalancedBatchSampler(lengths, batch_size, grad_accum, seed, drop_last, shuffle=shuffle,
                                               num_shards=num_shards, shard_index=shard_index)
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, **workers)
    if has_length(dataset):
        batch_sampler = EpochBatchSampler(len(dataset), batch_size, seed, shuffle=shuffle, drop_last=drop_last,
                                          grouped_by_length=grouped_by_length)
        if num_shards > 1:
            batch_sampler = ShardedEpochBatchSampler(batch_sampler, num_shards, shard_index)
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, **workers)
    if num_shards > 1:  # accelerate's split of a stream (dispatch_batches=False): rank r reads rows
        # [r * batch_size, (r + 1) * batch_size) of every batch_size * num_shards, the last round completed from
        # the stream's first rows unless drop_last (every rank gets as many batches)
        from accelerate.data_loader import IterableDatasetShard

        dataset = IterableDatasetShard(dataset, batch_size=batch_size, drop_last=drop_last, num_processes=num_shards,
                                       process_index=shard_index, split_batches=False)
        workers = {}  # one reader keeps the rows in the split's order
    return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, drop_last=drop_last, **workers)


class StreamGroupBatches(torch.utils.data.IterableDataset):
    """An online RL trainer's generation batches of prompts from a stream (TRL's ``repeat_iterable_dataset`` under
    accelerate's stream split): ``prompts_per_batch * num_shards`` rows at a time in stream order (a trailing
    incomplete batch dropped), this rank's ``prompts_per_batch`` of them (rank r the r-th contiguous slice, so
    every prompt's group stays on one rank), each batch yielded ``repeat`` times in a row."""

    def __init__(self, stream, prompts_per_batch: int, repeat: int, num_shards: int = 1, shard_index: int = 0):
        self.stream, self.prompts_per_batch, self.repeat = stream, prompts_per_batch, repeat
        self.num_shards, self.shard_index = num_shards, shard_index

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.stream, "set_epoch"):
            self.stream.set_epoch(epoch)  # reshuffles a shuffled datasets.IterableDataset

    def __iter__(self):
        width, rows, batches = self.prompts_per_batch * self.num_shards, [], 0
        start = self.shard_index * self.prompts_per_batch
        for row in self.stream:
            rows.append(row)
            if len(rows) == width:
                mine = rows[start : start + self.prompts_per_batch]
                for _ in range(self.repeat):
                    yield [copy.deepcopy(r) for r in mine]  # repeats stay independent, as re-read rows are
                rows, batches = [], batches + 1
        if batches == 0 and rows:
            raise ValueError(
                f"train_dataset (a stream) has {len(rows)} prompts, fewer than one generation batch needs "
                f"({width} prompts over {self.num_shards} data-parallel ranks): add prompts or lower "
                "per_device_train_batch_size / steps_per_generation"
            )


def start_epoch(dataloader: DataLoader, epoch: int, skip_batches: int = 0):
    """An iterator over the epoch's batches, the first ``skip_batches`` left out."""
    sampler = dataloader.batch_sampler
    if isinstance(sampler, (EpochBatchSampler, ShardedEpochBatchSampler, RebalancedBatchSampler)):
        sampler.set_epoch(epoch)
        sampler.skip_batches = skip_batches
        return iter(dataloader)
    if hasattr(dataloader.dataset, "set_epoch"):
        dataloader.dataset.set_epoch(epoch)
    iterator = iter(dataloader)
    for _ in range(skip_batches):
        next(iterator, None)
    return iterator
# dataset columns a batch may carry into the model and loss (others are dropped when
# remove_unused_columns is on, as transformers drops what the model's forward does not take)
MODEL_INPUT_COLUMNS = (
    "input_ids", "attention_mask", "position_ids", "labels", "shift_labels", "seq_lengths", "completion_mask", "assistant_masks",
)


class PreparedInputs(dict):
    """A batch ``DataMixin._prepare_inputs`` has prepared (a plain dict to every reader)."""


class DataMixin:
    """The Trainer's data: the objective's dataloaders, the columns a batch keeps, and each batch prepared once for
    the model."""

    def _drop_unused_columns(self, dataset):
        if dataset is None or not self.args.remove_unused_columns or not hasattr(dataset, "column_names"):
            return dataset
        if isinstance(dataset, dict):
            return {name: self._drop_unused_columns(d) for name, d in dataset.items()}
        columns = dataset.column_names or []
        unused = [c for c in columns if c not in MODEL_INPUT_COLUMNS]
        return dataset.remove_columns(unused) if unused and len(unused) < len(columns) else dataset

    def num_examples(self, dataloader) -> int:
        """Rows in ``dataloader``'s dataset (its batches x the per-device batch where it has no length)."""
        try:
            return len(dataloader.dataset)
        except (AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}: training requires a train_dataset.")
        return self.objective.train_dataloader(self.train_dataset, self.data_collator)

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer.evaluate() needs an eval_dataset")
        own = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        if not self.args.dataloader_persistent_workers or not any(dataset is d for d in own):
            return self.objective.eval_dataloader(dataset, self.data_collator)
        # persistent workers: one loader per eval dataset of the trainer for its life, as transformers keeps them (its
        # workers are not started again at every evaluation)
        kept = self.__dict__.setdefault("_eval_dataloaders", {})
        if id(dataset) not in kept:
            kept[id(dataset)] = self.objective.eval_dataloader(dataset, self.data_collator)
        return kept[id(dataset)]

    def _prepare_inputs(self, inputs: dict) -> dict:
        """Add what the model needs once per batch (shifted targets, the attention plan, made from the host tensors
        so no device sync), then move the tensors to the device; a batch prepared already (the loop prepares each
        step's batches, its normalizer counting them on the host between the two halves) comes back as it is."""
        if isinstance(inputs, PreparedInputs):
            return inputs
        return self._to_device(self._complete_on_host(inputs))

    def _complete_on_host(self, inputs: dict) -> dict:
        """What ``_prepare_inputs`` adds before the move: shifted targets, padding for the layout, the attention plan."""
        inputs = dict(inputs)
        if "labels" in inputs and "shift_labels" not in inputs:
            inputs["shift_labels"] = shift_labels(inputs["labels"])
        if self.distributed is not None and self.distributed.dims.tp_enabled:
            inputs = pad_sequence_to_multiple(inputs, self.distributed.dims.tp)
        if "attention_plan" not in inputs and hasattr(self.native_model, "plan_attention"):
            inputs["attention_plan"] = self.native_model.plan_attention(
                inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids"), device=self.device
            )
        return inputs

    def _to_device(self, inputs: dict) -> PreparedInputs:
        """The batch's tensors on the device; from the host to a GPU through pinned memory, so the copy does not wait
        for the kernels queued before it (a copy from pageable memory does)."""
        return PreparedInputs({k: host_to_device(v, self.device) if isinstance(v, torch.Tensor) else v
                               for k, v in inputs.items()})
