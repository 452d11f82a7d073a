"""Training state of a distributed or single-process run, saved with torch.distributed.checkpoint and never pickled.

Every rank calls ``save_training_state`` / ``load_training_state`` together. Model and optimizer state go through
``get_state_dict`` / ``set_state_dict`` (full parameter names, optimizer state keyed by them), so a run saved in one
layout (FSDP2 on 2 ranks) resumes in another (1 plain process, FSDP2 x TP2 on 4 ranks): DCP's planner reads, for
each rank, the pieces of the saved shards its own shards cover.

DCP's default FileSystemWriter pickles its ``.metadata`` and every non-tensor item, and its reader unpickles them,
so neither is used. Tensors go through torch's Hugging Face storage writer with every rank writing its own shards:
safetensors files whose headers carry each piece's offset in the whole tensor, from which the reader rebuilds the
global shapes. Everything else is JSON. The folder (``directory``):

    shard-<rank+1>-model-00001-of-00001.safetensors   one per rank that held a piece nobody else wrote; keys
                                                      ``model.<name>`` and ``optimizer.state.<name>.<field>``
    training_state.json    format and version, the saving world size, optimizer param_groups (hyper-parameters and
                           parameter names), non-tensor optimizer state, LR-scheduler state_dict, ``extra``
    rng_state_<rank>.json  that rank's python / numpy / torch (and cuda) generator states

It is written into a hidden sibling (``.tmp-<name>``) that the first rank renames into place once every rank has
finished, so a crash never leaves a folder that looks complete.
"""

from __future__ import annotations

import base64
import json
import os
import random
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from hfnative.optim.in_backward import OptimizerInBackward
from hfnative.optim.state_optimizers import dequantized
from hfnative.peft.quantize import is_quantized

from .atomic import atomic_directory
from .rng import set_cuda_rng_states

FORMAT = "hfnative-training-state"
VERSION = 1
STATE_FILE = "training_state.json"
RNG_FILE = "rng_state_{rank}.json"
MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer.state."


class TrainingStateError(ValueError):
    """A training-state folder that is missing, incomplete, or does not fit the model and optimizer."""


# ---------------------------------------------------------------- JSON for non-tensor state

