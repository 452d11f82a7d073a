"""Unpaired preference losses (KTO and APO-zero unpaired) as pure functions of sequence log-ratios.

``logratio = logp_policy - logp_ref`` of each completion's summed log-probs; desirable ("chosen") and undesirable
("rejected") completions come as separate tensors [C] and [R]. ``kl`` is the batch's estimate of
KL(policy || reference), a scalar (KTO's reference point z0), taken from mismatched prompt / completion pairs.
"""

from __future__ import annotations

import torch

UNPAIRED_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kl_free(loss_type: str) -> bool:
    """Whether the loss has no KL reference point (no mismatched completions needed)."""
    return loss_type == "apo_zero_unpaired"


def unpaired_preference_losses(
    chosen_logratios_C: torch.Tensor,
    rejected_logratios_R: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """The weighted losses [C + R]: desirable rows first, then undesirable ones.

    kto (Eq. 7 of the KTO paper): 1 - sigmoid(beta (logratio - kl)) desirable, 1 - sigmoid(beta (kl - logratio))
    undesirable; apo_zero_unpaired: 1 - sigmoid(beta logratio) desirable, sigmoid(beta logratio) undesirable."""
    if loss_type == "kto":
        chosen_C = 1 - torch.sigmoid(beta * (chosen_logratios_C - kl))
        rejected_R = 1 - torch.sigmoid(beta * (kl - rejected_logratios_R))
    elif loss_type == "apo_zero_unpaired":
        chosen_C = 1 - torch.sigmoid(beta * chosen_logratios_C)
        rejected_R = torch.sigmoid(beta * rejected_logratios_R)
    else:
        raise ValueError(f"Unknown loss type: {loss_type}. Should be one of {list(UNPAIRED_LOSS_TYPES)}")
    return torch.cat((desirable_weight * chosen_C, undesirable_weight * rejected_R))


__all__ = ["UNPAIRED_LOSS_TYPES", "kl_free", "unpaired_preference_losses"]
