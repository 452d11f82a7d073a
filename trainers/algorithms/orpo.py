"""ORPOTrainer: TRL's experimental Odds Ratio Preference Optimization on the one loop.

loss = NLL of the chosen rows (every attended token, prompt included, as TRL's) - beta * mean log sigmoid(log odds
ratio), the odds of the per-token average completion log-probs; no reference model.
"""

from __future__ import annotations

from hfnative.losses.preference import odds_ratio_terms

from .reference_free_config import ORPOConfig
from .reference_free_preference import ReferenceFreePreferenceObjective, ReferenceFreePreferenceTrainer


class ORPOObjective(ReferenceFreePreferenceObjective):
    """ORPO on the policy's average completion log-probs; TRL's metrics (rewards = beta * average log-prob)."""

    @property
    def padding_value(self):
        return self.args.padding_value

    def preference_loss(self, sums):
        beta = self.args.beta
        average_logps = sums["logps"] / sums["lengths"]
        chosen_logps, rejected_logps = average_logps.chunk(2, dim=0)
        log_sigmoid_odds, log_odds = odds_ratio_terms(chosen_logps, rejected_logps)
        nll = self.chosen_nll(sums["token_logps"], sums["attended"])
        loss = nll - (beta * log_sigmoid_odds).mean()
        metrics = self.reward_metrics(chosen_logps, rejected_logps, beta * chosen_logps.detach().float(),
                                      beta * rejected_logps.detach().float(), sums["mean_logits"][:, :-1])
        metrics.update({"nll_loss": nll.detach(), "log_odds_ratio": log_sigmoid_odds.detach().mean(),
                        "log_odds_chosen": log_odds.detach().mean()})
        return loss, metrics


class ORPOTrainer(ReferenceFreePreferenceTrainer):
    """TRL's ORPOTrainer: same constructor and ORPOConfig; logs loss, grad_norm, learning_rate, rewards/chosen,
    rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, logits/chosen,
    logits/rejected, nll_loss, log_odds_ratio, log_odds_chosen."""

    algorithm_name = "ORPO"
    config_class = ORPOConfig
    objective_class = ORPOObjective
    _tag_names = ["trl", "orpo"]


def cli_command():
    """``hfnative-train orpo``: the script, ORPOConfig and model arguments."""
    from ..running import cli

    return cli.Command("Odds Ratio Preference Optimization (TRL's experimental ORPO)", ORPOConfig, ORPOTrainer,
                       cli.train_model)


__all__ = ["ORPOConfig", "ORPOTrainer"]
