"""Lion, AdEMAMix and RMSprop with bitsandbytes' update rules, in PyTorch, their state in 32 or 8 bits.

transformers maps the ``optim`` names ``lion_*``, ``ademamix*``, ``rmsprop_bnb*`` (and the ``paged_`` ones) to
bitsandbytes' optimizers. These classes compute the same updates (bitsandbytes' 32-bit kernels, term for term) with
torch ops, so they run wherever the parameters do: DTensors of any layout, optimizer-in-backward, CPU or GPU.

``optim_bits=8`` keeps each state in 8 bits as bitsandbytes' blockwise optimizers do: torchao's ``OptimState8bit``
(bitsandbytes' signed dynamic quantization map, as its optimizers use for their first state, and the unsigned one for
AdEMAMix's second moment; absmax scales per block of 256 values), for parameters of at least 4,096 values
(bitsandbytes' ``min_8bit_size``) whose local values (a shard's, under FSDP2) are a whole number of blocks, not none;
others keep fp32 state, as do the parameters of a group with ``optim_bits=32`` (transformers keeps embeddings' state
in 32 bits under bitsandbytes' 8-bit optimizers: ``factory.with_full_precision_embeddings``). A row-sharded
parameter's blocks are then the blocks of those rows in one process. The update is computed in fp32 from the
dequantized state.

bf16 parameters: the fp32 result is rounded to nearest, or stochastically with ``bf16_stochastic_round=True``
(unbiased: updates smaller than half a bf16 ulp still land on average; ``hfnative.optim.bf16_updates``).
"""

from __future__ import annotations

import abc
import functools
import math

import torch
from torch.distributed.tensor import DTensor

from .bf16_updates import bf16_stochastically_rounded, on_local_values, saved_states

MIN_8BIT_SIZE = 4096


class _StateOptimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """One parameter at a time: dequantize its state, compute the fp32 update (``_update``), write back."""

    STATE_SIGNS: dict[str, bool] = {}  # state name -> signed (8-bit maps differ for signed and unsigned values)

    def __init__(self, params, defaults: dict, *, optim_bits: int = 32, block_size: int = 256,
                 bf16_stochastic_round: bool = False):
        if optim_bits not in (8, 32):
            raise ValueError(f"{type(self).__name__}: optim_bits={optim_bits!r}: expected 8 or 32")
        if defaults["lr"] < 0 or defaults.get("weight_decay", 0.0) < 0:
            raise ValueError(f"{type(self).__name__}: lr={defaults['lr']}, weight_decay={defaults.get('weight_decay')}: "
                             "expected both >= 0")
        if optim_bits == 8:
            _optim_state_8bit()  # fail now, not at the first step
        super().__init__(params, defaults)
        self.optim_bits = optim_bits
        self.block_size = block_size
        self.bf16_stochastic_round = bf16_stochastic_round

    def _zeros(self, param: torch.Tensor, signed: bool, group: dict) -> torch.Tensor:
        eight_bit = group.get("optim_bits", self.optim_bits) == 8 and param.numel() >= MIN_8BIT_SIZE

        def zeros(local):
            # the parameter's size decides (bitsandbytes' rule), so a shard quantizes as its rows do in one process
            if eight_bit and local.numel() > 0 and local.numel() % self.block_size == 0:
                return _optim_state_8bit().zeros(local.shape, signed, self.block_size, local.device)
            return torch.zeros(local.shape, dtype=torch.float32, device=local.device)

        return on_local_values(param, zeros)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not take sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)  # on the host: reading it makes no device sync
                    for name, signed in self.STATE_SIGNS.items():
                        state[name] = self._zeros(param, signed, group)
                state["step"] += 1
                stored = {name: state[name] for name in self.STATE_SIGNS}
                values = {name: dequantized(tensor) for name, tensor in stored.items()}
                new_param = self._update(param.float(), param.grad.float(), values, group, int(state["step"].item()))
                for name, tensor in stored.items():
                    tensor.copy_(values[name])
                if param.dtype == torch.bfloat16 and self.bf16_stochastic_round:
                    new_param = bf16_stochastically_rounded(new_param)
                param.copy_(new_param)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, which casts floating-point state to each parameter's dtype, then each state as it was saved: fp32
        (or 8-bit) over bf16 weights too, and the step count on the host."""
        super().load_state_dict(state_dict)
        group_of = {id(param): group for group in self.param_groups for param in group["params"]}
        for param, saved in saved_states(self, state_dict):
            state = self.state[param]
            for name, signed in self.STATE_SIGNS.items():
                if name in saved:
                    state[name] = requantized(saved[name], lambda: self._zeros(param, signed, group_of[id(param)]))
            if "step" in saved:
                state["step"] = saved["step"].detach().to("cpu", torch.float32)

    @abc.abstractmethod
    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], group: dict,
                step: int) -> torch.Tensor:
        """The parameter after this step (fp32); puts the states' new values into ``state``."""