def to_json(value: Any, where: str = "state") -> Any:
    """``value`` as plain JSON: tuples and (small) tensors tagged so ``from_json`` rebuilds them exactly.

    Raises TrainingStateError naming the path ``where`` of anything else (it could not be restored without
    pickle)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [to_json(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(item, f"{where}[{index}]") for index, item in enumerate(value)]}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TrainingStateError(
                    f"{where} has the key {key!r} ({type(key).__name__}); only string keys are saved as JSON, "
                    "so give it string keys"
                )
            if key in ("__tuple__", "__tensor__"):  # the tags from_json reads
                raise TrainingStateError(f"{where} has the reserved key {key!r}; rename it")
        return {key: to_json(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        tensor = value.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"__tensor__": {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                               "base64": base64.b64encode(raw).decode("ascii")}}
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    raise TrainingStateError(
        f"{where} is a {type(value).__name__}, which cannot be saved without pickle; keep training state to numbers, "
        "strings, lists, tuples, string-keyed dicts and tensors"
    )


def from_json(value: Any) -> Any:
    """The inverse of ``to_json``."""
    if isinstance(value, list):
        return [from_json(item) for item in value]
    if isinstance(value, dict):
        if value.keys() == {"__tuple__"}:
            return tuple(from_json(item) for item in value["__tuple__"])
        if value.keys() == {"__tensor__"}:
            spec = value["__tensor__"]
            dtype = getattr(torch, spec["dtype"])
            raw = bytearray(base64.b64decode(spec["base64"]))
            if not raw:
                return torch.empty(spec["shape"], dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(spec["shape"]).clone()
        return {key: from_json(item) for key, item in value.items()}
    return value


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TrainingStateError(
            f"{path} is missing: {path.parent} is not a complete training-state folder (saved by "
            "save_training_state); resume from another checkpoint"
        ) from None
    except json.JSONDecodeError as err:
        raise TrainingStateError(f"{path} is not valid JSON ({err}); resume from another checkpoint") from err


# ---------------------------------------------------------------- random generators

def rng_state() -> dict:
    """This process's generator states as JSON-ready values."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": to_json(random.getstate()),
        "numpy": {"kind": kind, "keys": keys.tolist(), "position": int(position), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached_gaussian)},
        "cpu": to_json(torch.random.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [to_json(generator) for generator in torch.cuda.random.get_rng_state_all()]
        state["cuda_device"] = torch.cuda.current_device()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned."""
    random.setstate(from_json(state["python"]))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], np.asarray(numpy_state["keys"], dtype=np.uint32),
                         numpy_state["position"], numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.random.set_rng_state(from_json(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        set_cuda_rng_states([from_json(generator) for generator in state["cuda"]], state.get("cuda_device"))


# ---------------------------------------------------------------- state dicts <-> flat tensors + JSON

def _storage_key(tensor: torch.Tensor) -> tuple:
    """Equal for two state-dict entries that are the same tensor (a tied weight's two names)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    pointer = local.untyped_storage().data_ptr()
    if pointer == 0:  # nothing allocated: empty tensors all point there
        return (id(tensor),)
    return (pointer, local.storage_offset(), tuple(local.shape), tuple(local.stride()))


def _split_state(model_state: dict, optimizer_state: dict) -> tuple[dict, dict]:
    """(flat tensors for DCP, JSON-ready rest). A tensor that is another key's tensor (a tied weight) is kept once,
    under the first name, and the other name recorded in ``aliases``. A quantized frozen base weight (NF4, int8) is
    left out: it never changes, and a resumed run loads it again with the model."""
    tensors, aliases, first_name = {}, {}, {}
    for name, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            raise TrainingStateError(f"the model's state_dict holds {name!r}, a {type(value).__name__}, not a tensor")
        if is_quantized(value.to_local() if isinstance(value, DTensor) else value):
            continue
        key = _storage_key(value)
        if key in first_name:
            aliases[MODEL_PREFIX + name] = first_name[key]
            continue
        first_name[key] = MODEL_PREFIX + name
        tensors[MODEL_PREFIX + name] = value
    non_tensor_state = {}
    for name, fields in optimizer_state["state"].items():
        for field, value in fields.items():
            if isinstance(value, torch.Tensor):
                # a quantized state as the fp32 values it holds: the safetensors writer reads a tensor's storage,
                # and a quantized state's is its wrapper's; the optimizer quantizes them again when it loads them
                tensors[f"{OPTIMIZER_PREFIX}{name}.{field}"] = dequantized(value)
            else:
                non_tensor_state.setdefault(name, {})[field] = to_json(value, f"optimizer state[{name!r}][{field!r}]")
    rest = {
        "model_aliases": aliases,
        "optimizer_param_groups": to_json(optimizer_state["param_groups"], "optimizer param_groups"),
        "optimizer_non_tensor_state": non_tensor_state,
    }
    return tensors, rest


def _check_fits(directory: Path, targets: dict, aliases: dict, saved: dict, model_is_part: bool) -> None:
    """Every tensor the model and optimizer expect is in the folder with its shape, and nothing else is (unless the
    model is one part of it: a pipeline stage); else TrainingStateError naming the differences."""
    on_disk = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    expected = set(targets) | set(aliases)
    present = set(on_disk) | set(saved["model_aliases"])
    missing, unexpected = sorted(expected - present), [] if model_is_part else sorted(present - expected)
    if missing or unexpected:
        raise TrainingStateError(
            f"{directory} does not fit this model and optimizer: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"({len(missing)} missing, {len(unexpected)} unexpected); resume with the model and optimizer the run was "
            "saved with"
        )
    for name, target in targets.items():
        if name in on_disk and tuple(on_disk[name].size) != tuple(target.shape):
            raise TrainingStateError(
                f"{directory}: {name} was saved with shape {tuple(on_disk[name].size)}, the model's is "
                f"{tuple(target.shape)}; resume with the model configuration the run was saved with"
            )


def _optimizers(optimizer: torch.optim.Optimizer):
    """What torch's get_state_dict / set_state_dict take for ``optimizer``: optimizer-in-backward's per-parameter
    optimizers (each parameter's state and hyperparameters under its name), any other optimizer itself."""
    return optimizer.parameter_optimizers() if isinstance(optimizer, OptimizerInBackward) else optimizer


def _restored_param_groups(saved_groups: list, current_groups: list, directory: Path, model_is_part: bool) -> list:
    """The saved hyper-parameters for the current groups, matched by their parameter names (model_is_part: a group
    of a pipeline stage holds some of a saved group's, in the same place)."""
    saved_groups = from_json(saved_groups)
    restored = []
    for index, group in enumerate(current_groups):
        names = set(group["params"])
        if model_is_part:
            fits = index < len(saved_groups) and names <= set(saved_groups[index]["params"])
            saved = saved_groups[index] if fits else None
        else:
            saved = next((saved for saved in saved_groups if names == set(saved["params"])), None)
        if saved is None:
            raise TrainingStateError(
                f"{directory}: no saved optimizer param_group holds the parameters {group['params'][:4]}...; the "
                "optimizer's groups must be the ones the run was saved with"
            )
        restored.append({**saved, "params": group["params"]})
    return restored


# ---------------------------------------------------------------- ranks and the staging folder

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _merged_over_ranks(rest: dict, group) -> dict:
    """``_split_state``'s JSON part with every rank's parameters: each optimizer param_group's names and the
    non-tensor state of every rank (under pipeline parallel each rank holds its stage's parameters only)."""
    if not _distributed():
        return rest
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, rest, group=group)
    merged = dict(rest, optimizer_param_groups=[dict(g, params=list(g["params"])) for g in rest["optimizer_param_groups"]],
                  optimizer_non_tensor_state={}, model_aliases={})
    for part in parts:
        for mine, theirs in zip(merged["optimizer_param_groups"], part["optimizer_param_groups"]):
            mine["params"] += [name for name in theirs["params"] if name not in mine["params"]]
        merged["optimizer_non_tensor_state"].update(part["optimizer_non_tensor_state"])
        merged["model_aliases"].update(part["model_aliases"])
    return merged


def _rank_and_size(group) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if _distributed() else (0, 1)


def _barrier(group) -> None:
    if _distributed():
        dist.barrier(group=group)


@contextmanager
def _single_process_is_intended():
    """Silence DCP's warning that it runs in one process: without a process group that is what is asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


@contextmanager
def _staged(final: Path, rank: int, group):
    """Yield the folder every rank writes into; it appears at ``final`` only after all of them finished."""
    staging = final.with_name(f".tmp-{final.name}")  # atomic_directory's sibling
    with atomic_directory(final) if rank == 0 else nullcontext(staging) as created:
        assert Path(created) == staging
        _barrier(group)  # the first rank made the folder
        yield staging
        _barrier(group)  # every rank wrote its files
    _barrier(group)  # the first rank renamed it into place


# ---------------------------------------------------------------- the API

def save_training_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    lr_scheduler=None,
    extra: dict | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Save the model, optimizer, LR scheduler and RNG state to ``directory`` (replaced as a whole), on every rank.

    model, optimizer: any layout (plain, FSDP2, HSDP, TP, FSDP2 x TP); parameters may be DTensors.
    lr_scheduler: anything with state_dict/load_state_dict whose state is JSON-able (transformers' schedules are).
    extra: JSON-able values to hand back on load (step counters, sampler position); the first rank's is saved.
    process_group: the ranks that hold the model (default: all of them).
    """
    final = Path(directory)
    rank, size = _rank_and_size(process_group)
    model_state, optimizer_state = get_state_dict(model, _optimizers(optimizer))
    tensors, rest = _split_state(model_state, optimizer_state)
    rest = _merged_over_ranks(rest, process_group)
    # everything turned to JSON before anything is written, so a bad value fails on every rank alike
    state = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": size,
        **rest,
        "lr_scheduler": to_json(lr_scheduler.state_dict(), "lr_scheduler state") if lr_scheduler is not None else None,
        "extra": to_json(extra or {}, "extra"),
    }
    state_text, rng_text = json.dumps(state, indent=1) + "\n", json.dumps(rng_state()) + "\n"
    with _staged(final, rank, process_group) as staging:
        writer = HuggingFaceStorageWriter(str(staging), save_distributed=True)
        with _single_process_is_intended():
            dcp.save(tensors, storage_writer=writer, process_group=process_group, no_dist=not _distributed())
        (staging / RNG_FILE.format(rank=rank)).write_text(rng_text)
        if rank == 0:
            (staging / STATE_FILE).write_text(state_text)


