"""No silent settings: each field of transformers' TrainingArguments that hfnative's own code does not read is either
honoured by the transformers code hfnative runs (``HONOURED_BY_TRANSFORMERS``), refused when set away from its
default (``REFUSED``: ``check_settings`` raises, naming the field and what to do), or has no effect by design
(``NO_EFFECT``, with the reason); likewise the TRL configs' own fields (``CONFIG_NO_EFFECT``, ``CONFIG_REFUSED``).
tests/test_no_silent_settings.py checks that every field falls in one of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import transformers
from transformers.debug_utils import DebugOption
from transformers.trainer_utils import enable_full_determinism, set_seed

# field -> the transformers code that reads it while hfnative trains
HONOURED_BY_TRANSFORMERS = {
    "logging_strategy": "transformers' DefaultFlowCallback, which decides the steps that log",
    "logging_first_step": "transformers' DefaultFlowCallback",
    "eval_delay": "transformers' DefaultFlowCallback, which decides the steps that evaluate",
    "run_name": "the report_to integrations (transformers' reporting callbacks)",
    "project": "the report_to integrations (trackio, wandb)",
    "trackio_space_id": "the trackio integration",
    "trackio_bucket_id": "the trackio integration",
    "trackio_static_space_id": "the trackio integration",
    "tf32": "TrainingArguments.__post_init__, which sets torch's TF32 switches",
    "fsdp_config": "TrainingArguments.__post_init__ (into fsdp_plugin_args, which trainers/running/parallel_plan.py reads)",
}

# field -> why it changes nothing in an hfnative run
NO_EFFECT = {
    "do_train": "read by training scripts, not by the Trainer (as in transformers)",
    "do_eval": "read by training scripts, not by the Trainer (as in transformers)",
    "do_predict": "read by training scripts, not by the Trainer (as in transformers)",
    "activation_checkpointing_kwargs": "activations are recomputed with torch's non-reentrant checkpoint; these kwargs "
                                       "(use_reentrant, ...) choose among implementations of the same recomputation",
    "dataloader_pin_memory": "a host-to-device copy speed setting; the values trained on are the same",
    "ddp_find_unused_parameters": "data parallelism runs on FSDP2 / replicated DTensors, not torch's "
                                  "DistributedDataParallel: there is no unused-parameter search to configure",
    "ddp_bucket_cap_mb": "data parallelism runs on FSDP2 / replicated DTensors, not torch's DistributedDataParallel: "
                         "gradients are reduced per parallelized unit, not in buckets",
    "ddp_broadcast_buffers": "data parallelism runs on FSDP2 / replicated DTensors, not torch's "
                             "DistributedDataParallel: every rank makes the same buffers",
    "ddp_static_graph": "data parallelism runs on FSDP2 / replicated DTensors, not torch's DistributedDataParallel",
    "eval_use_gather_object": "evaluation gathers every rank's outputs with all_gather_object already (any "
                              "picklable object, tensors included)",
    "eval_accumulation_steps": "evaluation moves each batch's predictions to the host as soon as they are made (what "
                               "eval_accumulation_steps=1 does); the metrics are the same for any value",
}

# field -> what to do instead; refused when the value is neither the class's default nor in ALSO_ACCEPTED
REFUSED = {
    "label_names": "the objectives read their own columns (labels; chosen / rejected; prompts); unset it",
    "debug": "tpu_metrics_debug reports TPU metrics, and hfnative runs on CPUs and GPUs; keep underflow_overflow only",
}

# the TRL configs' own fields (beyond TrainingArguments') that hfnative's code does not read: why each changes nothing
CONFIG_NO_EFFECT = {
    "ds3_gather_for_generation": "a DeepSpeed ZeRO-3 switch; hfnative runs no DeepSpeed (generation gathers a "
                                 "sharded policy's weights in every layout)",
    "log_multimodal": "logs the images of multimodal rows; hfnative's RL trainers take text and chat prompts only",
    "cast_lm_head_to_fp32": "the chunked head computes the log-probs in float32 already, whatever the weights' dtype",
    "cache_implementation": "selects transformers' generate() KV cache kind; the native engine keeps its own cache, "
                            "and every kind holds the same values",
    "fork_threshold_tokens": "splits TRL's re-tokenized multi-turn conversations into rows; hfnative's tool-calling "
                             "rollouts append each turn's tokens to the row, so a row is one sequence however many "
                             "turns it has",
    "sft_model_path": "read by TRL's PPO example script (the policy it loads), not by its trainer; hfnative-train ppo "
                      "loads --model_name_or_path",
    "num_sample_generations": "TRL's PPO prints a table of completions of its eval set that often; hfnative's PPO "
                              "runs no evaluation and prints none",
    "weight_sync_timeout": "bounds a weight transfer to a vLLM server over HTTP; hfnative's generators get weights "
                           "through Ray, and a generator that stops answering is caught by heartbeat_stale_after_s",
}

# the TRL configs' own fields refused when set away from the config's default
CONFIG_REFUSED = {}

# values besides the class's default that a refused field may hold (what __post_init__ turns the default into,
# or the values hfnative implements)
ALSO_ACCEPTED = {
    "debug": ([], [DebugOption.UNDERFLOW_OVERFLOW]),
    "label_names": (["labels"],),
}


# accelerate's options in accelerator_config that would change what trains (the values accepted, what to do instead);
# the others change nothing here: non_blocking (a host-to-device copy flag), use_configured_state, and
# gradient_accumulation_kwargs' sync_each_batch, sync_with_dataloader and
# adjust_scheduler (transformers accumulates gradients and steps its scheduler itself, as hfnative does); num_steps is
# applied (``apply_accelerator_config``)
ACCELERATOR_CONFIG_REFUSED = {
    "dispatch_batches": ((None, False), "each rank reads its own rows here, which dispatch_batches=True would only "
                                        "change in how a short last step is spread; leave it unset or False"),
    "split_batches": (False, "each rank trains on per_device_train_batch_size rows here: set it to the batch size "
                             "divided by the number of processes and leave split_batches False"),
    "even_batches": (True, "a last step shorter than the ranks is filled from the start of the data, as accelerate's "
                           "default does; leave even_batches True"),
    "use_seedable_sampler": (True, "the rows are shuffled from the data seed epoch by epoch (accelerate's seedable "
                                   "sampler, its default); leave use_seedable_sampler True"),
}
GRADIENT_ACCUMULATION_KWARGS = ("num_steps", "sync_each_batch", "sync_with_dataloader", "adjust_scheduler")


def accelerator_config_refusals(args) -> list[str]:
    """``accelerator_config.<option>=value: what to do`` for each option hfnative does not follow."""
    config = getattr(args, "accelerator_config", None)
    if config is None:
        return []
    found = [f"accelerator_config.{name}={getattr(config, name)!r}: {what_to_do}"
             for name, (accepted, what_to_do) in ACCELERATOR_CONFIG_REFUSED.items()
             if getattr(config, name) not in (accepted if isinstance(accepted, tuple) else (accepted,))]
    unknown = sorted(set(config.gradient_accumulation_kwargs or {}) - set(GRADIENT_ACCUMULATION_KWARGS))
    if unknown:
        found.append(f"accelerator_config.gradient_accumulation_kwargs {unknown}: accelerate's GradientAccumulationPlugin "
                     f"takes {list(GRADIENT_ACCUMULATION_KWARGS)}")
    return found


def apply_accelerator_config(args) -> None:
    """``gradient_accumulation_kwargs={"num_steps": N}`` as transformers' Trainer reads it: the accumulation steps
    when ``gradient_accumulation_steps`` is 1, an error when both are set."""
    num_steps = ((getattr(args, "accelerator_config", None) and args.accelerator_config.gradient_accumulation_kwargs)
                 or {}).get("num_steps")
    if num_steps is None:
        return
    if hasattr(args, "steps_per_generation"):
        raise ValueError(f"accelerator_config.gradient_accumulation_kwargs num_steps={num_steps} with "
                         f"{type(args).__name__}: its generation batch is sized from gradient_accumulation_steps when "
                         "the config is made, before num_steps would set it; set gradient_accumulation_steps instead")
    if args.gradient_accumulation_steps > 1:
        raise ValueError(
            "The `AcceleratorConfig`'s `num_steps` is set but `gradient_accumulation_steps` is greater than 1 in the "
            "passed `TrainingArguments`. If using the passed `AcceleratorConfig` is desired, do not set the "
            "`TrainingArguments` `gradient_accumulation_steps`.")
    args.gradient_accumulation_steps = int(num_steps)


def field_default(config_class, name: str):
    """The dataclass default of ``config_class``'s field ``name``."""
    field = next(f for f in dataclasses.fields(config_class) if f.name == name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def refused_settings(args) -> list[str]:
    """``name=value: what to do`` for every REFUSED field of ``args`` set away from its default (transformers', or the
    config class's own where a TRL config changes it)."""
    names = {f.name for f in dataclasses.fields(args)}
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    found = []
    for name, what_to_do in {**REFUSED, **CONFIG_REFUSED}.items():
        if name not in names:
            continue
        value = getattr(args, name)
        defaults = (field_default(type(args), name), *ALSO_ACCEPTED.get(name, ()))
        if name in base:
            defaults += (field_default(transformers.TrainingArguments, name),)
        if any(value == accepted for accepted in defaults):
            continue
        found.append(f"{name}={value!r}: {what_to_do}")
    nodes = _nodes()
    if args.save_on_each_node and nodes > 1:  # on one node it is the default's behaviour
        found.append(f"save_on_each_node=True: this run spans {nodes} nodes, and rank 0 writes the checkpoints of every "
                     "node (a filesystem all nodes see); leave it False")
    if getattr(args, "vllm_structured_outputs_regex", None) is not None and not getattr(args, "use_vllm", False):
        found.append(f"vllm_structured_outputs_regex={args.vllm_structured_outputs_regex!r}: completions constrained to "
                     "a regex are decoded by vLLM only (GRPO and RLOO with use_vllm=True; TRL drops the regex "
                     "without vLLM); generate with vLLM, or unset it")
    return found + accelerator_config_refusals(args)


def _nodes() -> int:
    """The nodes the run spans, from torchrun's environment (1 for a single process)."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if not world or not local or int(local) < 1:
        return 1
    return max(1, int(world) // int(local))


def seed_everything(args) -> None:
    """``seed`` as transformers' Trainer sets it: with ``full_determinism``, deterministic algorithms too."""
    (enable_full_determinism if args.full_determinism else set_seed)(args.seed)


def set_log_level(args, rank: int, local_rank: int) -> None:
    """transformers' log verbosity from ``log_level`` on the main process (of each node with ``log_on_each_node``)
    and ``log_level_replica`` on the others; "passive" leaves it as it is."""
    main = (local_rank if args.log_on_each_node else rank) == 0
    level = args.log_level if main else args.log_level_replica
    if level != "passive":
        transformers.utils.logging.set_verbosity(transformers.utils.logging.get_log_levels_dict()[level])
        logging.getLogger("hfnative").setLevel(transformers.utils.logging.get_log_levels_dict()[level])


def check_settings(args) -> None:
    """Raise ValueError naming every setting of ``args`` hfnative would otherwise ignore."""
    found = refused_settings(args)
    if found:
        raise ValueError("hfnative does not implement these settings (set away from their defaults): "
                         + "; ".join(found))


__all__ = [
    "ACCELERATOR_CONFIG_REFUSED",
    "ALSO_ACCEPTED",
    "CONFIG_NO_EFFECT",
    "CONFIG_REFUSED",
    "HONOURED_BY_TRANSFORMERS",
    "NO_EFFECT",
    "REFUSED",
    "apply_accelerator_config",
    "check_settings",
    "refused_settings",
    "seed_everything",
    "set_log_level",
]
