"""Load a Hub-format checkpoint into a native model, tensor by tensor.

The model is built on the meta device, the checkpoint's key set and shapes are checked against
it before any memory is allocated, then each Hub tensor is read from its safetensors shard and
copied straight into the native parameter(s) it maps to. Peak memory stays near one copy of the
weights plus the largest single tensor.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from hfnative.models.args import ModelArgs
from hfnative.models.classifier import build_model
from hfnative.models.decoder import Transformer

from .families import (
    CLASSIFIER_ARCHITECTURES,
    Family,
    Piece,
    UnsupportedModelError,
    family_for_config,
    is_sequence_classifier,
    model_pieces,
)
from .hub import resolve_model_dir
from .mxfp4 import Mxfp4Source, quant_method

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing, unexpected or mis-shaped tensors, bad files."""


@dataclass
class ConvertedModel:
    """A native model plus what is needed to write it back out in Hub format."""

    model: Transformer
    config: object  # the transformers PretrainedConfig it was built from
    family: Family
    source_dir: Path | None = None  # the checkpoint folder (None when converted from an object)
    config_overrides: tuple[str, ...] = ()  # config fields model_init_kwargs set (written to a saved config.json)

    @property
    def args(self) -> ModelArgs:
        return self.model.args


def _is_ignorable(key: str, args: ModelArgs) -> bool:
    # tied checkpoints sometimes still carry the head; rotary buffers were saved by old versions
    return (args.tie_embeddings and key == "lm_head.weight") or key.endswith("rotary_emb.inv_freq")


# --- where Hub tensors come from: safetensors files, or an in-memory state dict --------------------


class SafetensorsSource:
    """The tensors of a (possibly sharded) safetensors checkpoint folder, read lazily."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        index_path = model_dir / SAFETENSORS_INDEX
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({err})") from err
        elif (model_dir / SAFETENSORS_SINGLE).exists():
            weight_map = None
        else:
            others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
            hint = f" (found {others}: hfnative loads weights only from safetensors)" if others else ""
            raise CheckpointError(f"{model_dir}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}{hint}")
        files = sorted(set(weight_map.values())) if weight_map else [SAFETENSORS_SINGLE]
        missing_files = [f for f in files if not (model_dir / f).exists()]
        if missing_files:
            keys = sorted(k for k, f in weight_map.items() if f in missing_files)
            raise CheckpointError(
                f"{model_dir}: shard file(s) {missing_files} listed in {SAFETENSORS_INDEX} are missing "
                f"(they hold {len(keys)} tensors, e.g. {keys[:5]}); re-download the checkpoint"
            )
        self.file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            for key, shape in self._read_header(model_dir / name).items():
                self.file_of[key] = name
                self.shapes[key] = shape
        if weight_map:
            absent = sorted(k for k in weight_map if k not in self.file_of)
            if absent:
                raise CheckpointError(f"{model_dir}: tensors listed in the index are not in their shard: {absent[:10]}")

    @staticmethod
    def _read_header(path: Path) -> dict[str, tuple[int, ...]]:
        return {key: tuple(entry["shape"]) for key, entry in read_safetensors_header(path)[0].items()}

    def keys(self):
        return self.shapes.keys()

    def iter_tensors(self, wanted: set[str]):
        """Yield (key, tensor) file by file, one tensor in memory at a time.

        Tensors are read with plain file reads rather than a memory map: mapped pages of the file
        would count as resident memory next to the model, doubling the peak while loading.
        """
        by_file = defaultdict(list)
        for key in wanted:
            by_file[self.file_of[key]].append(key)
        for name in sorted(by_file):
            path = self.model_dir / name
            header, data_start = read_safetensors_header(path)
            with open(path, "rb", buffering=0) as f:
                for key in sorted(by_file[name], key=lambda k: header[k]["data_offsets"][0]):
                    yield key, _read_tensor(f, path, key, header[key], data_start)


# safetensors: an 8-byte little-endian header length, a JSON header, then the raw tensor bytes
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The tensor entries of a safetensors file and the offset where their data starts."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if 8 + length > size:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        unknown = sorted({entry["dtype"] for entry in header.values()} - set(_SAFETENSORS_DTYPES))
    except (struct.error, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: unreadable safetensors file ({err}); it may be truncated — re-download it") from err
    if 8 + length + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file ({size} bytes, its header describes {8 + length + end}); re-download it"
        )
    if unknown:
        raise CheckpointError(f"{path}: tensor dtypes {unknown} are not supported")
    return header, 8 + length


def _read_tensor(f, path: Path, key: str, entry: dict, data_start: int) -> torch.Tensor:
    tensor = torch.empty(entry["shape"], dtype=_SAFETENSORS_DTYPES[entry["dtype"]])
    begin, end = entry["data_offsets"]
    if end - begin != tensor.numel() * tensor.element_size():
        raise CheckpointError(f"{path}: tensor {key} holds {end - begin} bytes, its shape and dtype need more")
    if tensor.numel():
        f.seek(data_start + begin)
        buffer = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        read = 0
        while read < len(buffer):
            chunk = f.readinto(buffer[read:])
            if not chunk:
                raise CheckpointError(f"{path}: truncated while reading {key}; re-download it")
            read += chunk
    return tensor


class StateDictSource:
    """Hub-format tensors held in memory (from a transformers model object)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.state_dict = state_dict
        self.shapes = {k: tuple(v.shape) for k, v in state_dict.items()}

    def keys(self):
        return self.shapes.keys()

    def iter_tensors(self, wanted: set[str]):
        for key in sorted(wanted):
            yield key, self.state_dict[key]


