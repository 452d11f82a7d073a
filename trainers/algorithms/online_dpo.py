"""OnlineDPOTrainer: TRL's experimental Online DPO on the one loop.

Shapes: B prompts of a micro-batch, N = 2B completions (block layout: every prompt's first completion, then every
prompt's second), P prompt tokens (left-padded, their left end cut so that P + T <= max_length), T completion tokens
(right-padded), S = P + T.

Each micro-batch samples two completions of each of its prompts with the shared rollout component (the native
engine on the policy's live weights), scores them with the reward functions (TRL's calling convention, reward
models or callables; a completion without EOS loses ``missing_eos_penalty``), and takes the better-scored one of
each pair as chosen (the first on a tie). The loss is DPO's on the pair's summed completion log-probs under the
policy and the frozen reference: sigmoid ``-log σ(β Δ)`` or IPO ``(Δ - 1/(2β))²``, Δ = (logπ(y_w) - logπ(y_l)) -
(logπ_ref(y_w) - logπ_ref(y_l)), a mean over the micro-batch's pairs. As TRL, the rewards and the completions are
per rank (nothing gathered), and objective/kl and objective/entropy sum every completion position, padding included.
"""

from __future__ import annotations

import torch
import transformers

from hfnative.losses.preference import ipo_loss, sigmoid_loss

from .online_dpo_config import OnlineDPOConfig
from ..loop.objective import Normalizer, Objective
from .reference_free_preference import transformers_padding_plan
from .reference_model import ReferenceModel, ReferenceTrainer, router_loss_off
from ..rollout.rewards import RewardAttributes, RewardFunctions
from ..running.construction import config_dict
from ..rollout.prompts import sampling_params, stop_token_ids
from ..rollout.component import Rollout
from ..rollout.batches import completion_logprobs_of, model_inputs
from ..rollout.engines import make_rollout_engine
from ..loop.trainer import Trainer
from .sft import mirror_pad_token


def _rows(batch):
    """The collator: the dataset rows as they are."""
    return list(batch)


def as_rows(batch) -> list[dict]:
    """A collated batch as its rows: a list of row dicts as it is; a dict of columns (a user's collator, TRL's
    DPODataCollatorWithPadding keeps the prompts as a list) cut into rows."""
    if isinstance(batch, dict):
        if "prompt" not in batch:
            raise ValueError(f"the collated batch has columns {sorted(batch)}: it needs a 'prompt' column")
        count = len(batch["prompt"])
        return [{key: value[i] if isinstance(value, (list, tuple)) else value for key, value in batch.items()}
                for i in range(count)]
    return list(batch)


