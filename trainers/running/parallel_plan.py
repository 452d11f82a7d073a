"""One distributed layout from every way a user asks for one: ``resolve_parallel_plan(args, world_size)``.

Sources, read through the objects transformers and accelerate build from them (nothing is parsed again here),
in transformers' precedence:

- ``TrainingArguments.parallelism_config`` (accelerate's ``ParallelismConfig``), else one built from the
  ``PARALLELISM_CONFIG_*`` environment that ``accelerate launch --parallelism_config_*`` (or a config file's
  ``parallelism_config``) exports: the mesh sizes.
- ``TrainingArguments.fsdp`` / ``fsdp_config`` (as its ``__post_init__`` left them in ``fsdp_plugin_args``),
  else the ``FSDP_*`` environment of an ``accelerate launch`` FSDP config; both through accelerate's
  ``FullyShardedDataParallelPlugin``, as transformers' Trainer builds it.
- A DeepSpeed ZeRO config: ``TrainingArguments.deepspeed`` (read here, DeepSpeed never imported:
  ``deepspeed_config.py``), else ``accelerate launch`` with a DeepSpeed config (accelerate's ``DeepSpeedPlugin`` from
  the environment; needs deepspeed installed, as accelerate's launcher does); run as its FSDP2 equivalent.
- Nothing of the above on several processes: data parallel with replicated weights, as transformers' Trainer
  runs DDP under torchrun.

Plus the settings that travel with them: mixed precision (``args.mixed_precision``: accelerate's
``ACCELERATE_MIXED_PRECISION`` unless bf16 / fp16 say otherwise), CPU offload, FSDP's activation
checkpointing, and accelerate's dynamo (compile) config. A setting hfnative cannot honour raises ValueError
naming it and what to do instead; nothing is dropped silently.

Mapping (world = number of processes, local = processes per node, ``LOCAL_WORLD_SIZE``):

    full_shard, FSDP2 reshard_after_forward=True, ZeRO-3    dp_shard=world, resharded after forward
    shard_grad_op, reshard_after_forward=False, ZeRO-1/2    dp_shard=world, kept gathered until backward
    hybrid_shard / hybrid_shard_zero2 (FSDP1)               dp_replicate=world/local, dp_shard=local
    no_shard (FSDP1), ZeRO-0, DDP, nothing set              dp_replicate=world (replicated weights)
    parallelism_config                                      its dp_replicate / dp_shard / tp / cp sizes, and
                                                            hfnative's own ep_size (experts split over ep of
                                                            the dp_shard ranks) and pp_size (pipeline stages,
                                                            run by the schedule pp_schedule)
    offload, FSDP offload_params, ZeRO offload to cpu       cpu_offload
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from hfnative.parallel.dims import ParallelDims

logger = logging.getLogger(__name__)

PP_SCHEDULES = ("1f1b", "gpipe")  # parallelism_config's pp_schedule (hfnative.parallel.pipeline.SCHEDULES)

# accelerate's FSDP1 sharding strategies (torch's ShardingStrategy names) -> (hybrid, reshard_after_forward);
# NO_SHARD is plain replication
_FSDP1_STRATEGIES = {
    "FULL_SHARD": (False, True),
    "SHARD_GRAD_OP": (False, False),
    "HYBRID_SHARD": (True, True),
    "_HYBRID_SHARD_ZERO2": (True, False),
}


_DEFAULT_SOURCE = "the default (no fsdp, DeepSpeed or parallelism_config set)"


@dataclass(frozen=True)
class ParallelPlan:
    """The run's layout and the sharding options that go with it (``parallelize``'s arguments).

    dims: the mesh sizes (dp_replicate x dp_shard x tp = world size).
    reshard_after_forward: FSDP2 frees a block's gathered parameters after its forward (False: kept until
        backward, as shard_grad_op / ZeRO-2).
    cpu_offload: FSDP2 keeps parameters, gradients and the optimizer step on the CPU
        (``fully_shard(offload_policy=CPUOffloadPolicy(pin_memory=<on GPU>))``).
    mixed_precision: "bf16", "fp16" or None (parameters computed in their own dtype); accelerate's "fp8" is "bf16"
        here, its float8 layers made by ``parallelize`` (trainers/running/float8_plan.py).
    activation_checkpointing: asked for by the FSDP config (``fsdp_config`` / accelerate's
        ``fsdp_activation_checkpointing``), on top of the training arguments' own switch.
    compile: how the blocks are compiled (``compile_settings``: ``torch_compile`` and its backend and mode, or
        accelerate's dynamo config), None: not compiled.
    source: where the layout came from, in words.
    pp_schedule: the pipeline schedule with pp > 1 ("1f1b" or "gpipe", ``parallelism_config``'s pp_schedule).
    """

    dims: ParallelDims
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    mixed_precision: str | None = None
    activation_checkpointing: bool = False
    compile: object = None  # hfnative.parallel.CompileSettings
    source: str = _DEFAULT_SOURCE
    pp_schedule: str = "1f1b"

    def describe(self) -> str:
        """One line: the layout, its options and where it came from."""
        d = self.dims
        if d.world_size == 1:
            layout = "one process"
        elif d.hsdp_enabled:
            layout = f"HSDP: {d.dp_replicate} replicas x {d.dp_shard}-way FSDP2 sharding"
        elif d.fsdp_enabled:
            layout = f"FSDP2 sharding over {d.dp_shard} ranks"
        elif d.dp_replicate_enabled:
            layout = f"data parallel over {d.dp_replicate} ranks (replicated weights)"
        else:
            layout = "no data parallelism"
        parts = [layout]
        if d.tp_enabled:
            parts.append(f"{d.tp}-way tensor parallel")
        if d.cp_enabled:
            parts.append(f"{d.cp}-way context parallel (ring attention)")
        if d.ep_enabled:
            parts.append(f"{d.ep}-way expert parallel")
        if d.pp_enabled:
            parts.append(f"{d.pp}-stage pipeline parallel ({self.pp_schedule})")
        if d.fsdp_enabled:
            parts.append("resharded after forward" if self.reshard_after_forward else "kept gathered until backward")
        if self.cpu_offload:
            parts.append("CPU offload")
        parts.append(f"mixed precision {self.mixed_precision}" if self.mixed_precision else "no mixed precision")
        if self.activation_checkpointing:
            parts.append("activation checkpointing (FSDP config)")
        if self.compile:
            mode = f", mode {self.compile.mode}" if self.compile.mode not in (None, "default") else ""
            parts.append(f"compiled ({self.compile.backend}{mode})")
        processes = f"{d.world_size} process{'es' if d.world_size > 1 else ''}"
        return f"{', '.join(parts)} [{processes}; from {self.source}]"


def resolve_parallel_plan(args, world_size: int) -> ParallelPlan:
    """The layout for ``world_size`` processes from ``args`` (transformers' TrainingArguments, as its
    ``__post_init__`` left them) and the environment ``accelerate launch`` exported. Raises ValueError for
    a setting hfnative cannot honour, naming it."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected a positive integer (the number of processes)")
    _refuse_unsupported_launch()
    fsdp = _fsdp_plugin(args)
    sizes = _parallelism_config(args, world_size)
    deepspeed = _deepspeed_plugin(args, world_size if sizes is None else sizes[0] * sizes[1])
    if fsdp is not None and deepspeed is not None:
        raise ValueError(
            "both FSDP (fsdp / an accelerate FSDP config) and DeepSpeed (deepspeed / an accelerate DeepSpeed config) "
            "are set; choose one"
        )
    if fsdp is not None:
        layout = _fsdp_layout(*fsdp, world_size)
    elif deepspeed is not None:
        layout = _deepspeed_layout(deepspeed, world_size)
    else:
        layout = _Layout(_DEFAULT_SOURCE, world_size, 1)
    if sizes is not None:
        layout.replicate, layout.shard, layout.tp, layout.cp, layout.ep, layout.pp = sizes
        layout.source = "parallelism_config" + ("" if layout.source == _DEFAULT_SOURCE else f" with {layout.source}")
    try:
        dims = ParallelDims(dp_replicate=layout.replicate, dp_shard=layout.shard, tp=layout.tp, world_size=world_size,
                            cp=layout.cp, ep=layout.ep, pp=layout.pp)
    except ValueError as err:
        raise ValueError(f"{layout.source}: {err}") from err
    if world_size == 1 and (fsdp is not None or deepspeed is not None):
        _say(f"{layout.source} on one process: there is nothing to shard, so this is a single-process run")
    return ParallelPlan(
        dims=dims,
        reshard_after_forward=layout.reshard_after_forward,
        cpu_offload=layout.cpu_offload,
        mixed_precision=_mixed_precision(args),
        activation_checkpointing=layout.activation_checkpointing,
        compile=compile_settings(args),
        source=layout.source,
        pp_schedule=_pp_schedule(args),
    )


def parallelism_config_from(value):
    """A ParallelismConfig from a JSON object (a command-line value) or a mapping (a YAML config's value).
    ``ep_size`` (expert parallel), ``pp_size`` and ``pp_schedule`` (pipeline parallel), hfnative's own, are kept as
    attributes of the config."""
    from accelerate import ParallelismConfig

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"not a JSON object ({err.msg}), e.g. '{{\"dp_shard_size\": 2, \"tp_size\": 2}}'") from err
    if not isinstance(value, Mapping):
        raise ValueError("expected a JSON object of sizes, e.g. '{\"dp_shard_size\": 2, \"tp_size\": 2}'")
    value = dict(value)
    ep_size = value.pop("ep_size", 1)
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"ep_size={ep_size!r}: expected a positive integer (the ranks each MoE layer's experts are "
                         "split over)")
    pp_size = value.pop("pp_size", 1)
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ValueError(f"pp_size={pp_size!r}: expected a positive integer (the pipeline stages the model's blocks "
                         "are split into)")
    pp_schedule = value.pop("pp_schedule", "1f1b")
    if pp_schedule not in PP_SCHEDULES:
        raise ValueError(f"pp_schedule={pp_schedule!r}: expected one of {list(PP_SCHEDULES)} (the pipeline schedule "
                         "with pp_size > 1)")
    config = ParallelismConfig(**value)
    config.ep_size, config.pp_size, config.pp_schedule = ep_size, pp_size, pp_schedule
    return config


