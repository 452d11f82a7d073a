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
from .quantize import Int8Weight, QuantizedLinear, quantize_base
from .settings import Int8Settings, LoraSettings, NF4Settings, lora_settings, quantization_settings
from .token_rows import TokenRows, add_token_rows, has_token_rows, rows_weights, token_rows_modules

__all__ = [
    "ExpertLora",
    "ExpertLoraTarget",
    "LoraLinear",
    "Int8Settings",
    "Int8Weight",
    "LoraSettings",
    "LoraTarget",
    "NF4Settings",
    "QuantizedLinear",
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
    "quantization_settings",
    "quantize_base",
    "rows_weights",
    "token_rows_modules",
    "trainable_copies",
    "untie_output_head",
]
