"""Selective activation checkpointing: what a checkpointed block keeps for backward on a GPU.

Full checkpointing (``torch.utils.checkpoint``) keeps a block's input and runs its whole forward again in backward:
every matmul twice. Selective checkpointing keeps the outputs of the expensive ops, attention and every second
matmul, and recomputes the rest (norms, rotary embedding, activations, the other matmuls), as torchtitan's "op"
policy does: most of full checkpointing's memory saving for a fraction of its recompute time on a GPU. The device
policy (``hfnative.device_policy``, ``selective_checkpointing``) chooses it; a CPU, where the recompute costs little
next to the memory, keeps full checkpointing.

Inside the block autocast's cast cache is off: a weight cast earlier in the step (a forward without grad, as KTO's
and DPO's reference passes) would come from the cache in forward but be cast again in the recompute, and the two
would not run the same ops (each weight is cast once a block either way).

The choice is made in forward (torch 2.13 replays it in the recompute; older releases ask the policy again, so the
matmuls are counted apart for the forward and the recompute, and both choose alike).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten

MATMULS = {aten.mm.default, aten.addmm.default}
ATTENTION = {
    getattr(aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_flash_attention_forward")
    if hasattr(aten, name)
}


def _policy(counts: dict):
    def policy(ctx, func, *args, **kwargs):
        if func in ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if func in MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 1:  # the first, third, ... matmul of the block
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@contextlib.contextmanager
def _without_autocast_cache(context):
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with context:
            yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def selective_checkpoint_context():
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for one block's forward."""
    forward, recompute = create_selective_checkpoint_contexts(_policy(defaultdict(int)))
    return _without_autocast_cache(forward), _without_autocast_cache(recompute)


__all__ = ["selective_checkpoint_context"]
