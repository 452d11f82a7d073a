"""Write a native model back out as a Hub-format folder that transformers loads unchanged.

Weights go to safetensors under their Hub names (re-fusing or un-stacking per the family's
pieces), sharded with ``model.safetensors.index.json`` past ``max_shard_size``; config.json is
the original, field for field; generation config and tokenizer files come along. A checkpoint loaded
from MXFP4 is written dequantized, in the model's dtype, and its config without quantization_config.
The files are written aside and renamed into place when complete, the index and config.json last,
so a crash never leaves a folder that loads as a model with files missing.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from hfnative.checkpoint import atomic_files
from hfnative.peft.adapters import folded_expert_weights
from hfnative.peft.token_rows import rows_weights
from hfnative.peft.lora import LoraLinear
from hfnative.peft.quantize import dequantize, is_quantized

from .families import Piece, model_pieces
from .loading import SAFETENSORS_INDEX, ConvertedModel

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
# the files a loader starts from, renamed into a model folder after the files they refer to
LOADED_FIRST = (SAFETENSORS_INDEX, "adapter_config.json", "config.json")
# an earlier save's weight files, deleted when a new save no longer has them
WEIGHT_FILES = ("model*.safetensors", SAFETENSORS_INDEX)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hub_tensor(pieces: list[Piece], native: dict[str, torch.Tensor]) -> torch.Tensor:
    """Assemble one Hub tensor from its native piece(s)."""
    parts = []
    for piece in pieces:
        value = native[piece.native_key].detach()
        parts.append(piece.to_hub(value[piece.native_index] if piece.native_index is not None else value))
    if pieces[0].interleaved is not None:  # element by element along the last dim, in piece order
        parts = sorted(zip((p.interleaved[0] for p in pieces), parts), key=lambda pair: pair[0])
        return torch.stack([part for _, part in parts], dim=-1).flatten(-2)
    return torch.cat(parts) if pieces[0].hf_rows is not None else parts[0]


def merged_native_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The native state dict of ``model`` with every LoRA adapter folded into its base weight and quantized (NF4,
    int8) weights dequantized (the adapters' own tensors left out): what a model without adapters holds."""
    state = {name: tensor for name, tensor in model.state_dict().items()
             if ".lora_" not in name and ".token_rows." not in name}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            state[f"{name}.weight"] = module.merged_weight()
        elif isinstance(getattr(module, "weight", None), torch.Tensor) and is_quantized(module.weight):
            state[f"{name}.weight"] = dequantize(module.weight)
    state.update(folded_expert_weights(model))
    state.update(rows_weights(model))
    return state


def hub_state_dict_pieces(converted: ConvertedModel) -> dict[str, list[Piece]]:
    pieces_of = defaultdict(list)
    for piece in model_pieces(converted.family, converted.args):
        pieces_of[piece.hf_key].append(piece)
    return pieces_of


def _numel(pieces: list[Piece], native: dict[str, torch.Tensor]) -> int:
    tensors = [native[p.native_key] for p in pieces]
    if pieces[0].native_index is not None:  # one expert of a stacked tensor
        return tensors[0][0].numel()
    return sum(t.numel() for t in tensors)


