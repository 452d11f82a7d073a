"""GKDConfig and DistillationConfig: TRL 1.16's fields, defaults and checks (trl.experimental.gkd's GKDConfig,
trl's DistillationConfig), on hfnative's TrainingArguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..loop.arguments import SFTConfig, TRLBaseConfig


@dataclass(repr=False)
class GKDConfig(SFTConfig):
    """TRL's GKDConfig (trl.experimental.gkd): SFTConfig plus the distillation fields, same defaults.

    With probability ``lmbda`` a micro-batch's completions are sampled from the student (at ``temperature``);
    otherwise, with ``seq_kd``, from the teacher; otherwise the dataset's are used. The loss is the generalized
    JSD with ``beta`` at temperature 1, as TRL's GKDTrainer computes it.
    """

    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature of on-policy completions."})
    lmbda: float = field(default=0.5, metadata={"help": "Fraction of micro-batches with student-generated completions."})
    beta: float = field(
        default=0.5, metadata={"help": "Generalized JSD interpolation: 0.0 is KL(teacher||student), 1.0 KL(student||teacher)."}
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Maximum number of tokens generated per completion."})
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The teacher: a local model folder or a Hub model id."}
    )
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "How to load the teacher when it is given by name (JSON): dtype, revision, ..."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the student."})
    seq_kd: bool = field(
        default=False, metadata={"help": "Sequence-level KD: off-policy micro-batches train on teacher-generated completions."}
    )

    _VALID_DICT_FIELDS = SFTConfig._VALID_DICT_FIELDS + ["teacher_model_init_kwargs"]

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError("lmbda must be in the range [0.0, 1.0].")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError("beta must be in the range [0.0, 1.0].")


@dataclass(repr=False)
class DistillationConfig(TRLBaseConfig):
    """TRL's DistillationConfig: every field and default of TRL 1.16 (learning_rate 1e-6, logging_steps 10,
    gradient checkpointing on, bf16 unless fp16, beta 1.0, temperature 1.0 for sampling and the loss).

    Generation runs on hfnative's native engine: ``use_vllm`` and the ``vllm_*`` fields are accepted and
    ``use_vllm=True`` is refused; ``cache_implementation`` and ``ds3_gather_for_generation`` have no effect.
    """

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    # the teacher
    teacher_model_name_or_path: str | None = field(default=None, metadata={"help": "Model name or path of the teacher."})
    teacher_model_revision: str | None = field(default=None, metadata={"help": "Hub revision of the teacher."})
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "How to load the teacher when it is given by name (JSON): dtype, revision, ..."}
    )
    disable_dropout: bool = field(default=False, metadata={"help": "Turn dropout off in the student."})
    # data
    remove_unused_columns: bool | None = field(
        default=False, metadata={"help": "Keep only the 'prompt' column (the trainer reads the raw prompts)."}
    )
    max_completion_length: int | None = field(default=512, metadata={"help": "Maximum number of tokens generated per completion."})
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "DeepSpeed ZeRO-3 only; no effect here."})
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the training dataset."})
    pad_to_multiple_of: int | str | None = field(
        default="auto", metadata={"help": "Pad prompt and completion ids to a multiple of this ('auto': no padding here)."}
    )
    # generation
    temperature: float = field(default=1.0, metadata={"help": "Temperature for sampling and for the loss."})
    top_p: float = field(default=1.0, metadata={"help": "Top-p (nucleus) sampling."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 disables it."})
    min_p: float | None = field(default=None, metadata={"help": "Minimum token probability relative to the most likely."})
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Sampling settings that override the ones above (JSON), e.g. max_new_tokens."}
    )
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments for apply_chat_template when tokenizing prompts (JSON)."}
    )
    repetition_penalty: float = field(default=1.0, metadata={"help": "Penalty on tokens already in the sequence."})
    cache_implementation: str | None = field(default=None, metadata={"help": "Accepted for TRL compatibility; no effect."})
    # vLLM (TRL's fields, accepted; generation runs on the native engine)
    use_vllm: bool = field(default=False, metadata={"help": "Not available: completions come from the native engine."})
    vllm_mode: str = field(default="colocate", metadata={"help": "Accepted for TRL compatibility."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "Accepted for TRL compatibility."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Accepted for TRL compatibility."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "Refused: completions come from the native engine."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "Accepted for TRL compatibility."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Accepted for TRL compatibility."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Accepted for TRL compatibility."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Accepted for TRL compatibility."})
    vllm_group_port: int = field(default=51216, metadata={"help": "Accepted for TRL compatibility."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "Accepted for TRL compatibility."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "Accepted for TRL compatibility."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "Accepted for TRL compatibility."})
    # training and logging
    beta: float = field(
        default=1.0, metadata={"help": "Generalized JSD interpolation: 0.0 forward KL, 0.5 JSD, 1.0 reverse KL."}
    )
    max_tool_calling_iterations: int | None = field(default=None, metadata={"help": "Tool-calling turns per rollout (None: until no tool is called); needs tools."})
    tool_call_timeout: float | None = field(default=None, metadata={"help": "hfnative: seconds one tool call may take before it gets an error result (None: no limit, as TRL)."})
    log_completions: bool = field(default=False, metadata={"help": "At each log, print the latest prompts and completions, "
                                                                   "write them to output_dir/completions/ (parquet) and log "
                                                                   "them to W&B / trackio as a table."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "How many completions to print."})
    log_unique_prompts: bool = field(default=False, metadata={"help": "Log each prompt once in the W&B / trackio table."})

    _VALID_DICT_FIELDS = TRLBaseConfig._VALID_DICT_FIELDS + [
        "teacher_model_init_kwargs", "generation_kwargs", "chat_template_kwargs",
    ]

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            value = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if value in ("none", "null") else int(value)
        if self.pad_to_multiple_of == "auto":
            self.pad_to_multiple_of = None  # TRL pads to 128 on Neuron only
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")
        if self.use_vllm:
            raise ValueError(
                "use_vllm=True: hfnative's DistillationTrainer generates with its native KV-cache engine on the "
                "training model itself; drop use_vllm."
            )
