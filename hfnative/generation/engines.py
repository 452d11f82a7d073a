"""``make_rollout_engine``: the rollout backend a trainer's config asks for, under TRL's argument names.

Native KV-cache engine unless ``use_vllm``; then ``vllm_mode`` "colocate" (vllm.LLM in this process) or
"server" (a running ``vllm serve``). vLLM is imported only when it is asked for.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .rollouts import RolloutEngine

VLLM_MODES = ("colocate", "server")


def _field(args, name: str, default):
    value = getattr(args, name, default)
    return default if value is None else value


def vllm_model_folder(model) -> str:
    """A Hub-format folder (or Hub id) vLLM can load ``model`` from: a path or id as given; the folder a
    model was loaded from (``name_or_path`` / ``source_dir``) when it still exists; else the model is
    exported to a new temporary folder. ``make_rollout_engine`` then loads the model's live weights."""
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    carried = getattr(model, "_hub_converted", None)  # a trainer's model carries its ConvertedModel
    for candidate in (getattr(model, "name_or_path", None), getattr(carried, "source_dir", None),
                      getattr(model, "source_dir", None)):
        if candidate and (Path(candidate) / "config.json").is_file():
            return str(candidate)
    from hfnative.converters.export import export_hf

    from .vllm_backend import converted_model, merged_native_state

    converted = converted_model(model)
    folder = tempfile.mkdtemp(prefix="hfnative-vllm-model-")
    export_hf(converted, folder, native_state=merged_native_state(converted.model))
    return folder


def vllm_dtype(model) -> str:
    """The dtype vLLM should run ``model`` in: its parameters' (a model object) or its config's (a folder);
    "auto" otherwise. (vLLM's own "auto" runs a float32 checkpoint in bfloat16 on CPU.)"""
    if isinstance(model, (str, os.PathLike)):
        config_path = Path(model) / "config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            dtype = config.get("dtype") or config.get("torch_dtype")
            return dtype if isinstance(dtype, str) else "auto"
        return "auto"
    module = model.model if hasattr(model, "family") else model  # a ConvertedModel holds the module
    parameters = module.parameters() if hasattr(module, "parameters") else ()
    parameter = next((p for p in parameters if p.is_floating_point()), None)
    return str(parameter.dtype).removeprefix("torch.") if parameter is not None else "auto"


def make_rollout_engine(model, args, **engine_kwargs) -> RolloutEngine:
    """The rollout engine ``args`` selects (any object with TRL's field names, e.g. a GRPOConfig).

    use_vllm False (default): ``NativeRolloutEngine(model, **engine_kwargs)`` on the model's live weights.
    use_vllm True: vllm_mode "colocate" -> ``VLLMColocateEngine`` (vllm_tensor_parallel_size,
    vllm_gpu_memory_utilization, vllm_max_model_length, vllm_enable_sleep_mode, vllm_model_impl; the
    model's dtype unless hfnative's vllm_dtype is set; engine_kwargs go on to ``vllm.LLM``);
    "server" -> ``VLLMServerEngine`` (vllm_server_base_url, else vllm_server_host and vllm_server_port;
    vllm_server_timeout, vllm_group_port, and hfnative's vllm_weight_transport / vllm_weights_dir).
    """
    if not _field(args, "use_vllm", False):
        from .api import native_model
        from .native import NativeRolloutEngine

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
    from .vllm_backend import VLLMColocateEngine, VLLMServerEngine

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
        **engine_kwargs,
    )
    if not isinstance(model, (str, os.PathLike)):  # the live weights (adapters merged), not the folder's
        from .vllm_backend import hub_named_tensors

        engine.load_weights(hub_named_tensors(model))
    return engine