# --- checking and copying ------------------------------------------------------------------------


def _expected_hf_shapes(pieces: list[Piece], model: Transformer) -> dict[str, tuple[int, ...]]:
    native_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    shapes: dict[str, tuple[int, ...]] = {}
    for piece in pieces:
        native = native_shapes[piece.native_key]
        if piece.transposed:
            native = native[:-2] + (native[-1], native[-2])
        if piece.interleaved is not None:
            native = native[:-1] + (native[-1] * piece.interleaved[1],)
        if piece.native_index is not None:
            shapes[piece.hf_key] = native[1:]
        elif piece.hf_rows is not None:  # a fused tensor is as tall as its last row block ends
            rows_so_far = shapes.get(piece.hf_key, (0,))[0]
            shapes[piece.hf_key] = (max(rows_so_far, piece.hf_rows[1]),) + native[1:]
        else:
            shapes[piece.hf_key] = native
    return shapes


def check_checkpoint(source, pieces: list[Piece], model: Transformer, where: str,
                     config_overrides: dict | tuple | None = None) -> None:
    """Raise one CheckpointError naming every missing, unexpected and mis-shaped tensor."""
    expected = _expected_hf_shapes(pieces, model)
    found = source.shapes
    missing = sorted(k for k in expected if k not in found)
    unexpected = sorted(k for k in found if k not in expected and not _is_ignorable(k, model.args))
    wrong_shape = sorted(
        f"{k}: checkpoint {list(found[k])}, config implies {list(expected[k])}"
        for k in expected
        if k in found and tuple(found[k]) != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected}")
    if wrong_shape:
        problems.append(f"tensors with the wrong shape ({len(wrong_shape)}): {wrong_shape}")
    if problems:
        if config_overrides:  # what the checkpoint is checked against is not its own config.json alone
            raise CheckpointError(f"{where} does not match its config.json as model_init_kwargs "
                                  f"{sorted(config_overrides)} change it (a field that sets a tensor's shape or count "
                                  "must keep the checkpoint's value):\n  " + "\n  ".join(problems))
        raise CheckpointError(f"{where} does not match its config.json:\n  " + "\n  ".join(problems))


def _copy_whole(target: torch.Tensor, value: torch.Tensor, index: int | None = None) -> None:
    (target if index is None else target[index]).copy_(value)


def copy_into_model(source, pieces: list[Piece], model: Transformer, copy=_copy_whole) -> None:
    """Copy every Hub tensor of ``source`` into the native tensor(s) its pieces name, one Hub tensor in memory at
    a time. copy(target, value, native_index): how a native tensor receives its value (a rank of a sharded model
    copies only its slice: ``sharded_loading.copy_shard``)."""
    params = model.state_dict(keep_vars=True)
    pieces_of = defaultdict(list)
    for piece in pieces:
        pieces_of[piece.hf_key].append(piece)
    written = set()
    with torch.no_grad():
        for hf_key, tensor in source.iter_tensors(set(pieces_of)):
            for piece in pieces_of[hf_key]:
                copy(params[piece.native_key], piece.from_hub(tensor), piece.native_index)
                written.add((piece.native_key, piece.native_index))
            del tensor
    assert written == {(p.native_key, p.native_index) for p in pieces}, "some native tensors were not loaded"


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype


