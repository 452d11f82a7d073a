"""Prompt batches for the generating objectives and their generation batches cut into micro-batches.

Shapes: N completions of a generation batch, G per prompt (consecutive).

A generation batch of prompts is read once per micro-batch that trains on it (``GenerationBatchSampler``: TRL's
RepeatSampler without the per-completion repeats), every prompt's group on one data-parallel rank; the objective
generates on the first read and cuts the scored batch into micro-batches (``split_generation_batch``).
"""

from __future__ import annotations

import torch

from ..loop.data_loading import EpochBatchSampler, StreamGroupBatches, has_length
from .batches import model_inputs, trimmed_rows


class GenerationBatchSampler(EpochBatchSampler):
    """Batches of ``prompts_per_batch`` prompt indices in the epoch's seeded order (an incomplete last batch
    dropped), each yielded ``repeat`` times in a row: the loop reads one per micro-batch, and the objective
    generates on the first of each run (TRL's RepeatSampler, without the per-completion repeats). With
    ``num_shards`` data-parallel ranks, each generation batch of every rank is cut from one batch of
    ``prompts_per_batch * num_shards`` prompts, so every prompt's group stays on one rank."""

    def __init__(self, num_samples: int, prompts_per_batch: int, repeat: int, seed: int, shuffle: bool = True,
                 num_shards: int = 1, shard_index: int = 0):
        super().__init__(num_samples, prompts_per_batch * num_shards, seed, shuffle=shuffle, drop_last=True)
        self.repeat, self.prompts_per_batch, self.shard_index = repeat, prompts_per_batch, shard_index

    def __iter__(self):
        order = self.order()
        mine = slice(self.shard_index * self.prompts_per_batch, (self.shard_index + 1) * self.prompts_per_batch)
        batches = [order[i : i + self.batch_size][mine] for i in range(0, len(order) - self.batch_size + 1, self.batch_size)]
        repeated = [batch for batch in batches for _ in range(self.repeat)]
        skip, self.skip_batches = self.skip_batches, 0
        yield from repeated[skip:]

    def __len__(self) -> int:
        return (self.num_samples // self.batch_size) * self.repeat


def generation_dataloader(dataset, collator, args, repeat: int, shard: dict):
    """This rank's generation batches of prompts (``GenerationBatchSampler``), each read ``repeat`` times."""
    from torch.utils.data import DataLoader

    shards, G = shard.get("num_shards", 1), args.num_generations
    if args.generation_batch_size % (G * shards):
        raise ValueError(
            f"generation_batch_size={args.generation_batch_size} over {shards} data-parallel ranks does not give "
            f"each rank whole groups of num_generations={G}: make it a multiple of {G * shards}"
        )
    prompts_per_batch = args.generation_batch_size // (G * shards)
    if not has_length(dataset):  # a stream: TRL's buffered shuffle (seed), then its batches in stream order
        stream = dataset.shuffle(seed=args.seed) if args.shuffle_dataset and hasattr(dataset, "shuffle") else dataset
        return DataLoader(StreamGroupBatches(stream, prompts_per_batch, repeat, **shard), batch_size=None,
                          collate_fn=collator, num_workers=0)
    if len(dataset) < prompts_per_batch * shards:
        raise ValueError(
            f"train_dataset has {len(dataset)} prompts, fewer than one generation batch needs "
            f"({args.generation_batch_size} completions / {G} generations): add prompts or "
            "lower per_device_train_batch_size / steps_per_generation"
        )
    sampler = GenerationBatchSampler(len(dataset), prompts_per_batch, repeat,
                                     seed=args.data_seed if args.data_seed is not None else args.seed,
                                     shuffle=args.shuffle_dataset, **shard)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collator, num_workers=0)


def rows_as_they_are(batch):
    """The collator of prompt batches: the dataset rows as they are."""
    return list(batch)


def check_prompt_rows(dataset, name: str):
    """``dataset`` when its rows have a 'prompt' column (checked on row 0), else a ValueError naming it."""
    first = next(iter(dataset), None)
    if not isinstance(first, dict) or "prompt" not in first:
        raise ValueError(
            f"{name}: row 0 is {first!r}; expected a dict with a 'prompt' column (a string, or a list of "
            "{'role', 'content'} messages for conversations)"
        )
    return dataset


def group_eval_dataloader(dataset, collator, context, num_generations: int):
    """This rank's evaluation batches of prompts, in order: per_device_eval_batch_size completions each
    (per_device_eval_batch_size / num_generations prompts, every group on one rank)."""
    a, G = context.args, num_generations
    if a.per_device_eval_batch_size % G:
        raise ValueError(
            f"per_device_eval_batch_size={a.per_device_eval_batch_size} counts completions and must hold whole "
            f"groups of num_generations_eval={G}: make it a multiple of {G}"
        )
    return context.make_dataloader(dataset, a.per_device_eval_batch_size // G, collator, seed=a.seed, shuffle=False)


class GenerationBatches:
    """The data side of an objective that generates from batches of prompts (GRPO, RLOO; mixed in before
    ``Objective``): rows with a 'prompt' (with environments a row may leave it out: its environment's reset writes
    it), collated as they are, read in generation batches of ``generate_every`` micro-batches each, and evaluated in
    whole groups of ``num_generations_eval``. The objective has ``context``, ``args``, ``rollout`` and those two."""

    def prepare_train_dataset(self, dataset):
        return self._check_prompts(dataset, "train_dataset")

    def prepare_eval_dataset(self, dataset):
        return None if dataset is None else self._check_prompts(dataset, "eval_dataset")

    def _check_prompts(self, dataset, name: str):
        tool_calling = self.rollout.tool_calling
        if tool_calling is not None and tool_calling.environments is not None:
            return dataset
        return check_prompt_rows(dataset, name)

    def default_collator(self):
        return rows_as_they_are

    def train_dataloader(self, dataset, collator):
        return generation_dataloader(dataset, collator, self.args, self.generate_every, self.context.data_shard())

    def eval_dataloader(self, dataset, collator):
        return group_eval_dataloader(dataset, collator, self.context, self.num_generations_eval)


def split_generation_batch(batch: dict, pieces: int, order: torch.Tensor, context) -> list[dict]:
    """A generation batch (``Rollout.tensors`` and its per-row tensors) in the row ``order`` cut into ``pieces``
    micro-batches, each trimmed to its own longest prompt and completion, as model inputs split over the
    context-parallel ranks, and carrying the generation batch's completion tokens per micro-batch (TRL's count for
    the token-sum losses, which the loop averages over the ranks: ``Normalizer.tokens_per_micro_batch``)."""
    N = batch["prompt_ids"].shape[0]
    tokens_per_micro_batch = float(loss_mask(batch).sum()) / pieces
    micro_batches = []
    for start in range(0, N, N // pieces):
        micro_batch = context.context_parallel.split(model_inputs(trimmed_rows(batch, order[start : start + N // pieces])))
        micro_batch["completion_tokens_per_micro_batch"] = tokens_per_micro_batch
        micro_batches.append(micro_batch)
    return micro_batches


def loss_mask(batch: dict) -> torch.Tensor:
    """The completion tokens trained on: the completion mask, times a rollout's tool mask (0 on tokens a tool or
    environment wrote) when it has one (TRL's completion_mask * tool_mask)."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


__all__ = ["GenerationBatchSampler", "GenerationBatches", "check_prompt_rows", "generation_dataloader", "group_eval_dataloader", "loss_mask",
           "rows_as_they_are", "split_generation_batch"]
