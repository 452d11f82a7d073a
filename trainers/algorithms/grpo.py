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
    MEAN_LOSS_TYPES,
    clipped_policy_loss,
    group_advantages,
    high_entropy_mask,
    off_policy_sequence_mask,
    vespo_weights,
    normalize_then_sum_advantages,
    sampler_importance_weights,
    weighted_rewards,
)
from ..loop.arguments import LIGER_DEPRECATION
from ..rollout.completion_log import CompletionLog, CompletionsUpload, completions_folder, publish_completions
from ..running.construction import config_dict, is_model_name
from .entropy_control import EntropyBonus
from .grpo_config import GRPOConfig, check_run_settings
from ..loop.objective import Normalizer, Objective, enable_router_loss
from .reference_model import ReferenceModel, refuse_sync_without_reference
from ..rollout.rewards import RewardAttributes, RewardFunctions
from ..rollout.engines import make_rollout_engine
from ..rollout.tool_calling import tool_calling_for
from ..rollout.prompts import sampling_params, stop_token_ids
from ..rollout.component import Rollout
from ..rollout.prompt_batches import GenerationBatches, loss_mask, split_generation_batch
from ..rollout.batches import completion_logprobs_of, pad_token_lists
from ..running.script_arguments import ScriptArguments
from ..loop.trainer import Trainer
from .sft import mirror_pad_token

logger = logging.getLogger(__name__)

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


