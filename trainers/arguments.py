"""TrainingArguments and SFTConfig: transformers' / TRL's names and defaults, plus hfnative's few own.

TrainingArguments *is* transformers' class (subclassed), so every field, default, validation and
the TypeError for removed arguments (warmup_ratio, evaluation_strategy, ...) are exactly
transformers'. hfnative's own fields are listed in ``HFNATIVE_FIELDS`` and documented below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import transformers

# hfnative's own arguments (everything else is transformers' / TRL's)
HFNATIVE_FIELDS = ("fused_loss", "optimizer_in_backward", "activation_checkpointing_mode")


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments plus hfnative's engine switches.

    fused_loss: compute the loss with the fused linear-cross-entropy (no [tokens, vocab] logits
        kept for backward). On by default; ``use_liger_kernel=True`` also turns it on.
    optimizer_in_backward: step each parameter's optimizer inside backward and free its gradient
        at once (needs ``max_grad_norm=0``: global-norm clipping cannot be exact there).
    activation_checkpointing_mode: "full" (every block recomputed in backward) or "selective"
        (every other block), when ``activation_checkpointing``/``gradient_checkpointing`` is on.
    """

    fused_loss: bool = field(default=True, metadata={"help": "hfnative: fused linear-cross-entropy loss."})
    optimizer_in_backward: bool = field(
        default=False, metadata={"help": "hfnative: run the optimizer step per parameter inside backward."}
    )
    activation_checkpointing_mode: str = field(
        default="full", metadata={"help": "hfnative: 'full' or 'selective' activation checkpointing."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.activation_checkpointing_mode not in ("full", "selective"):
            raise ValueError(
                f"activation_checkpointing_mode={self.activation_checkpointing_mode!r}; use 'full' or 'selective'"
            )

    @property
    def checkpoint_activations(self) -> bool:
        return bool(self.activation_checkpointing or self.gradient_checkpointing)

    def to_sanitized_dict(self) -> dict[str, Any]:
        sanitized = super().to_sanitized_dict()
        sanitized.pop("hub_token", None)
        return sanitized


@dataclass
class SFTConfig(TrainingArguments):
    """TRL's SFTConfig: the same fields and defaults (learning_rate 2e-5, logging_steps 10,
    activation checkpointing on, bf16 unless fp16)."""

    learning_rate: float = 2e-5
    logging_steps: float = 10
    activation_checkpointing: bool = True
    bf16: bool | None = None
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    chat_template_path: str | None = None
    dataset_text_field: str = "text"
    dataset_kwargs: dict[str, Any] | str | None = None
    dataset_num_proc: int | None = None
    eos_token: str | None = None
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    shuffle_dataset: bool = False
    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    eval_packing: bool | None = None
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    loss_type: str = "nll"
    activation_offloading: bool = False
    pad_token: str | None = None

    _VALID_DICT_FIELDS = transformers.TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs", "dataset_kwargs"]

    def __post_init__(self):
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        super().__post_init__()
        if self.loss_type == "chunked_nll":
            self.loss_type = "nll"
        if self.loss_type not in ("nll", "dft"):
            raise ValueError(f"loss_type={self.loss_type!r} is not supported; use 'nll' or 'dft'")
        if self.packing_strategy == "bfd-requeue":
            self.packing_strategy = "bfd_split"
        if self.packing_strategy not in ("bfd", "bfd_split", "wrapped"):
            raise ValueError(f"packing_strategy={self.packing_strategy!r}; use 'bfd', 'bfd_split' or 'wrapped'")
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode={self.truncation_mode!r}; use 'keep_start' or 'keep_end'")
