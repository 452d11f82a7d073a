"""PPO with a value model on the one loop: TRL 0.29's PPOTrainer ``train()``, one rollout batch per step of the loop.

Shapes: N rollouts of the step's whole batch (batch_size, over every data-parallel rank), B of a micro-batch, P prompt
tokens (left-padded), T response tokens (right-padded), S = P + T.

Over data-parallel ranks (DDP, FSDP2) a step is one process's step on the whole batch: each rank completes its
local_batch_size prompts (each row from its own sampling stream), the completions are gathered, each rank runs the
forwards of its own rows and the results are gathered, so that every rank holds the whole rollout batch and whitens
and shuffles it as one process does. Each micro-batch of that order is cut over the ranks, and each rank's loss is
its rows' share of the micro-batch's token means (their sums over the micro-batch's tokens, counted over every rank's
rows through the loop's per-micro-batch normalizer). TRL whitens and shuffles each process's batch apart.

A step: the batch's prompts are completed by the rollout engine (temperature + 1e-7, top_k 0, top_p 1, stopping at
the stop token), then, without a graph, the policy's and the reference's log-probs, the value model's values at
every response position and the reward model's score are read (trainers/algorithms/ppo_forwards.py, as TRL's forwards); the score, less
``missing_eos_penalty`` for a response without EOS, and the per-token KL penalty make the rewards, GAE makes the
advantages and returns (hfnative.losses.ppo). The step then trains ``num_ppo_epochs`` passes over the batch in
mini-batches of micro-batches, each micro-batch's loss ``pg_loss + vf_coef * vf_loss`` divided by
gradient_accumulation_steps, the optimizer stepping where TRL's accelerate does (``steps_optimizer_after``).
"""

from __future__ import annotations

import time

import torch

from hfnative.generation.sampling import mix64_int
from hfnative.losses.ppo import (
    INVALID_LOGPROB,
    clipped_policy_loss,
    clipped_value_loss,
    first_true_indices,
    generalized_advantages,
    kl_estimate,
    masked_whiten,
    padding_masks,
    token_rewards,
    truncate_after_stop,
)

from ..loop.objective import Normalizer, Objective
from .ppo_forwards import PPOForwards, with_trl_plan
from .reference_model import ReferenceModel, frozen_for_autocast
from ..rollout.prompt_batches import GenerationBatchSampler
from ..rollout.prompts import sampling_params
from ..rollout.component import Rollout
from ..rollout.batches import completion_logprobs_of, pad_token_lists
from ..rollout.engines import make_rollout_engine

PPO_STATE_FILE = "ppo_state.json"
# the per-micro-batch statistics TRL keeps in [num_ppo_epochs, num_mini_batches, gradient_accumulation_steps] slots
STATS = ("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")
# TRL's logged mean of each slot tensor
STAT_KEYS = {"approxkl": "policy/approxkl_avg", "pg_clipfrac": "policy/clipfrac_avg", "pg_loss": "loss/policy_avg",
             "vf_loss": "loss/value_avg", "vf_clipfrac": "val/clipfrac_avg", "entropy": "policy/entropy_avg",
             "ratio": "val/ratio"}


def _rows(batch):
    """The collator: the dataset rows as they are."""
    return list(batch)


def accumulation_boundaries(count: int, accumulation: int, counter: int, end_of_pass: bool) -> tuple[list[bool], int]:
    """Where TRL's PPO steps the optimizer in ``count`` micro-batches: accelerate's ``accumulate`` counts micro-batches
    over the whole run and steps every ``accumulation``-th (across mini-batch boundaries when num_mini_batches > 1),
    and at every micro-batch of a rollout batch that is the last of its pass over the dataset (``end_of_pass``). The
    count goes on from ``counter``: (whether to step after each, the new counter)."""
    steps = []
    for _ in range(count):
        counter = 0 if end_of_pass else counter + 1
        steps.append(end_of_pass or counter % accumulation == 0)
    return steps, counter


