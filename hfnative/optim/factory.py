"""Optimizers by transformers' `optim` name, with the kwargs and parameter groups its Trainer uses.

`optimizer_parts` stops short of building the optimizer so optimizer-in-backward can build one
optimizer per parameter with the same class, kwargs and weight decay.
"""

from __future__ import annotations

import inspect
import logging
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from hfnative.log_once import warn_once

from .bf16_updates import (
    ADAMW_NAMES,
    LOW_BIT_ADAMW_NAMES,
    ROUNDING_FLAG_NAMES,
    STATE_OPTIMIZER_NAMES,
    KahanAdamW,
    bf16_update_choice,
    stochastic_rounding_adamw,
)
from .low_rank import LOW_RANK_NAMES, low_rank_class_and_kwargs, optional_module
from .state_optimizers import AdEMAMix, Lion, RMSprop, low_bit_adamw_with_full_precision_groups, requantizing

logger = logging.getLogger(__name__)

SCHEDULE_FREE_NAMES = ("schedule_free_adamw", "schedule_free_radam", "schedule_free_sgd")

# transformers' Trainer.get_decay_parameter_names: no weight decay for parameters whose lower-cased
# full name matches one of these, or that live inside a normalization module
_NO_DECAY_NAME_PATTERNS = [
    re.compile(pattern) for pattern in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
]

SUPPORTED_OPTIMIZERS = (
    "adamw_torch",
    "adamw_torch_fused",
    "sgd",
    "adagrad",
    "rmsprop",
    "adafactor",
    "adamw_torch_8bit",
    "adamw_torch_4bit",
    "adamw_8bit",
    # the names transformers gives bitsandbytes' optimizers, made here in PyTorch (state_optimizers.py)
    "adamw_bnb_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    *STATE_OPTIMIZER_NAMES,
    # the schedulefree package's (pip install schedulefree), as transformers builds them
    *SCHEDULE_FREE_NAMES,
    # galore_torch's and apollo_torch's, over the parameters optim_target_modules names (low_rank.py)
    *LOW_RANK_NAMES,
    "stable_adamw",  # torch-optimi's
)


@dataclass
class OptimizerSettings:
    """TrainingArguments' optimizer fields, with their names and defaults (trainers/ builds one per run).

    adafactor_class: what ``optim="adafactor"`` builds: transformers.optimization.Adafactor, handed in by
        trainers/ so the engine imports no transformers.
    bf16_weight_updates: how AdamW updates bf16 weights: "auto" (stochastic rounding where they are bf16),
        "stochastic_round", "kahan" or "round_to_nearest" (see ``hfnative.optim.bf16_updates``).
    warmup_steps: TrainingArguments' ``warmup_steps``, which transformers also hands the schedule-free AdamW and SGD
        (their own warmup).
    optim_target_names: the parameters (names in the model) a GaLore / APOLLO optimizer projects, in the order
        transformers' Trainer gives them (trainers/ resolves ``optim_target_modules`` into them).
    """

    optim: str = "adamw_torch_fused"
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim_args: str | None = None
    adafactor_class: type[torch.optim.Optimizer] | None = None
    bf16_weight_updates: str = "auto"
    warmup_steps: float = 0
    optim_target_names: tuple[str, ...] | None = None

    def __post_init__(self):
        self.optim = str(getattr(self.optim, "value", self.optim))  # accepts transformers' OptimizerNames enum too


