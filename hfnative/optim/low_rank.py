"""GaLore and APOLLO: optimizers that keep their state in a low-rank projection of chosen 2-D weights' gradients.

transformers' names (``optim="galore_adamw"``, ``galore_adamw_8bit``, ``galore_adafactor``, ``apollo_adamw`` and
their ``_layerwise`` forms) build the galore_torch / apollo_torch classes as transformers' Trainer builds them: two
parameter groups, the others (the class's defaults but ``lr``) and the targets with the projection's settings from
``optim_args`` (GaLore: ``rank`` 128, ``update_proj_gap`` 200, ``scale`` 0.25, ``proj_type`` "std"; APOLLO: ``rank``
128, ``proj`` "random", ``scale_type`` "channel", ``update_proj_gap`` 200, ``scale`` 1.0, ``proj_type`` "std", and
Adam's betas and eps). Which weights are targets, the trainer decides from ``optim_target_modules`` (transformers'
names; trainers/loop/optimization.py maps them to the native parameters) and hands over by name.

A ``_layerwise`` name is the same optimizer stepped per parameter inside backward (hfnative's optimizer-in-backward,
which the argument turns on).

Checkpoints: the classes keep a projector object per target in their state, which a checkpoint cannot hold (every
checkpoint file is read back without unpickling objects). ``checkpointable`` subclasses write each projector as its
plain fields (its matrices as tensors) and rebuild it on load.
"""

from __future__ import annotations

import functools

import torch

LOW_RANK_NAMES = (
    "galore_adamw", "galore_adamw_8bit", "galore_adafactor",
    "galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise",
    "apollo_adamw", "apollo_adamw_layerwise",
)
LAYERWISE_SUFFIX = "_layerwise"

_PROJECTOR_KEY = "hfnative_projector"  # marks a projector written as plain fields in a state dict


def is_layerwise(optim: str) -> bool:
    return optim in LOW_RANK_NAMES and optim.endswith(LAYERWISE_SUFFIX)


def low_rank_class_and_kwargs(optim: str, learning_rate: float, adam_kwargs: dict, take):
    """(class, constructor kwargs, the target group's settings) for a GaLore / APOLLO ``optim``, as transformers' Trainer
    makes them; ``take(key, convert, default)`` reads optim_args."""
    base = optim.removesuffix(LAYERWISE_SUFFIX)
    kwargs = {"lr": learning_rate}
    if base.startswith("galore"):
        module = optional_module("galore_torch", "galore-torch", optim)
        optimizer_cls = {"galore_adamw": "GaLoreAdamW", "galore_adamw_8bit": "GaLoreAdamW8bit",
                         "galore_adafactor": "GaLoreAdafactor"}[base]
        optimizer_cls = getattr(module, optimizer_cls)
        group = {"rank": take("rank", int, 128), "update_proj_gap": take("update_proj_gap", int, 200),
                 "scale": take("scale", float, 0.25), "proj_type": take("proj_type", str, "std")}
        if base == "galore_adafactor":
            kwargs.update(scale_parameter=False, relative_step=False)
    else:
        optimizer_cls = optional_module("apollo_torch", "apollo-torch", optim).APOLLOAdamW
        group = {"rank": take("rank", int, 128), "proj": take("proj", str, "random"),
                 "scale_type": take("scale_type", str, "channel"), "update_proj_gap": take("update_proj_gap", int, 200),
                 "scale": take("scale", float, 1.0), "proj_type": take("proj_type", str, "std"), **adam_kwargs}
    return checkpointable(optimizer_cls), kwargs, group


def optional_module(module: str, install: str, optim: str):
    """The optional package ``module`` that ``optim`` runs on; an ImportError saying ``pip install <install>``."""
    try:
        return __import__(module)
    except ImportError as error:
        raise ImportError(f"optim={optim!r} needs {module}: pip install {install}") from error


@functools.cache
def checkpointable(optimizer_cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``optimizer_cls`` whose state dict holds each projector as plain fields (tensors, numbers, strings)."""

    class Checkpointable(optimizer_cls):
        def state_dict(self):
            state_dict = super().state_dict()
            state_dict["state"] = {
                index: ({**state, "projector": _projector_fields(state["projector"])} if "projector" in state
                        else state)
                for index, state in state_dict["state"].items()
            }
            return state_dict

        def load_state_dict(self, state_dict):
            state_dict = {**state_dict, "state": {
                index: ({**state, "projector": _projector_from_fields(state["projector"])}
                        if isinstance(state.get("projector"), dict) else state)
                for index, state in state_dict["state"].items()
            }}
            super().load_state_dict(state_dict)

    Checkpointable.__name__ = Checkpointable.__qualname__ = optimizer_cls.__name__
    Checkpointable.__module__ = __name__
    return Checkpointable


def _projector_fields(projector) -> dict:
    cls = type(projector)
    return {_PROJECTOR_KEY: f"{cls.__module__}:{cls.__qualname__}", **vars(projector)}


def _projector_from_fields(fields: dict):
    fields = dict(fields)
    module_name, _, class_name = fields.pop(_PROJECTOR_KEY).partition(":")
    if not module_name.startswith(("galore_torch.", "apollo_torch.")):
        raise ValueError(f"optimizer state: a projector of {module_name}.{class_name}; only galore_torch's and "
                         "apollo_torch's are rebuilt")
    cls = getattr(__import__(module_name, fromlist=[class_name]), class_name)
    projector = cls.__new__(cls)
    vars(projector).update(fields)
    return projector


__all__ = ["LOW_RANK_NAMES", "checkpointable", "is_layerwise", "low_rank_class_and_kwargs", "optional_module"]
