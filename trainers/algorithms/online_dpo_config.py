"""OnlineDPOConfig: TRL 1.16's experimental Online DPO arguments, names and defaults, with the checks made when an
OnlineDPOTrainer is built (what hfnative does not run is refused there, naming the setting)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..loop.arguments import TRLBaseConfig

ONLINE_DPO_LOSS_TYPES = ("sigmoid", "ipo")


@dataclass(repr=False)
class OnlineDPOConfig(TRLBaseConfig):
    """TRL's OnlineDPOConfig: the same fields and defaults (learning_rate 5e-7, remove_unused_columns False,
    max_new_tokens 64, max_length 512, temperature 0.9, beta [0.1] (one value becomes a float), loss_type "sigmoid",
    dropout off, logging_steps 10, activation checkpointing on, bf16 unless fp16)."""

    learning_rate: float = field(default=5e-7, metadata={"help": "The initial learning rate for AdamW."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep the dataset's columns (the reward functions get them)."}
    )
    reward_model_path: str | None = field(
        default=None, metadata={"help": "A reward model (folder or Hub id), used when no reward_funcs are given."}
    )
    max_new_tokens: int = field(default=64, metadata={"help": "Maximum number of tokens generated per completion."})
    max_length: int = field(
        default=512,
        metadata={"help": "Maximum prompt + completion length for the log-probs: the prompts' left ends are cut."},
    )
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass (1.0: all tokens)."})
    top_k: int = field(default=0, metadata={"help": "Keep the k most likely tokens (0: all)."})
    min_p: float | None = field(
        default=None, metadata={"help": "Minimum probability relative to the most likely token."}
    )
    repetition_penalty: float = field(default=1.0, metadata={"help": "transformers' repetition penalty."})
    generation_kwargs: dict | None = field(
        default=None, metadata={"help": "More sampling settings of the native engine (they override the ones above)."}
    )
    cache_implementation: str | None = field(
        default=None, metadata={"help": "Accepted; the native engine keeps its own KV cache."}
    )
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtracted from the score of a completion that has no EOS token."}
    )
    beta: list[float] = field(
        default_factory=lambda: [0.1],
        metadata={"help": "Deviation from the reference (IPO's tau); a list: one per epoch, the last for the rest."},
    )
    loss_type: str = field(default="sigmoid", metadata={"help": "sigmoid (DPO) or ipo.", "choices": ["sigmoid", "ipo"]})
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the model and reference model."})
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (refused: the native engine samples)."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM model implementation (vLLM only)."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "vLLM structured outputs regex."})
    vllm_gpu_memory_utilization: float | None = field(default=0.55, metadata={"help": "vLLM GPU memory share."})
    vllm_mode: str = field(default="colocate", metadata={"help": "vLLM: server or colocate."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vLLM server URL."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "vLLM server timeout (s)."})
    vllm_group_port: int = field(default=51216, metadata={"help": "vLLM weight-update group port."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor-parallel size."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "vLLM sleep mode."})
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "Accepted (DeepSpeed ZeRO-3 only)."})
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weight of each reward function (default: all 1.0)."}
    )

    # read by the reference-model pieces DPO and KTO share (trainers/algorithms/reference_model.py); not options of online DPO:
    # its reference scores fresh completions (nothing to precompute) and TR-DPO's synchronisation is not one of its
    # settings
    precompute_ref_log_probs = False
    sync_ref_model = False

    def __post_init__(self):
        super().__post_init__()
        if hasattr(self.beta, "__len__") and len(self.beta) == 1:
            self.beta = self.beta[0]
        if self.max_length is not None and self.max_new_tokens >= self.max_length:
            warnings.warn(
                f"The configuration has `max_new_tokens` ({self.max_new_tokens}) >= `max_length` ({self.max_length}). "
                "This will cause prompts to be truncated or completely removed in the forward pass. To preserve "
                "prompts, ensure e.g. `max_length > max_new_tokens + 512`.",
                stacklevel=3,
            )

    def check_for_trainer(self) -> None:
        """The settings an OnlineDPOTrainer cannot run, refused when it is built (TRL finds a bad loss type only at
        the first step)."""
        if self.loss_type not in ONLINE_DPO_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: OnlineDPOTrainer implements {list(ONLINE_DPO_LOSS_TYPES)}")
        betas = self.beta if isinstance(self.beta, (list, tuple)) else [self.beta]
        if not betas:
            raise ValueError("beta=[]: give a float, or one float per epoch")
        if self.loss_type == "ipo" and any(b == 0 for b in betas):
            raise ValueError("beta=0 with loss_type='ipo': IPO's target 1 / (2 beta) needs beta > 0")
        if self.use_vllm:
            raise ValueError(
                "use_vllm=True: hfnative's OnlineDPOTrainer samples with the native engine (on the policy's live "
                "weights) and does not drive vLLM yet; set use_vllm=False"
            )


__all__ = ["ONLINE_DPO_LOSS_TYPES", "OnlineDPOConfig"]
