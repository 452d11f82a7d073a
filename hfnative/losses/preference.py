"""Preference-optimization losses (DPO and its variants) as pure functions of sequence log-probs.

Shapes: B preference pairs, S sequence positions.

Inputs are the summed completion log-probs of the policy and the reference for the chosen and the
rejected completion of each pair ([B] each). ``logratio = logp_policy - logp_ref``; a "score" is the
log-ratio passed through the f-divergence's derivative (the log-ratio itself for reverse KL, the
standard DPO). Each ``*_loss`` returns one loss per pair [B]; ``preference_loss`` weights and sums the
means of several, as TRL's DPOTrainer does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# the losses built on the chosen-minus-rejected score difference, where the f-DPO log-partition term cancels
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
# losses that sort the pairs (per-pair weights would no longer line up)
SORTING_LOSS_TYPES = ("aot", "aot_unpaired")


def f_divergence_scores(logratio_B: torch.Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 0.5) -> torch.Tensor:
    """f'(t) at t = exp(logratio): the f-DPO score of each sequence."""
    if f_divergence_type == "reverse_kl":
        return logratio_B
    if f_divergence_type == "forward_kl":  # f'(t) = 1 - 1/t
        return 1 - torch.exp(-logratio_B)
    if f_divergence_type == "js_divergence":  # f'(t) = log(2t / (t + 1))
        return math.log(2) + F.logsigmoid(logratio_B)
    if f_divergence_type == "alpha_divergence":  # f'(t) = (t^(alpha-1) - 1) / (alpha - 1)
        if abs(alpha - 1.0) < 1e-6:  # the limit is log t
            return logratio_B
        exponent = (alpha - 1.0) * logratio_B
        # clamped so exp stays finite once cast back to the input dtype
        clamp = {torch.float16: 11.0}.get(exponent.dtype, 80.0)
        return (torch.exp(torch.clamp(exponent.float(), max=clamp)) - 1.0).to(exponent.dtype) / (alpha - 1.0)
    raise ValueError(f"Unknown f_divergence_type: {f_divergence_type}; use one of {list(F_DIVERGENCES)}")


# --- one loss per pair [B] -------------------------------------------------------------------------------

def sigmoid_loss(delta_B, beta):
    """DPO: -log sigmoid(beta * (score_chosen - score_rejected))."""
    return -F.logsigmoid(beta * delta_B)


def hinge_loss(delta_B, beta):
    """SLiC: max(0, 1 - beta * delta)."""
    return torch.relu(1 - beta * delta_B)


def ipo_loss(chosen_scores_B, rejected_scores_B, chosen_lengths_B, rejected_lengths_B, beta):
    """IPO on per-token scores (each score divided by its completion length): (delta - 1 / (2 beta))^2."""
    delta_B = chosen_scores_B / chosen_lengths_B.clamp(min=1.0) - rejected_scores_B / rejected_lengths_B.clamp(min=1.0)
    return (delta_B - 1 / (2 * beta)) ** 2


def exo_pair_loss(delta_B, beta, epsilon):
    """EXO-pref: KL(softmax of beta * scores over {chosen, rejected} || [1 - epsilon, epsilon])."""
    z_B = beta * delta_B
    # the target's logs as host numbers (a tensor made from epsilon would be a copy the device waits for)
    return (torch.sigmoid(z_B) * (F.logsigmoid(z_B) - math.log1p(-epsilon))
            + torch.sigmoid(-z_B) * (F.logsigmoid(-z_B) - math.log(epsilon)))


def nca_pair_loss(chosen_logratio_B, rejected_logratio_B, beta):
    """NCA: -log sigmoid(r_w) - (log sigmoid(-r_w) + log sigmoid(-r_l)) / 2, r = beta * logratio."""
    chosen_B, rejected_B = beta * chosen_logratio_B, beta * rejected_logratio_B
    return -F.logsigmoid(chosen_B) - 0.5 * F.logsigmoid(-chosen_B) - 0.5 * F.logsigmoid(-rejected_B)


