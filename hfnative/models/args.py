"""ModelArgs: every number and switch that distinguishes one decoder family from another.

The decoder in ``decoder.py`` is built only from this dataclass; families differ by the values
they put here (see ``converters/families``, installed as ``hfnative.converters.families``), never by code
paths of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


NORM_PLACEMENTS = ("pre", "sandwich", "post")
QK_NORM_SCOPES = ("head", "projection")


@dataclass
class RopeArgs:
    """Rotary position embedding parameters (the ``rope_parameters`` of a transformers config)."""

    theta: float = 10000.0
    scaling: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0


@dataclass
class MoEArgs:
    """Token-choice top-k mixture of experts (Qwen3-MoE, Mixtral, GPT-OSS)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool = True  # renormalise the k routing weights to sum to one
    # False: softmax over all experts, then top-k (Qwen3-MoE, Mixtral); True: top-k over the router
    # logits, then softmax over the k chosen (GPT-OSS; normalize_top_k does not apply)
    softmax_after_top_k: bool = False
    router_bias: bool = False
    expert_bias: bool = False  # a bias on each expert's gate, up and down projections
    # clamped SwiGLU (GPT-OSS): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit);
    # None -> the model's gated activation act(gate) * up
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # weight of the router's load-balancing loss in training (the checkpoint's router_aux_loss_coef)
    aux_loss_coef: float = 0.0


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-6
    # (1 + w) * x_normed instead of w * x_normed (Gemma)
    norm_unit_offset: bool = False
    activation: str = "silu"  # silu | gelu_tanh
    qkv_bias: bool = False
    output_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # what the q/k norms normalize: "head" (each head's head_dim channels, Qwen3, Gemma 3) or
    # "projection" (all heads of the q or k projection together, before the head split: OLMo 2/3)
    qk_norm_scope: str = "head"
    # where each block's norms sit: "pre" x + f(norm(x)) (Llama); "sandwich" x + norm(f(norm(x)))
    # (Gemma); "post" x + norm(f(x)) (OLMo 2/3)
    norm_placement: str = "pre"
    # norms multiply by their weight in float32 and cast after (OLMo, GPT-OSS) instead of casting first
    norm_scale_in_float32: bool = False
    # RoPE cos/sin and the rotation in float32, cast to the activations' dtype after (OLMo 3)
    rotary_in_float32: bool = False
    # a learned logit per query head in each softmax denominator, with no value (GPT-OSS)
    attention_sinks: bool = False
    tie_embeddings: bool = False
    # a sequence classifier (hfnative.models.classifier): the head scores num_labels classes at the last token
    # that is not pad_token_id (None: each row's last position, one row at a time); None -> a causal LM
    num_labels: int | None = None
    pad_token_id: int | None = None
    # the embedding row of this token gets no gradient from the lookup (transformers' padding_idx)
    padding_idx: int | None = None
    embedding_scale: float | None = None
    attention_scale: float | None = None  # None -> head_dim ** -0.5
    final_logit_softcap: float | None = None
    rope: RopeArgs = field(default_factory=RopeArgs)
    # RoPE for sliding-window layers when it differs from the global one (Gemma 3's local base)
    local_rope: RopeArgs | None = None
    sliding_window: int | None = None
    # per layer: "full_attention" or "sliding_attention"; None -> all full
    layer_types: list[str] | None = None
    moe: MoEArgs | None = None
    # per layer: True where the feed-forward is the MoE block; None -> all MoE when moe is set
    moe_layers: list[bool] | None = None

    def __post_init__(self):
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement={self.norm_placement!r}: expected one of {NORM_PLACEMENTS}")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"qk_norm_scope={self.qk_norm_scope!r}: expected one of {QK_NORM_SCOPES}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        if self.num_labels is not None and (self.num_labels < 1 or self.tie_embeddings):
            raise ValueError(f"num_labels={self.num_labels}, tie_embeddings={self.tie_embeddings}: a sequence classifier "
                             "has at least one label and its own score head (tie_embeddings=False)")
        if self.moe_layers is not None and len(self.moe_layers) != self.n_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.n_layers} layers")

    def layer_type(self, layer_id: int) -> str:
        return "full_attention" if self.layer_types is None else self.layer_types[layer_id]

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.moe is None:
            return False
        return True if self.moe_layers is None else self.moe_layers[layer_id]
