"""Gemma 3 (text): (1 + w) RMSNorm, scaled embeddings, sandwich norms, qk-norm, GELU-tanh,
sliding/global layers with their own RoPE bases, query_pre_attn_scalar attention scale."""

from .common import Family, attention_pieces, dense_args, layer_types_sliding, mlp_pieces, rename, rope_args, unsupported


def config_to_args(config):
    if getattr(config, "use_bidirectional_attention", False):
        raise unsupported(config, "use_bidirectional_attention", True, [False])
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise unsupported(config, "attn_logit_softcapping", config.attn_logit_softcapping, [None])
    rope = config.rope_parameters
    return dense_args(
        config,
        norm_unit_offset=True,
        qk_norm=True,
        qkv_bias=config.attention_bias,
        output_proj_bias=config.attention_bias,
        norm_placement="sandwich",
        embedding_scale=config.hidden_size**0.5,
        attention_scale=config.query_pre_attn_scalar**-0.5,
        final_logit_softcap=config.final_logit_softcapping,
        rope=rope_args(config, rope["full_attention"]),
        local_rope=rope_args(config, rope["sliding_attention"]),
        **layer_types_sliding(config),
    )


def layer_pieces(args, layer_id):
    hf, nat = f"model.layers.{layer_id}.", f"layers.{layer_id}."
    norms = (
        ("input_layernorm", "attention_norm"),
        ("post_attention_layernorm", "post_attention_norm"),
        ("pre_feedforward_layernorm", "ffn_norm"),
        ("post_feedforward_layernorm", "post_ffn_norm"),
    )
    return (
        attention_pieces(args, layer_id)
        + mlp_pieces(args, layer_id)
        + [rename(f"{hf}{a}.weight", f"{nat}{b}.weight") for a, b in norms]
    )


FAMILY = Family("gemma3_text", ("Gemma3ForCausalLM",), config_to_args, layer_pieces)
