"""GRPOTrainer: TRL's Group Relative Policy Optimization on the one loop.

Shapes: N completions of a generation batch (G per prompt, consecutive), B completions of a micro-batch,
P prompt tokens (left-padded), T completion tokens (right-padded), D hidden dim.

Every ``steps_per_generation * num_iterations`` micro-batches the objective takes a generation batch of
prompts, samples G completions of each with the native rollout engine (the training model's own weights,
no copy; vLLM with ``use_vllm``, its log-probs corrected by TRL's importance weights), scores them with the
reward functions, turns the rewards into advantages, shuffles the batch and cuts it into
``steps_per_generation`` micro-batches of ``per_device_train_batch_size`` completions, which the following
micro-batches train on (``num_iterations`` times). When the policy has moved since generation, the ratio's
old log-probs are the engine's sampling log-probs (no extra forward). Log-probs of the completion tokens
come from the chunked head loss (no [B, T, V] logits kept); the loss is hfnative.losses.policy's.

Data-parallel ranks each generate whole groups for their part of the generation batch; as in TRL the rewards
are gathered over the ranks, the advantages (the batch std for scale_rewards="batch") and the logged reward
and completion statistics taken over the whole batch, and each rank keeps its own rows' advantages.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import warnings
from dataclasses import dataclass, field

import torch

from hfnative.losses.policy import (
    LOSS_TYPES,
    clipped_policy_loss,
    entropy_bonus,
    group_advantages,
    high_entropy_mask,
    nanstd,
    off_policy_sequence_mask,
    vespo_weights,
    normalize_then_sum_advantages,
    sampler_importance_weights,
    weighted_rewards,
)
from hfnative.peft import disable_adapters

from .arguments import LIGER_DEPRECATION
from .completion_log import CompletionLog
from .construction import is_model_name
from .data_loading import EpochBatchSampler, StreamGroupBatches, has_length
from .grpo_config import _UNSUPPORTED_UNLESS_DEFAULT, GRPOConfig, resolve_generation_batch
from .objective import Objective, enable_router_loss
from .reference_sync import mix_into_reference, sync_due
from .rewards import RewardFunctions
from .rollout_engines import make_rollout_engine
from .tool_calling import tool_calling_for, tool_metrics
from .rollout import (
    Rollout,
    completion_length_metrics,
    completion_logprobs_of,
    model_inputs,
    pad_token_lists,
    sampling_params,
    stop_token_ids,
    trimmed_rows,
)
from .script_arguments import ScriptArguments
from .trainer import Trainer

logger = logging.getLogger(__name__)

# --- data ------------------------------------------------------------------------------------------------------


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


def _rows(batch):
    """The collator: the dataset rows as they are."""
    return list(batch)


def _check_prompts(dataset, name: str):
    first = next(iter(dataset), None)
    if not isinstance(first, dict) or "prompt" not in first:
        raise ValueError(
            f"{name}: row 0 is {first!r}; expected a dict with a 'prompt' column (a string, or a list of "
            "{'role', 'content'} messages for conversations)"
        )
    return dataset


# the sampler-correction statistics taken over every rank: name -> 1.0 (a max) or -1.0 (a min)
SAMPLER_EXTREMES = {"sampling/sampling_logp_difference/max": 1.0, "sampling/importance_sampling_ratio/min": -1.0,
                    "sampling/importance_sampling_ratio/max": 1.0}


def sampler_correction(old_logprobs_NT, batch: dict, args) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's importance-sampling correction for a sampler other than the trained model (vLLM): the weights [N, T]
    and their statistics on this rank."""
    mask_NT = loss_mask(batch)
    weights = sampler_importance_weights(
        old_logprobs_NT, batch["sampling_logprobs"], mask_NT, args.vllm_importance_sampling_mode,
        args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max,
    )
    gap = (old_logprobs_NT - batch["sampling_logprobs"]).abs()[mask_NT.bool()]
    gap = gap[~torch.isnan(gap)]
    stats = {"sampling/sampling_logp_difference/mean": gap.mean() if gap.numel() else torch.tensor(0.0),
             "sampling/sampling_logp_difference/max": gap.max() if gap.numel() else torch.tensor(0.0)}
    flat = weights.flatten() if weights.shape[1] == 1 else weights[mask_NT.bool()]
    for name, reduce in (("min", torch.min), ("mean", torch.mean), ("max", torch.max)):
        stats[f"sampling/importance_sampling_ratio/{name}"] = reduce(flat) if flat.numel() else torch.tensor(0.0)
    return weights.expand_as(old_logprobs_NT).contiguous(), stats


