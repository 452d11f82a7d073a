"""RLOOTrainer: TRL's REINFORCE Leave-One-Out on GRPO's machinery (trainers/algorithms/grpo.py).

Shapes: N completions of a generation batch, B of a micro-batch, T completion tokens.

What differs from GRPO: the reward of a completion is compared with the mean reward of the other
completions of its prompt (no std scaling unless ``normalize_advantages``); with ``beta`` > 0 the KL to
the reference enters the reward, as beta times the completion's summed log-ratio log π_old - log π_ref,
instead of the loss; the clipped ratio is taken on whole-completion log-probs and the loss is averaged over
completions. TRL's defaults: num_generations 2, beta 0.05 (so a reference model by default).
"""

from __future__ import annotations

from hfnative.losses.policy import leave_one_out_advantages, sequence_kl_penalty, sequence_policy_loss, weighted_rewards

from .grpo import GRPOObjective, GRPOTrainer, RLScriptArguments, rl_trainer_kwargs
from .rloo_config import RLOOConfig


class RLOOObjective(GRPOObjective):
    """Leave-one-out advantages with the KL in the reward; the sequence-level clipped loss."""

    writes_completion_files = False  # TRL's RLOO logs its completions table to W&B / trackio only

    # TRL computes the old log-probs at every generation (the KL penalty needs them); by default they are the
    # engine's sampling log-probs of the same weights, with no forward pass
    def _needs_old_logprobs(self) -> bool:
        return True

    def advantages(self, rewards_NF, batch):
        args = self.args
        rewards_N = weighted_rewards(rewards_NF, self.rewards.weights_F)
        if args.reward_clip_range:
            low, high = args.reward_clip_range
            rewards_N = rewards_N.clamp(min=low, max=high)
        if args.beta != 0.0:  # rewards_NF holds every data-parallel rank's rows, batch this rank's
            mask_NT = batch["completion_mask"].float()
            gap_NT = (batch["old_logprobs"] - batch["ref_logprobs"]) * mask_NT
            kl_N = self.context.data_parallel.gather_rows(sequence_kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], mask_NT))
            rewards_N = rewards_N - args.beta * kl_N.to(rewards_N)
            self.context.metrics(self.mode).add_ratio("kl", gap_NT.sum(), mask_NT.sum())
        return leave_one_out_advantages(rewards_N, self.num_generations, normalize=args.normalize_advantages)

    def policy_loss(self, logprobs_BT, entropy_BT, mask_BT, inputs, num_items_in_batch):
        old_logps_B = (inputs["old_logprobs"] * mask_BT).sum(1)
        return sequence_policy_loss(logprobs_BT, old_logps_B, inputs["advantages"], mask_BT,
                                    epsilon=self.args.epsilon, epsilon_high=self.args.epsilon_high, entropy_BT=entropy_BT)


class RLOOTrainer(GRPOTrainer):
    """TRL's RLOOTrainer: ``RLOOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config)``, reward functions as GRPOTrainer's."""

    algorithm_name = "RLOO"
    config_class = RLOOConfig
    _tag_names = ["trl", "rloo"]
    objective_class = RLOOObjective

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), quantization_config=None,
                 peft_config=None):
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, quantization_config=quantization_config,
                         peft_config=peft_config)


def cli_command():
    """``hfnative-train rloo``: the GRPO command's script arguments with RLOO's config and trainer."""
    from ..running import cli

    return cli.Command("REINFORCE Leave-One-Out (TRL's `trl rloo`)", RLOOConfig, RLOOTrainer, cli.train_model,
                       script_args_class=RLScriptArguments, trainer_kwargs=rl_trainer_kwargs)


__all__ = ["RLOOConfig", "RLOOTrainer"]
