"""Load a Hub-format checkpoint into a parallelized native model: each rank keeps only its slice.

The model is built on the meta device from config.json (``meta_model``), parallelized
(``hfnative.parallel.parallelize``: its parameters become DTensors split over the mesh), then
``load_sharded`` materializes it and copies, tensor by tensor, this rank's part of each Hub tensor into
its local shard. The same ``Piece`` key map as the single-process load names every tensor, so fused,
stacked, interleaved or transposed Hub layouts load the same way. A rank reads one Hub tensor at a time
and keeps the box of it its shard covers (the box DTensor gives: its local shape and global offset), so
no rank ever holds the whole model; peak memory is the rank's shards plus the largest single tensor.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hfnative.models.classifier import build_model
from hfnative.models.decoder import Transformer

from .families import family_for_config, model_pieces
from .hub import resolve_model_dir
from .loading import (
    ConvertedModel,
    SafetensorsSource,
    _check_config_json,
    _config_dtype,
    config_with_overrides,
    check_checkpoint,
    copy_into_model,
    dequantizing_source,
    model_args,
)


def meta_model(
    model: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    config_overrides: dict | None = None,
) -> ConvertedModel:
    """The native model of a checkpoint folder or Hub id, built on the meta device (no weight read, no memory).

    dtype: None keeps the config's dtype (float32 when it names none). Parallelize the model, then ``load_sharded``.
    config_overrides: as ``load_pretrained``'s.
    """
    source_dir = resolve_model_dir(model, revision=revision, cache_dir=cache_dir, token=token)
    _check_config_json(source_dir / "config.json")
    config = config_with_overrides(source_dir, config_overrides)
    config._name_or_path = str(model)
    family = family_for_config(config)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype) if dtype != "auto" else None
    with torch.device("meta"):
        native = build_model(model_args(family, config))
    native.to(dtype=dtype or _config_dtype(config))
    return ConvertedModel(native, config, family, source_dir, tuple(config_overrides or ()))


def _local_box(target: DTensor) -> tuple[list[int], list[int]]:
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return list(shape), list(offset)


def copy_shard(target: torch.Tensor, full: torch.Tensor, index: int | None = None) -> None:
    """Copy into ``target`` (a parameter, a DTensor's shard or a plain tensor) its part of ``full``, the whole
    native tensor (of ``target[index]`` when ``index`` is given: one expert of a stacked tensor)."""
    if not isinstance(target, DTensor):
        (target if index is None else target[index]).copy_(full)
        return
    shape, offset = _local_box(target)
    local = target.to_local()
    if index is not None:
        if not offset[0] <= index < offset[0] + shape[0]:
            return  # this expert's rows live on another rank
        local, shape, offset = local[index - offset[0]], shape[1:], offset[1:]
    box = tuple(slice(start, start + size) for start, size in zip(offset, shape))
    local.copy_(full[box])


def copy_shards_into_model(source, pieces, model: Transformer) -> None:
    """Like ``copy_into_model``, each native tensor receiving only this rank's slice."""
    copy_into_model(source, pieces, model, copy=copy_shard)


def load_sharded(converted: ConvertedModel, device: torch.device | str) -> ConvertedModel:
    """Materialize ``converted.model`` (built by ``meta_model``, then parallelized) on ``device`` and load this
    rank's slice of every tensor of its checkpoint; rotary tables are recomputed. Returns ``converted``.

    Raises CheckpointError (before allocating) when the checkpoint's tensors do not match the config. MXFP4 tensors
    are dequantized to the model's dtype on the way, as the single-process load does.
    """
    model = converted.model
    where = str(converted.source_dir)
    dtype = next(model.parameters()).dtype
    source = dequantizing_source(SafetensorsSource(converted.source_dir), converted.config, dtype, where)
    pieces = model_pieces(converted.family, model.args)
    check_checkpoint(source, pieces, model, where, converted.config_overrides)
    model.to_empty(device=device)
    copy_shards_into_model(source, pieces, model)
    model.init_buffers()
    return converted


__all__ = ["copy_shard", "copy_shards_into_model", "load_sharded", "meta_model"]