def loss_mask(batch: dict) -> torch.Tensor:
    """The completion tokens trained on: the completion mask, times a rollout's tool mask (0 on tokens a tool or
    environment wrote) when it has one (TRL's completion_mask * tool_mask)."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


# the adaptive entropy controller's state in a checkpoint (TRL's file)
ENTROPY_STATE_FILE = "entropy_ctrl_state.json"


def extremes_over_ranks(metrics: dict, data_parallel, signs: dict[str, float] | None = None) -> dict:
    """The extremes among ``metrics`` over every data-parallel rank (TRL's nanmin / nanmax of the gathered values;
    NaN where no rank has one), so that the ranks' average is that value. ``signs``: name -> 1.0 (a max) or -1.0 (a
    min); default clip_ratio/high_max and clip_ratio/low_min."""
    signs = signs or {"clip_ratio/low_min": -1.0, "clip_ratio/high_max": 1.0}
    names = [name for name in signs if name in metrics]
    if not names or data_parallel.size == 1:
        return metrics
    values = torch.stack([signs[name] * torch.as_tensor(metrics[name]).detach().double() for name in names])
    values = data_parallel.max(values.nan_to_num(nan=-float("inf")))
    values = values.masked_fill(values == -float("inf"), float("nan"))
    return {**metrics, **{name: signs[name] * value for name, value in zip(names, values)}}


# --- the objective ---------------------------------------------------------------------------------------------


class GRPOObjective(Objective):
    """Generation, scoring and the GRPO loss (see the module docstring). Subclasses (RLOO) change
    ``advantages`` and ``policy_loss``."""

    supports = frozenset({"multi_process", "multi_process_generation", "tensor_parallel", "context_parallel",
                          "expert_parallel", "evaluation"})
    # log-probs of the policy at generation time, summed per sequence or per token: None (only when the
    # buffer outlives an optimizer step, as TRL), "rollout" (the engine's sampling log-probs) or "forward"
    old_logprobs_source = "rollout"
    split_collated_batches = False  # prompts are collated; the rollouts' model inputs are split in _split

    def __init__(self, context, reward_funcs, reward_processing_classes=None, reference=None, rollout_func=None,
                 tools=None, environment_factory=None):
        """``reference``: called for the reference model's source when one is needed (beta != 0, no adapters).
        ``rollout_func``: prompts -> TRL's rollout dict (the user's ``rollout_func`` with its trainer bound), which
        then makes the completions instead of the rollout engine. ``tools`` / ``environment_factory``: TRL's
        multi-turn tool-calling rollouts (trainers/tool_calling.py)."""
        super().__init__(context)
        self.rollout_func = rollout_func
        args = context.args
        if (tools or environment_factory is not None) and rollout_func is not None:
            raise ValueError("rollout_func makes the completions itself: pass it without tools / environment_factory")
        self.tool_calling = tool_calling_for(context, tools, environment_factory)
        # the MoE router's load-balancing loss in the policy's loss forward (TRL's rule for router_aux_loss_coef)
        self.aux_loss_coef = enable_router_loss(context.model, args.router_aux_loss_coef)
        if context.layout is not None and context.layout.dp_size != args.world_size:  # tp / cp ranks share completions
            resolve_generation_batch(args, context.layout.dp_size)
        self.num_generations_train = args.num_generations
        self.num_generations_eval = args.num_generations_eval or args.num_generations
        self.loss_type = getattr(args, "loss_type", None)
        if self.loss_type is not None and self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: expected one of {LOSS_TYPES}")
        for name in _UNSUPPORTED_UNLESS_DEFAULT:
            if getattr(args, name, None) not in (None, False, 0.0):
                raise ValueError(f"{name}={getattr(args, name)!r} is not available in hfnative's trainer: leave it at "
                                 "its default (generation runs on the native engine)")
        chat_template_kwargs = dict(args.chat_template_kwargs or {})
        self.rewards = RewardFunctions(reward_funcs, args.reward_weights, reward_processing_classes, context.device,
                                       chat_template_kwargs=chat_template_kwargs,
                                       episode_rewards=self.tool_calling.reward_functions() if self.tool_calling else None)
        sampling = sampling_params(args, args.max_completion_length, stop_token_ids(context.tokenizer, context.model),
                                   generation_kwargs=args.generation_kwargs)
        self.rollout = Rollout(context, sampling, engine=make_rollout_engine(context.model, args),
                               chat_template_kwargs=chat_template_kwargs)
        self.sampling = self.rollout.sampling
        # TRL's correction for a sampler other than the trained model itself (vLLM)
        self.sampler_correction = bool(args.use_vllm and getattr(args, "vllm_importance_sampling_correction", False))
        self.generate_every = args.steps_per_generation * args.num_iterations
        self.use_reference_adapters_off = False
        if args.beta != 0.0:
            if context.uses_adapters or context.trains_new_adapters:
                self.use_reference_adapters_off = True  # the base model, adapters disabled, is the reference
            else:
                self.auxiliary_models["ref"] = reference()
        if args.sync_ref_model:
            self._check_reference_sync(args)
        # the entropy bonus (TRL's entropy_coef / use_adaptive_entropy): the coefficient every micro-batch of a step
        # applies, and the adaptive controller's state (the whole batch's mean entropy of the last step, this step's
        # running sums)
        self.entropy_coef = getattr(args, "entropy_coef", 0.0)
        self.adaptive_entropy = bool(getattr(args, "use_adaptive_entropy", False))
        self.last_step_entropy = float("inf")
        self._entropy_window = None
        self._step = 0  # micro-batches trained so far (TRL's _step)
        self._eval_batches = 0  # evaluation batches completed so far (they key their sampling streams)
        self._buffer: list[dict] | None = None
        self._step_started = None
        self.completion_log = CompletionLog(self.rewards.names, args.generation_batch_size)

    @property
    def num_generations(self) -> int:
        """G of the generation being made: num_generations in training, num_generations_eval in evaluation."""
        return self.num_generations_train if self.context.model.training else self.num_generations_eval

    @property
    def mode(self) -> str:
        return "train" if self.context.model.training else "eval"

    @property
    def engine(self):
        """The policy's rollout engine (the rollout component's)."""
        return self.rollout.engine

    @engine.setter
    def engine(self, engine) -> None:
        self.rollout.engine = engine

    def generates(self) -> bool:
        return True

    # --- data -------------------------------------------------------------------------------------------------
    def prepare_train_dataset(self, dataset):
        return self._check_prompts(dataset, "train_dataset")

    def prepare_eval_dataset(self, dataset):
        return None if dataset is None else self._check_prompts(dataset, "eval_dataset")

    def _check_prompts(self, dataset, name: str):
        """Rows with a prompt; with environments a row may leave it out (its environment's reset writes it)."""
        if self.tool_calling is not None and self.tool_calling.environments is not None:
            return dataset
        return _check_prompts(dataset, name)

    def default_collator(self):
        return _rows

    def train_dataloader(self, dataset, collator):
        return generation_dataloader(dataset, collator, self.args, self.generate_every, self.context.data_shard())

    def eval_dataloader(self, dataset, collator):
        """This rank's evaluation batches of prompts, in order: per_device_eval_batch_size completions each
        (per_device_eval_batch_size / num_generations_eval prompts, every group on one rank)."""
        a, G = self.args, self.num_generations_eval
        if a.per_device_eval_batch_size % G:
            raise ValueError(
                f"per_device_eval_batch_size={a.per_device_eval_batch_size} counts completions and must hold whole "
                f"groups of num_generations_eval={G}: make it a multiple of {G}"
            )
        return self.context.make_dataloader(dataset, a.per_device_eval_batch_size // G, collator, seed=a.seed,
                                            shuffle=False)

    # --- evaluation: each batch of prompts completed (num_generations_eval each) and scored; its loss is the
    # policy loss on them, its metrics TRL's eval_* -----------------------------------------------------------------
    def eval_batch(self, batch):
        self._eval_batches += 1
        place = (1 << 40) + self.context.state.global_step * (1 << 20) + self._eval_batches
        return self.generate_and_score(batch, place)[0]

    def has_eval_loss(self, inputs: dict) -> bool:
        return True

    def samples_in_batch(self, inputs) -> int:
        """Completions of an evaluation batch of prompts."""
        return len(inputs) * self.num_generations_eval

    # --- one optimizer step (each micro-batch's loss is normalized on its own: the default normalizer) ------------
    def micro_batches(self, epoch_iterator, count: int) -> list[dict]:
        self._step_started = time.perf_counter()
        batches = []
        first_place = self.context.state.global_step * self.args.gradient_accumulation_steps
        for index, rows in zip(range(count), epoch_iterator):
            if self._step % self.generate_every == 0 or self._buffer is None:
                self._buffer = self.generate_and_score(rows, first_place + index)
            batches.append(self._buffer[self._step % self.args.steps_per_generation])
            self._step += 1
        return batches

    def _check_reference_sync(self, args) -> None:
        """TRL's refusals of ``sync_ref_model`` without a reference model to synchronize."""
        name = type(args).__name__.removesuffix("Config") + "Trainer"
        if args.beta == 0.0:
            raise ValueError(
                "You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model is not used during "
                f"training. Consequently, {name} does not create a `ref_model` instance, and there is nothing to "
                "synchronize. Please set `sync_ref_model=False`, or set `beta` to a non-zero value."
            )
        if self.use_reference_adapters_off:
            raise ValueError(
                "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. With PEFT, "
                f"{name} does not keep a separate reference model in memory; instead, it recovers reference behavior "
                "by temporarily disabling the adapter. As a result, there is no standalone `ref_model` instance to "
                "synchronize. Use `sync_ref_model=False`, or opt for full fine-tuning if you need a synced reference model."
            )

    def _update_entropy_coef(self) -> None:
        """TRL's adaptive entropy controller at a step's end: the step's mean token entropy over every rank; the
        coefficient up by entropy_coef_delta (to entropy_coef_max) when it is at most entropy_target, else down (to
        entropy_coef_min); logged as entropy_coef."""
        args = self.args
        if self.adaptive_entropy and self._entropy_window is not None:
            totals = self.context.data_parallel.sum(self._entropy_window)
            self.last_step_entropy = float(totals[0] / totals[1].clamp(min=1.0))
            if self.last_step_entropy <= args.entropy_target:
                self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            self._entropy_window = None
        if self.entropy_coef != 0.0 or self.adaptive_entropy:
            self.context.metrics().add("entropy_coef", torch.tensor(float(self.entropy_coef)))

    def checkpoint_state(self) -> dict[str, dict]:
        """TRL's adaptive entropy controller state (its file name and keys), when the controller runs."""
        if not self.adaptive_entropy:
            return {}
        return {ENTROPY_STATE_FILE: {"entropy_coef": self.entropy_coef, "last_world_entropy": self.last_step_entropy}}

    def load_checkpoint_state(self, files: dict[str, dict]) -> None:
        state = files.get(ENTROPY_STATE_FILE)
        if state is not None:
            self.entropy_coef = float(state["entropy_coef"])
            self.last_step_entropy = float(state["last_world_entropy"])

    def after_optimizer_step(self) -> None:
        self._update_entropy_coef()
        if sync_due(self.args, self.context.state.global_step + 1):  # the step just taken
            mix_into_reference(self.auxiliary_models["ref"], self.context.model, self.args.ref_model_mixup_alpha)
        if not self.engine.reads_live_weights and self._step % self.generate_every == 0:  # the next step generates
            from hfnative.converters.rollouts import hub_named_tensors

            self.engine.load_weights(hub_named_tensors(self.context.model))
        if self._step_started is not None:
            self.context.metrics().add("step_time", torch.tensor(time.perf_counter() - self._step_started))

    def on_log(self, logs: dict, mode: str) -> None:
        args, state = self.args, self.context.state
        if args.log_completions and state.is_world_process_zero and "train_runtime" not in logs:
            self.completion_log.print(state.global_step, args.num_completions_to_print, args.log_unique_prompts)

    # --- generation and scoring ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_and_score(self, rows: list[dict], place: int = 0) -> list[dict]:
        """Sample G completions per row, score them, and return the generation batch's micro-batches. ``place``:
        the run's micro-batch that generates (with the run's seed it keys the native engine's per-row sampling
        streams, so the completions do not depend on the number of processes, and a resumed run draws alike)."""
        G, data_parallel = self.num_generations, self.context.data_parallel
        rows = [row for row in rows for _ in range(G)]
        tool_mask, completions, reward_extra = None, None, {}
        if self.tool_calling is not None:
            prompts = [row.get("prompt", [{"role": "user", "content": ""}]) for row in rows]
            prompt_ids, completion_ids, sampling_logprobs, tool_mask, completions, prompts, reward_extra = (
                self._tool_rollout(rows, prompts, place))
        else:
            prompts = [row["prompt"] for row in rows]
        if self.rollout_func is not None:
            prompt_ids, completion_ids, sampling_logprobs, extra, tool_mask = self._custom_rollout(prompts)
            rows = [{**row, **{key: values[i] if isinstance(values, list) else values for key, values in extra.items()}}
                    for i, row in enumerate(rows)]  # TRL hands the extra fields to the reward functions
        elif self.tool_calling is None:
            prompt_ids = self.rollout.tokenize(prompts)
            rollouts = self.rollout.generate(prompt_ids, **self.rollout.row_streams(place, len(prompt_ids)))
            completion_ids, sampling_logprobs = rollouts.completion_ids, rollouts.logprobs
        if completions is None:
            completions = self.rollout.decode(prompts, completion_ids)
        self._log_generation(prompt_ids, completion_ids, tool_mask)

        batch = self.rollout.tensors(prompt_ids, completion_ids, sampling_logprobs, self.args.mask_truncated_completions)
        if tool_mask is not None:  # 0 on the tokens the rollout's environment wrote: attended to, never trained on
            batch["tool_mask"] = pad_token_lists(tool_mask, 1)
        log = self.completion_log
        local_rewards_NF = self.rewards.score(prompts, completions, completion_ids, rows, trainer_state=self.context.state,
                                              log_extra=log.log_extra, log_metric=log.log_metric, extra=reward_extra)
        batch.update(self._model_logprobs(batch))
        # TRL: the rewards of every data-parallel rank's groups, the advantages over them all (the batch std for
        # scale_rewards="batch"), this rank's rows kept; the logged reward statistics are the whole batch's
        rewards_NF = data_parallel.gather_rows(local_rewards_NF)
        advantages = self.advantages(rewards_NF, batch)
        batch["advantages"] = advantages.advantages_N[data_parallel.local_rows(len(prompts))]
        self._log_rewards(rewards_NF, advantages)
        for name, value in log.flush(prompts, completions, rewards_NF, advantages.advantages_N, data_parallel).items():
            self._add(name, value)
        return self._split(batch, 1 if self.mode == "eval" else self.args.steps_per_generation)

    def _tool_rollout(self, rows: list[dict], prompts: list, place: int):
        """A multi-turn rollout (trainers/tool_calling.py): each row's environment reset, the prompts rendered with
        their tools, completed, and continued after each turn's tool results. Later turns sample from per-row streams
        of their own (``Rollout.continuation``). Returns (prompt_ids, completion_ids, sampling log-probs, tool
        mask, completions as messages, the prompts after reset, the reward functions' extra arguments)."""
        tools = self.tool_calling
        episode = tools.start(rows, prompts)
        prompt_ids = tools.tokenize(episode)
        streams = self.rollout.row_streams(place, len(prompt_ids))
        rollouts = self.rollout.generate(prompt_ids, **streams)
        if not tools.calls_tools:  # environments without tool methods: one turn, the completions as text messages
            return (prompt_ids, rollouts.completion_ids, rollouts.logprobs, None,
                    self.rollout.decode(episode.prompts, rollouts.completion_ids), episode.prompts, episode.reward_kwargs())
        turns = tools.run(episode, prompt_ids, rollouts.completion_ids, rollouts.logprobs, self.rollout.continuation(streams))
        for name, value in tool_metrics(turns.calls, turns.failures, len(rows), self.context.data_parallel.sum).items():
            self._add(name, value)
        return (prompt_ids, turns.completion_ids, turns.logprobs, turns.tool_mask, turns.completions, episode.prompts,
                episode.reward_kwargs())

    def _custom_rollout(self, prompts: list):
        """TRL's ``rollout_func`` contract: it gets the prompts (each num_generations times, chat messages left
        untemplated) and returns prompt_ids, completion_ids and logprobs (one entry per prompt), optionally
        ``env_mask`` (1 on the model's tokens, 0 on tokens an environment wrote) and other fields, which go to the
        reward functions. Returns (prompt_ids, completion_ids, sampling log-probs, the other fields, env_mask)."""
        output = self.rollout_func(copy.deepcopy(prompts))
        if not isinstance(output, dict):
            raise ValueError(f"rollout_func returned a {type(output).__name__}: it must return a dict with "
                             "'prompt_ids', 'completion_ids' and 'logprobs'")
        missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - output.keys())
        if missing:
            raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
        extra = {key: value for key, value in output.items() if key not in ("prompt_ids", "completion_ids", "logprobs")}
        tool_mask = extra.pop("env_mask", None)
        extra.pop("logprob_token_ids", None)  # the sampled tokens' own log-probs are the ones used
        prompt_ids, completion_ids = [list(ids) for ids in output["prompt_ids"]], [list(ids) for ids in output["completion_ids"]]
        logprobs = output["logprobs"]
        for name, values in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids), ("logprobs", logprobs),
                             ("env_mask", tool_mask)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(f"rollout_func returned {len(values)} {name} for {len(prompts)} prompts (each prompt "
                                 "comes num_generations times): return one entry per prompt")
        if logprobs is None:
            logprobs = [[0.0] * len(ids) for ids in completion_ids]
        logprobs = [[float("nan") if x is None else float(x[0] if isinstance(x, (list, tuple)) else x) for x in row]
                    for row in logprobs]
        for index, (ids, row) in enumerate(zip(completion_ids, logprobs)):
            mask = None if tool_mask is None else tool_mask[index]
            if len(row) != len(ids) or (mask is not None and len(mask) != len(ids)):
                raise ValueError(f"rollout_func's completion {index} has {len(ids)} tokens but {len(row)} logprobs"
                                 + ("" if mask is None else f" and {len(mask)} env_mask values") + ": give one per token")
        return prompt_ids, completion_ids, logprobs, extra, tool_mask

    def _needs_old_logprobs(self) -> bool:
        """TRL: when the generation batch is trained on after an optimizer step has changed the policy, or
        the sampler's log-probs need correcting."""
        if self.mode == "eval":  # the policy has not moved since the evaluation batch was generated
            return self.sampler_correction
        return self.args.gradient_accumulation_steps % self.generate_every != 0 or self.sampler_correction

    def _model_logprobs(self, batch: dict) -> dict:
        """Generation-time per-token log-probs: the reference model's (beta > 0) and the policy's old ones."""
        out, policy = {}, self.context.model
        if self.args.beta != 0.0:
            if self.use_reference_adapters_off:
                with disable_adapters(policy):
                    out["ref_logprobs"] = self.rollout.completion_logprobs(policy, batch, self.args.per_device_train_batch_size)
            else:
                out["ref_logprobs"] = self.rollout.completion_logprobs(self.auxiliary_models["ref"], batch, self.args.per_device_train_batch_size)
        if self._needs_old_logprobs():
            if self.old_logprobs_source == "forward" or not self.engine.reads_live_weights or self.rollout_func:
                out["old_logprobs"] = self.rollout.completion_logprobs(policy, batch, self.args.per_device_train_batch_size)
            else:
                out["old_logprobs"] = batch["sampling_logprobs"]
        if self.sampler_correction:
            out["sampler_weights"], stats = sampler_correction(out["old_logprobs"], batch, self.args)
            # as TRL: the means averaged over the data-parallel ranks, the extremes taken over them
            for name, value in self._extremes_over_ranks(stats, SAMPLER_EXTREMES).items():
                self._add(name, value)
        return out

    def advantages(self, rewards_NF: torch.Tensor, batch: dict):
        weights_F = self.rewards.weights_F
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            return normalize_then_sum_advantages(rewards_NF, weights_F, self.num_generations)
        if self.args.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(f"multi_objective_aggregation={self.args.multi_objective_aggregation!r}: expected "
                             "'sum_then_normalize' or 'normalize_then_sum'")
        return group_advantages(weighted_rewards(rewards_NF, weights_F), self.num_generations, self.args.scale_rewards)

    def _split(self, batch: dict, pieces: int) -> list[dict]:
        """Shuffle the generation batch (torch's global RNG, as TRL; kept in order in evaluation) and cut it into
        ``pieces`` micro-batches, each trimmed to its own longest prompt and completion."""
        N = batch["prompt_ids"].shape[0]
        order = self.shuffled_order(N) if self.mode == "train" else torch.arange(N)
        # TRL's token count for dapo/cispo: the generation batch's completion tokens over every rank, per micro-batch
        totals = self.context.data_parallel.sum(torch.tensor(
            [float(loss_mask(batch).sum()), float(pieces)], dtype=torch.float64))
        tokens_per_micro_batch = (totals[0] / totals[1]).item()
        size = N // pieces
        micro_batches = []
        for start in range(0, N, size):
            part = trimmed_rows(batch, order[start : start + size])
            micro_batch = self.context.context_parallel.split(model_inputs(part))  # this rank's chunks under cp
            micro_batch["completion_tokens_per_micro_batch"] = tokens_per_micro_batch
            micro_batches.append(micro_batch)
        return micro_batches

    @staticmethod
    def shuffled_order(count: int) -> torch.Tensor:
        return torch.randperm(count)

    # --- the loss -----------------------------------------------------------------------------------------------
    def loss(self, model, inputs: dict, num_items_in_batch):
        logprobs_BT, entropy_BT, aux_loss = completion_logprobs_of(model, inputs, self.sampling.logprob_temperature,
                                                                   self.context)
        mask_BT = loss_mask(inputs)
        out = self.policy_loss(logprobs_BT, entropy_BT, mask_BT, inputs, num_items_in_batch)
        loss, metrics = out.loss, self._extremes_over_ranks(out.metrics)
        if aux_loss is not None:  # TRL: + coef * aux / the step's micro-batches, aux_loss logged
            loss = loss + self.aux_loss_coef * self.context.router_loss(aux_loss, num_items_in_batch)
            metrics["aux_loss"] = self.context.whole_router_loss(aux_loss)
        return loss, metrics

    def _extremes_over_ranks(self, metrics: dict, signs: dict[str, float] | None = None) -> dict:
        return extremes_over_ranks(metrics, self.context.data_parallel, signs)

    def policy_loss(self, logprobs_BT, entropy_BT, mask_BT, inputs, num_items_in_batch):
        args = self.args
        old = inputs.get("old_logprobs")
        sampler_weights = inputs.get("sampler_weights")
        vespo = self.loss_type == "vespo"
        token_weights = None if vespo else sampler_weights  # VESPO takes the sampler correction into its weights
        entropy_keep = None
        if args.top_entropy_quantile < 1.0:
            entropy_keep = high_entropy_mask(entropy_BT, mask_BT, 1 - args.top_entropy_quantile,
                                             gather=self.context.data_parallel.gather_values).to(logprobs_BT.dtype)
            token_weights = entropy_keep if token_weights is None else token_weights * entropy_keep
        out = clipped_policy_loss(
            logprobs_BT, logprobs_BT.detach() if old is None else old, inputs["advantages"], mask_BT,
            loss_type=self.loss_type, epsilon=args.epsilon, epsilon_high=args.epsilon_high, delta=args.delta,
            beta=args.beta, ref_logprobs_BT=inputs.get("ref_logprobs"), use_bias_correction_kl=args.use_bias_correction_kl,
            importance_sampling_level=args.importance_sampling_level, max_completion_length=args.max_completion_length,
            num_items=inputs["completion_tokens_per_micro_batch"], token_weights_BT=token_weights,
            entropy_BT=entropy_BT,
            sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
            off_policy_mask_threshold=getattr(args, "off_policy_mask_threshold", None),
            sampling_logprobs_BT=inputs.get("sampling_logprobs") if self.sampler_correction else None,
            vespo=dict(k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg,
                       lambda_neg=args.vespo_lambda_neg) if vespo else None,
            importance_ratio_BT=sampler_weights if vespo else None,
        )
        if self.entropy_coef != 0.0 or self.adaptive_entropy:
            out = self._with_entropy_bonus(out, entropy_BT, mask_BT if entropy_keep is None else mask_BT * entropy_keep)
        return out

    def _with_entropy_bonus(self, out, entropy_BT, mask_BT):
        """The policy loss minus the entropy bonus (the coefficient of the step's start; 0 in adaptive mode while the
        last step's entropy is above entropy_target, as TRL), with policy_loss logged; the adaptive controller's
        sums gathered."""
        coef = self.entropy_coef
        if self.adaptive_entropy:
            coef = coef if self.last_step_entropy <= self.args.entropy_target else 0.0
            if self.mode == "train":
                mask = mask_BT.to(entropy_BT.dtype)
                sums = torch.stack([(entropy_BT.detach() * mask).sum(), mask.sum()]).double()
                self._entropy_window = sums if self._entropy_window is None else self._entropy_window + sums
        metrics = {**out.metrics, "policy_loss": out.loss.detach()}
        return type(out)(out.loss + entropy_bonus(entropy_BT, mask_BT, coef), out.per_token_loss_BT, metrics)

    # --- logging -------------------------------------------------------------------------------------------------
    def _add(self, name: str, value: float) -> None:
        if value == value:
            self.context.metrics(self.mode).add(name, torch.tensor(float(value)))
        else:  # NaN (a function that scored nothing) is left out of the mean; logged as None with no value (TRL)
            self.context.metrics(self.mode).mark_missing(name)

    def _log_generation(self, prompt_ids, completion_ids, tool_mask=None) -> None:
        """Token count and completion-length statistics (over every data-parallel rank's completions, as TRL; with
        a rollout's env_mask, the lengths count the model's own tokens)."""
        state = self.context.state
        lengths_N, truncated_N = self.rollout.lengths(completion_ids)
        if tool_mask is not None:
            lengths_N = torch.tensor([float(sum(mask)) for mask in tool_mask], dtype=torch.float64)
        # the cp ranks of a batch share its tokens: counted once; evaluation logs the training's count (TRL)
        if self.mode == "train" and self.context.context_parallel.rank == 0:
            state.num_input_tokens_seen += int(sum(len(p) for p in prompt_ids) + lengths_N.sum())  # this rank's
        self.context.metrics(self.mode).set("num_tokens", torch.tensor(float(state.num_input_tokens_seen)))  # over ranks
        all_N2 = self.context.data_parallel.gather_rows(torch.stack([lengths_N, truncated_N.double()], dim=1))
        for name, value in completion_length_metrics(all_N2[:, 0], all_N2[:, 1]).items():
            self._add(name, value)

    def _log_rewards(self, rewards_NF, advantages) -> None:
        for index, name in enumerate(self.rewards.names):
            self._add(f"rewards/{name}/mean", torch.nanmean(rewards_NF[:, index]))
            self._add(f"rewards/{name}/std", nanstd(rewards_NF[:, index]))
        rewards_N = weighted_rewards(rewards_NF, self.rewards.weights_F)
        self._add("reward", torch.nanmean(rewards_N))
        self._add("reward_std", nanstd(rewards_N))
        self._add("frac_reward_zero_std", advantages.is_std_zero_N.float().mean())


