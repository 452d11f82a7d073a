"""Qwen3-MoE: Qwen3 attention; top-k routed experts (optionally renormalised) on the sparse layers."""

from hfnative.models.args import MoEArgs

from .common import Family, all_layers_sliding, attention_pieces, dense_args, llama_norm_pieces, mlp_pieces, moe_pieces


def config_to_args(config):
    moe_layers = [
        config.num_experts > 0
        and layer_id not in (config.mlp_only_layers or [])
        and (layer_id + 1) % config.decoder_sparse_step == 0
        for layer_id in range(config.num_hidden_layers)
    ]
    return dense_args(
        config,
        qk_norm=True,
        qkv_bias=config.attention_bias,
        output_proj_bias=config.attention_bias,
        moe=MoEArgs(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            normalize_top_k=config.norm_topk_prob,
            aux_loss_coef=getattr(config, "router_aux_loss_coef", 0.0),
        ),
        moe_layers=moe_layers,
        **all_layers_sliding(config),
    )


def layer_pieces(args, layer_id):
    if not args.is_moe_layer(layer_id):
        return attention_pieces(args, layer_id) + mlp_pieces(args, layer_id) + llama_norm_pieces(layer_id)
    moe = moe_pieces(args, layer_id, "mlp", "gate_proj", "up_proj", "down_proj")
    return attention_pieces(args, layer_id) + moe + llama_norm_pieces(layer_id)


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), config_to_args, layer_pieces)