def robust_loss(delta_B, beta, label_smoothing):
    """Robust DPO: the sigmoid loss unbiased for labels flipped with probability ``label_smoothing``."""
    clean_B = -(1 - label_smoothing) * F.logsigmoid(beta * delta_B)
    flipped_B = -label_smoothing * F.logsigmoid(-beta * delta_B)
    return (clean_B - flipped_B) / (1 - 2 * label_smoothing)


def bco_pair_loss(chosen_logratio_B, rejected_logratio_B, beta):
    """BCO on pairs: -log sigmoid(r_w) - log sigmoid(-r_l)."""
    return -F.logsigmoid(beta * chosen_logratio_B) - F.logsigmoid(-beta * rejected_logratio_B)


def sppo_hard_loss(chosen_logratio_B, rejected_logratio_B, beta):
    """SPPO with hard win probabilities: (lr_w - 1 / (2 beta))^2 + (lr_l + 1 / (2 beta))^2."""
    return (chosen_logratio_B - 0.5 / beta) ** 2 + (rejected_logratio_B + 0.5 / beta) ** 2


def _smoothed_sigmoid(delta_B, beta, label_smoothing):
    return -F.logsigmoid(beta * delta_B) * (1 - label_smoothing) - F.logsigmoid(-beta * delta_B) * label_smoothing


def aot_loss(chosen_logps_B, rejected_logps_B, ref_chosen_logps_B, ref_rejected_logps_B, beta, label_smoothing):
    """AOT (paired): the sorted policy margins against the sorted reference margins."""
    policy_B, _ = torch.sort(chosen_logps_B - rejected_logps_B, dim=0)
    reference_B, _ = torch.sort(ref_chosen_logps_B - ref_rejected_logps_B, dim=0)
    return _smoothed_sigmoid(policy_B - reference_B, beta, label_smoothing)


def aot_unpaired_loss(chosen_logratio_B, rejected_logratio_B, beta, label_smoothing):
    """AOT (unpaired): the sorted chosen log-ratios against the sorted rejected ones."""
    chosen_B, _ = torch.sort(chosen_logratio_B, dim=0)
    rejected_B, _ = torch.sort(rejected_logratio_B, dim=0)
    return _smoothed_sigmoid(chosen_B - rejected_B, beta, label_smoothing)


def apo_zero_loss(chosen_logratio_B, rejected_logratio_B, beta):
    """APO-zero: raise the chosen likelihood, lower the rejected one."""
    return 1 - torch.sigmoid(beta * chosen_logratio_B) + torch.sigmoid(beta * rejected_logratio_B)


def apo_down_loss(chosen_logratio_B, rejected_logratio_B, beta):
    """APO-down: lower both likelihoods, the rejected one more."""
    return torch.sigmoid(beta * chosen_logratio_B) + 1 - torch.sigmoid(beta * (chosen_logratio_B - rejected_logratio_B))


def discopop_loss(delta_B, beta, tau):
    """DiscoPOP: a logistic and an exponential loss blended by sigmoid(beta * delta / tau)."""
    z_B = beta * delta_B
    mix_B = torch.sigmoid(z_B / tau)
    return -F.logsigmoid(z_B) * (1 - mix_B) + torch.exp(-z_B) * mix_B


def sft_loss(chosen_logps_B, chosen_tokens_B):
    """The chosen completions' mean token NLL (one number for the batch, repeated per pair): their summed
    log-probs [B] over their completion tokens [B]."""
    nll = -chosen_logps_B.sum() / chosen_tokens_B.sum()
    return nll.expand(chosen_logps_B.shape[0])


def sigmoid_norm_loss(chosen_scores_B, rejected_scores_B, chosen_lengths_B, rejected_lengths_B, beta):
    """The sigmoid loss on per-token (length-normalized) scores."""
    delta_B = chosen_scores_B / chosen_lengths_B.clamp(min=1.0) - rejected_scores_B / rejected_lengths_B.clamp(min=1.0)
    return -F.logsigmoid(beta * delta_B)