# --- the trainer -----------------------------------------------------------------------------------------------


def warn_like_trl(args) -> None:
    """TRL's GRPOTrainer / RLOOTrainer warnings about these settings, word for word."""
    if args.use_liger_kernel:
        warnings.warn(LIGER_DEPRECATION, FutureWarning, stacklevel=3)
    loss_type, level = getattr(args, "loss_type", None), getattr(args, "importance_sampling_level", "token")
    if loss_type == "luspo" and level != "sequence":
        logger.warning("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to mirror "
                       "the paper's setup.")
    if loss_type == "vespo" and level != "token":
        logger.warning("VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
                       "should be set to `'token'` (the default).")
    if level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        logger.warning(
            f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums per-token "
            "contributions, which effectively weights each sequence by its completion length instead of "
            "optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'` "
            "(see https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-policy-optimization)."
        )


class GRPOTrainer(Trainer):
    """TRL's GRPOTrainer: ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config, rollout_func)``. ``model``: a folder, Hub id,
    transformers model or native model; ``reward_funcs``: a callable, a reward model (path or model), a built-in
    name or a dotted import path, or a list of them (see trainers/rewards.py); ``rollout_func(prompts, trainer)``:
    the user's rollout in place of the engine (TRL's contract, see ``GRPOObjective._custom_rollout``)."""

    algorithm_name = "GRPO"
    config_class = GRPOConfig
    requires_train_dataset = True
    _tag_names = ["trl", "grpo"]
    objective_class = GRPOObjective

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        if reward_funcs is None and environment_factory is None:
            raise ValueError("reward_funcs is required: a callable, a reward model, a built-in name or a list of them")
        if environment_factory is not None and os.environ.get("TRL_EXPERIMENTAL_SILENCE", "0") != "1":
            warnings.warn(
                "You are using 'environment_factory', which is an experimental feature. This API may change or be "
                "removed at any time without prior notice. Silence this warning by setting environment variable "
                "TRL_EXPERIMENTAL_SILENCE=1.", UserWarning, stacklevel=2,
            )
        self.tools, self.environment_factory = list(tools or []), environment_factory
        if rollout_func is not None and os.environ.get("TRL_EXPERIMENTAL_SILENCE", "0") != "1":
            warnings.warn(
                "You are using 'rollout_func', which is an experimental feature. This API may change or be removed at "
                "any time without prior notice. Silence this warning by setting environment variable "
                "TRL_EXPERIMENTAL_SILENCE=1.", UserWarning, stacklevel=2,
            )
        self.rollout_func = rollout_func
        self._reward_funcs, self._reward_processing_classes = reward_funcs, reward_processing_classes
        self._model_source = model
        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         quantization_config=quantization_config, peft_config=peft_config)
        warn_like_trl(self.args)

    def _make_objective(self):
        rollout_func = getattr(self, "rollout_func", None)  # TRL calls it with the trainer
        return self.objective_class(self.context, self._reward_funcs, self._reward_processing_classes,
                                    reference=self._reference_source,
                                    rollout_func=None if rollout_func is None else (lambda prompts: rollout_func(prompts, self)),
                                    **self._tool_arguments())

    def _tool_arguments(self) -> dict:
        tools, factory = getattr(self, "tools", None), getattr(self, "environment_factory", None)
        return {"tools": tools, "environment_factory": factory} if tools or factory is not None else {}

    # --- TRL's public helpers, with its signatures -------------------------------------------------------------
    @staticmethod
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        """TRL's off-policy sequence mask [B, 1] (1 keep): see hfnative.losses.policy.off_policy_sequence_mask."""
        return off_policy_sequence_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold)

    @staticmethod
    def get_gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos=2.0, lambda_pos=3.0,
                          k_neg=3.0, lambda_neg=2.0):
        """TRL's VESPO gamma weights [B, 1]: see hfnative.losses.policy.vespo_weights."""
        return vespo_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos=k_pos,
                             lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg)

    def get_high_entropy_mask(self, entropies, mask, threshold):
        """TRL's: tokens whose entropy is at least the ``threshold`` quantile of every process's completion tokens
        (bool [B, T], False outside ``mask``), gathered as TRL's method gathers them: through ``self.accelerator``'s
        ``pad_across_processes`` and ``gather`` (a negative pad, since entropies are not), so it runs on any object
        TRL's runs on."""
        pad_value = -1e9

        def gather(values):
            gathered = self.accelerator.gather(self.accelerator.pad_across_processes(values, dim=0, pad_index=pad_value))
            return gathered[gathered != pad_value]

        return high_entropy_mask(entropies, mask, threshold, gather=gather)

    def _reference_source(self):
        """What the reference model loads from: the policy's source when it is a path, else a copy of the
        policy as it is before training."""
        if is_model_name(self._model_source):
            return self._model_source
        return copy.deepcopy(self.native_model)


def cli_command():
    """``hfnative-train grpo``: TRL's GRPO script arguments (reward_funcs by built-in name or dotted path,
    reward_model_name_or_path)."""
    from . import cli

    return cli.Command("Group Relative Policy Optimization (TRL's `trl grpo`)", GRPOConfig, GRPOTrainer, cli.train_model,
                       script_args_class=RLScriptArguments, trainer_kwargs=rl_trainer_kwargs)


@dataclass
class RLScriptArguments(ScriptArguments):
    """TRL's GRPO/RLOO script arguments: the dataset, and the reward model and functions."""

    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A reward model: a local folder or a Hub id of a sequence-classification model."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: built-ins (exact_match, think_format_reward, get_soft_overlong_punishment, "
                          "completion_length) or dotted import paths (my_package.rewards.my_reward)."},
    )


def rl_trainer_kwargs(script_args, training_args, model_args) -> dict:
    """reward_funcs from the script arguments (the reward model first, as TRL's script)."""
    reward_funcs = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)
    reward_funcs += list(script_args.reward_funcs or [])
    if not reward_funcs:
        raise ValueError("no reward: pass --reward_funcs (a built-in name or a dotted import path) or "
                         "--reward_model_name_or_path")
    return {"reward_funcs": reward_funcs}
