"""Qwen2 / Qwen2.5: Llama with q/k/v biases (no output bias) and per-layer sliding windows."""

from .common import Family, dense_args, layer_types_sliding, llama_layer_pieces


def config_to_args(config):
    return dense_args(config, qkv_bias=True, **layer_types_sliding(config))


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), config_to_args, llama_layer_pieces)
