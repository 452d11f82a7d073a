"""Mixtral: Mistral attention; every layer's feed-forward is top-k routed experts (renormalised)."""

from hfnative.models.args import MoEArgs

from .common import Family, all_layers_sliding, attention_pieces, dense_args, llama_norm_pieces, rename, stacked


def config_to_args(config):
    return dense_args(
        config,
        moe=MoEArgs(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            normalize_top_k=True,
        ),
        **all_layers_sliding(config),
    )


def layer_pieces(args, layer_id):
    hf, nat = f"model.layers.{layer_id}.block_sparse_moe.", f"layers.{layer_id}.moe."
    experts = args.moe.num_experts
    return (
        attention_pieces(args, layer_id)
        + [rename(f"{hf}gate.weight", f"{nat}router.weight")]
        + stacked(lambda e: f"{hf}experts.{e}.w1.weight", f"{nat}experts.w1", experts)
        + stacked(lambda e: f"{hf}experts.{e}.w3.weight", f"{nat}experts.w3", experts)
        + stacked(lambda e: f"{hf}experts.{e}.w2.weight", f"{nat}experts.w2", experts)
        + llama_norm_pieces(layer_id)
    )


FAMILY = Family("mixtral", ("MixtralForCausalLM",), config_to_args, layer_pieces)
