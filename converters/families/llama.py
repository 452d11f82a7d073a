"""Llama 2/3.x: the base shape every other family varies (rope scaling: linear, llama3, yarn)."""

from .common import Family, dense_args, llama_layer_pieces


def config_to_args(config):
    return dense_args(
        config,
        qkv_bias=config.attention_bias,
        output_proj_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
    )


FAMILY = Family("llama", ("LlamaForCausalLM",), config_to_args, llama_layer_pieces)