class Lion(_StateOptimizer):
    """Lion (Chen et al., 2023) as bitsandbytes' ``Lion``: decoupled weight decay ``p *= 1 - lr * wd``, then
    ``p -= lr * sign(beta1 * m + (1 - beta1) * g)`` and ``m = beta2 * m + (1 - beta2) * g``."""

    STATE_SIGNS = {"exp_avg": True}

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 *, optim_bits: int = 32, block_size: int = 256, bf16_stochastic_round: bool = False):
        _check_betas(self, betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), optim_bits=optim_bits,
                         block_size=block_size, bf16_stochastic_round=bf16_stochastic_round)

    def _update(self, param, grad, state, group, step):
        lr, (beta1, beta2), weight_decay = group["lr"], group["betas"], group["weight_decay"]
        exp_avg = state["exp_avg"]
        if weight_decay > 0.0:
            param = param * (1.0 - lr * weight_decay)
        param = param - lr * torch.sign(exp_avg * beta1 + (1.0 - beta1) * grad)
        state["exp_avg"] = exp_avg * beta2 + (1.0 - beta2) * grad
        return param


class AdEMAMix(_StateOptimizer):
    """AdEMAMix (Pagliardini et al., 2024) as bitsandbytes' ``AdEMAMix``: Adam's fast EMA ``m1`` (beta1, bias
    corrected) plus ``alpha`` times a slow EMA ``m2`` (beta3, not corrected), over Adam's ``sqrt(nu)`` (beta2);
    decoupled weight decay. ``t_alpha`` / ``t_beta3`` warm alpha (linearly) and beta3 (from beta1) up over that
    many steps, with bitsandbytes' schedules."""

    STATE_SIGNS = {"exp_avg_fast": True, "exp_avg_slow": True, "exp_avg_sq": False}

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
                 alpha: float = 5.0, t_alpha: int | None = None, t_beta3: int | None = None, eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, optim_bits: int = 32, block_size: int = 256,
                 bf16_stochastic_round: bool = False):
        _check_betas(self, betas, count=3)
        if eps < 0:
            raise ValueError(f"AdEMAMix: eps={eps}: expected eps >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3,
                                      eps=eps, weight_decay=weight_decay),
                         optim_bits=optim_bits, block_size=block_size, bf16_stochastic_round=bf16_stochastic_round)

    def _update(self, param, grad, state, group, step):
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2, beta3 = group["betas"]
        alpha = group["alpha"]
        if group["t_alpha"]:
            alpha = min(step * alpha / group["t_alpha"], alpha)
        if group["t_beta3"]:
            ln_beta1, ln_beta3 = math.log(beta1), math.log(beta3)
            scale = step / group["t_beta3"]
            beta3 = min(math.exp((ln_beta1 * ln_beta3) / ((1 - scale) * ln_beta3 + scale * ln_beta1)), beta3)
        fast = state["exp_avg_fast"] * beta1 + (1.0 - beta1) * grad
        slow = state["exp_avg_slow"] * beta3 + (1.0 - beta3) * grad
        nu = state["exp_avg_sq"] * beta2 + (1.0 - beta2) * grad * grad
        state.update(exp_avg_fast=fast, exp_avg_slow=slow, exp_avg_sq=nu)
        if weight_decay > 0.0:
            param = param * (1.0 - lr * weight_decay)
        mixed = fast / (1.0 - beta1 ** step) + alpha * slow
        return param - lr * (mixed / (torch.sqrt(nu) / math.sqrt(1.0 - beta2 ** step) + eps))


