"""Mistral: Llama without biases, with an optional sliding window on every layer."""

from .common import Family, all_layers_sliding, dense_args, llama_layer_pieces


def config_to_args(config):
    return dense_args(config, **all_layers_sliding(config))


FAMILY = Family("mistral", ("MistralForCausalLM",), config_to_args, llama_layer_pieces)