def write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_weights(converted: ConvertedModel, out_dir: Path, max_shard_size: int | str = "5GB",
                 native_state: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Write the weights as safetensors shards, split as transformers' save_pretrained splits them
    (``max_shard_size``: bytes, or a string such as "5GB"); returns the file names written.
    native_state: the model's whole tensors under native names (gathered from a sharded model), instead of
    ``converted.model.state_dict()``."""
    from safetensors.torch import save_file

    native = dict(native_state if native_state is not None else converted.model.state_dict())
    pieces_of = hub_state_dict_pieces(converted)
    # the split needs only each Hub tensor's size and dtype: empty meta tensors stand in for them
    stand_ins = {
        key: torch.empty(_numel(pieces, native), dtype=native[pieces[0].native_key].dtype, device="meta")
        for key, pieces in pieces_of.items()
    }
    split = split_torch_state_dict_into_shards(stand_ins, max_shard_size=max_shard_size)
    for name, keys in split.filename_to_tensors.items():
        tensors = {key: hub_tensor(pieces_of[key], native).to("cpu").contiguous() for key in keys}
        write_atomically(out_dir / name, lambda tmp, shard=tensors: save_file(shard, str(tmp), metadata={"format": "pt"}))
        del tensors  # one shard in memory at a time
    if split.is_sharded:
        total_parameters = sum(tensor.numel() for tensor in stand_ins.values())
        index = {
            "metadata": {**split.metadata, "total_parameters": total_parameters},
            "weight_map": split.tensor_to_filename,
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        write_atomically(out_dir / SAFETENSORS_INDEX, lambda tmp: tmp.write_text(text))
    return list(split.filename_to_tensors)


def _save_config(converted: ConvertedModel, out_dir: Path) -> None:
    """The source config.json byte for byte; only ``dtype`` follows the weights if they changed, and a
    ``quantization_config`` goes (the weights are written dequantized)."""
    dtype_name = _DTYPE_NAMES.get(next(converted.model.parameters()).dtype)
    source = converted.source_dir / "config.json" if converted.source_dir else None
    if source is not None and source.exists() and not _classifier_config_changed(converted, json.loads(source.read_text())):
        text = source.read_text()
        fields = json.loads(text)
        key = "dtype" if "dtype" in fields or "torch_dtype" not in fields else "torch_dtype"
        changed = fields.pop("quantization_config", None) is not None
        if dtype_name and fields.get(key) not in (None, dtype_name):
            fields[key] = dtype_name
            changed = True
        changed |= _followed_fields(converted, fields)
        if converted.config_overrides:  # model_init_kwargs' config fields (aliases too), as the trained model has them
            from transformers import AutoConfig

            base = AutoConfig.from_pretrained(str(converted.source_dir), trust_remote_code=False).to_dict()
            current = converted.config.to_dict()
            differing = {name: value for name, value in current.items()
                         if not name.startswith("_") and name not in _NOT_OVERRIDES and base.get(name) != value}
            fields.update(differing)
            changed |= bool(differing)
        if changed:
            text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
    else:
        fields = converted.config.to_dict()
        fields.pop("quantization_config", None)
        if dtype_name:
            fields["dtype"] = dtype_name
        text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
    write_atomically(out_dir / "config.json", lambda tmp: tmp.write_text(text))


# config.json fields an override comparison leaves alone (written by transformers, or followed elsewhere)
_NOT_OVERRIDES = ("transformers_version", "dtype", "torch_dtype", "architectures")

# the fields training may change in the config (a cloned chat template's EOS and resized vocabulary, the pad token,
# online DPO's use_cache under gradient checkpointing), written as the model now has them
FOLLOWED_FIELDS = ("vocab_size", "eos_token_id", "pad_token_id", "use_cache")


def _followed_fields(converted: ConvertedModel, fields: dict) -> bool:
    """Set ``fields``' (the source config.json's, top level or its text_config) FOLLOWED_FIELDS that the model's config
    now holds otherwise; whether any was."""
    text = converted.config.get_text_config()
    target = fields["text_config"] if isinstance(fields.get("text_config"), dict) and "vocab_size" not in fields else fields
    changed = False
    differs_from_defaults = text.to_diff_dict()
    for name in FOLLOWED_FIELDS:
        value = getattr(text, name, None)
        absent_as_default = name not in target and name not in differs_from_defaults
        if value is not None and target.get(name) != value and not absent_as_default:
            target[name] = value
            changed = True
    return changed


def _classifier_config_changed(converted: ConvertedModel, fields: dict) -> bool:
    """A sequence classifier whose config is not its source file's where the classifier reads it (a causal LM given a
    score head, a pad or eos token set by the trainer): its config.json is written from the live config."""
    if converted.args.num_labels is None:
        return False
    config = converted.config
    text = config.get_text_config()
    labels = {str(index): label for index, label in config.id2label.items()}
    return (fields.get("architectures") != list(config.architectures or []) or fields.get("id2label", labels) != labels
            or fields.get("pad_token_id") != text.pad_token_id or fields.get("eos_token_id") != text.eos_token_id)


def _save_generation_config(converted: ConvertedModel, out_dir: Path, generation_config=None) -> None:
    """``generation_config`` (the model's live one: a cloned chat template or ``eos_token`` may have changed its EOS)
    where it says something else than the source folder's file, else that file as it is."""
    if converted.args.num_labels is not None:  # a sequence classifier does not generate (transformers writes none)
        return
    source = converted.source_dir / "generation_config.json" if converted.source_dir else None
    if generation_config is not None and source is not None and source.exists():
        from transformers import GenerationConfig

        if GenerationConfig.from_pretrained(str(source.parent)).to_diff_dict() == generation_config.to_diff_dict():
            generation_config = None  # the same settings: the file is copied byte for byte
    if generation_config is not None:
        text = generation_config.to_json_string()
    elif source is not None and source.exists():
        text = source.read_text()
    else:
        return
    write_atomically(out_dir / "generation_config.json", lambda tmp: tmp.write_text(text))


def save_tokenizer(out_dir: Path, processing_class=None, source_dir: Path | None = None) -> None:
    """The tokenizer via its own save_pretrained, or the source folder's tokenizer files copied."""
    if processing_class is not None:
        processing_class.save_pretrained(str(out_dir))
        return
    if source_dir is None:
        return
    for name in TOKENIZER_FILES:
        if (source_dir / name).exists():
            write_atomically(out_dir / name, lambda tmp, name=name: shutil.copyfile(source_dir / name, tmp))


def export_hf(
    converted: ConvertedModel,
    out_dir: str | os.PathLike,
    *,
    processing_class=None,
    generation_config=None,
    max_shard_size: int | str = "5GB",
    native_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``converted`` as a Hub-format folder: safetensors, config.json, generation config, tokenizer.
    Weight files of an earlier save into ``out_dir`` that this one does not write are removed.
    native_state: see ``save_weights`` (a sharded model's gathered tensors)."""
    out_dir = Path(out_dir)
    with atomic_files(out_dir, last=LOADED_FIRST, replaces=WEIGHT_FILES) as stage:
        save_weights(converted, stage, max_shard_size, native_state)
        _save_config(converted, stage)
        _save_generation_config(converted, stage, generation_config)
        save_tokenizer(stage, processing_class, converted.source_dir)
    return out_dir