def _is_norm_module(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(module).__name__


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names (as in model.named_parameters()) of the parameters that get weight decay: all but biases and norms."""
    in_norm_module = set()
    for module_name, module in model.named_modules():
        if module is not model and _is_norm_module(module):
            in_norm_module.update(name for name, _ in module.named_parameters(prefix=module_name))
    return {
        name
        for name, _ in model.named_parameters()
        if name not in in_norm_module and not any(p.search(name.lower()) for p in _NO_DECAY_NAME_PATTERNS)
    }


def split_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters as transformers' Trainer groups them: [decay group, no-decay group].

    Both groups are always present (possibly empty), so optimizer state dicts line up with the Trainer's.
    """
    decay_names = decay_parameter_names(model)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if name in decay_names else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError("the model has no parameter with requires_grad=True: nothing to optimize")
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def parse_optim_args(optim_args: str | None) -> dict[str, str]:
    """TrainingArguments.optim_args "k=v,k2=v2" -> {"k": "v", "k2": "v2"} (spaces ignored, values stay strings)."""
    if not optim_args:
        return {}
    parsed = {}
    for item in optim_args.replace(" ", "").split(","):
        key, sep, value = item.partition("=")
        if not sep or not key or "=" in value:
            raise ValueError(f"optim_args={optim_args!r}: expected comma-separated key=value pairs, got {item!r}")
        parsed[key] = value
    return parsed


def _to_bool(value: str) -> bool:
    return value.lower() in ("true", "1", "yes", "y", "on", "t")


def _import_torchao_adamw(optim: str):
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as error:
        raise ImportError(f"optim={optim!r} needs torchao's low-bit AdamW: pip install hfnative[quant]") from error
    if optim in BITSANDBYTES_8BIT_NAMES:
        return low_bit_adamw_with_full_precision_groups()
    return requantizing(AdamW4bit if optim == "adamw_torch_4bit" else AdamW8bit)


# the names transformers maps to bitsandbytes' 8-bit optimizers, under which it keeps embeddings' state in 32 bits
BITSANDBYTES_8BIT_NAMES = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "lion_8bit", "paged_lion_8bit",
                           "ademamix_8bit", "paged_ademamix_8bit", "rmsprop_bnb_8bit")


def with_full_precision_embeddings(model: nn.Module, groups: list[dict]) -> list[dict]:
    """``groups`` with each embedding weight moved to a group of its own that keeps 32-bit state (``optim_bits=32``,
    its group's other settings), as transformers registers every ``nn.Embedding`` with bitsandbytes for 32-bit state
    under an 8-bit optimizer; the groups left as they were when there is none."""
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    moved = []
    for group in groups:
        kept = [p for p in group["params"] if id(p) not in embeddings]
        moved += [{**group, "params": [p], "optim_bits": 32} for p in group["params"] if id(p) in embeddings]
        group["params"] = kept
    return groups + moved


