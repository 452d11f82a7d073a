"""GRPOConfig (and the fields RLOOConfig shares with it): TRL 1.16's names and defaults.

``per_device_train_batch_size`` counts completions; ``generation_batch_size`` / ``steps_per_generation`` say
how many completions are generated at once and over how many micro-batches they are trained on (TRL's rules,
``resolve_generation_batch``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..loop.arguments import TRLBaseConfig

@dataclass(repr=False)
class OnlineRLConfig(TRLBaseConfig):
    """The fields TRL 1.16's GRPOConfig and RLOOConfig share, with their defaults (learning_rate 1e-6,
    logging_steps 10, activation checkpointing on, bf16 unless fp16, remove_unused_columns False).
    ``per_device_train_batch_size`` counts completions; ``generation_batch_size`` (or ``steps_per_generation``)
    sets how many are generated at once."""

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    # model and reference model
    router_aux_loss_coef: float | None = field(default=None, metadata={"help": "MoE load-balancing loss weight."})
    disable_dropout: bool = field(default=False, metadata={"help": "Set every dropout probability to 0."})
    # data
    remove_unused_columns: bool | None = field(default=False, metadata={"help": "Keep the dataset's columns (rewards read them)."})
    num_generations: int | None = field(default=8, metadata={"help": "Completions sampled per prompt (G)."})
    num_generations_eval: int | None = field(default=None, metadata={"help": "G in evaluation (default num_generations)."})
    max_completion_length: int | None = field(default=512, metadata={"help": "Maximum length of a completion."})
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "Accepted (DeepSpeed ZeRO-3 only)."})
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the training prompts."})
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": "Pad prompts and completions to a multiple of this."})
    # generation
    generation_batch_size: int | None = field(default=None, metadata={"help": "Completions generated at once (per device)."})
    steps_per_generation: int | None = field(default=None, metadata={"help": "Micro-batches per generation (default gradient_accumulation_steps)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (also applied to the trained log-probs)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass."})
    top_k: int = field(default=0, metadata={"help": "Keep the k most likely tokens (0: all)."})
    min_p: float | None = field(default=None, metadata={"help": "Minimum probability relative to the most likely token."})
    generation_kwargs: dict | str | None = field(default=None, metadata={"help": "More sampling settings (JSON)."})
    chat_template_kwargs: dict | str | None = field(default=None, metadata={"help": "Keyword arguments of the chat template (JSON)."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "transformers' repetition penalty."})
    cache_implementation: str | None = field(default=None, metadata={"help": "Accepted; the native engine has its own cache."})
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (vllm_mode colocate or server) instead of the native engine."})
    vllm_mode: str = field(default="colocate", metadata={"help": "vLLM: server or colocate."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM model implementation."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "vLLM sleep mode."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "vLLM structured outputs regex."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vLLM server URL."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "vLLM server timeout (s)."})
    vllm_group_port: int = field(default=51216, metadata={"help": "vLLM weight-update group port."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM GPU memory share."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "vLLM context length."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor-parallel size."})
    # training
    beta: float = field(default=0.0, metadata={"help": "KL coefficient (> 0 loads a reference model)."})
    num_iterations: int = field(default=1, metadata={"help": "Optimization passes over each generation batch (μ)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range of the ratio."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping range (default epsilon)."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "Weight of each reward function."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Leave completions cut at max length out of the loss."})
    sync_ref_model: bool = field(default=False, metadata={"help": "Mix the policy into the reference every ref_model_sync_steps steps (TR-DPO)."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO mixup alpha."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO sync period."})
    # logging
    log_completions: bool = field(default=False, metadata={"help": "Print prompts, completions, rewards at each log."})
    log_multimodal: bool = field(default=True, metadata={"help": "Log images (multimodal)."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "Completions printed (None: all)."})
    log_unique_prompts: bool = field(default=False, metadata={"help": "Print each prompt once."})
    use_transformers_continuous_batching: bool = field(default=False, metadata={
        "help": "Accepted: transformers' continuous-batching engine for use_vllm=False; the native engine generates "
                "then, dropping finished rows from its batch."})
    transformers_continuous_batching_config: dict | str | None = field(default=None, metadata={
        "help": "Accepted: transformers' continuous-batching settings (see use_transformers_continuous_batching)."})
    use_transformers_paged: bool = field(default=False, metadata={"help": "Deprecated alias of use_transformers_continuous_batching."})

    _VALID_DICT_FIELDS = TRLBaseConfig._VALID_DICT_FIELDS + [
        "generation_kwargs", "chat_template_kwargs", "transformers_continuous_batching_config",
    ]

    def __post_init__(self):
        super().__post_init__()
        if self.use_transformers_paged:  # TRL's deprecated alias
            own_post_init = type(self).__post_init__ is not OnlineRLConfig.__post_init__  # GRPOConfig's calls this
            warnings.warn("`use_transformers_paged` is deprecated and will be removed in v2.0.0. Use "
                          "`use_transformers_continuous_batching` instead.", FutureWarning,
                          stacklevel=4 if own_post_init else 3)
            self.use_transformers_continuous_batching = True
        if isinstance(self.pad_to_multiple_of, str):
            text = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if text in ("auto", "none", "null") else int(text)
        resolve_generation_batch(self)


@dataclass(repr=False)
class GRPOConfig(OnlineRLConfig):
    """TRL 1.16's GRPOConfig: the shared fields plus GRPO's loss settings, same names and defaults."""

    cast_lm_head_to_fp32: bool = field(default=False, metadata={"help": "Accepted; the head's log-probs are fp32 already."})
    delta: float | None = field(default=None, metadata={"help": "Upper cap of the ratio (two-sided clipping)."})
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "SAPO gate temperature, negative advantages."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "SAPO gate temperature, positive advantages."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "VESPO: gamma shape k for advantages >= 0."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "VESPO: gamma rate lambda for advantages >= 0."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "VESPO: gamma shape k for advantages < 0."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "VESPO: gamma rate lambda for advantages < 0."})
    importance_sampling_level: str = field(default="token", metadata={"help": "token or sequence (GSPO) ratios."})
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata={"help": "sum_then_normalize or normalize_then_sum."})
    scale_rewards: str = field(default="group", metadata={"help": "Divide advantages by the std of: group, batch or none."})
    loss_type: str = field(default="dapo", metadata={"help": "grpo, bnpo, dr_grpo, dapo, luspo, cispo or sapo."})
    top_entropy_quantile: float = field(default=1.0, metadata={"help": "Train only on the top q highest-entropy tokens."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus coefficient: the loss is L_policy - entropy_coef * mean token entropy."})
    use_adaptive_entropy: bool = field(default=False, metadata={"help": "Adapt entropy_coef each step toward entropy_target."})
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy lower bound."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy upper bound."})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "Adaptive entropy step."})
    entropy_target: float = field(default=0.2, metadata={"help": "Adaptive entropy target."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={"help": "Tool-calling turns per rollout (None: until no tool is called); needs tools or environment_factory."})
    tool_call_timeout: float | None = field(default=None, metadata={"help": "hfnative: seconds one tool call may take before it gets an error result (None: no limit, as TRL)."})
    vllm_importance_sampling_correction: bool = field(default=True, metadata={"help": "vLLM importance correction."})
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata={"help": "vLLM importance mode."})
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={"help": "vLLM importance cap."})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={"help": "vLLM importance floor."})
    off_policy_mask_threshold: float | None = field(default=None, metadata={"help": "Drop negative-advantage sequences whose mean KL(sampler || policy) exceeds this."})
    use_bias_correction_kl: bool = field(default=True, metadata={"help": "Weight the KL by the importance ratio."})
    log_completions_hub_repo: str | None = field(default=None, metadata={
        "help": "With log_completions: a Hub dataset repository ('user/name', or 'name' in your namespace) the "
                "completions tables are pushed to every 2 minutes and when training ends (private with "
                "hub_private_repo)."})
    vllm_importance_sampling_cap: float | None = field(default=None, metadata={"help": "Deprecated: vllm_importance_sampling_clip_max."})

    def __post_init__(self):
        super().__post_init__()
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated alias
            warnings.warn("The `vllm_importance_sampling_cap` argument is deprecated and will be removed in v2.0.0. "
                          "Use `vllm_importance_sampling_clip_max` instead.", FutureWarning, stacklevel=2)
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap


def resolve_generation_batch(args, data_parallel_size: int | None = None) -> None:
    """TRL's rules: generation_batch_size and steps_per_generation follow from each other (default: one
    optimizer step's completions); the batch holds whole groups; G >= 2. The global batch counts the processes
    (``args.world_size``), or ``data_parallel_size`` once the run's layout says how many of them hold different
    completions (tensor- and context-parallel ranks share theirs): the trainer resolves again with it, from the
    values the user gave."""
    given = getattr(args, "_generation_batch_given", None)
    if given is None:
        given = args._generation_batch_given = (args.generation_batch_size, args.steps_per_generation)
    args.generation_batch_size, args.steps_per_generation = given
    global_batch = args.per_device_train_batch_size * (args.world_size if data_parallel_size is None else data_parallel_size)
    if args.generation_batch_size is None and args.steps_per_generation is None:
        args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = global_batch * args.steps_per_generation
    elif args.generation_batch_size is not None and args.steps_per_generation is None:
        if args.generation_batch_size % global_batch:
            raise ValueError(
                f"generation_batch_size ({args.generation_batch_size}) must be divisible by the global batch size "
                f"({global_batch})."
            )
        args.steps_per_generation = args.generation_batch_size // global_batch
    elif args.generation_batch_size is None:
        args.generation_batch_size = global_batch * args.steps_per_generation
    else:
        raise ValueError("'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time")
    if args.generation_batch_size % args.num_generations:
        raise ValueError(
            f"generation_batch_size ({args.generation_batch_size}) must be divisible by num_generations "
            f"({args.num_generations})."
        )
    if args.num_generations < 2:
        algorithm = type(args).__name__.removesuffix("Config")
        raise ValueError(
            f"{algorithm} requires at least 2 generations per prompt to calculate the advantages. You provided "
            f"{args.num_generations}, which is less than the minimum required."
        )


def check_run_settings(args, layout) -> None:
    """At the objective's construction: the generation batch for the run's layout (its tp / cp ranks share
    completions), the loss type, and TRL's settings hfnative does not take left at their defaults."""
    from hfnative.losses.policy import LOSS_TYPES

    if layout is not None and layout.dp_size != args.world_size:
        resolve_generation_batch(args, layout.dp_size)
    loss_type = getattr(args, "loss_type", None)
    if loss_type is not None and loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {LOSS_TYPES}")

