"""What a run asks of its objective, and the one refusal of what the objective does not declare.

Each objective declares the layouts and features it supports (``Objective.supports``, names of ``FEATURES``); the
loop also names the settings that no objective runs in the run's layout (``conflicts``: pipeline parallelism's, a
compute_loss_func or compute_metrics under context parallelism). ``check_supported`` refuses every one of them in
one message, at construction and again when evaluation starts.
"""

from __future__ import annotations

# a feature a run may use -> (what it is, what to do instead)
FEATURES = {
    "multi_process": ("a multi-process run (torchrun / accelerate launch)", "launch it as one process"),
    "tensor_parallel": ("tensor parallelism (tp_size > 1)", "set tp_size=1 (data-parallel and FSDP2 layouts remain)"),
    "context_parallel": ("context parallelism (cp_size > 1)", "set cp_size=1"),
    "expert_parallel": ("expert parallelism (ep_size > 1)", "set ep_size=1"),
    "multi_process_generation": (
        "generating completions in a multi-process run (the native engine decodes one process's whole model)",
        "run on one process",
    ),
    "pipeline_parallel": ("pipeline parallelism (pp_size > 1)", "set pp_size=1 (the language-modeling objectives of "
                          "Trainer and SFTTrainer, and DPO, run under it)"),
    "evaluation": ("evaluation (eval_strategy / evaluate())", "set eval_strategy='no'"),
}


class UnsupportedLayoutError(ValueError):
    """A run asks its objective for a layout or feature the objective does not declare in ``supports``."""


def features_used(objective, context, evaluating: bool = False) -> list[str]:
    """The features of ``FEATURES`` the run asks of ``objective``."""
    layout = context.layout
    used = []
    if context.world_size > 1:
        used.append("multi_process")
        if objective.generates():
            used.append("multi_process_generation")
    if layout is not None:
        used += [name for name, on in (("tensor_parallel", layout.tp_enabled), ("context_parallel", layout.cp_enabled),
                                       ("expert_parallel", layout.ep_enabled),
                                       ("pipeline_parallel", getattr(layout, "pp_enabled", False))) if on]
    if evaluating or context.args.eval_strategy != "no":
        used.append("evaluation")
    return used


def check_supported(objective, context, evaluating: bool = False, algorithm: str | None = None,
                    conflicts: list[str] = ()) -> None:
    """Refuse, in one message, every feature the run uses that ``objective.supports`` does not name, and every
    setting in ``conflicts`` (each "what: what to do instead")."""
    missing = [name for name in features_used(objective, context, evaluating) if name not in objective.supports]
    lines = [f"{FEATURES[name][0]}: {FEATURES[name][1]}" for name in missing] + list(conflicts)
    if lines:
        who = algorithm or type(objective).__name__
        raise UnsupportedLayoutError(f"{who} does not support " + "; ".join(lines))


__all__ = ["FEATURES", "UnsupportedLayoutError", "check_supported", "features_used"]