def optimizer_class_and_kwargs(settings: OptimizerSettings) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and constructor kwargs (weight decay excluded: it is per group) for `settings.optim`."""
    optimizer_cls, kwargs, _ = _class_kwargs_and_target_group(settings)
    return optimizer_cls, kwargs


def _class_kwargs_and_target_group(settings: OptimizerSettings):
    """(class, constructor kwargs, the settings of GaLore's / APOLLO's target group, None for other optimizers)."""
    optim = settings.optim
    target_group = None
    extra = parse_optim_args(settings.optim_args)
    used: set[str] = set()

    def take(key: str, convert, default=None):
        used.add(key)
        return convert(extra[key]) if key in extra else default

    kwargs: dict = {"lr": settings.learning_rate}
    adam_kwargs = {"betas": (settings.adam_beta1, settings.adam_beta2), "eps": settings.adam_epsilon}
    if optim.startswith("paged_"):
        warn_once(logger, f"optim={optim!r}: the optimizer state stays in the parameters' memory (bitsandbytes' paging to "
                       "host memory under pressure is not implemented); the update is the unpaged optimizer's")
    if optim in ("adamw_torch", "adamw_torch_fused", "paged_adamw_32bit"):
        # bitsandbytes' 32-bit AdamW is torch's update (step size lr * sqrt(1 - beta2^t) / (1 - beta1^t) over
        # sqrt(v) + eps * sqrt(1 - beta2^t) is lr / (1 - beta1^t) over sqrt(v / (1 - beta2^t)) + eps)
        optimizer_cls = torch.optim.AdamW
        kwargs.update(adam_kwargs)
        if optim != "adamw_torch":
            # adamw_torch_fused as transformers: always fused; torch >= 2.4 has fused AdamW for cpu, cuda, mps, xpu
            kwargs["fused"] = True
    elif optim in ("sgd", "adagrad", "rmsprop"):
        optimizer_cls, float_keys, bool_keys = {
            "sgd": (torch.optim.SGD, ("momentum", "dampening", "weight_decay"), ("nesterov",)),
            "adagrad": (torch.optim.Adagrad, ("lr_decay", "weight_decay", "eps"), ()),
            "rmsprop": (torch.optim.RMSprop, ("momentum", "alpha", "eps", "weight_decay"), ("centered",)),
        }[optim]
        # weight_decay here only sets the default; both parameter groups override it, as in transformers
        kwargs.update({key: take(key, float) for key in float_keys if key in extra})
        kwargs.update({key: take(key, _to_bool) for key in bool_keys if key in extra})
    elif optim == "adafactor":
        if settings.adafactor_class is None:
            raise ValueError(
                "optim='adafactor' needs OptimizerSettings(adafactor_class=transformers.optimization.Adafactor) "
                "(hfnative's Trainer passes it)"
            )
        optimizer_cls = settings.adafactor_class
        # the Trainer's settings: an external learning rate, no scaling by parameter RMS
        kwargs.update({"scale_parameter": False, "relative_step": False})
    elif optim in LOW_BIT_ADAMW_NAMES:
        # transformers maps adamw_8bit, adamw_bnb_8bit and paged_adamw_8bit to bitsandbytes; the engine stays pure
        # PyTorch with torchao's AdamW8bit (the same blockwise dynamic quantization of both moments)
        optimizer_cls = _import_torchao_adamw(optim)
        kwargs["block_size"] = take("block_size", int, 256)
        kwargs["bf16_stochastic_round"] = take("bf16_stochastic_round", _to_bool, False)
        kwargs.update(adam_kwargs)
    elif optim in STATE_OPTIMIZER_NAMES:
        optimizer_cls, kwargs = _state_optimizer(optim, settings, kwargs, take, extra)
    elif optim in SCHEDULE_FREE_NAMES:
        optimizer_cls, kwargs = _schedule_free(optim, settings, kwargs, take, adam_kwargs)
    elif optim in LOW_RANK_NAMES:
        optimizer_cls, kwargs, target_group = low_rank_class_and_kwargs(optim, settings.learning_rate, adam_kwargs, take)
    elif optim == "stable_adamw":
        # transformers' kwargs; its booleans parsed as words ("false" is False; transformers takes any word as True)
        optimizer_cls = optional_module("optimi", "torch-optimi", optim).StableAdamW
        kwargs.update(adam_kwargs, weight_decay=settings.weight_decay, decouple_lr=take("decouple_lr", _to_bool, False),
                      max_lr=take("max_lr", float), kahan_sum=take("kahan_sum", _to_bool))
    else:
        raise ValueError(f"optim={optim!r} is not supported; choose one of {', '.join(SUPPORTED_OPTIMIZERS)}")

    unused = sorted(set(extra) - used)
    if unused:
        warnings.warn(f"optim_args {unused} are ignored by optim={optim!r}", stacklevel=3)
    return optimizer_cls, kwargs, target_group


def _state_optimizer(optim: str, settings: OptimizerSettings, kwargs: dict, take, extra: dict):
    """bitsandbytes' Lion / AdEMAMix / RMSprop for ``optim``, with the kwargs transformers gives them."""
    kwargs = {**kwargs, "optim_bits": 8 if "8bit" in optim else 32,
              "bf16_stochastic_round": take("bf16_stochastic_round", _to_bool, False)}
    if "lion" in optim:
        return Lion, {**kwargs, "betas": (settings.adam_beta1, settings.adam_beta2)}
    if "ademamix" in optim:
        kwargs["betas"] = (take("beta1", float, settings.adam_beta1), take("beta2", float, settings.adam_beta2),
                           take("beta3", float, 0.9999))
        kwargs["alpha"] = take("alpha", float, 5.0)
        kwargs["eps"] = take("eps", float, settings.adam_epsilon)
        kwargs.update({key: take(key, int) for key in ("t_alpha", "t_beta3") if key in extra})
        return AdEMAMix, kwargs
    # transformers hands optim_args to bitsandbytes' RMSprop as they are: alpha, eps (momentum and centered it has
    # not; it ignores momentum, refuses centered)
    for key in ("momentum", "centered"):
        if key in extra and take(key, float if key == "momentum" else _to_bool):
            raise ValueError(f"optim={optim!r}: bitsandbytes' RMSprop has no {key}; use optim='rmsprop' (torch's "
                             f"RMSprop) for optim_args {key}={extra[key]}")
    kwargs.update({key: take(key, float) for key in ("alpha", "eps") if key in extra})
    return RMSprop, kwargs


