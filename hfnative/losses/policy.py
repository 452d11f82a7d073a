"""Policy-gradient pieces of GRPO and RLOO: rewards to advantages, the clipped per-token loss and its
aggregations, the k3 KL, and the statistics TRL logs about them. Pure functions on tensors.

Shapes: N completions (a whole generation batch), G generations per prompt (rows of one prompt are
consecutive), F reward functions, B completions of a micro-batch, T completion tokens (right-padded).

Rewards a function could not give (None) are NaN here: they are left out of every mean, std and
baseline, and a completion no function scored gets advantage 0 (TRL 1.16's rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import torch

# added to the std before dividing by it (TRL's value)
ADVANTAGE_EPSILON = 1e-4
SCALE_REWARDS = ("group", "batch", "none")
# aggregations of the clipped surrogate; "cispo" and "sapo" change the per-token term too
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
# loss types whose micro-batch loss is already a mean (the step divides it by the accumulation steps);
# the others are sums divided by a token count given by the caller
MEAN_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "luspo", "sapo")


# --- rewards and advantages -------------------------------------------------------------------------------


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation with Bessel's correction over the non-NaN values; NaN where fewer than two."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    variance = torch.where(count > 1, variance * count / (count - 1).clamp(min=1), torch.nan)
    std = variance.sqrt()
    return std if keepdim else std.squeeze(dim)


def weighted_rewards(rewards_NF: torch.Tensor, weights_F: torch.Tensor) -> torch.Tensor:
    """Σ_f w_f r_f per completion over the functions that scored it; NaN when none did. [N]"""
    total_N = (rewards_NF * weights_F.to(rewards_NF)[None, :]).nansum(dim=1)
    return total_N.masked_fill(torch.isnan(rewards_NF).all(dim=1), torch.nan)


@dataclass
class Advantages:
    """advantages_N: one per completion (0 for unscorable ones). std_N: the spread each was compared with
    (the group's, or the batch's for scale_rewards="batch"); is_std_zero_N: where it is 0 (TRL's
    frac_reward_zero_std)."""

    advantages_N: torch.Tensor
    std_N: torch.Tensor
    is_std_zero_N: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.is_std_zero_N = torch.isclose(self.std_N, torch.zeros_like(self.std_N))


def _check_groups(rewards_N: torch.Tensor, num_generations: int) -> None:
    if num_generations < 1 or rewards_N.numel() % num_generations:
        raise ValueError(
            f"{rewards_N.numel()} rewards do not split into groups of num_generations={num_generations}: the "
            "generation batch must hold whole groups (a multiple of num_generations completions)"
        )


def group_advantages(
    rewards_N: torch.Tensor, num_generations: int, scale_rewards: str = "group", epsilon: float = ADVANTAGE_EPSILON
) -> Advantages:
    """GRPO: A = R - mean of R's group, divided by (std + epsilon) unless scale_rewards="none".

    rewards_N: the weighted reward per completion (NaN: unscorable). scale_rewards: "group" (std within
    the group), "batch" (std over all N) or "none" (not divided; the group std is still reported).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: expected one of {SCALE_REWARDS}")
    _check_groups(rewards_N, num_generations)
    grouped_PG = rewards_N.view(-1, num_generations)
    mean_N = torch.nanmean(grouped_PG, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std_N = nanstd(rewards_N).expand_as(rewards_N) if rewards_N.numel() > 1 else torch.zeros_like(rewards_N)
    elif num_generations > 1:
        std_N = nanstd(grouped_PG, dim=1).repeat_interleave(num_generations)
    else:
        std_N = torch.zeros_like(rewards_N)
    advantages_N = rewards_N - mean_N
    if scale_rewards != "none":
        advantages_N = advantages_N / (std_N + epsilon)
    return Advantages(torch.nan_to_num(advantages_N, nan=0.0), std_N)


def normalize_then_sum_advantages(
    rewards_NF: torch.Tensor, weights_F: torch.Tensor, num_generations: int, epsilon: float = ADVANTAGE_EPSILON
) -> Advantages:
    """GRPO with multi_objective_aggregation="normalize_then_sum": each function's rewards standardized within
    their group, weighted and summed, then the sum standardized over the batch."""
    _check_groups(rewards_NF[:, 0], num_generations)
    grouped_PGF = rewards_NF.view(-1, num_generations, rewards_NF.shape[1])
    mean_P1F = torch.nanmean(grouped_PGF, dim=1, keepdim=True)
    std_P1F = nanstd(grouped_PGF, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_P1F)
    standardized_NF = ((grouped_PGF - mean_P1F) / (std_P1F + epsilon)).view_as(rewards_NF)
    total_N = (standardized_NF * weights_F.to(rewards_NF)[None, :]).nansum(dim=1)
    total_N = total_N.masked_fill(torch.isnan(rewards_NF).all(dim=1), torch.nan)
    std_N = nanstd(total_N).expand_as(total_N) if total_N.numel() > 1 else torch.zeros_like(total_N)
    advantages_N = (total_N - torch.nanmean(total_N)) / (std_N + epsilon)
    return Advantages(torch.nan_to_num(advantages_N, nan=0.0), std_N)


def leave_one_out_advantages(
    rewards_N: torch.Tensor, num_generations: int, normalize: bool = False, epsilon: float = ADVANTAGE_EPSILON
) -> Advantages:
    """RLOO: A_i = r_i - mean of the other scorable rewards of i's group; a group with one scorable
    completion gives 0. normalize: then standardize the advantages over the batch (TRL's normalize_advantages).
    std_N: the group's reward std (for frac_reward_zero_std)."""
    _check_groups(rewards_N, num_generations)
    grouped_PG = rewards_N.view(-1, num_generations)
    if num_generations > 1:
        std_N = nanstd(grouped_PG, dim=1).repeat_interleave(num_generations)
        scorable_P1 = (~torch.isnan(grouped_PG)).sum(dim=1, keepdim=True)
        others_sum_PG = torch.nansum(grouped_PG, dim=1, keepdim=True) - grouped_PG
        advantages_N = rewards_N - (others_sum_PG / (scorable_P1 - 1)).view(-1)
    else:
        std_N = torch.zeros_like(rewards_N)
        advantages_N = torch.zeros_like(rewards_N)
    if normalize:
        advantages_N = (advantages_N - torch.nanmean(advantages_N)) / (nanstd(advantages_N) + epsilon)
    return Advantages(torch.nan_to_num(advantages_N, nan=0.0), std_N)


def sequence_kl_penalty(old_logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """RLOO's KL estimate subtracted (times beta) from each reward: Σ_t (log π_old - log π_ref). [B]"""
    return ((old_logprobs_BT - ref_logprobs_BT) * mask_BT).sum(-1)


# --- the per-token loss ---------------------------------------------------------------------------------------


def k3_kl(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π || π_ref) per token: exp(ref - logπ) - (ref - logπ) - 1 (>= 0)."""
    gap_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(gap_BT) - gap_BT - 1


def high_entropy_mask(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, quantile: float,
                      gather=None) -> torch.Tensor:
    """Tokens whose entropy is at least the ``quantile`` quantile of the completion tokens' entropies
    (TRL's top_entropy_quantile q keeps the top q: pass 1 - q). Boolean [B, T], False outside the mask.
    ``gather``: takes this rank's values [n] to every data-parallel rank's, concatenated (the quantile is then
    the whole batch's, as TRL gathers it)."""
    valid_BT = mask_BT.bool()
    # the other positions as NaN, which the quantile leaves out: no boolean index, whose size the host would wait for
    values = torch.where(valid_BT, entropy_BT.detach().float(), float("nan")).reshape(-1)
    if gather is not None:
        values = gather(values)
    if values.numel() == 0:
        return torch.zeros_like(valid_BT)
    threshold = _quantile_of_numbers(values, quantile)  # NaN where no rank has a completion token: nothing is kept
    return ((entropy_BT * mask_BT.float()) >= threshold) & valid_BT


def _quantile_of_numbers(values: torch.Tensor, quantile: float) -> torch.Tensor:
    """``torch.nanquantile(values, quantile)`` (linear interpolation between the sorted numbers; NaN when there are
    none) from one sort on the device: no host read, and no 2**24-element limit (every position of every rank's
    batch is here, the NaNs among them)."""
    ordered = values.sort().values  # NaNs last
    count = (~values.isnan()).sum()
    position = (count - 1).clamp(min=0) * quantile
    below = position.floor()
    # index_select with an index tensor (ordered[tensor] would read the index on the host)
    low, high = (ordered.index_select(0, i.long().view(1)) for i in (below, position.ceil()))
    return torch.lerp(low, high, position - below).squeeze(0)


@dataclass
class PolicyLoss:
    """loss: the micro-batch's aggregated loss (scalar, differentiable). per_token_loss_BT: before masking.
    metrics: TRL's logged keys; a (sum, count) pair is a mean to be taken over every rank's sums, a tensor
    is this micro-batch's value (clip_ratio/low_min, clip_ratio/high_max)."""

    loss: torch.Tensor
    per_token_loss_BT: torch.Tensor
    metrics: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


def _masked_sums(x: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) over the completion tokens, or over the sequences for a per-sequence x [B, 1]."""
    if x.shape[1] == 1:
        return x.detach().sum(), x.new_full((), float(x.shape[0]))  # made on the device: no copy from the host
    return (x.detach() * mask_BT).sum(), mask_BT.sum().float()


def _sequence_means(x: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over its tokens [B] (NaN for an empty one); a per-sequence x [B, 1] as is."""
    if x.shape[1] == 1:
        return x.detach().squeeze(1)
    return (x.detach() * mask_BT).sum(-1) / mask_BT.sum(-1)


def _nan_extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
    """The largest (smallest) value that is not NaN; NaN when there is none. On the device: no boolean index, whose
    size a GPU would have to report to the host."""
    if values.numel() == 0:
        return values.new_full((), torch.nan)
    nan = torch.isnan(values)
    filled = values.masked_fill(nan, -torch.inf if largest else torch.inf)
    extreme = filled.amax() if largest else filled.amin()
    return torch.where(nan.all(), values.new_full((), torch.nan), extreme)


def off_policy_sequence_mask(advantages, logprobs_BT, sampling_logprobs_BT, mask_BT, threshold: float) -> torch.Tensor:
    """The off-policy sequence mask [B, 1] (1 keep, 0 drop; DeepSeek-V3.2's, as TRL): a sequence with a negative
    advantage is dropped when its mean KL(π_sampling || π) over its completion tokens exceeds ``threshold``. Tokens
    without a sampling log-prob (NaN) count 0."""
    kl_BT = torch.nan_to_num(sampling_logprobs_BT - logprobs_BT.detach(), nan=0.0)
    mean_kl_B1 = (kl_BT * mask_BT).sum(dim=1, keepdim=True) / mask_BT.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl_B1 <= threshold)).to(mask_BT.dtype)


@torch.no_grad()
def vespo_weights(advantages, log_ratio_BT, mask_BT, importance_ratio_BT=None, *, k_pos: float = 2.0,
                  lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0) -> torch.Tensor:
    """VESPO's gamma weight per sequence [B, 1], no gradient: φ(w) = exp(λ + k log w - λ w) with w the sequence's
    importance ratio exp(Σ_t clamp(log ρ_t, ±20)) (times a sampler correction ``importance_ratio_BT``), log w
    clamped to [log 1e-8, 20]; (k, λ) by the sign of the advantage; 0 where it overflows."""
    floor = math.log(1e-8)
    log_w_B1 = (torch.clamp(log_ratio_BT, -20.0, 20.0) * mask_BT).sum(dim=-1, keepdim=True)
    if importance_ratio_BT is not None:
        log_w_B1 = log_w_B1 + torch.clamp(torch.log(importance_ratio_BT), floor, 20.0).sum(dim=-1, keepdim=True)
    log_w_B1 = torch.clamp(log_w_B1, floor, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, k_pos, k_neg)
    lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w_B1 - lam * torch.exp(log_w_B1)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def entropy_bonus(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, coef: float) -> torch.Tensor:
    """The term an entropy bonus adds to a micro-batch's loss: -coef times the mean entropy over the tokens it
    acts on (``mask_BT``), whatever the loss type's own normalization (TRL's L = L_policy - coef H)."""
    mask_BT = mask_BT.to(entropy_BT.dtype)
    return -coef * (entropy_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1.0)


def clipped_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    ref_logprobs_BT: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items: torch.Tensor | float | None = None,
    token_weights_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    off_policy_mask_threshold: float | None = None,
    sampling_logprobs_BT: torch.Tensor | None = None,
    vespo: dict | None = None,
    importance_ratio_BT: torch.Tensor | None = None,
) -> PolicyLoss:
    """GRPO's clipped surrogate per token, plus beta times the k3 KL, aggregated as ``loss_type`` says.

    ρ = exp(logπ - logπ_old) (per token, or the sequence's mean log-ratio with importance_sampling_level=
    "sequence"); ℓ = -min(ρA, clip(ρ, 1 - epsilon, 1 + epsilon_high) A), with ρ first capped at ``delta``
    when given (two-sided clipping); "cispo": ℓ = -min(ρ, epsilon_high).detach() A logπ; "sapo": the soft
    gate 4σ(τ(ρ - 1))/τ A with τ by the sign of A; "vespo": ℓ = -φ(w) A logπ (``vespo_weights``, with
    ``vespo``'s k_pos / lambda_pos / k_neg / lambda_neg and the sampler correction ``importance_ratio_BT`` inside
    w). ``off_policy_mask_threshold``: ℓ times ``off_policy_sequence_mask`` against ``sampling_logprobs_BT``
    (default the old log-probs). ``token_weights_BT`` multiplies ℓ (an entropy mask, an importance weight). With
    beta > 0: + beta k3(logπ, logπ_ref), times ρ when use_bias_correction_kl.

    Aggregation over the completion tokens (mask_BT, 1 = counted):
      grpo, sapo: mean over sequences of each sequence's token mean;  bnpo: token mean;
      dr_grpo: token sum / (B * max_completion_length);  luspo: mean over sequences of each token sum;
      dapo, cispo, vespo: token sum / num_items (the optimizer step's token count, default this micro-batch's).
    logprobs_BT is differentiable; old_logprobs_BT, advantages_B [B] (or [B, T]) and ref_logprobs_BT are
    constants. entropy_BT (optional): adds the "entropy" metric.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {LOSS_TYPES}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}: expected 'token' or 'sequence'")
    if beta != 0.0 and ref_logprobs_BT is None:
        raise ValueError(f"beta={beta} needs ref_logprobs_BT (the reference model's per-token log-probs)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by max_completion_length: pass it")
    epsilon_low = epsilon
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask_BT = mask_BT.to(logprobs_BT.dtype)
    advantages = advantages_B.unsqueeze(1) if advantages_B.dim() == 1 else advantages_B

    log_ratio_BT = logprobs_BT - old_logprobs_BT
    keep_B1 = None
    if off_policy_mask_threshold is not None:
        sampled = old_logprobs_BT if sampling_logprobs_BT is None else sampling_logprobs_BT
        keep_B1 = off_policy_sequence_mask(advantages, logprobs_BT, sampled, mask_BT, off_policy_mask_threshold)
    if importance_sampling_level == "token":
        log_weight = log_ratio_BT
    else:
        log_weight = ((log_ratio_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_weight)

    kl_BT = None
    if beta != 0.0:
        kl_BT = k3_kl(logprobs_BT, ref_logprobs_BT)
        if use_bias_correction_kl:
            kl_BT = kl_BT * ratio

    if loss_type == "cispo":
        per_token_loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logprobs_BT
    elif loss_type == "sapo":
        temperature = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages
    elif loss_type == "vespo":
        phi_B1 = vespo_weights(advantages, log_ratio_BT, mask_BT, importance_ratio_BT, **(vespo or {}))
        per_token_loss = -phi_B1 * advantages * logprobs_BT
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)
        per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    if keep_B1 is not None:
        per_token_loss = per_token_loss * keep_B1
    if token_weights_BT is not None:
        per_token_loss = per_token_loss * token_weights_BT
    if kl_BT is not None:
        per_token_loss = per_token_loss + beta * kl_BT

    masked_BT = per_token_loss * mask_BT
    if loss_type in ("grpo", "sapo"):
        loss = (masked_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked_BT.sum() / mask_BT.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked_BT.sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type == "luspo":
        loss = masked_BT.sum(-1).mean()
    else:  # dapo, cispo, vespo
        if num_items is None:
            count = mask_BT.sum().clamp(min=1.0)
        elif isinstance(num_items, torch.Tensor):
            count = num_items.to(device=mask_BT.device, dtype=mask_BT.dtype).clamp(min=1.0)
        else:  # a host number divides as it is (a tensor made from it would be a copy the GPU waits for)
            count = max(float(num_items), 1.0)
        loss = masked_BT.sum() / count

    metrics: dict = {}
    if kl_BT is not None:
        metrics["kl"] = _masked_sums(kl_BT, mask_BT)
    if entropy_BT is not None:
        metrics["entropy"] = _masked_sums(entropy_BT, mask_BT)
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = _masked_sums(((ratio > epsilon_high) & (advantages > 0)).float(), mask_BT)
    elif loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = (phi_B1.sum(), phi_B1.new_full((), float(phi_B1.shape[0])))
    elif loss_type != "sapo":
        low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
        metrics["clip_ratio/low_mean"] = _masked_sums(low, mask_BT)
        metrics["clip_ratio/high_mean"] = _masked_sums(high, mask_BT)
        metrics["clip_ratio/region_mean"] = _masked_sums(torch.maximum(low, high), mask_BT)
        metrics["clip_ratio/low_min"] = _nan_extreme(_sequence_means(low, mask_BT), largest=False)
        metrics["clip_ratio/high_max"] = _nan_extreme(_sequence_means(high, mask_BT), largest=True)
    return PolicyLoss(loss, per_token_loss, metrics)


def sequence_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logps_B: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    entropy_BT: torch.Tensor | None = None,
) -> PolicyLoss:
    """RLOO's loss: the clipped surrogate on each completion's whole log-prob, averaged over completions.

    ρ_i = exp(Σ_t logπ - old_logps_i); ℓ_i = -min(ρ_i A_i, clip(ρ_i, 1 - epsilon, 1 + epsilon_high) A_i).
    old_logps_B: Σ_t log π_old over the completion (at generation time). Metrics as TRL's RLOOTrainer:
    clip fractions over completions, entropy over tokens.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask_BT = mask_BT.to(logprobs_BT.dtype)
    ratio_B = torch.exp((logprobs_BT * mask_BT).sum(1) - old_logps_B)
    clipped_B = torch.clamp(ratio_B, 1 - epsilon, 1 + epsilon_high)
    per_sequence_B = -torch.min(ratio_B * advantages_B, clipped_B * advantages_B)
    count = ratio_B.new_full((), float(ratio_B.numel()))
    low_B = ((ratio_B < 1 - epsilon) & (advantages_B < 0)).float()
    high_B = ((ratio_B > 1 + epsilon_high) & (advantages_B > 0)).float()
    metrics: dict = {}
    if entropy_BT is not None:
        metrics["entropy"] = _masked_sums(entropy_BT, mask_BT)
    metrics["clip_ratio/low_mean"] = (low_B.sum(), count)
    metrics["clip_ratio/low_min"] = low_B.min()
    metrics["clip_ratio/high_mean"] = (high_B.sum(), count)
    metrics["clip_ratio/high_max"] = high_B.max()
    metrics["clip_ratio/region_mean"] = (torch.maximum(low_B, high_B).sum(), count)
    return PolicyLoss(per_sequence_B.mean(), per_sequence_B, metrics)


IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_importance_weights(
    logprobs_NT: torch.Tensor,
    sampling_logprobs_NT: torch.Tensor,
    mask_NT: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """Weights correcting for a sampler (vLLM) whose token log-probs differ from the trainer's: the ratio
    π_train / π_sampler per token, or per sequence (exp of the summed log-ratio) for "sequence_*" modes;
    "*_truncate" clamps it to [clip_min, clip_max], "*_mask" sets ratios outside that range to 0 (TRL's
    vllm_importance_sampling_mode). NaN sampler log-probs count as no difference. [N, T] or [N, 1]."""
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r}: expected one of {IMPORTANCE_SAMPLING_MODES}")
    gap_NT = torch.nan_to_num((logprobs_NT - sampling_logprobs_NT) * mask_NT, nan=0.0)
    ratio = torch.exp(gap_NT.sum(-1, keepdim=True) if mode.startswith("sequence") else gap_NT)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -float("inf") if clip_min is None else clip_min
    high = float("inf") if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