class PPOObjective(Objective):
    """TRL 0.29's PPO (see the module docstring). ``value_model`` is set by the trainer once loaded."""

    # data, tensor, context and expert parallel layouts, each checked against one process (tests/test_ppo_layouts.py)
    supports = frozenset({"multi_process", "multi_process_generation", "tensor_parallel", "context_parallel",
                          "expert_parallel"})
    split_collated_batches = False

    def __init__(self, context, reference_source, reference_given: bool, reward_model, users_reward_model=False):
        super().__init__(context)
        args = context.args
        tokenizer = context.tokenizer
        if tokenizer.pad_token_id is None:
            raise ValueError("PPOTrainer needs a pad token: set processing_class.pad_token (e.g. to its eos_token)")
        self.pad_token_id, self.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.stop_token_id = tokenizer.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        self.reference = ReferenceModel(self, reference_source, reference_given)
        self.auxiliary_models["reward_model"] = reward_model  # loaded by the trainer (its own classifier kwargs)
        self.users_reward_model = users_reward_model  # the user's own native model object, left as given
        self.value_model = None
        self.temperature = args.temperature + 1e-7  # TRL's, in sampling and in every log-prob
        stops = [] if self.stop_token_id is None else [self.stop_token_id]
        sampling = sampling_params(args, args.response_length, stops, temperature=self.temperature, top_k=0, top_p=1.0)
        # vLLM is started here; the native engine is made at its first use, after the run's capabilities are checked
        # (a pipeline stage, which holds part of the model, is refused there, not here)
        engine = make_rollout_engine(context.model, args) if args.use_vllm else None
        self.rollout = Rollout(context, sampling, engine=engine)
        self.forwards = PPOForwards(context, self.pad_token_id, self.temperature)
        shape = (len(STATS), args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps)
        self._stats = torch.zeros(shape, device=context.device)
        self._steps_after: list[bool] = []
        self._accumulated = 0  # accelerate's micro-batch counter in TRL's loop
        self._updates_per_pass = 1
        self._dataset_length = 1
        self._start_time = None
        self.last_rollout: dict | None = None  # the last rollout batch's tensors (rewards, advantages, returns, ...)

    def generates(self) -> bool:
        return True

    def auxiliary_models_ready(self) -> None:
        """The reference ready; the reward model, which scores rollouts under the trainer's autocast, with its linear
        weights kept in the autocast dtype unless it is the user's own native model object (``frozen_for_autocast``)."""
        self.reference.ready()
        if not self.users_reward_model:
            frozen_for_autocast(self.auxiliary_models["reward_model"], self.args)

    # --- data: rows with TRL's tokenized prompts ("input_ids"), one rollout batch read per micro-batch of a step -----
    def prepare_train_dataset(self, dataset):
        """TRL's rows of tokenized prompts (``input_ids``) as they are; rows with a ``prompt`` (text, or chat messages
        rendered with the generation prompt) are tokenized here (the command line's datasets)."""
        first = next(iter(dataset), None)
        if isinstance(first, dict) and "input_ids" in first:
            return dataset
        if isinstance(first, dict) and "prompt" in first:
            return dataset.map(lambda row: {"input_ids": self.rollout.tokenize([row["prompt"]])[0]},
                               remove_columns=dataset.column_names, num_proc=self.args.dataset_num_proc)
        raise ValueError(f"train_dataset: row 0 is {first!r}; PPOTrainer expects tokenized prompts, rows with an "
                         "'input_ids' column (as TRL's PPO example makes them), or a 'prompt' column to tokenize")

    def default_collator(self):
        return _rows

    def train_dataloader(self, dataset, collator):
        """Batches of local_batch_size prompts (an incomplete one dropped) in a seeded order per epoch, each read
        gradient_accumulation_steps times (the loop's micro-batches of one step)."""
        from torch.utils.data import DataLoader

        args = self.args
        sampler = GenerationBatchSampler(len(dataset), args.local_batch_size, args.gradient_accumulation_steps,
                                         seed=args.data_seed if args.data_seed is not None else args.seed,
                                         **self.context.data_shard())
        if len(sampler) == 0:
            raise ValueError(f"train_dataset has {len(dataset)} prompts, fewer than one rollout batch "
                             f"(batch_size={args.batch_size}): add prompts or lower per_device_train_batch_size / "
                             "gradient_accumulation_steps")
        self._updates_per_pass = len(sampler) // args.gradient_accumulation_steps
        self._dataset_length = len(dataset)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collator, num_workers=0)

    # --- one step: a rollout batch, then num_ppo_epochs x mini-batches x micro-batches -------------------------------
    def micro_batches(self, epoch_iterator, count: int) -> list[dict]:
        if self._start_time is None:
            self._start_time = time.time()
        rows = None
        for _, batch in zip(range(count), epoch_iterator):
            rows = batch if rows is None else rows
        if rows is None:
            return []
        update = self.context.state.global_step
        rollout = self.make_rollout(rows, place=update)
        batches = self.training_micro_batches(rollout, update)
        end_of_pass = update % self._updates_per_pass == self._updates_per_pass - 1
        self._steps_after, self._accumulated = accumulation_boundaries(
            len(batches), self.args.gradient_accumulation_steps, self._accumulated, end_of_pass)
        self._stats.zero_()
        return batches

    def normalizer(self, batches: list[dict]) -> Normalizer:
        """Each micro-batch's loss is its token means divided by gradient_accumulation_steps (accelerate's backward);
        a rank's part of those means is its rows' sums over the micro-batch's kept tokens (``loss``), counted here."""
        return Normalizer.tokens_per_micro_batch([batch["kept_tokens"] for batch in batches],
                                                 means_over=self.args.gradient_accumulation_steps)

    def steps_optimizer_after(self, index: int) -> bool:
        return self._steps_after[index]

    @torch.no_grad()
    def make_rollout(self, rows: list[dict], place: int) -> dict:
        """Complete this rank's prompts, then score and value the whole rollout batch (each rank its own rows): the
        batch's tensors, the rewards, advantages and returns, and TRL's objective/* metrics recorded."""
        args, pad, data_parallel = self.args, self.pad_token_id, self.context.data_parallel
        local_queries = [list(row["input_ids"]) for row in rows]
        rollouts = self.rollout.generate(local_queries, **self.rollout.row_streams(place, len(local_queries)))
        queries = data_parallel.gather_lists(local_queries)
        completions = data_parallel.gather_lists([list(ids) for ids in rollouts.completion_ids])
        queries_NP = pad_token_lists(queries, pad, side="left")
        responses_NT = pad_token_lists(completions, pad)
        kept_NT = responses_NT if self.stop_token_id is None else truncate_after_stop(responses_NT, self.stop_token_id, pad)
        query_responses_NS = torch.cat([queries_NP, responses_NT], dim=1)
        sequence_lengths_N = first_true_indices(kept_NT == pad) - 1
        parts = {"logprobs": [], "ref_logprobs": [], "values": [], "scores": []}
        size = args.local_rollout_forward_batch_size
        forwards, policy = self.forwards, self.context.model
        mine = data_parallel.local_rows(len(local_queries))
        for start in range(mine.start, mine.stop, size):
            rows_slice = slice(start, min(start + size, mine.stop))
            inputs = forwards.prepare(forwards.batch(query_responses_NS[rows_slice], responses_NT.shape[1]))
            parts["logprobs"].append(forwards.logprobs(policy, inputs)[0])
            parts["ref_logprobs"].append(forwards.reference_logprobs(self.reference, inputs))
            parts["values"].append(forwards.values(self.value_model, inputs))
            kept = forwards.prepare(forwards.batch(torch.cat([queries_NP[rows_slice], kept_NT[rows_slice]], dim=1),
                                                   kept_NT.shape[1]))
            positions_B = queries_NP.shape[1] + sequence_lengths_N[rows_slice]
            parts["scores"].append(forwards.scores(self.auxiliary_models["reward_model"], kept, positions_B))
        logprobs, ref_logprobs, values, scores = (data_parallel.gather_rows(torch.cat(parts[k]).float())
                                                  for k in ("logprobs", "ref_logprobs", "values", "scores"))
        contain_eos_N = (kept_NT == self.eos_token_id).any(dim=-1).to(scores.device)
        if args.missing_eos_penalty is not None:
            scores[~contain_eos_N] -= args.missing_eos_penalty
        device = scores.device
        host_masks = padding_masks(sequence_lengths_N, responses_NT.shape[1])
        kept_N, valued_N = ((~mask).sum(1) for mask in host_masks)  # each row's counts, on the host: no device sync
        padding_mask, padding_mask_p1 = (m.to(device) for m in host_masks)
        logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
        ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
        values = values.masked_fill(padding_mask_p1, 0)
        kl = kl_estimate(logprobs, ref_logprobs, args.kl_estimator)
        non_score_reward = -args.kl_coef * kl
        rewards = token_rewards(non_score_reward, scores, sequence_lengths_N.to(device))
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0)
        advantages, returns = generalized_advantages(rewards, values, args.gamma, args.lam)
        advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)
        self._record_rollout(kl, logprobs, non_score_reward, scores, responses_NT)
        self.last_rollout = dict(queries=queries_NP, responses=responses_NT, query_responses=query_responses_NS,
                                 logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores,
                                 rewards=rewards, advantages=advantages, returns=returns, padding_mask=padding_mask,
                                 padding_mask_p1=padding_mask_p1, kept_tokens=kept_N, valued_tokens=valued_N)
        return self.last_rollout

    def _record_rollout(self, kl, logprobs, non_score_reward, scores, responses_NT) -> None:
        metrics = self.context.metrics()
        mean_non_score_reward = non_score_reward.sum(1).mean()
        metrics.add("objective/kl", kl.sum(1).mean())
        metrics.add("objective/entropy", (-logprobs).sum(1).mean())  # padded positions count -INVALID_LOGPROB (TRL's)
        metrics.add("objective/non_score_reward", mean_non_score_reward)
        metrics.add("objective/rlhf_reward", mean_non_score_reward + scores.mean())
        metrics.add("objective/scores", scores.mean())
        metrics.add("val/num_eos_tokens", (responses_NT == self.eos_token_id).sum())

    def minibatch_order(self, update: int, epoch: int) -> torch.Tensor:
        """The shuffle of the whole rollout batch for one PPO epoch, keyed by the seed, the update and the epoch (the
        same on every rank; a resumed run draws the same)."""
        key = mix64_int(mix64_int(mix64_int(int(self.args.seed)) ^ update) ^ epoch)
        generator = torch.Generator().manual_seed(key & ((1 << 63) - 1))
        return torch.randperm(self.args.batch_size, generator=generator)

    def training_micro_batches(self, rollout: dict, update: int) -> list[dict]:
        """This rank's micro-batches in TRL's order: for each PPO epoch a fresh shuffle of the whole batch, cut into
        num_mini_batches mini-batches of micro-batches of micro_batch_size rows (per_device_train_batch_size on each
        rank); each keeps its (epoch, mini-batch, micro-batch) slot for the statistics, its rank's kept tokens and
        the whole micro-batch's kept and valued tokens (its policy and value means count different positions)."""
        args, data_parallel = self.args, self.context.data_parallel
        T = rollout["responses"].shape[1]
        batches = []
        for epoch in range(args.num_ppo_epochs):
            order = self.minibatch_order(update, epoch)
            for mini, start in enumerate(range(0, args.batch_size, args.mini_batch_size)):
                mini_rows = order[start : start + args.mini_batch_size]
                for micro, micro_start in enumerate(range(0, args.mini_batch_size, args.micro_batch_size)):
                    whole = mini_rows[micro_start : micro_start + args.micro_batch_size]
                    rows = whole[data_parallel.local_rows(args.per_device_train_batch_size)]
                    batch = self.forwards.batch(rollout["query_responses"][rows], T)
                    for name in ("responses", "logprobs", "values", "returns", "advantages", "padding_mask",
                                 "padding_mask_p1"):
                        batch[name] = rollout[name][rows.to(rollout[name].device)]
                    batch["slot"] = (epoch, mini, micro)
                    batch["kept_tokens"] = int(rollout["kept_tokens"][rows].sum())
                    batch["whole_tokens"] = (int(rollout["kept_tokens"][whole].sum()),
                                             int(rollout["valued_tokens"][whole].sum()))
                    batches.append(self.forwards.split(batch))
        return batches

    # --- the loss ---------------------------------------------------------------------------------------------------
    def loss(self, model, inputs: dict, num_items_in_batch):
        """pg_loss + vf_coef * vf_loss of one micro-batch (token means), its statistics kept in its slot. On one
        process ``num_items_in_batch`` is the micro-batch's kept tokens; over data-parallel ranks it is their mean
        over the ranks, each rank's sums divided by it making its share of the whole micro-batch's means (the loop
        averages the ranks' shares)."""
        args = self.args
        kept = float(inputs["kept_tokens"] if num_items_in_batch is None else num_items_in_batch)
        whole_kept, whole_valued = inputs["whole_tokens"]
        valued = kept * whole_valued / whole_kept if whole_kept else float(whole_valued)
        inputs = with_trl_plan(inputs)
        logprobs_BT, entropy_BT, _ = completion_logprobs_of(model, inputs, self.temperature, self.context)
        padding_mask, padding_mask_p1 = inputs["padding_mask"], inputs["padding_mask_p1"]
        new_logprobs_BT = logprobs_BT.float().masked_fill(padding_mask, INVALID_LOGPROB)
        predicted_BT = self.forwards.values(self.value_model, inputs).float().masked_fill(padding_mask_p1, 0)
        vf_loss, vf_clipfrac = clipped_value_loss(predicted_BT, inputs["values"], inputs["returns"], padding_mask_p1,
                                                  args.cliprange_value, tokens=valued)
        pg_loss, pg_clipfrac, ratio_BT, log_ratio_BT = clipped_policy_loss(
            new_logprobs_BT, inputs["logprobs"], inputs["advantages"], padding_mask, args.cliprange, tokens=kept)
        loss = pg_loss + args.vf_coef * vf_loss
        if model.training:
            with torch.no_grad():
                values = (0.5 * (log_ratio_BT**2).mean(), pg_clipfrac, pg_loss, vf_loss, vf_clipfrac,
                          entropy_BT.float().mean(), ratio_BT.mean())
                self._stats[(slice(None), *inputs["slot"])] = torch.stack([v.detach().float() for v in values])
        return loss, {}

    # --- after the step ---------------------------------------------------------------------------------------------
    def after_optimizer_step(self) -> None:
        """TRL's averages of the step's statistics slots (the empty slots of num_mini_batches > 1 included, as TRL's),
        and the new weights pushed to a rollout engine that holds a copy."""
        metrics = self.context.metrics()
        for index, name in enumerate(STATS):
            metrics.add(STAT_KEYS[name], self._stats[index].mean())
        metrics.add("val/ratio_var", self._stats[STATS.index("ratio")].var())
        self.rollout.sync_weights()

    def checkpoint_state(self) -> dict[str, dict]:
        """TRL's accumulation counter (accelerate's), which places the optimizer steps of the updates to come."""
        return {PPO_STATE_FILE: {"accumulation_counter": self._accumulated}}

    def load_checkpoint_state(self, files: dict[str, dict]) -> None:
        state = files.get(PPO_STATE_FILE)
        if state is not None:
            self._accumulated = int(state["accumulation_counter"])

    def on_log(self, logs: dict, mode: str) -> None:
        """TRL's lr, episode and eps beside the loop's keys, and its epoch (episodes over the dataset's rows)."""
        if mode != "train" or "learning_rate" not in logs:
            return
        episode = self.context.state.global_step * self.args.batch_size
        self.context.state.epoch = episode / self._dataset_length
        logs["lr"] = logs["learning_rate"]
        logs["episode"] = episode
        logs["eps"] = int(episode / max(time.time() - (self._start_time or time.time()), 1e-9))


__all__ = ["PPOObjective", "accumulation_boundaries"]
