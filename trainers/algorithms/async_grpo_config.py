"""AsyncGRPOConfig: TRL 1.16's ``trl.experimental.async_grpo`` arguments, names and defaults, plus where the
Ray actors run."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..loop.arguments import TRLBaseConfig


@dataclass(repr=False)
class AsyncGRPOConfig(TRLBaseConfig):
    """TRL's AsyncGRPOConfig: its fields and defaults (learning_rate 1e-6, logging_steps 1, a constant LR schedule,
    max_completion_length 2048, max_staleness 4, ...), plus where the Ray actors run.

    Generation runs in a Ray actor, on hfnative's native engine by default and on vLLM with ``use_vllm=True``
    (GRPOConfig's names): ``vllm_mode="colocate"`` runs ``vllm.LLM`` inside the generator actor, loaded from the
    model's Hub-format folder, which the actor's machine must see (vllm_gpu_memory_utilization, vllm_max_model_length,
    vllm_model_impl); ``vllm_mode="server"`` generates on the vLLM server at ``vllm_server_base_url``, as TRL's async
    trainer always does (vllm_server_timeout, vllm_group_port, vllm_weight_transport, vllm_weights_dir: see
    hfnative.generation.vllm_backend). Weights reach vLLM as Hub-named tensors, at start and at every sync.
    ``ignore_data_skip``: a resumed run always continues with the prompts after its checkpoint's step.
    hfnative's own fields:
      ray_address: join this Ray cluster (e.g. "ray://head:10001" or "auto"); None starts a local Ray instance
        (or uses the one already initialized in the process, or the cluster RAY_ADDRESS names).
      num_rollout_actors: generator actors, each with its own copy of the policy, given micro-batches in turn
        (more generation throughput, e.g. one per node or GPU); every weight sync reaches all of them.
      rollout_actor_options / reward_actor_options: Ray actor options of each generator (default num_cpus=1)
        and the reward scorer (default num_cpus=0), e.g. {"num_gpus": 1} or {"resources": {"node:10.0.0.2": 0.01}}.
    """

    dtype: str = field(default="float32", metadata={"help": "Dtype to load the model under."})
    router_aux_loss_coef: float | None = field(default=None, metadata={"help": "MoE load-balancing loss weight."})
    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=1, metadata={"help": "Log every X update steps."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    ignore_data_skip: bool = field(default=True, metadata={"help": "Accepted for TRL (see the class docstring)."})
    num_generations: int = field(default=8, metadata={"help": "Number of generations per prompt to sample."})
    max_completion_length: int = field(default=2048, metadata={"help": "Maximum length of the generated completion."})
    temperature: float = field(default=1.0, metadata={"help": "Temperature for sampling."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling probability mass."})
    top_k: int = field(default=0, metadata={"help": "Top-k filtering (0: off)."})
    min_p: float | None = field(default=None, metadata={"help": "Minimum token probability relative to the top one."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty (1.0: none)."})
    chat_template_kwargs: dict | str | None = field(default=None, metadata={"help": "Extra apply_chat_template kwargs."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={"help": "Tool-calling turns per rollout (None: until no tool is called); needs tools."})
    tool_call_timeout: float | None = field(default=None, metadata={"help": "hfnative: seconds one tool call may take before it gets an error result (None: no limit, as TRL)."})
    fork_threshold_tokens: int = field(default=1024, metadata={"help": "Multi-turn re-tokenization drift (unused)."})
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (vllm_mode) instead of the native engine."})
    vllm_mode: str = field(default="colocate", metadata={"help": "vLLM: colocate (in the generator actor) or server."})
    vllm_server_base_url: str = field(default="http://localhost:8000", metadata={"help": "vLLM server URL (vllm_mode server)."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Seconds to wait for the vLLM server."})
    vllm_group_port: int = field(default=51216, metadata={"help": "vLLM NCCL weight-transfer port (server)."})
    vllm_weight_transport: str = field(default="auto", metadata={"help": "vLLM server weights: files, nccl or auto."})
    vllm_weights_dir: str | None = field(default=None, metadata={"help": "Folder of the files weight transport."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM GPU memory share (colocate)."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "vLLM context length (colocate)."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM model implementation (colocate)."})
    request_timeout: int = field(default=600, metadata={"help": "Accepted for TRL; unused."})
    weight_sync_timeout: int = field(default=1800, metadata={"help": "Accepted for TRL; unused."})
    epsilon: float = field(default=0.2, metadata={"help": "Epsilon value for clipping."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping epsilon (default: epsilon)."})
    token_budget: int | None = field(
        default=None, metadata={"help": "Token-budgeted micro-batching: None or <= 0 (fixed-count micro-batches)."}
    )
    max_inflight_tasks: int = field(
        default=-1, metadata={"help": "Completions generated ahead, at most (-1: max_staleness x completions per step)."}
    )
    max_staleness: int = field(default=4, metadata={"help": "Optimizer steps a rollout may lag behind the policy."})
    queue_maxsize: int = field(default=1024, metadata={"help": "Completions buffered in the rollout queue, at most."})
    weight_sync_steps: int = field(default=1, metadata={"help": "Optimizer steps between weight syncs to the generator."})
    heartbeat_stale_after_s: float = field(
        default=300.0, metadata={"help": "Seconds an actor may hold work without a result before the run stops."}
    )
    log_completions: bool = field(default=False, metadata={"help": "Print (prompt, completion, reward) samples when logging."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "Completions printed (None: all)."})
    ray_address: str | None = field(default=None, metadata={"help": "hfnative: the Ray cluster to join (None: local)."})
    num_rollout_actors: int = field(default=1, metadata={"help": "hfnative: generator actors, given micro-batches in turn."})
    rollout_actor_options: dict | str | None = field(default=None, metadata={"help": "hfnative: generator actor options."})
    reward_actor_options: dict | str | None = field(default=None, metadata={"help": "hfnative: reward actor options."})

    _VALID_DICT_FIELDS = TRLBaseConfig._VALID_DICT_FIELDS + [
        "chat_template_kwargs", "rollout_actor_options", "reward_actor_options",
    ]

    def __post_init__(self):
        super().__post_init__()
        if self.num_generations < 2:
            raise ValueError(f"num_generations={self.num_generations}: GRPO compares at least 2 completions per prompt")
        if self.per_device_train_batch_size % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size={self.per_device_train_batch_size} must be a multiple of "
                f"num_generations={self.num_generations}: each micro-batch holds whole groups of completions"
            )
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness!r}: expected an int >= 0 (0: on-policy)")
        if self.weight_sync_steps < 1 or self.weight_sync_steps > self.max_staleness + 1:
            raise ValueError(
                f"weight_sync_steps={self.weight_sync_steps} with max_staleness={self.max_staleness}: expected "
                "1 <= weight_sync_steps <= max_staleness + 1 (else every rollout between two syncs is too stale)"
            )
        if self.token_budget is not None and self.token_budget > 0:
            raise ValueError(
                f"token_budget={self.token_budget}: token-budgeted micro-batches are not implemented; leave it None "
                "(micro-batches of per_device_train_batch_size completions)"
            )
        if self.queue_maxsize < self.per_device_train_batch_size:
            raise ValueError(
                f"queue_maxsize={self.queue_maxsize} holds less than one micro-batch "
                f"(per_device_train_batch_size={self.per_device_train_batch_size})"
            )
        if self.num_rollout_actors < 1:
            raise ValueError(f"num_rollout_actors={self.num_rollout_actors}: expected an int >= 1")
        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode={self.vllm_mode!r}: expected 'colocate' or 'server'")
        if self.use_vllm and self.vllm_mode == "server" and self.num_rollout_actors > 1:
            raise ValueError(
                f"num_rollout_actors={self.num_rollout_actors} with vllm_mode='server': the generators would share one "
                "server's weights, so their policy versions would be wrong; use num_rollout_actors=1"
            )
        if self.heartbeat_stale_after_s <= 0:
            raise ValueError(f"heartbeat_stale_after_s={self.heartbeat_stale_after_s}: expected > 0 seconds")


__all__ = ["AsyncGRPOConfig"]
