"""hfnative: a drop-in, Hugging Face-compatible post-training engine in pure PyTorch.

Public names are re-exported lazily so that ``import hfnative`` stays fast and the
engine never imports the trainer layer at import time.
"""

from importlib import import_module

__version__ = "0.1.0"

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
