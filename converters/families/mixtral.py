"""Mixtral: Mistral attention; every layer's feed-forward is top-k routed experts (renormalised)."""

from hfnative.models.args import MoEArgs

from .common import Family, all_layers_sliding, attention_pieces, dense_args, llama_norm_pieces, moe_pieces


def config_to_args(config):
    return dense_args(
        config,
        moe=MoEArgs(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            normalize_top_k=True,
            aux_loss_coef=getattr(config, "router_aux_loss_coef", 0.0),
        ),
        **all_layers_sliding(config),
    )


def layer_pieces(args, layer_id):
    moe = moe_pieces(args, layer_id, "block_sparse_moe", "w1", "w3", "w2")
    return attention_pieces(args, layer_id) + moe + llama_norm_pieces(layer_id)


FAMILY = Family("mixtral", ("MixtralForCausalLM",), config_to_args, layer_pieces)
