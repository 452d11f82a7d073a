"""RewardConfig: TRL 1.16's reward-modeling arguments, names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..loop.arguments import TRLBaseConfig, _deprecated


@dataclass(repr=False)
class RewardConfig(TRLBaseConfig):
    """TRL's RewardConfig: the same fields and defaults (learning_rate 1e-4, logging_steps 10, activation
    checkpointing on, bf16 unless fp16, max_length 1024, center_rewards_coefficient None)."""

    learning_rate: float = field(default=1e-4, metadata={"help": "The initial learning rate."})
    chat_template_path: str | None = field(
        default=None, metadata={"help": "A .jinja chat template file, or a tokenizer folder whose template to use."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the model."})
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used to tokenize the dataset."})
    eos_token: str | None = field(
        default=None, metadata={"help": "The end-of-sequence token (None: the processing class's eos_token)."}
    )
    max_length: int | None = field(
        default=1024, metadata={"help": "Drop pairs whose chosen or rejected sequence is longer (None: keep every pair)."}
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto", metadata={"help": "Pad sequences to a multiple of this length ('auto': no padding off Neuron)."}
    )
    center_rewards_coefficient: float | None = field(
        default=None, metadata={"help": "Weight of mean((r_chosen + r_rejected)^2), for mean-zero rewards (e.g. 0.01)."}
    )
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to the CPU."})
    pad_token: str | None = field(default=None, metadata={"help": "Deprecated in TRL: the padding token to set on the tokenizer."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.pad_to_multiple_of, str):  # the CLI passes a string; "auto" pads only on Neuron
            text = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if text in ("auto", "none", "null") else int(text)
        if self.pad_token is not None:
            _deprecated("pad_token")


__all__ = ["RewardConfig"]
