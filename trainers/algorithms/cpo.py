"""CPOTrainer: TRL's experimental Contrastive Preference Optimization (and SimPO, AlphaPO) on the one loop.

loss = mean over pairs of the loss type's preference term on the policy's completion log-probs (summed; averaged per
token for ipo and simpo) + cpo_alpha * the chosen completions' token NLL; no reference model.
"""

from __future__ import annotations

import logging

import torch

from hfnative.losses.preference import cpo_loss

from .reference_free_config import CPOConfig
from .reference_free_preference import ReferenceFreePreferenceObjective, ReferenceFreePreferenceTrainer

logger = logging.getLogger(__name__)


class CPOObjective(ReferenceFreePreferenceObjective):
    """CPO's loss types; TRL's metrics (rewards = beta * log-prob, or beta * AlphaPO's reward)."""

    pads_with_eos = True

    def __init__(self, context):
        super().__init__(context)
        args = self.args
        if args.loss_type in ("hinge", "ipo") and args.label_smoothing > 0:
            logger.warning(f"You are using the {args.loss_type} loss type that does not support label smoothing. The "
                           "`label_smoothing` parameter will be ignored. Set `label_smoothing` to `0.0` to remove "
                           "this warning.")

    def preference_loss(self, sums):
        args = self.args
        logps = sums["logps"] / sums["lengths"] if args.loss_type in ("ipo", "simpo") else sums["logps"]
        chosen_logps, rejected_logps = logps.chunk(2, dim=0)
        losses, chosen_rewards, rejected_rewards = cpo_loss(
            chosen_logps, rejected_logps, loss_type=args.loss_type, beta=args.beta,
            label_smoothing=args.label_smoothing, simpo_gamma=args.simpo_gamma, alpha=args.alpha,
        )
        if args.cpo_alpha == 0:
            nll = torch.zeros((), device=logps.device)
        else:
            nll = self.chosen_nll(sums["token_logps"], sums["completion"])
        loss = losses.mean() + args.cpo_alpha * nll
        metrics = self.reward_metrics(chosen_logps, rejected_logps, chosen_rewards, rejected_rewards,
                                      sums["mean_logits"])
        metrics["nll_loss"] = nll.detach()
        return loss, metrics


class CPOTrainer(ReferenceFreePreferenceTrainer):
    """TRL's CPOTrainer: same constructor and CPOConfig; logs loss, grad_norm, learning_rate, rewards/chosen,
    rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, logits/chosen,
    logits/rejected, nll_loss."""

    algorithm_name = "CPO"
    config_class = CPOConfig
    objective_class = CPOObjective
    _tag_names = ["trl", "cpo"]


def cli_command():
    """``hfnative-train cpo``: the script, CPOConfig and model arguments."""
    from ..running import cli

    return cli.Command("Contrastive Preference Optimization (TRL's experimental CPO)", CPOConfig, CPOTrainer,
                       cli.train_model)


__all__ = ["CPOConfig", "CPOTrainer"]
