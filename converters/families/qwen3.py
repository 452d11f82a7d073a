"""Qwen3: Llama with RMSNorm on each query and key head before RoPE."""

from .common import Family, dense_args, layer_types_sliding, llama_layer_pieces


def config_to_args(config):
    return dense_args(
        config,
        qk_norm=True,
        qkv_bias=config.attention_bias,
        output_proj_bias=config.attention_bias,
        **layer_types_sliding(config),
    )


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), config_to_args, llama_layer_pieces)
