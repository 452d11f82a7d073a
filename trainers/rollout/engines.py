"""The rollout engine a trainer's config asks for, under TRL's argument names: ``make_rollout_engine`` builds
it here, ``ConfiguredEngine`` builds it later where it runs (in a Ray generator actor).

Native KV-cache engine unless ``use_vllm``; then ``vllm_mode`` "colocate" (vllm.LLM in this process) or
"server" (a running ``vllm serve``). vLLM is imported only when it is asked for.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from hfnative.converters.fallback import TransformersCausalLM
from hfnative.converters.fallback_generation import TransformersRolloutEngine
from hfnative.converters.rollouts import hub_named_tensors, native_model, vllm_dtype, vllm_model_folder
from hfnative.generation import NativeRolloutEngine, RolloutEngine

VLLM_MODES = ("colocate", "server")


def _field(args, name: str, default):
    value = getattr(args, name, default)
    return default if value is None else value


def make_rollout_engine(model, args, **engine_kwargs) -> RolloutEngine:
    """The rollout engine ``args`` selects (any object with TRL's field names, e.g. a GRPOConfig) for ``model``
    (a trainer's model, a ConvertedModel, a checkpoint folder or Hub id).

    use_vllm False (default): ``NativeRolloutEngine(model, **engine_kwargs)`` on the model's live weights, its decode
    step compiled (a CUDA graph on CUDA) when ``torch_compile`` is set
    (``TransformersRolloutEngine``, transformers' generate, for a model without a native implementation).
    use_vllm True: vllm_mode "colocate" -> ``VLLMColocateEngine`` (vllm_tensor_parallel_size,
    vllm_gpu_memory_utilization, vllm_max_model_length, vllm_enable_sleep_mode, vllm_model_impl; the
    model's dtype unless hfnative's vllm_dtype is set; engine_kwargs go on to ``vllm.LLM``), started from the
    model's folder and then given its live weights; "server" -> ``VLLMServerEngine`` (vllm_server_base_url,
    else vllm_server_host and vllm_server_port; vllm_server_timeout, vllm_group_port, and hfnative's
    vllm_weight_transport / vllm_weights_dir).
    """
    if not _field(args, "use_vllm", False):
        if isinstance(model, TransformersCausalLM):  # no native implementation: transformers' generate
            return TransformersRolloutEngine(model)
        engine_kwargs.setdefault("compile", bool(_field(args, "torch_compile", False)))
        return NativeRolloutEngine(native_model(model), **engine_kwargs)

    mode = _field(args, "vllm_mode", "colocate")
    if mode not in VLLM_MODES:
        raise ValueError(f"vllm_mode={mode!r}: expected 'colocate' or 'server'")
    try:
        from vllm import LLM  # noqa: F401  (a name, not just the package: a folder named vllm on sys.path is no vllm)
    except ImportError as err:
        raise ImportError(
            f"use_vllm=True needs vllm, which is not importable here ({err}). Install it (`pip install vllm`, or "
            "the CPU build as scripts/vllm_env.sh does) or set use_vllm=False for the native engine"
        ) from err
    from hfnative.generation.vllm_backend import VLLMColocateEngine, VLLMServerEngine

    if mode == "server":
        return VLLMServerEngine(
            _field(args, "vllm_server_base_url", None),
            host=_field(args, "vllm_server_host", "0.0.0.0"),
            port=_field(args, "vllm_server_port", 8000),
            timeout=_field(args, "vllm_server_timeout", 240.0),
            group_port=_field(args, "vllm_group_port", 51216),
            weight_transport=_field(args, "vllm_weight_transport", "auto"),
            weights_dir=_field(args, "vllm_weights_dir", None),
            **engine_kwargs,
        )
    engine = VLLMColocateEngine(
        vllm_model_folder(model),
        tensor_parallel_size=_field(args, "vllm_tensor_parallel_size", 1),
        gpu_memory_utilization=_field(args, "vllm_gpu_memory_utilization", 0.3),
        max_model_len=_field(args, "vllm_max_model_length", None),
        enable_sleep_mode=_field(args, "vllm_enable_sleep_mode", False),
        model_impl=_field(args, "vllm_model_impl", "vllm"),
        dtype=_field(args, "vllm_dtype", None) or vllm_dtype(model),
        # a regex is compiled over the tokenizer's vocabulary (vLLM's structured outputs): vLLM loads it then
        skip_tokenizer_init=_field(args, "vllm_structured_outputs_regex", None) is None,
        **engine_kwargs,
    )
    if not isinstance(model, (str, os.PathLike)):  # the live weights (adapters merged), not the folder's
        engine.load_weights(hub_named_tensors(model))
    return engine


class ConfiguredEngine:
    """The rollout engine ``make_rollout_engine`` builds for ``settings`` (TRL's field names: use_vllm, vllm_mode,
    vllm_server_base_url, ...), built when called: a ``RolloutGenerator``'s ``engine_factory``, picklable, so it
    travels to the Ray actor.

    source: what the engine starts from when it is not the actor's copy of the policy, e.g. the Hub-format
    folder a colocated vLLM loads (then the actor holds no native copy: ``RolloutQueue(ship_policy=False)``).
    engine_kwargs go on to the engine (e.g. ``enforce_eager=True`` for ``vllm.LLM``).
    """

    def __init__(self, settings: dict[str, Any], source: Any = None, **engine_kwargs):
        self.settings, self.source, self.engine_kwargs = dict(settings), source, engine_kwargs

    def __call__(self, model) -> RolloutEngine:
        target = self.source if self.source is not None else model
        return make_rollout_engine(target, SimpleNamespace(**self.settings), **self.engine_kwargs)


__all__ = ["ConfiguredEngine", "VLLM_MODES", "make_rollout_engine"]
