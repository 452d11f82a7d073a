"""TR-DPO's reference synchronization (TRL's ``sync_ref_model``), shared by DPO, GRPO and RLOO: every
``ref_model_sync_steps`` optimizer steps the frozen reference becomes ``alpha * policy + (1 - alpha) * reference``
(``ref_model_mixup_alpha``), parameter by parameter. Under FSDP2 or tensor parallel the reference and the policy
are parallelized by the same code, so each rank mixes its own shards."""

from __future__ import annotations

import torch


def sync_due(args, step_taken: int) -> bool:
    """Whether the optimizer step ``step_taken`` (1-based: the step just taken) mixes the policy into the reference."""
    return bool(args.sync_ref_model) and step_taken % args.ref_model_sync_steps == 0


@torch.no_grad()
def mix_into_reference(reference, policy, alpha: float) -> None:
    """reference <- alpha * policy + (1 - alpha) * reference, in place (the parameters in the same order)."""
    for ref_param, param in zip(reference.parameters(), policy.parameters(), strict=True):
        ref_param.mul_(1.0 - alpha).add_(param.detach().to(ref_param.dtype), alpha=alpha)


__all__ = ["mix_into_reference", "sync_due"]
