"""PPO with a value model (TRL 0.29's PPOTrainer), as pure functions on tensors: responses cut at the stop token,
the KL penalty in the reward, generalized advantage estimation, whitening, and the clipped policy and value losses.

Shapes: N rollouts of an update, B of a micro-batch, T response tokens (right-padded). Two masks follow TRL:
``padding_mask`` [N, T] is True after each response's last kept token (``sequence_lengths``), ``padding_mask_p1``
one token later (the value and the reward also count the token after it).
"""

from __future__ import annotations

import torch

# the log-prob TRL writes at padded response positions (so that the ratio there is exp(0) = 1)
INVALID_LOGPROB = 1.0


def first_true_indices(bools_NT: torch.Tensor) -> torch.Tensor:
    """Index of the first True of each row [N]; the row length T for a row with none."""
    T = bools_NT.size(-1)
    index_or_length = T * (~bools_NT).long() + torch.arange(T, device=bools_NT.device)
    return index_or_length.min(dim=-1).values


def truncate_after_stop(responses_NT: torch.Tensor, stop_token_id: int, pad_token_id: int) -> torch.Tensor:
    """The responses with every token after the first ``stop_token_id`` replaced by ``pad_token_id``."""
    stop_N1 = first_true_indices(responses_NT == stop_token_id).unsqueeze(-1)
    positions_1T = torch.arange(responses_NT.shape[1], device=responses_NT.device).view(1, -1)
    return responses_NT.masked_fill(positions_1T > stop_N1, pad_token_id)


def padding_masks(sequence_lengths_N: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's (padding_mask, padding_mask_p1) [N, T] from the index of each response's last kept token."""
    positions_NT = torch.arange(T, device=sequence_lengths_N.device).repeat(sequence_lengths_N.shape[0], 1)
    return positions_NT > sequence_lengths_N.unsqueeze(1), positions_NT > (sequence_lengths_N + 1).unsqueeze(1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` (over ``axis``, or all)."""
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` where ``mask``, with Bessel's correction when ``unbiased``."""
    centered = values - masked_mean(values, mask)
    variance = masked_mean(centered**2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("The sum of the mask is zero, which can happen when `mini_batch_size=1`; try increase "
                             "the `mini_batch_size` or `gradient_accumulation_steps`")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over ``mask``; the mean added back when not ``shift_mean``."""
    mean, variance = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_estimate(logprobs_NT: torch.Tensor, ref_logprobs_NT: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(policy || reference) from the sampled tokens' log-probs (http://joschu.net/blog/kl-approx.html):
    k1 = -log r, k3 = (r - 1) - log r, with log r = ref - policy."""
    log_ratio = ref_logprobs_NT - logprobs_NT
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return (log_ratio.exp() - 1) - log_ratio
    raise ValueError(f"kl_estimator={estimator!r}: expected 'k1' or 'k3'")


def token_rewards(non_score_reward_NT: torch.Tensor, scores_N: torch.Tensor, sequence_lengths_N: torch.Tensor) -> torch.Tensor:
    """The per-token reward: the KL penalty, plus each score at TRL's index, ``sequence_lengths + 1`` (one past the
    last kept token, where the value is still counted), or the last kept token when that is the last position."""
    rewards_NT = non_score_reward_NT.clone()
    after_N = sequence_lengths_N + 1
    at_N = torch.where(after_N < rewards_NT.size(1), after_N, sequence_lengths_N)
    rewards_NT[torch.arange(rewards_NT.size(0), device=rewards_NT.device), at_N] += scores_N
    return rewards_NT


def generalized_advantages(rewards_NT: torch.Tensor, values_NT: torch.Tensor, gamma: float,
                           lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over each response (the value after the last position is 0): (advantages, returns = advantages + values)."""
    T = rewards_NT.shape[1]
    running = 0
    reversed_advantages = []
    for t in reversed(range(T)):
        next_values = values_NT[:, t + 1] if t < T - 1 else 0.0
        delta = rewards_NT[:, t] + gamma * next_values - values_NT[:, t]
        running = delta + gamma * lam * running
        reversed_advantages.append(running)
    advantages_NT = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages_NT, advantages_NT + values_NT


def _over(values: torch.Tensor, mask: torch.Tensor, tokens) -> torch.Tensor:
    """The sum of ``values`` where ``mask`` over ``tokens`` (None: the mask's own count, a masked mean)."""
    return masked_mean(values, mask) if tokens is None else (values * mask).sum() / tokens


def clipped_policy_loss(new_logprobs_BT, old_logprobs_BT, advantages_BT, padding_mask_BT, cliprange: float,
                        tokens=None):
    """PPO's clipped surrogate, the mean over the kept tokens of max(-A r, -A clip(r, 1 - c, 1 + c)):
    (loss, clip fraction, ratio [B, T], log-ratio [B, T]). ``tokens``: divide the sums by this count instead of the
    kept tokens of these rows (the rows' share of a mean over a micro-batch split over processes)."""
    log_ratio_BT = new_logprobs_BT - old_logprobs_BT
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped = -advantages_BT * ratio_BT
    clipped = -advantages_BT * torch.clamp(ratio_BT, 1.0 - cliprange, 1.0 + cliprange)
    kept_BT = ~padding_mask_BT
    loss = _over(torch.max(unclipped, clipped), kept_BT, tokens)
    clip_fraction = _over((clipped > unclipped).float(), kept_BT, tokens).detach()
    return loss, clip_fraction, ratio_BT, log_ratio_BT


def clipped_value_loss(predicted_BT, old_values_BT, returns_BT, padding_mask_p1_BT, cliprange_value: float,
                       tokens=None):
    """The clipped value loss, 0.5 times the mean over the valued tokens of max((v - R)^2, (clip(v) - R)^2) with v
    clipped to old value +- cliprange_value: (loss, clip fraction). ``tokens`` as in ``clipped_policy_loss``."""
    clipped_BT = torch.clamp(predicted_BT, old_values_BT - cliprange_value, old_values_BT + cliprange_value)
    unclipped_loss = torch.square(predicted_BT - returns_BT)
    clipped_loss = torch.square(clipped_BT - returns_BT)
    valued_BT = ~padding_mask_p1_BT
    loss = 0.5 * _over(torch.max(unclipped_loss, clipped_loss), valued_BT, tokens)
    return loss, _over((clipped_loss > unclipped_loss).float(), valued_BT, tokens).detach()


__all__ = [
    "INVALID_LOGPROB",
    "clipped_policy_loss",
    "clipped_value_loss",
    "first_true_indices",
    "generalized_advantages",
    "kl_estimate",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "padding_masks",
    "token_rewards",
    "truncate_after_stop",
]
