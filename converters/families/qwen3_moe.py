"""Qwen3-MoE: Qwen3 attention; top-k routed experts (optionally renormalised) on the sparse layers."""

from hfnative.models.args import MoEArgs

from .common import Family, all_layers_sliding, attention_pieces, dense_args, llama_norm_pieces, mlp_pieces, rename, stacked


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
        ),
        moe_layers=moe_layers,
        **all_layers_sliding(config),
    )


def layer_pieces(args, layer_id):
    if not args.is_moe_layer(layer_id):
        return attention_pieces(args, layer_id) + mlp_pieces(args, layer_id) + llama_norm_pieces(layer_id)
    hf, nat = f"model.layers.{layer_id}.mlp.", f"layers.{layer_id}.moe."
    experts = args.moe.num_experts
    return (
        attention_pieces(args, layer_id)
        + [rename(f"{hf}gate.weight", f"{nat}router.weight")]
        + stacked(lambda e: f"{hf}experts.{e}.gate_proj.weight", f"{nat}experts.w1", experts)
        + stacked(lambda e: f"{hf}experts.{e}.up_proj.weight", f"{nat}experts.w3", experts)
        + stacked(lambda e: f"{hf}experts.{e}.down_proj.weight", f"{nat}experts.w2", experts)
        + llama_norm_pieces(layer_id)
    )


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), config_to_args, layer_pieces)
