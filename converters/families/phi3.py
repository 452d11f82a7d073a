"""Phi-3: Mistral-shaped, but the Hub weights fuse q/k/v into one matrix and gate/up into another."""

from .common import Family, all_layers_sliding, dense_args, fused, llama_norm_pieces, rename


def config_to_args(config):
    return dense_args(config, **all_layers_sliding(config))


def layer_pieces(args, layer_id):
    hf, nat = f"model.layers.{layer_id}.", f"layers.{layer_id}."
    q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    qkv = [(f"{nat}attention.wq.weight", q_rows), (f"{nat}attention.wk.weight", kv_rows), (f"{nat}attention.wv.weight", kv_rows)]
    gate_up = [(f"{nat}feed_forward.w1.weight", args.intermediate_size), (f"{nat}feed_forward.w3.weight", args.intermediate_size)]
    return (
        fused(f"{hf}self_attn.qkv_proj.weight", qkv)
        + [rename(f"{hf}self_attn.o_proj.weight", f"{nat}attention.wo.weight")]
        + fused(f"{hf}mlp.gate_up_proj.weight", gate_up)
        + [rename(f"{hf}mlp.down_proj.weight", f"{nat}feed_forward.w2.weight")]
        + llama_norm_pieces(layer_id)
    )


FAMILY = Family("phi3", ("Phi3ForCausalLM",), config_to_args, layer_pieces)
