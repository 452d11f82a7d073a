"""Updates that bf16 weights keep: stochastic rounding or Kahan-compensated AdamW.

A bf16 weight has 8 significant bits: an update smaller than half its ulp (|w| * 2^-9) rounds back to the same
weight. AdamW's update is about ``lr`` per step, so at ``lr=1e-5`` every weight above ~0.005 in magnitude stops
moving, and the loss stalls with nothing to say why. Two cures, chosen by ``bf16_weight_updates``:

    "stochastic_round"  the fp32 result rounds up or down with probability proportional to its distance to each
                        (torchao's ``_AdamW(bf16_stochastic_round=True)``; the low-bit AdamWs' own flag): unbiased,
                        so small updates land on average; moments kept in bf16 (6 bytes a parameter with the weight)
    "kahan"             ``KahanAdamW``: the part of each update the rounding dropped is kept in a bf16 buffer and
                        added to the next one, so the weight tracks the fp32 trajectory deterministically; moments in
                        fp32 (12 bytes a parameter with the weight and the buffer)
    "round_to_nearest"  the optimizer as named (torch's AdamW rounds to nearest: small updates are lost)
    "auto"              (default) "stochastic_round" when trainable weights are bf16 and the optimizer is an AdamW
                        (``adamw_torch``, ``adamw_torch_fused``, ``paged_adamw_32bit``, the 8-/4-bit ones) or one of
                        bitsandbytes' Lion / AdEMAMix / RMSprop names (``ROUNDING_FLAG_NAMES``: their own flag): the
                        leaner cure ("kahan" for the AdamWs where torchao is not installed); else "round_to_nearest"

Only bf16 parameters are affected; fp32 ones (norms kept in fp32, or FSDP2 mixed precision's fp32 masters) get the
plain update in every mode.
"""

from __future__ import annotations

import logging
from importlib.util import find_spec

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hfnative.log_once import warn_once

logger = logging.getLogger(__name__)

