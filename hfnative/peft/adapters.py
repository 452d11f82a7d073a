"""Putting adapters on a native model, switching them off, and folding them back in.

Everything here speaks native module names ("layers.0.attention.wq"); choosing which modules to
adapt from Hub names (q_proj, regexes, "all-linear", modules_to_save) is the converter's job
(``hfnative.converters.peft``).

A trainable copy (peft's ``modules_to_save``) replaces a module's parameter by a trainable clone under
the same name and keeps the original as the non-persistent buffer ``original_<name>``, used only
while adapters are disabled.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hfnative.models.moe import adapted_experts

from .expert_lora import ExpertLora
from .lora import LoraLinear
from .quantize import QuantizedLinear, dequantize, is_quantized
from .settings import LoraSettings, lora_settings
from .token_rows import TokenRows, remove_token_rows, token_rows_modules

ORIGINAL_PREFIX = "original_"
LORA_PARAMETERS = ("lora_A", "lora_B", "lora_magnitude_vector")


@dataclass(frozen=True)
class LoraTarget:
    """One adapter: a native linear, or several native linears that share lora_A and split lora_B by rows
    (a fused Hub projection, e.g. Phi-3's qkv_proj over wq, wk, wv), in row order."""

    modules: tuple[str, ...]
    r: int
    lora_alpha: float


@dataclass(frozen=True)
class ExpertLoraTarget:
    """One adapter on a stacked expert tensor (peft's target_parameters): the native experts module it goes on, its
    key there (the Hub tensor's name, "gate_up_proj"), the tensor's features and the native weights it folds into
    (``ExpertLora.parts``)."""

    module: str  # "layers.0.moe.experts"
    name: str
    in_features: int
    out_features: int
    parts: tuple[tuple[str, slice], ...]
    r: int
    lora_alpha: float


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _adapter_dtype(weight: torch.Tensor, settings: LoraSettings) -> torch.dtype:
    if settings.autocast_adapter_dtype and weight.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return weight.dtype


def add_lora(model: nn.Module, targets: list[LoraTarget], settings) -> None:
    """Replace each target nn.Linear by a LoraLinear holding the same weight and bias parameters."""
    settings = lora_settings(settings)
    for target in targets:
        shared_A = None
        for name in target.modules:
            module = model.get_submodule(name)
            if isinstance(module, LoraLinear):
                raise ValueError(f"{name} already has a LoRA adapter; hfnative holds one adapter per model")
            if not isinstance(module, nn.Linear):
                raise ValueError(f"{name} is a {type(module).__name__}: LoRA applies to nn.Linear layers only")
            lora = LoraLinear(
                module,
                target.r,
                settings.scaling(target.r, target.lora_alpha),
                dropout=settings.lora_dropout,
                use_dora=settings.use_dora,
                init=settings.init_lora_weights,
                adapter_dtype=_adapter_dtype(module.weight, settings),
                lora_A=shared_A,
            )
            shared_A = lora.lora_A
            _set_submodule(model, name, lora)


def add_expert_lora(model: nn.Module, targets: list[ExpertLoraTarget], settings) -> None:
    """Put an ``ExpertLora`` on each target's stacked experts (their ``lora`` ModuleDict, in target order)."""
    settings = lora_settings(settings)
    for target in targets:
        experts = model.get_submodule(target.module)
        if not hasattr(experts, "lora") or not hasattr(experts, "w1"):
            raise ValueError(f"{target.module} is a {type(experts).__name__}, not stacked MoE experts")
        if experts.lora is None:
            experts.lora = nn.ModuleDict()
        if target.name in experts.lora:
            raise ValueError(f"{target.module}.{target.name} already has a LoRA adapter; hfnative holds one adapter per "
                             "model")
        weight = experts.w1
        experts.lora[target.name] = ExpertLora(
            weight.shape[0], target.in_features, target.out_features, target.r,
            settings.scaling(target.r, target.lora_alpha), dict(target.parts), init=settings.init_lora_weights,
            dtype=_adapter_dtype(weight, settings), device=weight.device)


def untie_output_head(model: nn.Module) -> None:
    """Let a tied model's head hold the embedding parameter itself, so that the head and the embedding
    can each be replaced by a trainable copy (peft's modules_to_save unties them too)."""
    model.output.untie()


def add_trainable_copies(model: nn.Module, parameter_names: list[str]) -> None:
    """Replace each named parameter by a trainable clone under the same name (peft's modules_to_save)."""
    for name in parameter_names:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if hasattr(module, ORIGINAL_PREFIX + attr):
            continue
        original = getattr(module, attr)
        if is_quantized(original):
            raise ValueError(f"{name} is quantized; a trainable copy needs the full-precision weight")
        module.register_buffer(ORIGINAL_PREFIX + attr, original.detach(), persistent=False)
        setattr(module, attr, nn.Parameter(original.detach().clone(), requires_grad=True))


def trainable_copies(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(parameter name, module, attribute) of every trainable copy."""
    found = []
    for module_name, module in model.named_modules():
        for buffer_name in list(module._buffers):
            if buffer_name.startswith(ORIGINAL_PREFIX):
                attr = buffer_name[len(ORIGINAL_PREFIX) :]
                found.append((f"{module_name}.{attr}" if module_name else attr, module, attr))
    return found


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLinear)}


def expert_lora_modules(model: nn.Module) -> dict[str, ExpertLora]:
    """The adapters on stacked expert tensors, by module name ("layers.0.moe.experts.lora.gate_up_proj")."""
    return {name: module for name, module in model.named_modules() if isinstance(module, ExpertLora)}


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` carries any LoRA adapter (on a linear or on stacked experts)."""
    return any(isinstance(module, (LoraLinear, ExpertLora, TokenRows)) for module in model.modules())


@torch.no_grad()
def folded_expert_weights(model: nn.Module, gather=None) -> dict[str, torch.Tensor]:
    """Each adapted stacked expert weight with its adapters folded in (enabled or not, as a LoRA layer's
    ``merged_weight`` and peft's merge), by native parameter name ("layers.0.moe.experts.w1"). gather: what makes a
    tensor whole (a sharded model's: ``whole_tensor``, called on every tensor in the same order on each rank); None
    for a model whose tensors are whole."""
    gather = gather or (lambda tensor: tensor)
    folded = {}
    for name, experts in adapted_experts(model).items():
        for attr in sorted({part for adapter in experts.lora.values() for part in adapter.parts}):
            weight = gather(getattr(experts, attr).detach())
            for adapter in experts.lora.values():
                if attr in adapter.parts:
                    weight = adapter.fold(attr, weight, gather(adapter.lora_A.detach()), gather(adapter.lora_B.detach()))
            folded[f"{name}.{attr}"] = weight
    return folded


def mark_trainable(model: nn.Module, bias: str = "none", trainable: bool = True) -> None:
    """Freeze everything but the adapters and trainable copies (and biases, per peft's ``bias``)."""
    for param in model.parameters():
        param.requires_grad_(False)
    if not trainable:
        return
    for module in lora_modules(model).values():
        for name in LORA_PARAMETERS:
            param = getattr(module, name)
            if param is not None:
                param.requires_grad_(True)
        if bias == "lora_only" and module.bias is not None:
            module.bias.requires_grad_(True)
    for module in expert_lora_modules(model).values():
        module.lora_A.requires_grad_(True)
        module.lora_B.requires_grad_(True)
    for _, module, attr in trainable_copies(model):
        getattr(module, attr).requires_grad_(True)
    for module in token_rows_modules(model).values():
        module.values.requires_grad_(True)
    if bias == "all":
        for name, param in model.named_parameters():
            if "bias" in name:
                param.requires_grad_(True)


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should train (shared lora_A parameters appear once)."""
    return [param for param in model.parameters() if param.requires_grad]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Native-named adapter tensors: lora_A / lora_B / lora_magnitude_vector of every adapted linear
    (a shared lora_A under each of its modules' names), trainable copies and other trainable parameters."""
    copies = {name for name, _, _ in trainable_copies(model)}
    state = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.rpartition(".")[2] in LORA_PARAMETERS or name in copies or param.requires_grad:
            state[name] = param.detach()
    return state


def load_lora_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a ``lora_state_dict`` back in (e.g. on resume); its key set must match the model's."""
    expected = lora_state_dict(model)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter state does not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, value in state_dict.items():
            if tuple(value.shape) != tuple(expected[name].shape):
                raise ValueError(f"{name}: saved shape {list(value.shape)}, model has {list(expected[name].shape)}")
            expected[name].copy_(value)


@contextmanager
def disable_adapters(model: nn.Module):
    """Run the base model: LoRA layers skip their adapter and trainable copies show the original weights
    (peft's ``disable_adapter()``; DPO's reference model when training with LoRA). Biases trained with
    ``bias="all"/"lora_only"`` stay trained, as in peft."""
    loras = (list(lora_modules(model).values()) + list(expert_lora_modules(model).values())
             + list(token_rows_modules(model).values()))
    copies = trainable_copies(model)
    was_enabled = [module.adapter_enabled for module in loras]
    trained = [module._parameters[attr] for _, module, attr in copies]
    try:
        for module in loras:
            module.adapter_enabled = False
        for _, module, attr in copies:
            module._parameters[attr] = getattr(module, ORIGINAL_PREFIX + attr)
        yield model
    finally:
        for module, enabled in zip(loras, was_enabled):
            module.adapter_enabled = enabled
        for (_, module, attr), param in zip(copies, trained):
            module._parameters[attr] = param


def _tied_head_diverged(model: nn.Module) -> bool:
    args = getattr(model, "args", None)
    head = model.output
    return bool(getattr(args, "tie_embeddings", False)) and not head.is_tied and head.weight is not model.tok_embeddings.weight


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (peft's merge_and_unload), dequantize quantized (NF4, int8) weights,
    keep trained copies as the weights, and make every parameter trainable again; returns the plain model."""
    if any(isinstance(p, DTensor) for module in lora_modules(model).values() for p in module.parameters(recurse=False)):
        raise ValueError("merge_lora on a parallelized model (its adapters are split over ranks): merge on a model "
                         "gathered to one process, e.g. save_model() then merge the saved adapter into the base")
    if _tied_head_diverged(model):
        raise ValueError(
            "the model ties its output head to the embedding, but modules_to_save trained the two apart "
            "(lm_head / embed_tokens); a tied checkpoint cannot hold both. Load the base with "
            "tie_word_embeddings=False before training, or do not list them in modules_to_save"
        )
    remove_token_rows(model)  # refuses a tied head trained apart from the embedding (token_rows.TIED_HEAD_APART)
    plain_dtypes = [p.dtype for p in model.parameters() if p.is_floating_point() and not is_quantized(p)]
    for name, module in list(model.named_modules()):
        if isinstance(module, (LoraLinear, QuantizedLinear)):
            weight = module.merged_weight() if isinstance(module, LoraLinear) else dequantize(module.weight)
            if is_quantized(module.weight) and plain_dtypes:  # back to the dtype of the unquantized parameters
                weight = weight.to(plain_dtypes[0])
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            plain.weight = nn.Parameter(weight.detach().clone())
            plain.bias = module.bias
            _set_submodule(model, name, plain)
    for name, weight in folded_expert_weights(model).items():
        experts_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(experts_name), attr, nn.Parameter(weight.clone()))
    for experts in adapted_experts(model).values():
        experts.lora = None
    for _, module, attr in trainable_copies(model):
        del module._buffers[ORIGINAL_PREFIX + attr]
    if getattr(model.args, "tie_embeddings", False):
        model.output.tie(model.tok_embeddings)  # untied only structurally (see untie_output_head); tied again
    for param in model.parameters():
        param.requires_grad_(True)
    return model