class GRPOObjective(GenerationBatches, Objective):
    """Generation, scoring and the GRPO loss (see the module docstring). Subclasses (RLOO) change
    ``advantages`` and ``policy_loss``."""

    supports = frozenset({"multi_process", "multi_process_generation", "tensor_parallel", "context_parallel",
                          "expert_parallel", "evaluation"})
    # log-probs of the policy at generation time, summed per sequence or per token: None (only when the
    # buffer outlives an optimizer step, as TRL), "rollout" (the engine's sampling log-probs) or "forward"
    old_logprobs_source = "rollout"
    split_collated_batches = False  # prompts are collated; the rollouts' model inputs are split in _split
    writes_completion_files = True  # log_completions: output_dir/completions/completions_{step:05d}.parquet, as TRL

    def __init__(self, context, reward_funcs, reward_processing_classes=None, reference=None, rollout_func=None,
                 tools=None, environment_factory=None):
        """``reference``: called for the reference model's source when one is needed (beta != 0, no adapters).
        ``rollout_func``: prompts -> TRL's rollout dict (the user's ``rollout_func`` with its trainer bound), which
        then makes the completions instead of the rollout engine. ``tools`` / ``environment_factory``: TRL's
        multi-turn tool-calling rollouts (trainers/rollout/tool_calling.py)."""
        super().__init__(context)
        args = context.args
        if context.processing_class is not None:  # TRL's: the EOS pads when the tokenizer has no pad token
            mirror_pad_token(context.tokenizer, context.model)
        tool_calling = tool_calling_for(context, tools, environment_factory)
        # the MoE router's load-balancing loss in the policy's loss forward (TRL's rule for router_aux_loss_coef)
        self.aux_loss_coef = enable_router_loss(context.model, args.router_aux_loss_coef)
        check_run_settings(args, context.layout)
        self.num_generations_train = args.num_generations
        self.num_generations_eval = args.num_generations_eval or args.num_generations
        self.loss_type = getattr(args, "loss_type", None)
        chat_template_kwargs = dict(args.chat_template_kwargs or {})
        self.rewards = RewardFunctions(reward_funcs, args.reward_weights, reward_processing_classes, context.device,
                                       chat_template_kwargs=chat_template_kwargs,
                                       model_init_kwargs=config_dict(args.model_init_kwargs),
                                       episode_rewards=tool_calling.reward_functions() if tool_calling else None)
        sampling = sampling_params(args, args.max_completion_length, stop_token_ids(context.tokenizer, context.model),
                                   generation_kwargs=config_dict(args.generation_kwargs), strict=True)
        self.rollout = Rollout(context, sampling, engine=make_rollout_engine(context.model, args),
                               chat_template_kwargs=chat_template_kwargs, tool_calling=tool_calling,
                               rollout_func=rollout_func)
        self.sampling = self.rollout.sampling
        # TRL's correction for a sampler other than the trained model itself (vLLM)
        self.sampler_correction = bool(args.use_vllm and getattr(args, "vllm_importance_sampling_correction", False))
        self.generate_every = args.steps_per_generation * args.num_iterations
        # the reference (beta != 0): a frozen copy, or the policy's base with its adapters disabled (TRL's GRPO)
        self.reference = None if args.beta == 0.0 else ReferenceModel(self, reference, base_of_loaded_adapters=True)
        if args.sync_ref_model:
            refuse_sync_without_reference(args, self.reference)
        self.entropy_bonus = EntropyBonus(args)  # TRL's entropy_coef / use_adaptive_entropy
        self._step = 0  # micro-batches trained so far (TRL's _step)
        self._eval_batches = 0  # evaluation batches completed so far (they key their sampling streams)
        self._buffer: list[dict] | None = None
        self._step_started = None
        self.completion_log = CompletionLog(self.rewards.names, args.generation_batch_size)
        self.completions_upload = None
        if getattr(args, "log_completions_hub_repo", None) and not args.log_completions and context.rank == 0:
            logger.warning("log_completions_hub_repo=%r pushes the completions tables that log_completions=True "
                           "writes; with log_completions=False nothing is pushed", args.log_completions_hub_repo)
        if args.log_completions and self.writes_completion_files and context.rank == 0:
            folder = completions_folder(args.output_dir)  # made with the trainer, as TRL
            if getattr(args, "log_completions_hub_repo", None):
                self.completions_upload = CompletionsUpload(
                    args.log_completions_hub_repo, folder, args.hub_private_repo, args.hub_token,
                    args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir)))

    def auxiliary_models_ready(self) -> None:
        if self.reference is not None:
            self.reference.ready()

    @property
    def num_generations(self) -> int:
        """G of the generation being made: num_generations in training, num_generations_eval in evaluation."""
        return self.num_generations_train if self.context.model.training else self.num_generations_eval

    @property
    def mode(self) -> str:
        return self.rollout.mode

    @property
    def engine(self):
        """The policy's rollout engine (the rollout component's)."""
        return self.rollout.engine

    @engine.setter
    def engine(self, engine) -> None:
        self.rollout.engine = engine

    def generates(self) -> bool:
        return True

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

    # --- one optimizer step -----------------------------------------------------------------------------------
    def normalizer(self, batches: list[dict]) -> Normalizer:
        """Each micro-batch's loss is a mean of its own; the token-sum losses (dapo, cispo, vespo) divide by their
        generation batch's completion tokens per micro-batch, averaged over the ranks by the loop (TRL's)."""
        if self.loss_type in MEAN_LOSS_TYPES:
            return Normalizer.micro_batches(batches)
        return Normalizer.tokens_per_micro_batch([batch["completion_tokens_per_micro_batch"] for batch in batches])

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

    def checkpoint_state(self) -> dict[str, dict]:
        return self.entropy_bonus.checkpoint_state()

    def load_checkpoint_state(self, files: dict[str, dict]) -> None:
        self.entropy_bonus.load_checkpoint_state(files)

    def after_optimizer_step(self) -> None:
        self.entropy_bonus.end_step(self.context.data_parallel.ratio_of_sums, self.context.metrics())
        if self.reference is not None:
            self.reference.after_optimizer_step()  # TR-DPO's sync_ref_model
        if self._step % self.generate_every == 0:  # the next step generates
            self.rollout.sync_weights()
        if self._step_started is not None:
            self.context.metrics().add("step_time", torch.tensor(time.perf_counter() - self._step_started))

    def end_training(self) -> None:
        super().end_training()
        if self.completions_upload is not None:
            self.completions_upload.finish()

    def after_log(self, logs: dict, mode: str) -> None:
        args, state = self.args, self.context.state
        if args.log_completions and state.is_world_process_zero:  # every log, the run's last one included, as TRL
            publish_completions(self.completion_log.logged, state.global_step, args, self.writes_completion_files)

    # --- generation and scoring ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_and_score(self, rows: list[dict], place: int = 0) -> list[dict]:
        """Sample G completions per row (the rollout component; ``place``: the run's micro-batch that generates), score
        them, and return the generation batch's micro-batches."""
        data_parallel = self.context.data_parallel
        done = self.rollout.complete([row for row in rows for _ in range(self.num_generations)], place)
        self.rollout.record(done)
        batch = self.rollout.tensors(done.prompt_ids, done.completion_ids, done.logprobs,
                                     self.args.mask_truncated_completions)
        if done.tool_mask is not None:  # 0 on the tokens the rollout's environment wrote: attended to, never trained on
            batch["tool_mask"] = pad_token_lists(done.tool_mask, 1)
        log = self.completion_log
        local_rewards_NF = self.rewards.score(done.prompts, done.completions, done.completion_ids, done.rows,
                                              trainer_state=self.context.state, log_extra=log.log_extra,
                                              log_metric=log.log_metric, extra=done.reward_kwargs or {})
        batch.update(self._model_logprobs(batch))
        # TRL: the rewards of every data-parallel rank's groups, the advantages over them all (the batch std for
        # scale_rewards="batch"), this rank's rows kept; the logged reward statistics are the whole batch's
        rewards_NF = data_parallel.gather_rows(local_rewards_NF)
        advantages = self.advantages(rewards_NF, batch)
        batch["advantages"] = advantages.advantages_N[data_parallel.local_rows(len(done.rows))]
        metrics = self.context.metrics(self.mode)
        logged = {**self.rewards.metrics(rewards_NF), "frac_reward_zero_std": advantages.is_std_zero_N.float().mean(),
                  **log.flush(done.prompts, done.completions, rewards_NF, advantages.advantages_N, data_parallel)}
        for name, value in logged.items():
            metrics.add_value(name, value)
        return self._split(batch, 1 if self.mode == "eval" else self.args.steps_per_generation)

    def _needs_old_logprobs(self) -> bool:
        """TRL: when the generation batch is trained on after an optimizer step has changed the policy, or
        the sampler's log-probs need correcting."""
        if self.mode == "eval":  # the policy has not moved since the evaluation batch was generated
            return self.sampler_correction
        return self.args.gradient_accumulation_steps % self.generate_every != 0 or self.sampler_correction

    def _model_logprobs(self, batch: dict) -> dict:
        """Generation-time per-token log-probs: the reference model's (beta > 0) and the policy's old ones."""
        out, policy = {}, self.context.model
        if self.reference is not None:
            with self.reference.running() as reference:
                out["ref_logprobs"] = self.rollout.completion_logprobs(reference, batch, self.args.per_device_train_batch_size)
        if self._needs_old_logprobs():
            if self.old_logprobs_source == "forward" or not self.engine.reads_live_weights or self.rollout.rollout_func:
                out["old_logprobs"] = self.rollout.completion_logprobs(policy, batch, self.args.per_device_train_batch_size)
            else:
                out["old_logprobs"] = batch["sampling_logprobs"]
        if self.sampler_correction:
            out["sampler_weights"], stats = sampler_correction(out["old_logprobs"], batch, self.args)
            # as TRL: the means averaged over the data-parallel ranks, the extremes taken over them
            for name, value in self._extremes_over_ranks(stats, SAMPLER_EXTREMES).items():
                self.context.metrics(self.mode).add_value(name, value)
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
        """The generation batch shuffled (torch's global RNG, as TRL; kept in order in evaluation) and cut into
        ``pieces`` micro-batches."""
        N = batch["prompt_ids"].shape[0]
        order = self.shuffled_order(N) if self.mode == "train" else torch.arange(N)
        return split_generation_batch(batch, pieces, order, self.context)

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
            num_items=num_items_in_batch, token_weights_BT=token_weights, entropy_BT=entropy_BT,
            sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
            off_policy_mask_threshold=getattr(args, "off_policy_mask_threshold", None),
            sampling_logprobs_BT=inputs.get("sampling_logprobs") if self.sampler_correction else None,
            vespo=dict(k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg,
                       lambda_neg=args.vespo_lambda_neg) if vespo else None,
            importance_ratio_BT=sampler_weights if vespo else None,
        )
        if self.entropy_bonus.active:
            out = self.entropy_bonus.apply(out, entropy_BT, mask_BT if entropy_keep is None else mask_BT * entropy_keep,
                                           self.mode == "train")
        return out

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


class GRPOTrainer(RewardAttributes, Trainer):
    """TRL's GRPOTrainer: ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config, rollout_func)``. ``model``: a folder, Hub id,
    transformers model or native model; ``reward_funcs``: a callable, a reward model (path or model), a built-in
    name or a dotted import path, or a list of them (see trainers/rollout/rewards.py); ``rollout_func(prompts, trainer)``:
    the user's rollout in place of the engine (TRL's contract, see ``GRPOObjective._custom_rollout``)."""

    loaded_tokenizer_kwargs = {"padding_side": "left", "truncation_side": "left"}  # as TRL loads it

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

    @property
    def ref_model(self):
        """The frozen reference model (None with beta=0.0, or when it is the policy with its adapters disabled)."""
        reference = self.objective.reference
        return None if reference is None else reference.model

    def _reference_source(self):
        """What the reference model loads from: the policy's source when it is a path, else a copy of the
        policy as it is before training."""
        if is_model_name(self._model_source):
            return self._model_source
        return copy.deepcopy(self.native_model)


def cli_command():
    """``hfnative-train grpo``: TRL's GRPO script arguments (reward_funcs by built-in name or dotted path,
    reward_model_name_or_path)."""
    from ..running import cli

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