BF16_WEIGHT_UPDATES = ("auto", "stochastic_round", "kahan", "round_to_nearest")
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused", "paged_adamw_32bit")
LOW_BIT_ADAMW_NAMES = ("adamw_torch_8bit", "adamw_torch_4bit", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit")
# bitsandbytes' other optimizers, made by hfnative.optim.state_optimizers
STATE_OPTIMIZER_NAMES = (
    "lion_32bit", "lion_8bit", "paged_lion_32bit", "paged_lion_8bit",
    "ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit",
    "rmsprop_bnb", "rmsprop_bnb_32bit", "rmsprop_bnb_8bit",
)
# optimizers that keep bf16 weights' small updates themselves (torch-optimi's StableAdamW: Kahan summation by default
# over bf16 weights)
OWN_BF16_UPDATES_NAMES = ("stable_adamw",)
# the optimizers with a bf16_stochastic_round flag of their own
ROUNDING_FLAG_NAMES = LOW_BIT_ADAMW_NAMES + STATE_OPTIMIZER_NAMES


class KahanAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch's) whose bf16 parameters take their updates through a Kahan
    compensation buffer; moments kept in fp32, the update computed in fp32. Other dtypes update as torch's AdamW.

    State per parameter: ``step`` (a 0-dim fp32 tensor), ``exp_avg``, ``exp_avg_sq`` (fp32, the parameter's shape),
    and for a bf16 parameter ``compensation`` (bf16: what rounding dropped from the weight so far, < half an ulp).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"KahanAdamW: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}: expected "
                             "lr, eps, weight_decay >= 0 and betas in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, which casts floating-point state to each parameter's dtype, then the moments back in fp32 as they
        were saved (the compensation stays bf16)."""
        super().load_state_dict(state_dict)
        for param, saved in saved_states(self, state_dict):
            for name in ("exp_avg", "exp_avg_sq"):
                if name in saved:
                    self.state[param][name] = saved[name].to(param.device, torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = torch.as_tensor(group["lr"], dtype=torch.float32)  # a tensor: the compiled step never recompiles
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                    if param.dtype == torch.bfloat16:
                        state["compensation"] = torch.zeros_like(param)
                state["step"] += 1
                step_fn = _kahan_adamw_step if param.device.type == "cpu" else _compiled_step()
                step_fn(param, param.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                        state.get("compensation"), lr, beta1, beta2, group["weight_decay"],
                        group["eps"])
        return loss


def _kahan_adamw_step(param, grad, step, exp_avg, exp_avg_sq, compensation, lr, beta1, beta2, weight_decay, eps):
    """One AdamW update of ``param`` computed in fp32; a bf16 ``param`` adds what rounding dropped before to it,
    and keeps what rounding drops now in ``compensation``."""
    weight = param.float()
    grad = grad.float()
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    update = -lr * weight_decay * weight - lr * (exp_avg / bias_correction1) / (
        (exp_avg_sq / bias_correction2).sqrt() + eps)
    if compensation is None:
        param.copy_(weight + update)
        return
    intended = update + compensation.float()  # this step's change plus what earlier roundings dropped
    rounded = bf16_rounded(weight + intended)
    compensation.copy_(intended - (rounded - weight))  # the part of it the bf16 weight could not take
    param.copy_(rounded)  # exact: rounded holds a bf16 value


def saved_states(optimizer: torch.optim.Optimizer, state_dict: dict):
    """(parameter, its saved state) for each parameter of ``optimizer`` that ``state_dict`` holds state for, matched
    as torch's ``load_state_dict`` matches them: by position in the saved groups' ``params``, whatever their keys are
    (indices in a torch.save file, parameter names from torch's distributed checkpoint loader)."""
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        for param, key in zip(group["params"], saved_group["params"]):
            if key in state_dict["state"]:
                yield param, state_dict["state"][key]


def bf16_rounded(x: torch.Tensor) -> torch.Tensor:
    """The float32 ``x`` rounded to the nearest bf16 value (ties to even, NaN kept), as float32: the bits of
    ``x.to(torch.bfloat16).float()`` made with integer ops. A compiler may fold a cast to bf16 and back into nothing
    (torch 2.11's inductor does, even with ``emulate_precision_casts``), and the rounding's loss, the compensation,
    would be lost with it; integer ops it keeps."""
    bits = x.view(torch.int32)
    bits = (bits + ((bits >> 16) & 1) + 0x7FFF) & -0x10000  # c10's round_to_nearest_even, on the bit pattern
    return torch.where(x.isnan(), x, bits.view(torch.float32))


def on_local_values(tensor: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` of ``tensor``'s local values, as a DTensor laid out like ``tensor`` when it is one (its shape and
    stride given, as a shard may be uneven); ``fn(tensor)`` otherwise."""
    if not isinstance(tensor, DTensor):
        return fn(tensor)
    return DTensor.from_local(fn(tensor.to_local()), tensor.device_mesh, tensor.placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def bf16_stochastically_rounded(x: torch.Tensor) -> torch.Tensor:
    """The float32 ``x`` as bf16, rounded away from zero with probability (the dropped 16 bits) / 2^16, else toward
    zero: unbiased, so an update smaller than a bf16 ulp lands on average. A DTensor rounds its local values."""
    return on_local_values(x, _stochastically_rounded)


def _stochastically_rounded(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    return ((bits + noise) & -0x10000).view(torch.float32).to(torch.bfloat16)


_COMPILED = None


def _compiled_step():
    """The step compiled once on accelerators, where its ~15 elementwise kernels become one. Shapes turn dynamic from
    the second one: a model's many parameter shapes share a graph per rank of the shapes (static, each shape would
    compile anew, and past torch's recompile limit a fullgraph function raises). The rounding is ``bf16_rounded``'s
    integer ops, which the compiler keeps (a cast to bf16 and back it may fold away, losing the compensation)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_kahan_adamw_step, fullgraph=True, dynamic=None)
    return _COMPILED


def bf16_update_choice(mode: str, optim: str, params: list[nn.Parameter], sr_flag_given: bool) -> str:
    """What ``bf16_weight_updates=mode`` means for ``optim`` on these trainable ``params``: "stochastic_round",
    "kahan" or "round_to_nearest". ``sr_flag_given``: ``optim_args`` set the optimizer's own bf16_stochastic_round
    itself (then that flag decides). Raises ValueError for a mode the optimizer cannot honour."""
    if mode not in BF16_WEIGHT_UPDATES:
        raise ValueError(f"bf16_weight_updates={mode!r}: expected one of {list(BF16_WEIGHT_UPDATES)}")
    has_bf16 = any(p.dtype == torch.bfloat16 for p in params)
    if optim in OWN_BF16_UPDATES_NAMES:
        if mode in ("stochastic_round", "kahan"):
            raise ValueError(f"bf16_weight_updates={mode!r} with optim={optim!r}: it keeps bf16 weights' small updates "
                             "itself (Kahan summation, its optim_args kahan_sum); leave bf16_weight_updates='auto'")
        return "round_to_nearest"  # the optimizer's own update, as it is
    covered = optim in ADAMW_NAMES or optim in ROUNDING_FLAG_NAMES
    if mode in ("stochastic_round", "kahan") and not covered:
        raise ValueError(f"bf16_weight_updates={mode!r}: optim={optim!r} has no such update: use "
                         f"optim='adamw_torch_fused' (or one of {', '.join(ROUNDING_FLAG_NAMES)} for stochastic "
                         "rounding), or bf16_weight_updates='round_to_nearest'")
    if mode == "kahan" and optim in ROUNDING_FLAG_NAMES:
        raise ValueError(f"bf16_weight_updates='kahan' with optim={optim!r}: this optimizer can only round "
                         "stochastically; use bf16_weight_updates='stochastic_round' (or 'auto'), or "
                         "optim='adamw_torch_fused' for Kahan-compensated updates")
    if sr_flag_given and mode in ("stochastic_round", "kahan"):
        raise ValueError(f"bf16_weight_updates={mode!r} and optim_args' bf16_stochastic_round both say how bf16 "
                         "weights are rounded; set one of them")
    if mode == "auto" and has_bf16 and covered and not sr_flag_given:
        # torchao is an optional extra: without it, the cure that needs nothing
        mode = "stochastic_round" if optim in ROUNDING_FLAG_NAMES or find_spec("torchao") else "kahan"
    elif mode == "auto":
        mode = "round_to_nearest"
    if has_bf16 and not sr_flag_given:
        warn_once(logger, _describe(mode, optim))
    return mode


def _describe(choice: str, optim: str) -> str:
    if choice == "stochastic_round":
        how = ("torchao's AdamW with stochastic rounding (moments in bf16)" if optim in ADAMW_NAMES
               else f"optim={optim!r} with its bf16_stochastic_round")
        return f"bf16 weights: {how}, so updates smaller than a bf16 ulp still land (bf16_weight_updates)"
    if choice == "kahan":
        return ("bf16 weights: Kahan-compensated AdamW (fp32 moments, a bf16 compensation buffer), so updates smaller "
                "than a bf16 ulp still land (bf16_weight_updates)")
    return (f"bf16 weights with optim={optim!r} round each update to nearest: an update smaller than half a bf16 ulp "
            "(|w| * 2^-9) is lost. AdamW keeps them with bf16_weight_updates='stochastic_round' or 'kahan'; fp32 "
            "weights with bf16 mixed precision (bf16=True) avoid the question")



def stochastic_rounding_adamw():
    """torchao's full-precision-state AdamW that rounds bf16 weights stochastically (``_AdamW``)."""
    try:
        from torchao.optim import _AdamW
    except ImportError as error:
        raise ImportError("bf16_weight_updates='stochastic_round' with AdamW needs torchao: pip install hfnative[quant] "
                          "(or bf16_weight_updates='kahan', which needs nothing)") from error
    return _AdamW
