"""What every family declaration is built from: config reading and HF <-> native key pieces.

A ``Piece`` says that rows ``hf_rows`` of the Hub tensor ``hf_key`` are the native tensor
``native_key`` (or its slice ``[native_index]`` for stacked experts); a Hub tensor may also hold
native tensors interleaved along its last dim, and store them with the last two dims swapped.
One list of pieces drives loading, export and adapter key mapping, so a family states its key
layout exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hfnative.models.args import ModelArgs, RopeArgs
from hfnative.models.rope import SUPPORTED_ROPE_SCALING


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or configuration the native models do not implement."""


@dataclass(frozen=True)
class Piece:
    hf_key: str
    native_key: str
    hf_rows: tuple[int, int] | None = None  # a row range of a fused Hub tensor
    native_index: int | None = None  # an expert's slice of a stacked native tensor
    # (i, n): the Hub tensor's last dim interleaves n native tensors element by element; this is
    # the i-th (hub[..., i::n]), e.g. GPT-OSS's gate/up columns
    interleaved: tuple[int, int] | None = None
    transposed: bool = False  # the Hub tensor (after de-interleaving) is the native one with its last two dims swapped

    def from_hub(self, hub: torch.Tensor) -> torch.Tensor:
        """This piece's part of the Hub tensor, in the native layout (a view)."""
        if self.hf_rows is not None:
            hub = hub[self.hf_rows[0] : self.hf_rows[1]]
        if self.interleaved is not None:
            hub = hub[..., self.interleaved[0] :: self.interleaved[1]]
        return hub.transpose(-2, -1) if self.transposed else hub

    def to_hub(self, native: torch.Tensor) -> torch.Tensor:
        """The native tensor in the Hub layout, before fusing or interleaving with other pieces."""
        return native.transpose(-2, -1) if self.transposed else native


@dataclass(frozen=True)
class Family:
    name: str  # the model_type of its transformers config
    architectures: tuple[str, ...]
    config_to_args: Callable  # (transformers PretrainedConfig) -> ModelArgs
    layer_pieces: Callable  # (ModelArgs, layer_id) -> list[Piece]


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def unsupported(config, field: str, value, supported) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{type(config).__name__}: {field}={value!r} is not supported by hfnative's native models; "
        f"supported: {supported}"
    )


def rope_args(config, params: dict) -> RopeArgs:
    """A transformers ``rope_parameters`` dict (already standardized by the config class) -> RopeArgs."""
    scaling = params.get("rope_type", params.get("type", "default"))
    if scaling not in SUPPORTED_ROPE_SCALING:
        raise unsupported(config, "rope_parameters.rope_type", scaling, list(SUPPORTED_ROPE_SCALING))
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if scaling == "yarn" and factor is None:
        factor = config.max_position_embeddings / original
    return RopeArgs(
        theta=float(params["rope_theta"]),
        scaling=scaling,
        factor=float(factor) if factor is not None else 1.0,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
    )


