"""PPOConfig: TRL 0.29's ``trl.experimental.ppo.PPOConfig`` (the last TRL with PPO), its names and defaults, and the
batch sizes its trainer derives from them (with TRL's divisibility errors)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ..loop.arguments import TRLBaseConfig

KL_ESTIMATORS = ("k1", "k3")


@dataclass(repr=False)
class PPOConfig(TRLBaseConfig):
    """TRL 0.29's PPOConfig: the same fields and defaults (learning_rate 3e-6, num_mini_batches 1, response_length 53,
    temperature 0.7, num_ppo_epochs 4, kl_coef 0.05, kl_estimator "k1", cliprange 0.2, vf_coef 0.1, cliprange_value
    0.2, gamma 1.0, lam 0.95, logging_steps 10, bf16 unless fp16). ``world_size``, ``num_total_batches``,
    ``micro_batch_size``, ``local_batch_size``, ``batch_size``, ``local_mini_batch_size`` and ``mini_batch_size`` are
    set by the trainer (``resolve_batch_sizes``), as TRL's does. hfnative's own: ``use_vllm`` and the ``vllm_*`` fields
    (GRPOConfig's names), the rollout engine."""

    learning_rate: float = field(default=3e-6, metadata={"help": "The initial learning rate for AdamW."})
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Number of processes to use for processing the dataset."}
    )
    num_mini_batches: int = field(default=1, metadata={"help": "Number of minibatches to split a batch into."})
    total_episodes: int | None = field(default=None, metadata={"help": "Total number of episodes in the dataset."})
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Per rank no grad forward pass in the rollout phase."}
    )
    num_sample_generations: int = field(
        default=10,
        metadata={"help": "Number of debugging samples generations (i.e., `generate_completions` calls) throughout "
                          "training."},
    )
    response_length: int = field(default=53, metadata={"help": "Length of the response."})
    stop_token: Literal["eos"] | None = field(
        default=None,
        metadata={"help": "Specifies the stop token to use for text generation. This parameter is mutually exclusive "
                          "with `stop_token_id`."},
    )
    stop_token_id: int | None = field(
        default=None,
        metadata={"help": "Specifies the ID of the stop token to use for text generation. If `None`, no stop token ID "
                          "is applied, unless `stop_token` is specified. This parameter is mutually exclusive with "
                          "`stop_token`."},
    )
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Penalty applied to the score when the model fails to generate an EOS token. This is useful "
                          "to encourage to generate completions shorter than the maximum length (`max_new_tokens`). "
                          "The penalty must be a positive value."},
    )
    sft_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path to the SFT model."})
    world_size: int | None = field(
        default=None, metadata={"help": "Number of processes (GPUs) to use for the training."}
    )
    num_total_batches: int | None = field(default=None, metadata={"help": "Number of total batches to train."})
    micro_batch_size: int | None = field(
        default=None,
        metadata={"help": "Micro batch size across devices (HF's `per_device_train_batch_size` * `world_size`)."},
    )
    local_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size per GPU (HF's `per_device_train_batch_size` * `gradient_accumulation_steps`)."},
    )
    batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size across devices (HF's `per_device_train_batch_size` * `world_size` * "
                          "`gradient_accumulation_steps`)."},
    )
    local_mini_batch_size: int | None = field(default=None, metadata={"help": "Mini batch size per GPU."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "Mini batch size across GPUs."})
    push_to_hub: bool = field(default=False, metadata={"help": "Whether to push the model to the Hub after training."})
    reward_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path to the reward model."})
    model_adapter_name: str | None = field(
        default=None, metadata={"help": "Name of the train target PEFT adapter, when using LoRA with multiple adapters."}
    )
    ref_adapter_name: str | None = field(
        default=None, metadata={"help": "Name of the reference PEFT adapter, when using LoRA with multiple adapters."}
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Number of epochs to train."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whether to whiten the rewards."})
    kl_coef: float = field(default=0.05, metadata={"help": "KL coefficient."})
    kl_estimator: Literal["k1", "k3"] = field(
        default="k1",
        metadata={"help": "Which estimator for KL-Divergence to use from Approximating KL Divergence "
                          "(http://joschu.net/blog/kl-approx.html): 'k1' (unbiased) or 'k3' (unbiased, lower variance)."},
    )
    cliprange: float = field(default=0.2, metadata={"help": "Clip range."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value function coefficient."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range for the value function."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "Lambda value for GAE."})
    ds3_gather_for_generation: bool = field(
        default=True, metadata={"help": "Accepted (DeepSpeed ZeRO-3 only); the native engine decodes the live weights."}
    )
    # hfnative's own (TRL's PPO generates with transformers' generate only): the rollout engine, as GRPOConfig names it
    use_vllm: bool = field(
        default=False, metadata={"help": "hfnative: generate with vLLM (vllm_mode colocate or server) instead of the "
                                         "native engine; the trained weights are pushed to it after every update."}
    )
    vllm_mode: str = field(default="colocate", metadata={"help": "hfnative: vLLM server or colocate."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "hfnative: vLLM model implementation."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "hfnative: vLLM sleep mode."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "hfnative: vLLM server URL."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "hfnative: vLLM server host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "hfnative: vLLM server port."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "hfnative: vLLM server timeout (s)."})
    vllm_group_port: int = field(default=51216, metadata={"help": "hfnative: vLLM weight-update group port."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "hfnative: vLLM GPU memory share."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "hfnative: vLLM context length."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "hfnative: vLLM tensor-parallel size."})

    # read by the shared reference-model piece (trainers/algorithms/reference_model.py); not PPO options: TRL's PPO scores fresh
    # completions and turns dropout off in every model it is given
    precompute_ref_log_probs = False
    disable_dropout = True


def exact_div(a: int, b: int, message: str) -> int:
    """a / b when b divides a, else TRL's error."""
    q = a // b
    if a != q * b:
        raise ValueError(f"{message}, inexact division: {a} / {b} = {a / b}")
    return q


def resolve_batch_sizes(args: PPOConfig, world_size: int, dataset_length: int) -> None:
    """TRL's derived sizes, set on ``args`` as TRL's trainer sets them: ``total_episodes`` (num_train_epochs times the
    dataset when unset), ``local_batch_size`` (rollouts per rank per update: per_device_train_batch_size x
    gradient_accumulation_steps), ``batch_size`` (over the ranks), the mini-batch sizes (num_mini_batches must divide
    them) and ``num_total_batches`` (the updates, ceil(total_episodes / batch_size))."""
    if args.total_episodes is None:
        args.total_episodes = int(args.num_train_epochs * dataset_length)
    args.world_size = world_size
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.micro_batch_size = int(args.per_device_train_batch_size * args.world_size)
    args.batch_size = int(args.local_batch_size * args.world_size)
    args.mini_batch_size = exact_div(args.batch_size, args.num_mini_batches,
                                     "`batch_size` must be a multiple of `num_mini_batches`")
    args.local_mini_batch_size = exact_div(args.local_batch_size, args.num_mini_batches,
                                           "`local_batch_size` must be a multiple of `num_mini_batches`")
    if args.whiten_rewards and args.local_mini_batch_size < 8:
        raise ValueError(f"Per-rank minibatch size {args.local_mini_batch_size} is insufficient for whitening")
    args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)  # may train for more than total_episodes


__all__ = ["KL_ESTIMATORS", "PPOConfig", "exact_div", "resolve_batch_sizes"]
