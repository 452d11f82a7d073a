"""ORPOConfig and CPOConfig: TRL 1.16's experimental ORPO and CPO arguments, names and defaults."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from hfnative.losses.preference import CPO_LOSS_TYPES

from ..loop.arguments import TRLBaseConfig


@dataclass(repr=False)
class _ReferenceFreeConfig(TRLBaseConfig):
    """The fields ORPO's and CPO's configs share (learning_rate 1e-6, max_length 1024, beta 0.1, dropout off)."""

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum length of prompt + completion; the completion's end is cut (None: 512)."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Maximum completion length (encoder-decoder models only, which hfnative refuses)."}
    )
    beta: float = field(default=0.1, metadata={"help": "Weight of the preference term."})
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the model."})
    generate_during_eval: bool = field(
        default=False, metadata={"help": "At each evaluation, sample completions of eval_batch_size prompts of the eval "
                                         "set and log them to W&B / Comet as the table game_log."}
    )
    is_encoder_decoder: bool | None = field(
        default=None, metadata={"help": "Whether the model is an encoder-decoder (hfnative trains decoders only)."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used to tokenize the dataset."})

    def check_for_trainer(self, algorithm: str) -> None:
        """What TRL's trainers need that hfnative does not do, refused when the trainer is built."""
        if self.generate_during_eval and not any(importlib.util.find_spec(name) for name in ("wandb", "comet_ml")):
            raise ValueError("`generate_during_eval=True` requires Weights and Biases or Comet to be installed. Please "
                             "install `wandb` or `comet-ml` to resolve.")  # TRL's
        if self.is_encoder_decoder:
            raise ValueError(
                f"{algorithm}: is_encoder_decoder=True: encoder-decoder (seq2seq) models are out of scope for hfnative, "
                "which trains decoder-only causal language models (natively, or through transformers' *ForCausalLM "
                "modules, which seq2seq models are not). Train a seq2seq model with TRL's trainer itself; for a "
                "decoder-only model leave is_encoder_decoder unset (None) or False"
            )

    @property
    def sequence_length_limit(self) -> int:
        """max_length, or TRL's 512 when it is None."""
        return 512 if self.max_length is None else self.max_length


@dataclass(repr=False)
class ORPOConfig(_ReferenceFreeConfig):
    """TRL's ORPOConfig: the same fields and defaults; beta is ORPO's lambda (the odds-ratio term's weight)."""

    padding_value: int | None = field(
        default=None, metadata={"help": "Padding value of the input ids (None: the tokenizer's pad token)."}
    )


@dataclass(repr=False)
class CPOConfig(_ReferenceFreeConfig):
    """TRL's CPOConfig: the same fields and defaults (loss_type "sigmoid", cpo_alpha 1.0, simpo_gamma 0.5, alpha 0.0);
    loss_type "alphapo" becomes "simpo" with cpo_alpha 0.0, as in TRL."""

    label_smoothing: float = field(default=0.0, metadata={"help": "Label smoothing of the sigmoid / simpo losses."})
    loss_type: str = field(
        default="sigmoid",
        metadata={"help": "Type of loss to use.", "choices": ["sigmoid", "hinge", "ipo", "simpo", "alphapo"]},
    )
    cpo_alpha: float = field(default=1.0, metadata={"help": "Weight of the BC regularizer (the chosen NLL)."})
    simpo_gamma: float = field(default=0.5, metadata={"help": "Target reward margin of the SimPO loss."})
    alpha: float = field(
        default=0.0, metadata={"help": "AlphaPO's reward shape: r = (1 - p^(-alpha)) / alpha (0: log-prob rewards)."}
    )

    def __post_init__(self):
        if self.loss_type == "alphapo":
            self.loss_type = "simpo"
            self.cpo_alpha = 0.0
        super().__post_init__()

    def check_for_trainer(self, algorithm: str) -> None:
        super().check_for_trainer(algorithm)
        if self.loss_type == "kto_pair":
            raise ValueError("Support for kto_pair has been removed in CPOTrainer. Please use KTOTrainer.")
        if self.loss_type not in CPO_LOSS_TYPES:
            raise ValueError(f"Unknown loss type: {self.loss_type}. Should be one of {list(CPO_LOSS_TYPES)}")


__all__ = ["CPOConfig", "ORPOConfig"]
