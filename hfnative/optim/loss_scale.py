"""fp16 loss scaling: what ``torch.amp.GradScaler`` does with its defaults, which is what accelerate gives transformers'
Trainer under ``fp16=True`` on a GPU.

fp16 gradients of small magnitude round to zero. The loss is multiplied by a scale before backward (2^16 at first), the
gradients are divided by it before clipping and the optimizer step, and a step whose gradients hold an inf or a NaN
(the scale overflowed them) is skipped and the scale halved; after ``growth_interval`` steps in a row without one the
scale doubles. The scale stays a power of two, so scaling and unscaling are exact.

One difference from GradScaler, on purpose: the overflow is read from the step's global gradient norm, which every
rank computes over all the shards (``clip_grad_norm_`` and its sharded forms), not from each rank's own gradients. A
rank of a sharded model that saw finite shards and a rank that saw an inf then skip the same step (GradScaler, which
FSDP2 runs under accelerate, would let them part). Reading it costs one host read of the device per optimizer step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class LossScale:
    """The scale and how it moves (``torch.amp.GradScaler``'s defaults and semantics)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0  # steps in a row without an overflow since the scale last moved

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward from."""
        return loss * self.scale

    def unscale_(self, parameters) -> None:
        """Divides the gradients of ``parameters`` by the scale, in place (before they are clipped or stepped)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        inverse = 1.0 / self.scale
        if all(type(grad) is torch.Tensor for grad in grads):
            torch._foreach_mul_(grads, inverse)
        else:  # DTensor gradients (sharded or split parameters)
            for grad in grads:
                grad.mul_(inverse)

    def update(self, grad_norm: torch.Tensor | float) -> bool:
        """After the gradients were unscaled and their global norm taken: whether the optimizer may step (no overflow);
        moves the scale as GradScaler.update does."""
        finite = bool(torch.isfinite(torch.as_tensor(grad_norm)))
        if not finite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
        return finite

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def scales_loss(device: torch.device) -> bool:
    """Whether ``fp16=True`` scales the loss on ``device``: on accelerators, as accelerate does; a CPU trains fp16
    unscaled, as under accelerate."""
    return device.type != "cpu"


__all__ = ["LossScale", "scales_loss"]
