"""LoRA, DoRA and QLoRA on native models, numerically matching peft 0.21.

The engine side, in native module names. Choosing modules by Hub names and reading/writing PEFT
adapter folders lives in ``hfnative.converters.peft`` (``apply_lora``, ``save_adapter``, ``load_adapter``).
"""

from .adapters import (
    ExpertLoraTarget,
    LoraTarget,
    adapted_experts,
    adapter_parameters,
    add_expert_lora,
    add_lora,
    add_trainable_copies,
    disable_adapters,
    expert_lora_modules,
    folded_expert_weights,
    has_adapters,
    load_lora_state_dict,
    lora_modules,
    lora_state_dict,
    mark_trainable,
    merge_lora,
    trainable_copies,
    untie_output_head,
)
from .expert_lora import ExpertLora
from .lora import LoraLinear
from .quantize import NF4Linear, quantize_base_nf4
from .settings import LoraSettings, NF4Settings, lora_settings, nf4_settings
from .token_rows import TokenRows, add_token_rows, has_token_rows, rows_weights, token_rows_modules

__all__ = [
    "ExpertLora",
    "ExpertLoraTarget",
    "LoraLinear",
    "LoraSettings",
    "LoraTarget",
    "NF4Linear",
    "NF4Settings",
    "TokenRows",
    "adapted_experts",
    "adapter_parameters",
    "add_expert_lora",
    "add_lora",
    "add_token_rows",
    "add_trainable_copies",
    "disable_adapters",
    "expert_lora_modules",
    "folded_expert_weights",
    "has_adapters",
    "has_token_rows",
    "load_lora_state_dict",
    "lora_modules",
    "lora_settings",
    "lora_state_dict",
    "mark_trainable",
    "merge_lora",
    "nf4_settings",
    "quantize_base_nf4",
    "rows_weights",
    "token_rows_modules",
    "trainable_copies",
    "untie_output_head",
]
