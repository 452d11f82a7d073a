"""KTOConfig: TRL 1.16's KTO arguments, names and defaults, with TRL's checks of the loss settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from hfnative.losses.unpaired_preference import UNPAIRED_LOSS_TYPES, kl_free

from ..loop.arguments import TRLBaseConfig


@dataclass(repr=False)
class KTOConfig(TRLBaseConfig):
    """TRL's KTOConfig: the same fields and defaults (learning_rate 1e-6, train_sampling_strategy "sequential",
    logging_steps 10, activation checkpointing on, bf16 unless fp16, loss_type "kto", beta 0.1, max_length 1024)."""

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate."})
    train_sampling_strategy: str = field(
        default="sequential",
        metadata={"help": "Sampler of the train batches: 'sequential' (the KL estimate's pairing needs it) or 'random'."},
    )
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "Weight of the MoE load-balancing loss (None: the model config's value)."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the model and reference model."})
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used to tokenize the dataset."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Truncate each prompt + completion sequence (its end) to this length (None: no truncation)."}
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto", metadata={"help": "Pad sequences to a multiple of this length ('auto': no padding off Neuron)."}
    )
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "Compute the reference log-probs of every row once, before training."}
    )
    precompute_ref_batch_size: int | None = field(
        default=None, metadata={"help": "Batch size of that pass (default: the per-device train / eval batch size)."}
    )
    loss_type: str = field(default="kto", metadata={"help": f"One of {', '.join(UNPAIRED_LOSS_TYPES)}."})
    beta: float = field(default=0.1, metadata={"help": "Deviation from the reference model (higher: less deviation)."})
    desirable_weight: float = field(default=1.0, metadata={"help": "Weight of the desirable rows' losses."})
    undesirable_weight: float = field(default=1.0, metadata={"help": "Weight of the undesirable rows' losses."})
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to the CPU."})
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: mix the policy into the reference every ref_model_sync_steps steps."}
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO: ref = alpha * policy + (1 - alpha) * ref."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO: steps between reference updates."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.pad_to_multiple_of, str):  # the CLI passes a string; "auto" pads only on Neuron
            text = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if text in ("auto", "none", "null") else int(text)

    @property
    def uses_kl(self) -> bool:
        """Whether the loss estimates the KL term from mismatched completions."""
        return not kl_free(self.loss_type)

    def check_for_trainer(self) -> None:
        """TRL's checks, made when a KTOTrainer is built (an unknown loss type is refused here, not at the first step)."""
        if self.loss_type not in UNPAIRED_LOSS_TYPES:
            raise ValueError(f"Unknown loss type: {self.loss_type}. Should be one of {list(UNPAIRED_LOSS_TYPES)}")
        if self.uses_kl and self.train_sampling_strategy != "sequential":
            raise ValueError(
                f"Loss type `'{self.loss_type}'` estimates the KL divergence term and requires "
                "`train_sampling_strategy='sequential'` because the KL completion for each example is precomputed "
                "against its neighbors in a fixed-order batch; any other strategy breaks that pairing. "
                f"Got `train_sampling_strategy='{self.train_sampling_strategy}'`."
            )
        if self.uses_kl and self.per_device_train_batch_size <= 1:
            raise ValueError(
                "Actual (not effective) batch size must be > 1. KTO will not work properly because the KL term will be "
                "equivalent to the implied reward."
            )
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError(
                "You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`: the reference "
                "model changes during training, so log-probs computed before it would be stale. Set "
                "`precompute_ref_log_probs=False` or disable `sync_ref_model`."
            )


__all__ = ["KTOConfig"]
