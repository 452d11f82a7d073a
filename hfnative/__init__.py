"""hfnative: a drop-in, Hugging Face-compatible post-training engine in pure PyTorch.

Public names are re-exported lazily so that ``import hfnative`` stays fast and the
engine never imports the trainer layer at import time.
"""

import logging
from importlib import import_module

__version__ = "0.1.0"


class _DropImportNoise(logging.Filter):
    """Drops the records of one logger whose message template starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


# transformers imports torchao (through peft) on every start; torchao then logs these two at WARNING on every
# import: its optional CUDA/other-Python kernels not loading, and its Enum registration torch now deprecates.
# Neither is actionable by a user of hfnative, so only these two messages are dropped; the loggers stay on.
logging.getLogger("torchao").addFilter(_DropImportNoise("Failed to load "))
logging.getLogger("torch.utils._pytree").addFilter(_DropImportNoise("%s is an Enum subclass and is now natively supported"))
# peft imports bitsandbytes where it is installed (galore-torch needs it); on a CPU with AVX512-BF16 its CPU backend
# then fetches a 4-bit GEMM kernel through the kernels package and logs when it cannot (offline, say). hfnative runs
# no bitsandbytes kernel (its QLoRA is torchao's NF4, its 8-bit base and bitsandbytes-named optimizers are
# PyTorch): both dropped.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropImportNoise("Failed to load CPU gemm_4bit_forward"))
logging.getLogger("kernels._internals.hf_hub").addFilter(
    _DropImportNoise("Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"))

# public name -> module that defines it
_LAZY = {
    "ModelArgs": "hfnative.models.args",
    "Transformer": "hfnative.models.decoder",
    "load_pretrained": "hfnative.converters.loading",
    "export_hf": "hfnative.converters.export",
    "TrainingArguments": "hfnative.trainers",
    "Trainer": "hfnative.trainers",
    "SFTConfig": "hfnative.trainers",
    "SFTTrainer": "hfnative.trainers",
    **{name: "hfnative.trainers" for name in (
        "DPOConfig", "DPOTrainer", "DistillationConfig", "DistillationTrainer", "GKDConfig", "GKDTrainer",
        "GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer", "AsyncGRPOConfig", "AsyncGRPOTrainer",
        "RewardConfig", "RewardTrainer",
        "KTOConfig", "KTOTrainer",
        "ORPOConfig", "ORPOTrainer", "CPOConfig", "CPOTrainer",
        "OnlineDPOConfig", "OnlineDPOTrainer", "PPOConfig", "PPOTrainer",
    )},
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hfnative' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