def low_rank_groups(model: nn.Module, target_names, target_group: dict, optim: str) -> list[dict]:
    """transformers' groups for GaLore / APOLLO: the trainable parameters that are not targets (no weight decay: the
    classes' defaults), then the targets (``target_names``, in that order) with the projection's settings."""
    if not target_names:
        raise ValueError(f"optim={optim!r}: no target parameters: set optim_target_modules (transformers' module names, "
                         "a regex, or 'all-linear') to the linear layers to project")
    params = dict(model.named_parameters())
    missing = [name for name in target_names if name not in params]
    if missing:
        raise ValueError(f"optim={optim!r}: target parameters {missing} are not the model's")
    targets = [params[name] for name in target_names]
    if optim.startswith("galore_adamw_8bit") and any(p.device.type != "cuda" for p in targets):
        raise ValueError(f"optim={optim!r} runs bitsandbytes' 8-bit GaLore step, which needs CUDA; on "
                         f"{targets[0].device.type} use optim='galore_adamw'")
    chosen = {id(p) for p in targets}
    others = [p for p in params.values() if p.requires_grad and id(p) not in chosen]
    return [{"params": others}, {"params": targets, **target_group}]


def _schedule_free(optim: str, settings: OptimizerSettings, kwargs: dict, take, adam_kwargs: dict):
    """The schedulefree package's optimizer for ``optim`` with the kwargs transformers gives it: Adam's betas and eps
    (not SGD), ``warmup_steps`` (not RAdam, which warms up itself), ``weight_lr_power`` and ``r`` from optim_args.
    The loop calls its ``train()`` before each training step and ``eval()`` when evaluation starts, as transformers'
    does (hfnative/optim/in_backward.py passes both on to each parameter's optimizer)."""
    schedulefree = optional_module("schedulefree", "schedulefree (or pip install hfnative[schedulefree])", optim)
    name = optim.removeprefix("schedule_free_")
    optimizer_cls = {"adamw": schedulefree.AdamWScheduleFree, "radam": getattr(schedulefree, "RAdamScheduleFree", None),
                     "sgd": schedulefree.SGDScheduleFree}[name]
    if optimizer_cls is None:
        raise ImportError("optim='schedule_free_radam' needs schedulefree>=1.4.0: pip install -U schedulefree")
    kwargs = {**kwargs, **(adam_kwargs if name != "sgd" else {}), "weight_decay": settings.weight_decay}
    if name != "radam":
        kwargs["warmup_steps"] = settings.warmup_steps
    kwargs["weight_lr_power"] = take("weight_lr_power", float, 2.0)
    kwargs["r"] = take("r", float, 0.0)
    return optimizer_cls, kwargs


def with_fused_kernel(optim: str, kwargs: dict, params) -> dict:
    """``adamw_torch`` on parameters torch's fused AdamW kernel takes: ``fused=True``.

    transformers leaves ``adamw_torch`` to torch's default, which on CPU is a per-parameter loop of
    about seven elementwise ops (each a pass over the parameter and a temporary); the fused kernel
    computes the same update in one pass (measured 8.8 ms vs 40.9 ms per step for 12M fp32 parameters
    on 2 CPU cores). Plain floating-point tensors on cpu/cuda only; anything else keeps the default.
    """
    if optim != "adamw_torch" or "fused" in kwargs:
        return kwargs
    params = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    eligible = all(
        type(p.data) is torch.Tensor and p.dtype.is_floating_point and p.device.type in ("cpu", "cuda") for p in params
    )
    return {**kwargs, "fused": True} if params and eligible else kwargs