def pick_pairs(rewards_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) row indices of block-laid pairs: of rows i and i + B the higher reward is chosen,
    the first on a tie (TRL's rule)."""
    B = rewards_N.shape[0] // 2
    first_wins_B = rewards_N[:B] >= rewards_N[B:]
    rows_B = torch.arange(B)
    return rows_B + (~first_wins_B) * B, rows_B + first_wins_B * B


def online_dpo_losses(chosen_logratio_B, rejected_logratio_B, beta: float, loss_type: str) -> torch.Tensor:
    """One loss per pair [B] from the policy-minus-reference log-ratios of the chosen and the rejected completion:
    DPO's sigmoid loss, or IPO's on whole-sequence log-ratios (no length normalisation, unlike DPOTrainer's)."""
    if loss_type == "sigmoid":
        return sigmoid_loss(chosen_logratio_B - rejected_logratio_B, beta)
    if loss_type == "ipo":
        ones_B = torch.ones_like(chosen_logratio_B)
        return ipo_loss(chosen_logratio_B, rejected_logratio_B, ones_B, ones_B, beta)
    raise ValueError(f"loss_type={loss_type!r}: expected 'sigmoid' or 'ipo'")


class OnlineDPOObjective(Objective):
    """Sampling two completions per prompt, scoring and pairing them, and the online DPO loss (module docstring)."""

    # data-parallel: each rank completes, scores and pairs its own prompts (TRL gathers only the logged means)
    supports = frozenset({"multi_process", "multi_process_generation"})
    split_collated_batches = False  # the collated prompts become model inputs after generation

    def __init__(self, context, reward_funcs, reward_processing_classes, reference, reference_given: bool):
        super().__init__(context)
        args, tokenizer = context.args, context.tokenizer
        mirror_pad_token(tokenizer, context.model)  # TRL's: the EOS pads when the tokenizer has no pad token
        config = getattr(context.model, "config", None)
        if args.gradient_checkpointing and config is not None:  # TRL's online DPO turns the cache off (and saves it so)
            config.use_cache = False
        self.rewards = RewardFunctions(reward_funcs, args.reward_weights, reward_processing_classes, context.device,
                                       model_init_kwargs=config_dict(args.model_init_kwargs))
        self.stop_ids = stop_token_ids(tokenizer, context.model)
        sampling = sampling_params(args, args.max_new_tokens, self.stop_ids, generation_kwargs=args.generation_kwargs,
                                   strict=True)
        # TRL tokenizes the (chat-templated) prompts without special tokens
        self.rollout = Rollout(context, sampling, engine=make_rollout_engine(context.model, args),
                               add_special_tokens=False)
        self.reference = ReferenceModel(self, reference, reference_given)

    @property
    def engine(self):
        return self.rollout.engine

    def generates(self) -> bool:
        return True

    def auxiliary_models_ready(self) -> None:
        self.reference.ready()

    @property
    def beta(self) -> float:
        """β of the current epoch: a list gives one per epoch, its last for the epochs past it (TRL 1.16 documents
        this but indexes the list with the fractional epoch, a TypeError from its second step)."""
        beta = self.args.beta
        if not isinstance(beta, (list, tuple)):
            return float(beta)
        state = self.context.state
        epoch = int(state.epoch or 0) if state is not None else 0
        return float(beta[min(epoch, len(beta) - 1)])

    # --- data -------------------------------------------------------------------------------------------------
    def prepare_train_dataset(self, dataset):
        first = next(iter(dataset), None)
        if not isinstance(first, dict) or "prompt" not in first:
            raise ValueError(f"train_dataset: row 0 is {first!r}; expected a dict with a 'prompt' column (a string, "
                             "or a list of {'role', 'content'} messages)")
        if "image" in first or "images" in first:
            raise ValueError("train_dataset has images: hfnative's OnlineDPOTrainer trains text models only")
        if self.args.remove_unused_columns and hasattr(dataset, "column_names"):  # the prompts are what it uses
            unused = [name for name in dataset.column_names or [] if name != "prompt"]
            dataset = dataset.remove_columns(unused) if unused else dataset
        return dataset

    def default_collator(self):
        return _rows

    # --- one optimizer step: each micro-batch's prompts completed twice, scored and paired ----------------------
    def normalizer(self, batches: list[dict]) -> Normalizer:
        """TRL backpropagates each micro-batch's mean as it is (the step trains on their sum) and logs their mean."""
        return Normalizer.summed_micro_batches(batches)

    def micro_batches(self, epoch_iterator, count: int) -> list[dict]:
        first_place = self.context.state.global_step * self.args.gradient_accumulation_steps
        return [self.generate_and_pair(as_rows(batch), first_place + index)
                for index, batch in zip(range(count), epoch_iterator)]

    @torch.no_grad()
    def generate_and_pair(self, rows: list[dict], place: int) -> dict:
        """The micro-batch of ``rows``: two sampled completions per prompt (``place``, the run's micro-batch, keys
        the engine's per-row sampling streams), their rewards [N], whether each holds an EOS [N], the chosen and
        rejected rows [B], and the model inputs (``model_inputs``)."""
        rows = rows + rows  # block layout, as TRL repeats its prompt tensor
        prompts = [row["prompt"] for row in rows]
        prompt_ids = self.rollout.tokenize(prompts)
        rollouts = self.rollout.generate(prompt_ids, **self.rollout.row_streams(place, len(prompt_ids)))
        batch = self.rollout.tensors(prompt_ids, rollouts.completion_ids, rollouts.logprobs)
        completion_ids_NT = batch["completion_ids"]
        contains_eos_N = torch.isin(completion_ids_NT, torch.tensor(self.stop_ids)).any(dim=1)
        # as TRL: the reward functions get the padded completion rows, decoded without special tokens
        padded = completion_ids_NT.tolist()
        completions = self.rollout.decode(prompts, padded)
        rewards_NF = self.rewards.score(prompts, completions, padded, rows, trainer_state=self.context.state)
        rewards_N = (rewards_NF * self.rewards.weights_F[None, :]).nansum(dim=1)
        if self.args.missing_eos_penalty is not None:
            rewards_N = torch.where(contains_eos_N, rewards_N, rewards_N - self.args.missing_eos_penalty)
        chosen_B, rejected_B = pick_pairs(rewards_N)
        inputs = model_inputs(batch, max_length=self.args.max_length, target_padding=True)
        return {**inputs, "rewards": rewards_N, "contains_eos": contains_eos_N, "chosen_rows": chosen_B,
                "rejected_rows": rejected_B}

    # --- the loss -----------------------------------------------------------------------------------------------
    def completion_logprobs(self, model, inputs: dict) -> torch.Tensor:
        """Log-prob [N, T] of every completion token (padding too), softmax of the raw logits (no temperature), as
        TRL; without the model's router loss (TRL's online DPO adds none)."""
        with router_loss_off(model):
            return completion_logprobs_of(model, inputs, 1.0, self.context, fused=self.args.fused_loss)[0]

    def loss(self, model, inputs: dict, num_items_in_batch):
        beta = self.beta
        # padding queries attend to the real keys before them, as transformers' masks do: TRL's objective/kl and
        # objective/entropy read the log-probs at the completions' padding
        plan = transformers_padding_plan(inputs["attention_plan"], inputs["attention_mask"])
        inputs = {**inputs, "attention_plan": plan}
        logprobs_NT = self.completion_logprobs(model, inputs)
        with torch.no_grad(), self.reference.running() as reference:
            ref_logprobs_NT = self.completion_logprobs(reference, inputs).to(logprobs_NT.dtype)
        mask_NT = inputs["completion_mask"].to(logprobs_NT.dtype)
        logps_N, ref_logps_N = (logprobs_NT * mask_NT).sum(dim=1), (ref_logprobs_NT * mask_NT).sum(dim=1)
        chosen_B, rejected_B = inputs["chosen_rows"], inputs["rejected_rows"]
        chosen_logratio_B = logps_N[chosen_B] - ref_logps_N[chosen_B]
        rejected_logratio_B = logps_N[rejected_B] - ref_logps_N[rejected_B]
        loss = online_dpo_losses(chosen_logratio_B, rejected_logratio_B, beta, self.args.loss_type).mean()
        return loss, self.metrics(logprobs_NT.detach(), ref_logprobs_NT, logps_N.detach(), chosen_logratio_B.detach(),
                                  rejected_logratio_B.detach(), inputs, beta)

    @staticmethod
    def metrics(logprobs_NT, ref_logprobs_NT, logps_N, chosen_logratio_B, rejected_logratio_B, inputs, beta) -> dict:
        """TRL's online DPO metrics of the micro-batch (means over its completions or pairs; the loop averages them
        over micro-batches and ranks)."""
        rewards_N = inputs["rewards"].to(logps_N.device, logps_N.dtype)
        chosen_B, rejected_B = inputs["chosen_rows"], inputs["rejected_rows"]
        kl_N = (logprobs_NT - ref_logprobs_NT).sum(dim=1)  # every completion position, as TRL's
        non_score_reward_N = -beta * kl_N
        chosen_rewards_B, rejected_rewards_B = beta * chosen_logratio_B, beta * rejected_logratio_B
        margins_B = chosen_rewards_B - rejected_rewards_B
        return {
            "objective/kl": kl_N.mean(),
            "objective/entropy": -logprobs_NT.sum(dim=1).mean(),
            "objective/non_score_reward": non_score_reward_N.mean(),
            "objective/rlhf_reward": (rewards_N + non_score_reward_N).mean(),
            "objective/scores": rewards_N.mean(),
            "objective/scores_margin": (rewards_N[chosen_B] - rewards_N[rejected_B]).mean(),
            "rewards/chosen": chosen_rewards_B.mean(),
            "rewards/rejected": rejected_rewards_B.mean(),
            "rewards/accuracies": (margins_B > 0).float().mean(),
            "rewards/margins": margins_B.mean(),
            "logps/chosen": logps_N[chosen_B].mean(),
            "logps/rejected": logps_N[rejected_B].mean(),
            "val/contain_eos_token": inputs["contains_eos"].float().mean(),
            "beta": torch.tensor(beta, dtype=torch.float64),
        }

    def after_optimizer_step(self) -> None:
        self.rollout.sync_weights()


class OnlineDPOTrainer(RewardAttributes, ReferenceTrainer, Trainer):
    """TRL's experimental OnlineDPOTrainer: ``OnlineDPOTrainer(model, ref_model, reward_funcs, args, data_collator,
    train_dataset, eval_dataset, processing_class, reward_processing_classes, peft_config, compute_metrics,
    callbacks, optimizers, preprocess_logits_for_metrics)``. ``reward_funcs``: a callable, a reward model (path or
    model), a built-in name or a dotted import path, or a list of them (trainers/rollout/rewards.py); with none,
    ``args.reward_model_path``. Logs loss, grad_norm, learning_rate and TRL's objective/*, rewards/*, logps/*,
    val/contain_eos_token and beta."""

    algorithm_name = "OnlineDPO"
    config_class = OnlineDPOConfig
    requires_train_dataset = True
    _tag_names = ["trl", "online-dpo"]

    def __init__(
        self,
        model,
        ref_model=None,
        reward_funcs=None,
        args: OnlineDPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        peft_config=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
    ):
        args = self.resolve_args(args, model)
        if reward_funcs is not None and args.reward_model_path is not None:
            raise ValueError(
                f"reward_model_path={args.reward_model_path!r} and reward_funcs are both set: TRL's trainer reads only "
                "reward_funcs; pass the reward model among reward_funcs and unset reward_model_path"
            )
        if reward_funcs is None and args.reward_model_path is None:
            raise ValueError("`reward_funcs` must be provided (or `reward_model_path` in the config).")
        self._reward_funcs = reward_funcs if reward_funcs is not None else args.reward_model_path
        self._reward_processing_classes = reward_processing_classes
        self._take_reference_source(args, model, ref_model, peft_config)
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config,
        )
        self._keep_trl_generation_attributes(args)

    def _keep_trl_generation_attributes(self, args) -> None:
        """TRL's public generation attributes, as its constructor sets them (what users' code reads; the sampling
        itself reads ``args``): the settings, the stop ids and the GenerationConfig TRL builds from them."""
        self.use_vllm, self.num_generations = args.use_vllm, 2
        self.temperature, self.top_p, self.top_k, self.min_p = args.temperature, args.top_p, args.top_k, args.min_p
        self.repetition_penalty = args.repetition_penalty
        self.vllm_mode = args.vllm_mode if args.use_vllm else None
        self.vllm_gpu_memory_utilization = args.vllm_gpu_memory_utilization
        self.vllm_tensor_parallel_size, self.vllm_model_impl = args.vllm_tensor_parallel_size, args.vllm_model_impl
        self.max_length = args.max_length
        self.eos_token_ids = list(self.objective.stop_ids)
        # transformers' GenerationConfig, as TRL builds it without vLLM (use_vllm=True is refused by the config)
        tokenizer = self.objective.context.tokenizer
        settings = {"max_new_tokens": args.max_new_tokens, "do_sample": True, "pad_token_id": tokenizer.pad_token_id,
                    "bos_token_id": tokenizer.bos_token_id, "eos_token_id": self.eos_token_ids,
                    "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                    "repetition_penalty": self.repetition_penalty, "use_cache": not args.gradient_checkpointing}
        if self.min_p is not None:
            settings["min_p"] = self.min_p
        settings.update(args.generation_kwargs or {})
        self.generation_kwargs = {key: value for key, value in settings.items() if value is not None}
        self.generation_config = transformers.GenerationConfig(**self.generation_kwargs)

    def _make_objective(self):
        return OnlineDPOObjective(self.context, self._reward_funcs, self._reward_processing_classes,
                                  self._reference_for_objective(), reference_given=self._ref_given)

    @property
    def beta(self) -> float:
        """TRL's: β of the current epoch."""
        return self.objective.beta



__all__ = ["OnlineDPOObjective", "OnlineDPOTrainer", "as_rows", "online_dpo_losses", "pick_pairs"]