class RMSprop(_StateOptimizer):
    """RMSprop as bitsandbytes' ``RMSprop``: weight decay added to the gradient, ``v = alpha * v + (1 - alpha) *
    g^2``, ``p -= lr * g / (sqrt(v) + eps)``. bitsandbytes has neither momentum nor the centered variant; torch's
    ``RMSprop`` (``optim="rmsprop"``) has both."""

    STATE_SIGNS = {"square_avg": True}  # bitsandbytes' one-state optimizers quantize with the signed map

    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 *, optim_bits: int = 32, block_size: int = 256, bf16_stochastic_round: bool = False):
        if not 0.0 < alpha < 1.0 or eps < 0:
            raise ValueError(f"RMSprop: alpha={alpha}, eps={eps}: expected 0 < alpha < 1 and eps >= 0")
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay), optim_bits=optim_bits,
                         block_size=block_size, bf16_stochastic_round=bf16_stochastic_round)

    def _update(self, param, grad, state, group, step):
        lr, alpha, eps, weight_decay = group["lr"], group["alpha"], group["eps"], group["weight_decay"]
        if weight_decay > 0.0:
            grad = grad + param * weight_decay
        square_avg = state["square_avg"] * alpha + (1.0 - alpha) * grad * grad
        state["square_avg"] = square_avg
        return param - lr * grad / (torch.sqrt(square_avg) + eps)


def is_plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a DTensor: its local values) is a plain tensor, not a quantized state."""
    return type(tensor.to_local() if isinstance(tensor, DTensor) else tensor) is torch.Tensor


def dequantized(state: torch.Tensor) -> torch.Tensor:
    """The fp32 values a quantized optimizer state holds (torchao's 8-bit, 4-bit and float8 states, a DTensor of one);
    a plain tensor as it is."""
    return state if is_plain(state) else on_local_values(state, lambda local: local.dequantize().float())


def requantized(value: torch.Tensor, make_buffer) -> torch.Tensor:
    """A loaded state ``value`` in the form the parameter's fresh state (``make_buffer()``) has: an 8-bit buffer takes
    the fp32 values a distributed checkpoint stores (``hfnative.checkpoint.distributed``) quantized again (the same
    codes, but in a block whose largest value is negative: the signed map ends at -0.993, so that block's scale comes
    out 0.7% smaller); a state saved quantized (torch.save) is kept; a plain one comes back in fp32 on the buffer's
    device."""
    if not is_plain(value):
        return value
    buffer = make_buffer()
    if is_plain(buffer):
        return value.to(buffer.device, torch.float32)
    buffer.copy_(value.to(buffer.device, torch.float32))
    return buffer


@functools.cache
def requantizing(optimizer_cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """torchao's low-bit AdamW class whose load_state_dict puts states a distributed checkpoint stored as fp32 back in
    their quantized form (torch's own loader would keep them fp32: more memory, another trajectory)."""

    class Requantizing(optimizer_cls):
        def load_state_dict(self, state_dict: dict) -> None:
            super().load_state_dict(state_dict)
            for param, saved in saved_states(self, state_dict):
                state = self.state[param]
                for name, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
                    buffer = self._new_buffer(param, signed) if name in saved and is_plain(saved[name]) else None
                    if buffer is not None and not is_plain(buffer):  # plain ones: torch's loader's, as torchao makes
                        state[name] = requantized(saved[name], lambda: buffer)

    Requantizing.__name__ = Requantizing.__qualname__ = optimizer_cls.__name__
    Requantizing.__module__ = __name__
    return Requantizing


@functools.cache
def low_bit_adamw_with_full_precision_groups():
    """torchao's AdamW8bit whose groups with ``optim_bits=32`` keep fp32 moments (bitsandbytes' per-module override,
    which transformers sets for embeddings); the others quantized as torchao does."""
    from torchao.optim import AdamW8bit

    class AdamW8bitFullPrecisionGroups(requantizing(AdamW8bit)):
        def _new_buffer(self, p, signed: bool):
            if not any(group.get("optim_bits") == 32 and any(p is q for q in group["params"])
                       for group in self.param_groups):
                return super()._new_buffer(p, signed)
            return on_local_values(p, lambda local: torch.zeros(local.shape, dtype=torch.float32, device=local.device))

    return AdamW8bitFullPrecisionGroups


def _check_betas(optimizer, betas, count: int = 2) -> None:
    if len(betas) != count or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"{type(optimizer).__name__}: betas={tuple(betas)}: expected {count} values in [0, 1)")


def _optim_state_8bit():
    try:
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError as error:
        raise ImportError("8-bit optimizer state needs torchao: pip install hfnative[quant]") from error
    return OptimState8bit


__all__ = ["AdEMAMix", "Lion", "MIN_8BIT_SIZE", "RMSprop"]