def optimizer_parts(
    model: nn.Module, settings: OptimizerSettings
) -> tuple[type[torch.optim.Optimizer], list[dict], dict]:
    """What transformers' Trainer builds its optimizer from: the class, the decay / no-decay groups of
    `model`'s trainable parameters, and the constructor kwargs; an AdamW over bf16 weights made to keep their
    small updates as ``settings.bf16_weight_updates`` says."""
    optimizer_cls, kwargs, target_group = _class_kwargs_and_target_group(settings)
    if target_group is None:
        groups = split_decay_groups(model, settings.weight_decay)
        if settings.optim in BITSANDBYTES_8BIT_NAMES:
            groups = with_full_precision_embeddings(model, groups)
    else:
        groups = low_rank_groups(model, settings.optim_target_names, target_group, settings.optim)
    optimizer_cls, kwargs = _with_bf16_weight_updates(settings, optimizer_cls, kwargs, groups)
    if optimizer_cls is torch.optim.AdamW:
        kwargs = with_fused_kernel(settings.optim, kwargs, groups)
    if settings.optim == "stable_adamw":
        kwargs = _optimi_kernels_for(optimizer_cls, kwargs, groups)
    return optimizer_cls, groups, kwargs


def _optimi_kernels_for(optimizer_cls, kwargs: dict, groups: list[dict]) -> dict:
    """torch-optimi's kwargs with its Triton kernels off where a parameter is in CPU memory. Left to itself it takes
    them whenever Triton imports (it decides before it has seen a parameter), and they cannot read CPU tensors: a
    CPU run on a machine with Triton installed (a CUDA build of torch) failed at its first step."""
    on_cpu = any(p.device.type == "cpu" for group in groups for p in group["params"])
    if on_cpu and "triton" in inspect.signature(optimizer_cls).parameters:
        return {**kwargs, "triton": False}
    return kwargs


def _with_bf16_weight_updates(settings: OptimizerSettings, optimizer_cls, kwargs: dict, groups: list[dict]):
    """(class, kwargs) with bf16 weights' updates kept: torchao's stochastic-rounding AdamW or ``KahanAdamW`` in
    place of torch's AdamW, the low-bit AdamWs' own bf16_stochastic_round flag."""
    params = [p for group in groups for p in group["params"]]
    sr_flag_given = "bf16_stochastic_round" in parse_optim_args(settings.optim_args)
    choice = bf16_update_choice(settings.bf16_weight_updates, settings.optim, params, sr_flag_given)
    if not any(p.dtype == torch.bfloat16 for p in params) or sr_flag_given:
        return optimizer_cls, kwargs
    if settings.optim in ROUNDING_FLAG_NAMES:
        return optimizer_cls, {**kwargs, "bf16_stochastic_round": choice == "stochastic_round"}
    if settings.optim in ADAMW_NAMES and choice != "round_to_nearest":
        adamw_kwargs = {key: value for key, value in kwargs.items() if key != "fused"}
        return (stochastic_rounding_adamw() if choice == "stochastic_round" else KahanAdamW), (
            {**adamw_kwargs, "bf16_stochastic_round": True} if choice == "stochastic_round" else adamw_kwargs)
    return optimizer_cls, kwargs


def build_optimizer(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    """The optimizer transformers' Trainer builds for these TrainingArguments fields (torch's Adam / AdamW with their
    state already allocated: ``allocate_adam_state``)."""
    optimizer_cls, groups, kwargs = optimizer_parts(model, settings)
    return allocate_adam_state(optimizer_cls(groups, **kwargs))


def allocate_adam_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Give torch's Adam / AdamW (exactly those classes) the per-parameter state their first ``step`` would make:
    ``step`` 0 (a 0-dim tensor of torch's scalar dtype, on the parameter's device when fused or capturable, else on
    the CPU), ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad) zeros like the parameter. Torch
    skips its lazy initialization for a parameter with state, so every update is the one it would make.

    Why: made at the first step, the moments (2x the trainable parameters, kept for the whole run) land in the heap
    among the first step's freed activations and gradients, and glibc's heap then grows around them; made here,
    before any forward, they sit below what the steps allocate and free. Measured on the reference SFT preset
    (2 CPU cores, fp32, benchmarks/bench_sft.py): peak RSS 1,030-1,053 MiB before, 997-1,022 MiB after, the same
    losses and speed. Returns ``optimizer``; other optimizers are returned untouched."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer
    from torch.optim.optimizer import _get_scalar_dtype

    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for param in group["params"]:
            state = optimizer.state[param]
            if state or not param.requires_grad:
                continue
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=param.device)
                             if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return optimizer