def load_training_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    lr_scheduler=None,
    process_group: dist.ProcessGroup | None = None,
    model_is_part: bool = False,
) -> dict:
    """Load what ``save_training_state`` wrote into ``model`` and ``optimizer`` of any layout, on every rank; restore
    the LR scheduler and (when the number of ranks is the saved one) each rank's RNG state. Returns ``extra``.

    model_is_part: the model is one part of the saved one (a pipeline stage: the other stages' tensors are not
    expected here).
    Raises TrainingStateError when the folder is incomplete or does not fit the model and optimizer.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise TrainingStateError(f"{directory} does not exist or is not a folder; resume from a saved checkpoint")
    state = _read_json(directory / STATE_FILE)
    if state.get("format") != FORMAT or state.get("version") != VERSION:
        raise TrainingStateError(
            f"{directory / STATE_FILE} is not an hfnative training state of version {VERSION} "
            f"(format {state.get('format')!r}, version {state.get('version')!r})"
        )
    rank, size = _rank_and_size(process_group)
    optimizers = _optimizers(optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizers)  # creates the optimizer's state if need be
    targets, rest = _split_state(model_state, optimizer_state)
    _check_fits(directory, targets, rest["model_aliases"], state, model_is_part)
    with _single_process_is_intended():
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(directory)), process_group=process_group,
                 no_dist=not _distributed())
    for name, fields in optimizer_state["state"].items():  # a quantized state was loaded into an fp32 stand-in
        for field, value in fields.items():
            loaded = targets.get(f"{OPTIMIZER_PREFIX}{name}.{field}")
            if loaded is not None and loaded is not value:
                fields[field] = loaded

    for name, fields in state["optimizer_non_tensor_state"].items():
        optimizer_state["state"].setdefault(name, {}).update(from_json(fields))
    optimizer_state["param_groups"] = _restored_param_groups(
        state["optimizer_param_groups"], optimizer_state["param_groups"], directory, model_is_part
    )
    set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optimizer_state)
    if isinstance(optimizer, OptimizerInBackward):
        optimizer.adopt_parameter_hyperparameters()
    if lr_scheduler is not None:
        if state["lr_scheduler"] is None:
            raise TrainingStateError(f"{directory} holds no LR-scheduler state; it was saved without lr_scheduler")
        lr_scheduler.load_state_dict(from_json(state["lr_scheduler"]))
    if size == state["world_size"]:
        set_rng_state(_read_json(directory / RNG_FILE.format(rank=rank)))
    else:
        warnings.warn(
            f"{directory} was saved by {state['world_size']} ranks and is loaded by {size}: the random generators "
            "keep their current state (they are restored only for the same number of ranks)",
            stacklevel=2,
        )
    return from_json(state["extra"])


__all__ = ["TrainingStateError", "load_training_state", "save_training_state"]