def _check_config_json(path: Path) -> None:
    """config.json exists and is a JSON object (transformers' own error for a broken one loses where)."""
    if not path.exists():
        raise CheckpointError(f"{path.parent}: no config.json; is this a Hub-format model folder?")
    try:
        fields = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f" at line {err.lineno}, column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8 text"
        raise CheckpointError(f"{path} is not valid JSON{where} ({reason}); fix it or download the model again") from err
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path} holds a JSON {type(fields).__name__}, not the object of a model config")


def config_with_overrides(source_dir: Path, overrides: dict | None):
    """The folder's transformers config with ``overrides`` set, as ``from_pretrained(..., **kwargs)`` sets the kwargs
    that are config fields; a key that is none is refused by name (transformers would hand it to the model's
    constructor, which takes no such argument)."""
    from transformers import AutoConfig

    if not overrides:
        return AutoConfig.from_pretrained(str(source_dir), trust_remote_code=False)
    config, unused = AutoConfig.from_pretrained(str(source_dir), trust_remote_code=False, return_unused_kwargs=True,
                                                **overrides)
    if unused:
        raise ValueError(f"model_init_kwargs {sorted(unused)}: neither a loading option hfnative reads nor a field of "
                         f"the model's config ({type(config).__name__}); remove them")
    return config


def load_pretrained(
    model: str | os.PathLike | object,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    num_labels: int | None = None,
    score_seed: int | None = None,
    config_overrides: dict | None = None,
) -> ConvertedModel:
    """Load a checkpoint folder, a Hub id or a transformers PreTrainedModel as a native model.

    config_overrides: fields of the folder's config to set before the model is built (the rest of TRL's
    ``model_init_kwargs``, as ``from_pretrained`` takes them: ``config_with_overrides``).

    dtype: None keeps the config's dtype (float32 when it names none). MXFP4-quantized tensors
    (``quantization_config.quant_method == "mxfp4"``) are dequantized into parameters of that dtype.
    A ``*ForSequenceClassification`` checkpoint loads as a native SequenceClassifier (its config's num_labels, or
    ``num_labels``). ``num_labels`` with a causal-LM checkpoint: a SequenceClassifier on its decoder, the LM head
    dropped and a new score head drawn as transformers' AutoModelForSequenceClassification draws it, normal(0,
    initializer_range), from a generator seeded with ``score_seed`` (torch's global generator when None).
    """
    from transformers import AutoConfig, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        config, source_dir = model.config, None
        source = StateDictSource(_hub_state_dict(model))
        where = f"the {type(model).__name__} object"
    else:
        source_dir = resolve_model_dir(model, revision=revision, cache_dir=cache_dir, token=token)
        _check_config_json(source_dir / "config.json")
        config = config_with_overrides(source_dir, config_overrides)
        config._name_or_path = str(model)  # the name passed (a Hub id, not its cache folder), as transformers keeps it
        source = SafetensorsSource(source_dir)
        where = str(source_dir)
    family = family_for_config(config)
    is_classifier = is_sequence_classifier(config) or type(model).__name__.endswith("ForSequenceClassification")
    new_head = num_labels is not None and not is_classifier
    if is_classifier or new_head:
        config = classifier_config(config, family, num_labels)
    args = model_args(family, config)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype) if dtype != "auto" else None
    dtype = dtype or _config_dtype(config)

    source = dequantizing_source(source, config, dtype, where)

    pieces = model_pieces(family, args)
    if new_head:  # the causal LM's head is dropped; the score head is not in the checkpoint
        source = WithoutLanguageModelHead(source)
        pieces = [piece for piece in pieces if piece.hf_key != SCORE_KEY]
    with torch.device("meta"):
        native = build_model(args)
    check_checkpoint(source, pieces, native, where, config_overrides)  # before any memory is allocated
    native = native.to(dtype=dtype).to_empty(device=device)
    copy_into_model(source, pieces, native)
    if new_head:
        init_score_head(native, config, score_seed)
    native.init_buffers()
    return ConvertedModel(native, config, family, source_dir, tuple(config_overrides or ()))