# --- the combined loss -----------------------------------------------------------------------------------

@dataclass
class PreferenceLogps:
    """One batch of pairs: sequence log-probs [B], and per row (chosen rows first, then rejected, [2B]) what
    some losses need. Every row value is a sum over the row's completion tokens, so a batch whose sequences are
    split over ranks (context parallel) gives them summed over its ranks' chunks.

    completion_lengths_B2: completion tokens per row, for ``ipo`` / ``sigmoid_norm``.
    plain_logps_B2: summed completion log-probs without LD-DPO's weights, for ``sft`` (None: the sequence log-probs).
    token_counts_B2: the tokens those sums run over, for ``sft`` and the WPO weights.
    wpo_sums_B2: sum over the completion tokens of log p(token) - log sum_v p_v^2, without gradient (the WPO
        weights; only with use_weighting).
    """

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor
    ref_rejected_logps: torch.Tensor
    completion_lengths_B2: torch.Tensor | None = None
    plain_logps_B2: torch.Tensor | None = None
    token_counts_B2: torch.Tensor | None = None
    wpo_sums_B2: torch.Tensor | None = None


def wpo_weights(wpo_sums_B2, token_counts_B2) -> tuple[torch.Tensor, torch.Tensor]:
    """WPO's per-sequence weights (chosen [B], rejected [B]): exp of the mean over completion tokens of
    log p(token) - log sum_v p_v^2, without gradient."""
    weights_B2 = torch.exp(wpo_sums_B2.detach() / token_counts_B2.clamp_min(1))
    return weights_B2.chunk(2, dim=0)