def _padding_idx(config) -> int | None:
    pad = getattr(config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None


# config fields asking for dropout in the transformers modules of hfnative's families, which the native decoders do
# not apply: a float the attention reads (TRL's disable_dropout leaves it), and dropout layers (disable_dropout zeroes)
ATTENTION_DROPOUT_FIELDS = ("attention_dropout",)
LAYER_DROPOUT_FIELDS = ("resid_pdrop", "hidden_dropout")


def dropout_refusal(config, fields) -> UnsupportedModelError | None:
    """The error for the first of ``fields`` that asks ``config``'s model for dropout (None: none does)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in fields:
        if getattr(text, name, None):
            return unsupported(text, name, getattr(text, name), "0.0 when training (hfnative's native models apply "
                               "no dropout)")
    return None


def dense_args(config, **overrides) -> ModelArgs:
    """ModelArgs for the Llama-shaped fields every family shares; families pass their differences."""
    activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if activation not in ACTIVATIONS:
        raise unsupported(config, "hidden_act", activation, sorted(ACTIVATIONS))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fields = dict(
        vocab_size=config.vocab_size,
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        activation=ACTIVATIONS[activation],
        tie_embeddings=bool(config.tie_word_embeddings),
        padding_idx=_padding_idx(config),
    )
    fields.update(overrides)
    if "rope" not in fields:
        fields["rope"] = rope_args(config, config.rope_parameters)
    return ModelArgs(**fields)


def all_layers_sliding(config) -> dict:
    """Families whose single ``sliding_window`` value, when set, applies to every layer."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return {}
    return dict(sliding_window=window, layer_types=["sliding_attention"] * config.num_hidden_layers)


def layer_types_sliding(config) -> dict:
    """Families that name each layer's attention type in ``config.layer_types``."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    if "sliding_attention" not in layer_types:
        return {}
    return dict(sliding_window=config.sliding_window, layer_types=layer_types)


def rename(hf_key: str, native_key: str) -> Piece:
    return Piece(hf_key, native_key)


def fused(hf_key: str, native_keys_and_rows: list[tuple[str, int]]) -> list[Piece]:
    """One Hub tensor whose consecutive row blocks are separate native tensors (e.g. fused qkv)."""
    pieces, start = [], 0
    for native_key, rows in native_keys_and_rows:
        pieces.append(Piece(hf_key, native_key, hf_rows=(start, start + rows)))
        start += rows
    return pieces


def stacked(hf_key_of_expert: Callable[[int], str], native_key: str, num_experts: int) -> list[Piece]:
    """Per-expert Hub tensors stored as one stacked native tensor [E, ...]."""
    return [Piece(hf_key_of_expert(e), native_key, native_index=e) for e in range(num_experts)]


def attention_pieces(args: ModelArgs, layer_id: int) -> list[Piece]:
    hf, nat = f"model.layers.{layer_id}.self_attn.", f"layers.{layer_id}.attention."
    pieces = [rename(f"{hf}{a}_proj.weight", f"{nat}w{b}.weight") for a, b in zip("qkvo", "qkvo")]
    if args.qkv_bias:
        pieces += [rename(f"{hf}{a}_proj.bias", f"{nat}w{a}.bias") for a in "qkv"]
    if args.output_proj_bias:
        pieces.append(rename(f"{hf}o_proj.bias", f"{nat}wo.bias"))
    if args.qk_norm:
        pieces += [rename(f"{hf}{a}_norm.weight", f"{nat}{a}_norm.weight") for a in "qk"]
    if args.attention_sinks:
        pieces.append(rename(f"{hf}sinks", f"{nat}sinks"))
    return pieces


def mlp_pieces(args: ModelArgs, layer_id: int, hf_prefix: str = "mlp") -> list[Piece]:
    hf, nat = f"model.layers.{layer_id}.{hf_prefix}.", f"layers.{layer_id}.feed_forward."
    names = (("gate", "w1"), ("up", "w3"), ("down", "w2"))
    pieces = [rename(f"{hf}{a}_proj.weight", f"{nat}{b}.weight") for a, b in names]
    if args.mlp_bias:
        pieces += [rename(f"{hf}{a}_proj.bias", f"{nat}{b}.bias") for a, b in names]
    return pieces


def moe_pieces(args: ModelArgs, layer_id: int, block: str, gate: str, up: str, down: str) -> list[Piece]:
    """Router + per-expert Hub tensors ``model.layers.{i}.{block}.experts.{e}.{gate|up|down}.weight``."""
    hf, nat = f"model.layers.{layer_id}.{block}.", f"layers.{layer_id}.moe."
    experts = args.moe.num_experts
    return (
        [rename(f"{hf}gate.weight", f"{nat}router.weight")]
        + stacked(lambda e: f"{hf}experts.{e}.{gate}.weight", f"{nat}experts.w1", experts)
        + stacked(lambda e: f"{hf}experts.{e}.{up}.weight", f"{nat}experts.w3", experts)
        + stacked(lambda e: f"{hf}experts.{e}.{down}.weight", f"{nat}experts.w2", experts)
    )


def llama_norm_pieces(layer_id: int) -> list[Piece]:
    hf, nat = f"model.layers.{layer_id}.", f"layers.{layer_id}."
    return [
        rename(f"{hf}input_layernorm.weight", f"{nat}attention_norm.weight"),
        rename(f"{hf}post_attention_layernorm.weight", f"{nat}ffn_norm.weight"),
    ]


def llama_layer_pieces(args: ModelArgs, layer_id: int) -> list[Piece]:
    return attention_pieces(args, layer_id) + mlp_pieces(args, layer_id) + llama_norm_pieces(layer_id)


def model_pieces(family: Family, args: ModelArgs) -> list[Piece]:
    """Every piece of a whole model, in Hub key order of appearance."""
    pieces = [rename("model.embed_tokens.weight", "tok_embeddings.weight")]
    for layer_id in range(args.n_layers):
        pieces += family.layer_pieces(args, layer_id)
    pieces.append(rename("model.norm.weight", "norm.weight"))
    if args.num_labels is not None:  # a sequence classifier's score head
        pieces.append(rename("score.weight", "output.weight"))
    elif not args.tie_embeddings:
        pieces.append(rename("lm_head.weight", "output.weight"))
    return pieces