# --- sequence classifiers ---------------------------------------------------------------------------

SCORE_KEY = "score.weight"


def classifier_config(config, family: Family, num_labels: int | None = None):
    """A copy of ``config`` naming the family's sequence classifier (``architectures``) with ``num_labels`` labels
    (default: the config's own)."""
    architecture = CLASSIFIER_ARCHITECTURES.get(family.name)
    if architecture is None:
        raise UnsupportedModelError(f"the {family.name} family has no sequence-classification model in transformers")
    config = copy.deepcopy(config)
    config.architectures = [architecture]
    if num_labels is not None and num_labels != config.num_labels:
        config.num_labels = num_labels  # transformers' setter rebuilds id2label / label2id
    return config


def model_args(family: Family, config) -> ModelArgs:
    """The ModelArgs of ``config``: a causal LM's, or with ``num_labels`` and the pooling pad token for a
    sequence-classification config (its score head is its own, never tied)."""
    args = family.config_to_args(config)
    if not is_sequence_classifier(config):
        return args
    text_config = config.get_text_config()
    return dataclasses.replace(args, num_labels=config.num_labels, tie_embeddings=False,
                               pad_token_id=getattr(text_config, "pad_token_id", None))


class WithoutLanguageModelHead:
    """A causal LM checkpoint's tensors but its LM head (a sequence classifier built on its decoder drops it)."""

    def __init__(self, source):
        self.source = source
        self.shapes = {key: shape for key, shape in source.shapes.items() if key != "lm_head.weight"}

    def keys(self):
        return self.shapes.keys()

    def iter_tensors(self, wanted: set[str]):
        return self.source.iter_tensors(wanted)


@torch.no_grad()
def init_score_head(model: Transformer, config, seed: int | None = None) -> None:
    """A new score head [L, D] ~ normal(0, initializer_range), drawn on the CPU as transformers initializes a
    missing ``score.weight``; from a generator seeded with ``seed``, or torch's global one when None."""
    std = getattr(config.get_text_config(), "initializer_range", 0.02)
    weight = model.output.weight
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    value = torch.empty(weight.shape, dtype=weight.dtype).normal_(0.0, std, generator=generator)
    weight.copy_(value)


def dequantizing_source(source, config, dtype: torch.dtype, where: str):
    """The source as the native model reads it: MXFP4 tensors dequantized to ``dtype`` on the way
    (every loader of a Hub folder wraps its source with this)."""
    method = quant_method(config)
    if method is None:
        return source
    if method == "mxfp4":
        return Mxfp4Source(source, dtype)
    raise UnsupportedModelError(
        f"{where}: quantization_config.quant_method={method!r} is not supported by hfnative's native models; "
        "supported: 'mxfp4' (dequantized on load); load the unquantized checkpoint instead"
    )


def hub_state_dict(causal_lm, adapter_names=()) -> dict[str, torch.Tensor]:
    """A transformers model's tensors under their Hub checkpoint names (in-memory fusions undone, tied copies
    left out). ``adapter_names``: peft adapters injected into it, whose tensors (stored under the adapter's
    name) are left out; the base weights of wrapped layers (``base_layer``, ``original_module``, a token
    adapter's ``token_adapter``) keep their plain names."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {}
    for key, value in causal_lm.state_dict().items():
        parts = key.split(".")
        if not set(adapter_names) & set(parts):
            state[".".join(p for p in parts if p not in ("base_layer", "original_module", "token_adapter"))] = value
    state = revert_weight_conversion(causal_lm, state)
    for tied in getattr(causal_lm, "all_tied_weights_keys", None) or {}:
        state.pop(tied, None)
    return state


def _hub_state_dict(model) -> dict[str, torch.Tensor]:
    """A transformers model's tensors under their Hub checkpoint names (undoing in-memory fusions)."""
    adapters = getattr(model, "peft_config", None)
    if adapters:  # a PeftModel's base, adapters injected: its own tensors under their plain names
        return hub_state_dict(model, set(adapters))
    state_dict = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state_dict
    return revert_weight_conversion(model, state_dict)


__all__ = [
    "CheckpointError",
    "hub_state_dict",
    "ConvertedModel",
    "classifier_config",
    "init_score_head",
    "UnsupportedModelError",
    "load_pretrained",
]