# --- the pieces --------------------------------------------------------------------------------------


@dataclass
class _Layout:
    source: str
    replicate: int
    shard: int
    tp: int = 1
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    cp: int = 1
    ep: int = 1
    pp: int = 1


def _say(message: str) -> None:
    """A warning logged once per run (by rank 0, the launcher's RANK before the process group starts), not once per
    process."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        logger.warning(message)


def _refuse_unsupported_launch() -> None:
    from accelerate.utils import parse_flag_from_env

    if parse_flag_from_env("ACCELERATE_USE_MEGATRON_LM"):
        raise ValueError(
            "accelerate launch with a Megatron-LM config is not supported by hfnative: use an FSDP2 config "
            "(--accelerate_config fsdp2) and parallelism_config's tp_size for tensor parallelism"
        )


def _fsdp_plugin(args):
    """(accelerate's FullyShardedDataParallelPlugin, where it came from): built as transformers' Trainer builds it
    (from ``args.fsdp_plugin_args``, the environment filling what they leave unset), or from the environment of an
    ``accelerate launch`` FSDP config; None when FSDP is off."""
    from accelerate.utils import FullyShardedDataParallelPlugin, parse_flag_from_env, patch_environment

    if getattr(args, "fsdp", None):
        plugin_args = getattr(args, "fsdp_plugin_args", None)
        if plugin_args is None:  # transformers leaves none for its XLA (TPU) FSDP
            raise ValueError("fsdp_config={'xla': True} (XLA FSDP, for TPUs) is not supported by hfnative; drop xla")
        kwargs, source = dict(plugin_args), "fsdp / fsdp_config"
    elif parse_flag_from_env("ACCELERATE_USE_FSDP"):
        kwargs, source = {}, "accelerate's FSDP config"
    else:
        return None
    if kwargs.get("fsdp_version") == 1:
        # accelerate's rank-0 broadcast of the loaded weights (FSDP1's sync_module_states) looks up an accelerator
        # device, and fails on CPU; hfnative loads each rank's slice itself, so the plugin is read without it
        kwargs.update(sync_module_states=False, cpu_ram_efficient_loading=False)
    # the same for the environment's values; and the plugin writes FSDP_CPU_RAM_EFFICIENT_LOADING, put back after
    with patch_environment(FSDP_SYNC_MODULE_STATES="false", FSDP_CPU_RAM_EFFICIENT_LOADING="false"):
        try:
            plugin = FullyShardedDataParallelPlugin(**kwargs)
        except (ValueError, KeyError) as err:
            raise ValueError(f"{source}: {err}") from err
    return plugin, source


def _fsdp_layout(plugin, source: str, world_size: int) -> _Layout:
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, ShardingStrategy

    if plugin.ignored_modules is not None:
        raise ValueError(f"{source}: ignored_modules={plugin.ignored_modules!r} is not supported by hfnative "
                         "(every module is sharded); remove it")
    if plugin.activation_checkpointing_offload:
        raise ValueError(f"{source}: activation_checkpointing_offload is not supported by hfnative; use "
                         "activation_checkpointing, and SFTConfig's activation_offloading to keep activations on the CPU")
    if plugin.fsdp_version == 1:
        # transformers hands FSDP1's strategy over as reshard_after_forward; accelerate's launcher as
        # sharding_strategy (its --fsdp_sharding_strategy, which accelerate's FSDP1 itself applies)
        chosen = plugin.reshard_after_forward
        strategy = chosen if isinstance(chosen, ShardingStrategy) else plugin.sharding_strategy
        name = strategy.name.lower().lstrip("_")
        _say(f"{source}: FSDP1 ({name}) runs as FSDP2 with the same sharding")
        if strategy == ShardingStrategy.NO_SHARD:
            layout = _Layout(f"{source} (FSDP1 no_shard)", world_size, 1)
        else:
            hybrid, reshard = _FSDP1_STRATEGIES[strategy.name]
            if hybrid:
                layout = _hybrid_layout(source, world_size, name)
            else:
                layout = _Layout(f"{source} (FSDP1 {name})", 1, world_size)
            layout.reshard_after_forward = reshard
    else:
        layout = _Layout(f"{source} (FSDP2)", 1, world_size, reshard_after_forward=plugin.reshard_after_forward)
    layout.cpu_offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy) or (
        isinstance(plugin.cpu_offload, CPUOffload) and plugin.cpu_offload.offload_params)
    layout.activation_checkpointing = bool(plugin.activation_checkpointing)
    return layout


def _hybrid_layout(source: str, world_size: int, strategy: str) -> _Layout:
    """FSDP1's hybrid sharding: shard within a node, replicate across nodes."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if world_size > 1 and local is None:
        raise ValueError(f"{source}: {strategy} shards within a node, and LOCAL_WORLD_SIZE (the processes per node, "
                         "set by torchrun and accelerate launch) is not set; launch with torchrun or accelerate launch")
    local = int(local or 1)
    if world_size % local:
        raise ValueError(f"{source}: {strategy} needs the world size ({world_size}) to be a multiple of the processes "
                         f"per node (LOCAL_WORLD_SIZE={local}); launch the same number of processes on every node")
    return _Layout(f"{source} (FSDP1 {strategy})", world_size // local, local)


def _deepspeed_plugin(args, data_parallel_size: int):
    """``args.deepspeed`` read for ``data_parallel_size`` data-parallel ranks (``deepspeed_config.py``), else
    transformers' DeepSpeedPlugin or the one accelerate builds from its DeepSpeed environment; None when DeepSpeed is
    off."""
    from accelerate.utils import DeepSpeedPlugin, is_deepspeed_available, parse_flag_from_env

    if getattr(args, "deepspeed", None):
        from .deepspeed_config import deepspeed_config

        return deepspeed_config(args, data_parallel_size)
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None and not parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return None
    if not is_deepspeed_available():
        raise ValueError(
            "this run is configured for DeepSpeed (accelerate launch with a zero1/zero2/zero3 config) "
            "and deepspeed is not installed: pip install deepspeed (hfnative then runs the ZeRO stage as its FSDP2 "
            "equivalent), or use the FSDP2 config instead (--accelerate_config fsdp2)"
        )
    return plugin if plugin is not None else DeepSpeedPlugin()


def _deepspeed_layout(plugin, world_size: int) -> _Layout:
    config = plugin.deepspeed_config
    source = f"DeepSpeed ZeRO-{plugin.zero_stage}"
    for section in ("optimizer", "scheduler"):
        if section in config and section not in getattr(plugin, "sections_read", ()):
            replaced = "optim" if section == "optimizer" else "lr_scheduler_type"
            instead = "optim" if section == "optimizer" else "lr_scheduler_type and warmup_steps"
            raise ValueError(
                f"{source}: the DeepSpeed config's {section!r} section is not supported by hfnative (it would replace "
                f"the training arguments' {replaced}); remove it and set {instead} instead"
            )
    devices = {"offload_param_device": plugin.offload_param_device,
               "offload_optimizer_device": plugin.offload_optimizer_device}
    for name, device in devices.items():
        if device not in (None, "none", "cpu"):
            raise ValueError(f"{source}: {name}={device!r} is not supported by hfnative (only CPU offload); use "
                             "'cpu' or 'none'")
    stage = plugin.zero_stage
    if stage == 0:
        layout = _Layout(f"{source} (data parallel)", world_size, 1)
    elif stage in (1, 2, 3):
        layout = _Layout(f"{source} (as FSDP2)", 1, world_size, reshard_after_forward=stage == 3)
    else:
        raise ValueError(f"DeepSpeed zero_stage={stage!r}: expected 0, 1, 2 or 3")
    layout.cpu_offload = "cpu" in devices.values()
    if stage:
        sharding = "fully sharded" if stage == 3 else "sharded, parameters kept gathered until backward"
        _say(f"{source} runs as FSDP2: {sharding}{', CPU offload' if layout.cpu_offload else ''}")
    return layout


def _parallelism_config_of(args):
    """``args.parallelism_config`` as a ParallelismConfig (None when unset)."""
    config = getattr(args, "parallelism_config", None)
    return parallelism_config_from(config) if isinstance(config, (str, Mapping)) else config


def _pp_schedule(args) -> str:
    config = _parallelism_config_of(args)
    return getattr(config, "pp_schedule", "1f1b") if config is not None else "1f1b"


def _parallelism_config(args, world_size: int) -> tuple[int, int, int, int, int, int] | None:
    """(dp_replicate, dp_shard, tp, cp, ep, pp) from ``args.parallelism_config``, else from accelerate's
    ``PARALLELISM_CONFIG_*`` environment; None when neither asks for more than one rank."""
    from accelerate import ParallelismConfig
    from accelerate.utils import parse_flag_from_env

    config = _parallelism_config_of(args)
    if config is None and parse_flag_from_env("ACCELERATE_USE_PARALLELISM_CONFIG"):
        config = ParallelismConfig()  # reads PARALLELISM_CONFIG_* itself
    if config is None:
        return None
    if getattr(config, "sp_size", 1) > 1:
        raise ValueError(
            f"parallelism_config sp_size={config.sp_size}: DeepSpeed-Ulysses sequence parallelism is not available in "
            "hfnative; use cp_size (ring attention) to split sequences, and set sp_size=1"
        )
    ep_size, pp_size = getattr(config, "ep_size", 1), getattr(config, "pp_size", 1)
    if config.total_size == 1 and ep_size == 1 and pp_size == 1:  # accelerate then falls back to plain data
        return None  # parallelism; so does ours
    sizes = config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size, pp_size
    total = config.total_size * pp_size
    if total != world_size:
        names = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "pp_size")
        named = " x ".join(f"{name}={size}" for name, size in zip(names, sizes)
                           if name not in ("cp_size", "pp_size") or size > 1)
        others = config.dp_replicate_size * config.tp_size * config.cp_size * pp_size
        hint = f" (e.g. dp_shard_size={world_size // others})" if world_size % others == 0 else ""
        raise ValueError(f"parallelism_config: {named} = {total}, but {world_size} processes were launched; "
                         f"the sizes must multiply to the number of processes{hint}")
    if ep_size > 1 and config.dp_shard_size % ep_size:
        raise ValueError(f"parallelism_config ep_size={ep_size} must divide dp_shard_size={config.dp_shard_size}: the "
                         "experts are split over ep of the FSDP (dp_shard) ranks")
    return (*sizes[:4], ep_size, pp_size)


def _mixed_precision(args) -> str | None:
    from accelerate.utils import PrecisionType, parse_choice_from_env

    # transformers' resolution: accelerate's choice, replaced by bf16 / fp16 when they are set
    choice = getattr(args, "mixed_precision", None) or parse_choice_from_env("ACCELERATE_MIXED_PRECISION", "no")
    choice = str(choice).lower()
    if choice not in PrecisionType.list():
        raise ValueError(f"mixed precision {choice!r} (ACCELERATE_MIXED_PRECISION / accelerate launch "
                         f"--mixed_precision): expected one of {PrecisionType.list()}")
    if choice == "fp8":  # float8 linear layers (trainers/running/float8_plan.py), the rest in bf16 as accelerate runs it
        return "bf16"
    return None if choice == "no" else choice


def compile_settings(args):
    """How the blocks are compiled (``hfnative.parallel.CompileSettings``), or None: as transformers' Trainer asks
    torch.compile, from ``torch_compile`` with ``torch_compile_backend`` / ``torch_compile_mode`` (which set it), else
    from accelerate's dynamo config (``ACCELERATE_DYNAMO_BACKEND`` / ``_MODE``, what ``accelerate launch
    --dynamo_backend`` exports)."""
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    from hfnative.parallel import CompileSettings

    if getattr(args, "torch_compile", False):
        return CompileSettings(backend=getattr(args, "torch_compile_backend", None) or "inductor",
                               mode=getattr(args, "torch_compile_mode", None))
    dynamo = TorchDynamoPlugin()  # ACCELERATE_DYNAMO_* only: the training arguments' own switch is torch_compile
    if dynamo.backend == DynamoBackend.NO:
        return None
    # (its dynamic switch is always exported, "False" by default, so it says nothing; hfnative's graphs are dynamic,
    # static under tensor parallel)
    if dynamo.fullgraph or dynamo.use_regional_compilation:
        _say("accelerate's dynamo config: hfnative compiles each decoder block with dynamic shapes (static under "
             "tensor parallel); fullgraph and regional compilation do not apply")
    try:
        return CompileSettings(backend=dynamo.backend.value.lower(), mode=dynamo.mode)
    except ValueError as err:
        raise ValueError(f"accelerate's dynamo config (--dynamo_backend {dynamo.backend.value}, --dynamo_mode "
                         f"{dynamo.mode}): {err}") from err


__all__ = ["ParallelPlan", "compile_settings", "parallelism_config_from", "resolve_parallel_plan"]
