"""TrainingArguments and SFTConfig: transformers' / TRL's names and defaults, plus hfnative's few own.

TrainingArguments *is* transformers' class (subclassed), so every field, default, validation and
the TypeError for removed arguments (warmup_ratio, evaluation_strategy, ...) are exactly
transformers'. hfnative's own fields are listed in ``HFNATIVE_FIELDS`` and documented below.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import transformers

from hfnative.data.packing import PACKING_STRATEGIES
from hfnative.parallel.float8 import FLOAT8_RECIPES
from hfnative.optim.bf16_updates import BF16_WEIGHT_UPDATES
from hfnative.optim.low_rank import is_layerwise

# hfnative's own arguments (everything else is transformers' / TRL's)
HFNATIVE_FIELDS = ("fused_loss", "optimizer_in_backward", "activation_checkpointing_mode", "peak_tflops",
                   "bf16_weight_updates", "float8_recipe")


# counts a run divides by: 0 would fail deep inside the loop
_AT_LEAST_ONE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")


def mixed_precision_dtype(args) -> torch.dtype | None:
    """The dtype ``bf16=True`` / ``fp16=True`` trains in under autocast (any TrainingArguments), None for neither."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


# repr=False keeps transformers' __repr__, which masks the *_token fields (hub_token); a regenerated one prints it
@dataclass(repr=False)
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments plus hfnative's engine switches.

    fused_loss: compute the loss with the fused linear-cross-entropy (no [tokens, vocab] logits
        kept for backward). On by default; ``use_liger_kernel=True`` also turns it on.
    optimizer_in_backward: step each parameter's optimizer inside backward and free its gradient
        at once (needs ``max_grad_norm=0``: global-norm clipping cannot be exact there).
    activation_checkpointing_mode: "full" (every block recomputed in backward) or "selective"
        (every other block), when ``activation_checkpointing``/``gradient_checkpointing`` is on.
    peak_tflops: the peak dense TFLOP/s of one device that ``perf/mfu_wall_clock`` divides by. None: a listed
        GPU's datasheet peak for the training dtype (no MFU for an unlisted one), a CPU's measured once per process
        by a timed matmul.
    bf16_weight_updates: how an AdamW (or Lion, AdEMAMix, RMSprop by bitsandbytes' names) updates weights stored in
        bf16 (``model_init_kwargs={"dtype": "bfloat16"}``), where an update smaller than half a bf16 ulp would round
        away: "auto" (default: stochastic rounding there, Kahan for AdamW without torchao), "stochastic_round" (torchao's AdamW, bf16 moments), "kahan" (fp32 moments and a
        compensation buffer: deterministic, tracks the fp32 weights) or "round_to_nearest" (torch's AdamW as is).
        See hfnative.optim.bf16_updates.
    float8_recipe: train the decoder blocks' attention and MLP projections in float8 through torchao: "tensorwise" or
        "rowwise" (torchao's recipe names); None (default) for none, unless accelerate's ``mixed_precision: fp8`` asks
        for it (then "tensorwise", accelerate's default recipe). See hfnative.parallel.float8.
    """

    fused_loss: bool = field(default=True, metadata={"help": "hfnative: fused linear-cross-entropy loss."})
    optimizer_in_backward: bool = field(
        default=False, metadata={"help": "hfnative: run the optimizer step per parameter inside backward."}
    )
    activation_checkpointing_mode: str = field(
        default="full", metadata={"help": "hfnative: 'full' or 'selective' activation checkpointing."}
    )
    peak_tflops: float | None = field(
        default=None, metadata={"help": "hfnative: peak TFLOP/s of one device for perf/mfu_wall_clock (default: the "
                                        "device's, listed or measured)."}
    )
    bf16_weight_updates: str = field(
        default="auto", metadata={"help": "hfnative: how the optimizer updates bf16 weights: auto, stochastic_round, "
                                          "kahan or round_to_nearest."}
    )
    float8_recipe: str | None = field(
        default=None, metadata={"help": "hfnative: float8 training of the blocks' linear layers (torchao recipe: "
                                        "tensorwise or rowwise)."}
    )

    def __post_init__(self):
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; it must be at least 1")
        # a DeepSpeed config runs as its FSDP2 layout (trainers/running/deepspeed_config.py): transformers' own
        # processing of it, which starts DeepSpeed and needs the package, is skipped; the field keeps the user's value
        if isinstance(self.deepspeed, str) and self.deepspeed.startswith("{"):  # a JSON object, as transformers parses it
            import json

            from transformers.training_args import _convert_str_dict

            self.deepspeed = _convert_str_dict(json.loads(self.deepspeed))
        with self._deepspeed_hidden():
            super().__post_init__()
        if self.deepspeed:
            from ..running.deepspeed_config import read_deepspeed_config

            read_deepspeed_config(self.deepspeed)  # a bad value is refused here, not when the trainer is built
        self._layerwise_optimizer_in_backward()
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops={self.peak_tflops!r}; it must be a positive number of TFLOP/s, or None")
        if self.bf16_weight_updates not in BF16_WEIGHT_UPDATES:
            raise ValueError(f"bf16_weight_updates={self.bf16_weight_updates!r}; use one of {list(BF16_WEIGHT_UPDATES)}")
        if self.float8_recipe is not None and self.float8_recipe not in FLOAT8_RECIPES:
            raise ValueError(f"float8_recipe={self.float8_recipe!r}; use one of {list(FLOAT8_RECIPES)}, or None")
        if self.activation_checkpointing_mode not in ("full", "selective"):
            raise ValueError(
                f"activation_checkpointing_mode={self.activation_checkpointing_mode!r}; use 'full' or 'selective'"
            )

    @cached_property
    def _setup_devices(self) -> torch.device:
        """transformers' device setup, without the DeepSpeed engine a ``deepspeed`` config would make it start."""
        with self._deepspeed_hidden():
            return transformers.TrainingArguments._setup_devices.func(self)

    @contextmanager
    def _deepspeed_hidden(self):
        """``deepspeed`` unset while transformers' own code runs (it would need the package and start DeepSpeed),
        the user's value back after it."""
        deepspeed, self.deepspeed = self.deepspeed, None
        try:
            yield
        finally:
            self.deepspeed = deepspeed

    def _layerwise_optimizer_in_backward(self) -> None:
        """``optim="galore_adamw_layerwise"`` (and the other ``_layerwise`` names) steps each parameter inside backward,
        as transformers does with its hooks: hfnative's optimizer-in-backward, turned on here. Gradients cannot be
        clipped there; transformers' layerwise optimizers leave them unclipped, and so does this (said once)."""
        optim = str(getattr(self.optim, "value", self.optim))
        if not is_layerwise(optim):
            return
        self.optimizer_in_backward = True
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            warnings.warn(f"optim={optim!r} steps each parameter inside backward, before the gradient norm is known: "
                          f"max_grad_norm={self.max_grad_norm} is not applied (as with transformers' layerwise "
                          "optimizers); grad_norm is still logged", stacklevel=3)
            self.max_grad_norm = 0.0

    def check_checkpointing(self) -> None:
        """TRL's checks of ``gradient_checkpointing_kwargs={"selective": True}``, made when a trainer is built (as
        TRL's SFTTrainer makes them)."""
        checkpointing = self.gradient_checkpointing_kwargs or {}
        if checkpointing.get("selective") and not self.activation_checkpointing:
            raise ValueError(
                "`gradient_checkpointing_kwargs={'selective': True}` requires `gradient_checkpointing=True`"
            )
        if checkpointing.get("selective") and checkpointing.get("use_reentrant"):
            raise ValueError(
                "`gradient_checkpointing_kwargs={'selective': True}` requires non-reentrant gradient checkpointing: "
                "leave `use_reentrant` unset or False."
            )

    @property
    def checkpoint_activations(self) -> bool:
        return bool(self.activation_checkpointing)

    @property
    def checkpoint_keeps(self) -> str | None:
        """What a checkpointed block keeps (``hfnative.models.selective_checkpoint``): TRL's
        ``gradient_checkpointing_kwargs={"selective": True}`` keeps the attention's output, ``False`` nothing (full
        recompute); unset, the device policy chooses (a GPU keeps the attention and the query, value and gate
        projections' results; a CPU nothing)."""
        selective = (self.gradient_checkpointing_kwargs or {}).get("selective")
        if selective is None:
            return None
        return "attention" if selective else "nothing"

    def to_sanitized_dict(self) -> dict[str, Any]:
        sanitized = super().to_sanitized_dict()
        sanitized.pop("hub_token", None)
        return sanitized


@dataclass(repr=False)
class TRLBaseConfig(TrainingArguments):
    """What every TRL trainer's config shares (TRL's ``_BaseConfig``): logging_steps 10, activation checkpointing on,
    bf16 unless fp16, and how a model given by name is loaded."""

    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps (a float < 1: a ratio of the total)."})
    # TRL's default; transformers resolves it into activation_checkpointing, so gradient_checkpointing=False turns it off
    gradient_checkpointing: bool | None = field(
        default=True, metadata={"help": "Recompute activations in backward to save memory (about 20%% slower)."}
    )
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision; when not set, True unless fp16 (needs a GPU, or use_cpu)."}
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "How to load the model when it is given by name (JSON): dtype, revision, ..."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Accepted for TRL compatibility; hfnative never runs a model's own code."}
    )

    _VALID_DICT_FIELDS = transformers.TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs"]

    def __post_init__(self):
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        super().__post_init__()


@dataclass(repr=False)
class SFTConfig(TRLBaseConfig):
    """TRL's SFTConfig: the same fields and defaults (learning_rate 2e-5, logging_steps 10,
    activation checkpointing on, bf16 unless fp16)."""

    learning_rate: float = field(default=2e-5, metadata={"help": "The initial learning rate."})
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "Weight of the MoE load-balancing loss (None: the model config's value)."}
    )
    chat_template_path: str | None = field(
        default=None, metadata={"help": "A .jinja chat template file, or a tokenizer folder whose template to use."}
    )
    dataset_text_field: str = field(default="text", metadata={"help": "The column holding the text of language-modeling rows."})
    dataset_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Dataset preparation options (JSON), e.g. {\"skip_prepare_dataset\": true}."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used to tokenize the dataset."})
    eos_token: str | None = field(
        default=None, metadata={"help": "The end-of-turn / end-of-sequence token (default: the tokenizer's)."}
    )
    max_length: int | None = field(
        default=1024, metadata={"help": "Truncate tokenized sequences to this length (the block length when packing)."}
    )
    truncation_mode: str = field(default="keep_start", metadata={"help": "Which end to keep when truncating: keep_start or keep_end."})
    shuffle_dataset: bool = field(default=False, metadata={"help": "Shuffle the dataset before preparing it."})
    packing: bool = field(default=False, metadata={"help": "Pack several sequences into each max_length block."})
    packing_strategy: str = field(
        default="bfd", metadata={"help": "bfd (best-fit decreasing), bfd_split (splits what overflows) or wrapped."}
    )
    padding_free: bool = field(default=False, metadata={"help": "Flatten each batch into one sequence, without padding."})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad sequences to a multiple of this length."})
    eval_packing: bool | None = field(default=None, metadata={"help": "Pack the eval dataset (default: as packing)."})
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "Loss on completions only (default: yes for prompt-completion data)."}
    )
    assistant_only_loss: bool = field(
        default=False, metadata={"help": "Loss on assistant turns only (conversational data; the chat template marks them)."}
    )
    loss_type: str = field(default="nll", metadata={"help": "nll (negative log-likelihood) or dft (Dynamic Fine-Tuning)."})
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to the CPU."})
    pad_token: str | None = field(default=None, metadata={"help": "Deprecated in TRL: the padding token to set on the tokenizer."})

    _VALID_DICT_FIELDS = TRLBaseConfig._VALID_DICT_FIELDS + ["dataset_kwargs"]

    def __post_init__(self):
        super().__post_init__()
        # TRL's deprecations, warned as TRL warns them; loss_type, packing_strategy and truncation_mode values
        # are checked by SFTTrainer when it is built, as TRL does (a config alone is never refused for them)
        if self.loss_type == "chunked_nll":
            _deprecated("chunked_nll")
            self.loss_type = "nll"
        if self.pad_token is not None:
            _deprecated("pad_token")
        if self.truncation_mode == "keep_end":
            _deprecated("keep_end")
        if self.packing_strategy == "bfd-requeue":
            _deprecated("bfd-requeue")
            self.packing_strategy = "bfd_split"

    def check_for_trainer(self) -> None:
        """TRL's checks of these arguments, made (as TRL makes them) when an SFTTrainer is built from them,
        with TRL's messages. Raises ValueError."""
        if self.loss_type not in ("nll", "dft"):
            raise ValueError(f"Invalid `loss_type` {self.loss_type} passed: use 'nll' or 'dft'.")
        if self.packing_strategy not in PACKING_STRATEGIES:
            raise ValueError(f"Invalid packing strategy {self.packing_strategy!r}, must be one of {PACKING_STRATEGIES}")
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"Unsupported truncation mode: {self.truncation_mode}; use 'keep_start' or 'keep_end'")
        if self.max_length is None and (self.packing or self.eval_packing):
            raise ValueError("When packing is enabled, `max_length` can't be `None`: it is the length of a packed row.")
        if self.padding_free and not self.packing and self.max_length is not None:
            raise ValueError(
                "When `padding_free=True` without packing, `max_length` is not enforced: enable packing "
                "(packing=True, packing_strategy='bfd'), or set max_length=None with rows already short enough."
            )
        self.check_checkpointing()
        if self.use_liger_kernel and (self.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
            raise ValueError(
                '`liger_kernel_config={"fused_linear_cross_entropy": True}` is not supported: the loss is already '
                "computed by a fused linear-cross-entropy (hfnative's fused_loss)."
            )
        if self.label_smoothing_factor > 0:
            raise ValueError(
                f"`label_smoothing_factor` is deprecated in `SFTTrainer` (TRL) and hfnative does not implement it "
                f"(label_smoothing_factor={self.label_smoothing_factor}): set it to 0.0."
            )


# TRL 1.16's deprecation warnings, word for word (users' code and tests match them)
DEPRECATIONS = {
    "chunked_nll": "`loss_type='chunked_nll'` is deprecated and will be removed in v2.0.0. Use `loss_type='nll'` (the "
                   "default), which computes the loss the same way, without materializing the full logits.",
    "pad_token": "`pad_token` is deprecated and will be removed in v2.0.0. Set `tokenizer.pad_token` directly and pass it "
                 "as `processing_class` to the trainer instead.",
    "keep_end": "The `'keep_end'` truncation mode is deprecated and will be removed in v2.0.0. Use "
                "`truncation_mode='keep_start'` (the default) instead.",
    "bfd-requeue": "The `bfd-requeue` packing strategy has been renamed to `bfd_split`. Please update your configuration "
                   "accordingly. The `bfd-requeue` strategy is deprecated and will be removed in v2.0.0.",
}
# TRL's first sentence; its advice (transformers' Hub kernels) is replaced by what hfnative does instead
LIGER_DEPRECATION = ("`use_liger_kernel=True` is deprecated and will be removed in v2.0.0. hfnative's loss is already a "
                     "fused linear-cross-entropy (`fused_loss`, on by default).")


def _deprecated(name: str) -> None:
    warnings.warn(DEPRECATIONS[name], FutureWarning, stacklevel=4)
