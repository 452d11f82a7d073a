"""float8 training from the two ways a user asks for it: ``float8_recipe`` (hfnative's field: torchao's recipe name)
or accelerate's ``mixed_precision: fp8`` (``accelerate launch --mixed_precision fp8 [--fp8_backend ao]``), whose
torchao settings travel in ``ACCELERATE_FP8_*`` (``--fp8_enable_fsdp_float8_all_gather``, ``--fp8_pad_inner_dim``).

accelerate's fp8 runs torchao's default recipe (tensorwise) on the linear layers and bf16 autocast around them; so does
hfnative (the layers chosen as ``hfnative.parallel.float8`` says). transformers lets ``bf16=True`` (TRL's configs'
default) replace accelerate's fp8 choice in ``args.mixed_precision``; hfnative reads accelerate's choice itself, so a
launch with ``--mixed_precision fp8`` trains in float8 under every config.
"""

from __future__ import annotations

import os

from hfnative.parallel.float8 import Float8Training


def float8_training(args) -> Float8Training | None:
    """The float8 settings ``args`` (TrainingArguments) and accelerate's environment ask for; None for none.
    Raises ValueError for a combination hfnative cannot honour, naming it."""
    from accelerate.utils import parse_flag_from_env

    recipe = getattr(args, "float8_recipe", None)
    from_accelerate = "fp8" in (str(getattr(args, "mixed_precision", "")).lower(),
                                os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower())
    if recipe is None and not from_accelerate:
        return None
    asked = f"float8_recipe={recipe!r}" if recipe is not None else "mixed precision 'fp8' (accelerate)"
    backend = os.environ.get("ACCELERATE_FP8_BACKEND", "AO").upper()
    if from_accelerate and backend == "TE":
        raise ValueError("accelerate's fp8_backend te (TransformerEngine) is not supported by hfnative, which trains "
                         "float8 through torchao: launch with --fp8_backend ao")
    if getattr(args, "fp16", False):
        raise ValueError(f"{asked} with fp16=True: float8 training keeps the other operations in bf16 (as accelerate's "
                         "fp8 does); set fp16=False and bf16=True")
    return Float8Training(
        recipe=recipe or "tensorwise",
        fsdp_float8_all_gather=parse_flag_from_env("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", default=True),
        # accelerate's AORecipeKwargs pads by default, and so does hfnative's own field: the weight gradient's matmul
        # runs over the batch's tokens, whose count (padded rows, completions) need not be a multiple of 16
        pad_inner_dim=not from_accelerate or parse_flag_from_env("ACCELERATE_FP8_PAD_INNER_DIM", default=True),
    )


__all__ = ["float8_training"]
