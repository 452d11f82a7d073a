"""DPOConfig: TRL 1.16's DPO arguments, names and defaults, with TRL's checks of the loss settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from hfnative.losses.preference import F_DIVERGENCE_LOSS_TYPES, F_DIVERGENCES, LOSS_TYPES, SORTING_LOSS_TYPES

from ..loop.arguments import TRLBaseConfig, _deprecated


@dataclass(repr=False)
class DPOConfig(TRLBaseConfig):
    """TRL's DPOConfig: the same fields and defaults (learning_rate 1e-6, logging_steps 10, activation
    checkpointing on, bf16 unless fp16, beta 0.1, loss_type ["sigmoid"], max_length 1024)."""

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate."})
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "Weight of the MoE load-balancing loss (None: the model config's value)."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the model and reference model."})
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used to tokenize the dataset."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Truncate each prompt + completion sequence to this length (None: no truncation)."}
    )
    truncation_mode: str = field(
        default="keep_start", metadata={"help": "Which end to keep when truncating: keep_start or keep_end (deprecated)."}
    )
    padding_free: bool = field(
        default=False, metadata={"help": "Unavailable in TRL 1.16 (falls back to padding with a warning); kept for its name."}
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
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": f"One or more of {', '.join(LOSS_TYPES)} (several are summed with loss_weights)."},
    )
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "The weight of each loss_type (default: 1.0 each)."}
    )
    ld_alpha: float | None = field(
        default=None, metadata={"help": "LD-DPO: weight of the completion tokens past the shorter completion's length."}
    )
    f_divergence_type: str = field(
        default="reverse_kl", metadata={"help": f"The f-divergence of f-DPO: {', '.join(F_DIVERGENCES)}."}
    )
    f_alpha_divergence_coef: float = field(default=0.5, metadata={"help": "alpha of the alpha-divergence."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Label-flip probability (robust, aot: in [0, 0.5)); EXO's epsilon (exo_pair: > 0)."}
    )
    beta: float = field(default=0.1, metadata={"help": "Deviation from the reference model (IPO: its tau)."})
    use_weighting: bool = field(default=False, metadata={"help": "WPO: weight pairs by their length-normalized probabilities."})
    discopop_tau: float = field(default=0.05, metadata={"help": "Temperature of the DiscoPOP blend."})
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to the CPU."})
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: mix the policy into the reference every ref_model_sync_steps steps."}
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO: ref = alpha * policy + (1 - alpha) * ref."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO: steps between reference updates."})
    pad_token: str | None = field(default=None, metadata={"help": "Deprecated in TRL: the padding token to set on the tokenizer."})

    _VALID_DICT_FIELDS = TRLBaseConfig._VALID_DICT_FIELDS

    def __post_init__(self):
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                "`loss_weights` must have the same length as `loss_type` when combining multiple losses. "
                f"Got {len(self.loss_weights)} weights for {len(self.loss_type)} loss types."
            )
        if self.pad_token is not None:
            _deprecated("pad_token")
        if self.truncation_mode == "keep_end":
            _deprecated("keep_end")
        super().__post_init__()
        if isinstance(self.pad_to_multiple_of, str):  # the CLI passes a string; "auto" pads only on Neuron
            text = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if text in ("auto", "none", "null") else int(text)

    def check_for_trainer(self) -> None:
        """TRL's checks of the loss settings (made when a DPOTrainer is built, as TRL makes them; an unknown loss
        type is refused here rather than at the first step)."""
        unknown = [name for name in self.loss_type if name not in LOSS_TYPES]
        if unknown:
            raise ValueError(f"Unknown loss type: {unknown[0]}. Should be one of {list(LOSS_TYPES)}")
        if self.f_divergence_type not in F_DIVERGENCES:
            raise ValueError(f"Unknown f_divergence_type: {self.f_divergence_type}; use one of {list(F_DIVERGENCES)}")
        if self.f_divergence_type != "reverse_kl" and not set(self.loss_type) <= set(F_DIVERGENCE_LOSS_TYPES):
            raise ValueError(
                f"`f_divergence_type='{self.f_divergence_type}'` is only supported for the following loss types: "
                f"{sorted(F_DIVERGENCE_LOSS_TYPES)}. You provided {self.loss_type}. Use the default "
                "`f_divergence_type='reverse_kl'` with these losses."
            )
        if self.use_weighting and set(self.loss_type) & set(SORTING_LOSS_TYPES):
            raise UnsupportedSettings(
                "WPO-style weighting is not implemented for 'aot' or 'aot_unpaired' because those losses sort "
                "samples, which would misalign per-pair weights: set use_weighting=False or use another loss_type."
            )
        if "robust" in self.loss_type and not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(
                f"The `label_smoothing` parameter must lie in [0.0, 0.5) for the 'robust' loss (it is the probability "
                f"that a preference label is flipped); you provided {self.label_smoothing}."
            )
        if "exo_pair" in self.loss_type and self.label_smoothing == 0.0:
            raise ValueError(
                "Label smoothing must be greater than 0.0 when using 'exo_pair' loss. The EXO paper recommends a "
                "value of 1e-3."
            )
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"`ld_alpha` must be in [0.0, 1.0]; you provided {self.ld_alpha}.")
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"Unsupported truncation mode: {self.truncation_mode}, expected 'keep_start' or 'keep_end'")
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError(
                "You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`: the reference "
                "model changes during training, so log-probs computed before it would be stale. Set "
                "`precompute_ref_log_probs=False` or disable `sync_ref_model`."
            )


class UnsupportedSettings(ValueError, NotImplementedError):
    """Settings TRL refuses with NotImplementedError: a ValueError here, and still that for code catching it."""


__all__ = ["DPOConfig", "UnsupportedSettings"]
