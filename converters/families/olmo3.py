"""OLMo 3: norms after each sublayer (no pre-norm), RMSNorm over the whole q and k projections,
sliding/full layers with their own RoPE, optional q/k/v/o biases."""

from .common import Family, attention_pieces, dense_args, layer_types_sliding, mlp_pieces, rename, rope_args


def config_to_args(config):
    rope = config.rope_parameters
    # transformers' yarn reads `truncate` from the top level of rope_parameters, not the layer type's entry
    truncate = {"truncate": rope.get("truncate", True)}
    return dense_args(
        config,
        norm_placement="post",
        qk_norm=True,
        qk_norm_scope="projection",
        norm_scale_in_float32=True,
        rotary_in_float32=True,
        qkv_bias=config.attention_bias,
        output_proj_bias=config.attention_bias,
        rope=rope_args(config, {**rope["full_attention"], **truncate}),
        local_rope=rope_args(config, {**rope["sliding_attention"], **truncate}),
        **layer_types_sliding(config),
    )


def layer_pieces(args, layer_id):
    hf, nat = f"model.layers.{layer_id}.", f"layers.{layer_id}."
    norms = (("post_attention_layernorm", "post_attention_norm"), ("post_feedforward_layernorm", "post_ffn_norm"))
    return (
        attention_pieces(args, layer_id)
        + mlp_pieces(args, layer_id)
        + [rename(f"{hf}{a}.weight", f"{nat}{b}.weight") for a, b in norms]
    )


FAMILY = Family("olmo3", ("Olmo3ForCausalLM",), config_to_args, layer_pieces)