def preference_loss(
    logps: PreferenceLogps,
    loss_type: list[str] | tuple[str, ...] = ("sigmoid",),
    loss_weights: list[float] | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    use_weighting: bool = False,
) -> torch.Tensor:
    """sum_k weight_k * mean over pairs of loss_k (TRL's DPOTrainer loss, before any auxiliary loss)."""
    weights = loss_weights or [1.0] * len(loss_type)
    chosen_logratio = logps.chosen_logps - logps.ref_chosen_logps
    rejected_logratio = logps.rejected_logps - logps.ref_rejected_logps
    chosen_scores = f_divergence_scores(chosen_logratio, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = f_divergence_scores(rejected_logratio, f_divergence_type, f_alpha_divergence_coef)
    delta = chosen_scores - rejected_scores
    lengths = logps.completion_lengths_B2
    chosen_lengths, rejected_lengths = lengths.chunk(2, dim=0) if lengths is not None else (None, None)
    pair_weights = None
    if use_weighting:
        pair_weights = wpo_weights(logps.wpo_sums_B2, logps.token_counts_B2)

    total = 0.0
    for name, weight in zip(loss_type, weights, strict=True):
        if name == "sigmoid":
            per_pair = sigmoid_loss(delta, beta)
        elif name == "hinge":
            per_pair = hinge_loss(delta, beta)
        elif name == "ipo":
            per_pair = ipo_loss(chosen_scores, rejected_scores, chosen_lengths, rejected_lengths, beta)
        elif name == "exo_pair":
            per_pair = exo_pair_loss(delta, beta, label_smoothing)
        elif name == "nca_pair":
            per_pair = nca_pair_loss(chosen_logratio, rejected_logratio, beta)
        elif name == "robust":
            per_pair = robust_loss(delta, beta, label_smoothing)
        elif name == "bco_pair":
            per_pair = bco_pair_loss(chosen_logratio, rejected_logratio, beta)
        elif name == "sppo_hard":
            per_pair = sppo_hard_loss(chosen_logratio, rejected_logratio, beta)
        elif name == "aot":
            per_pair = aot_loss(logps.chosen_logps, logps.rejected_logps, logps.ref_chosen_logps,
                                logps.ref_rejected_logps, beta, label_smoothing)
        elif name == "aot_unpaired":
            per_pair = aot_unpaired_loss(chosen_logratio, rejected_logratio, beta, label_smoothing)
        elif name == "apo_zero":
            per_pair = apo_zero_loss(chosen_logratio, rejected_logratio, beta)
        elif name == "apo_down":
            per_pair = apo_down_loss(chosen_logratio, rejected_logratio, beta)
        elif name == "discopop":
            per_pair = discopop_loss(delta, beta, discopop_tau)
        elif name == "sft":
            plain_B2 = logps.plain_logps_B2
            chosen_plain = plain_B2.chunk(2, dim=0)[0] if plain_B2 is not None else logps.chosen_logps
            per_pair = sft_loss(chosen_plain, logps.token_counts_B2.chunk(2, dim=0)[0])
        elif name == "sigmoid_norm":
            per_pair = sigmoid_norm_loss(chosen_scores, rejected_scores, chosen_lengths, rejected_lengths, beta)
        else:
            raise ValueError(f"Unknown loss type: {name}. Should be one of {list(LOSS_TYPES)}")
        if pair_weights is not None:
            per_pair = per_pair * (pair_weights[0] * pair_weights[1])
        total = total + per_pair.mean() * weight
    return total


# --- reference-free losses (ORPO, CPO / SimPO / AlphaPO) ------------------------------------------------------
# their inputs are the policy's own sequence log-probs [B] (summed or averaged over the completion tokens)

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, branched at -log 2 so neither side cancels."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_terms(chosen_logps_B, rejected_logps_B) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO: (log sigmoid(log odds ratio) [B], log odds ratio [B]) in float32, where log odds(p) = log p - log(1 - p)
    of the per-token average log-probs; the loss subtracts beta times the first's mean from the chosen NLL."""
    chosen_B, rejected_B = chosen_logps_B.float(), rejected_logps_B.float()
    log_odds_B = (chosen_B - rejected_B) - (log1mexp(chosen_B) - log1mexp(rejected_B))
    return F.logsigmoid(log_odds_B), log_odds_B


def alphapo_rewards(logps_B, alpha: float) -> torch.Tensor:
    """AlphaPO's reward (1 - p^-alpha) / alpha of a sequence log-prob (alpha != 0)."""
    return (1 - torch.exp(logps_B).pow(-alpha)) / alpha


def cpo_loss(chosen_logps_B, rejected_logps_B, loss_type: str = "sigmoid", beta: float = 0.1,
             label_smoothing: float = 0.0, simpo_gamma: float = 0.5, alpha: float = 0.0) -> tuple:
    """CPO's preference term per pair [B] and the (chosen, rejected) rewards [B] (no gradient): the margin is between
    the log-probs, or with ``alpha`` != 0 between AlphaPO's rewards; SimPO shifts it by simpo_gamma / beta."""
    if alpha != 0.0:
        chosen_B, rejected_B = alphapo_rewards(chosen_logps_B, alpha), alphapo_rewards(rejected_logps_B, alpha)
    else:
        chosen_B, rejected_B = chosen_logps_B, rejected_logps_B
    delta_B = chosen_B - rejected_B
    if loss_type == "simpo":
        losses_B = _smoothed_sigmoid(delta_B - simpo_gamma / beta, beta, label_smoothing)
    elif loss_type == "sigmoid":
        losses_B = _smoothed_sigmoid(delta_B, beta, label_smoothing)
    elif loss_type == "hinge":
        losses_B = hinge_loss(delta_B, beta)
    elif loss_type == "ipo":  # on log-probs already averaged per token
        losses_B = (delta_B - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"Unknown loss type: {loss_type}. Should be one of {list(CPO_LOSS_TYPES)}")
    return losses_B, beta * chosen_B.detach(), beta * rejected_B.detach()
