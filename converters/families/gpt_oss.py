"""GPT-OSS: attention with learned per-head sinks and q/k/v/o biases, alternating sliding/full layers,
yarn RoPE; every feed-forward is routed experts (top-k over the router logits, then softmax over the
k), with biases and a clamped SwiGLU. The Hub stores a layer's experts as fused tensors: gate_up_proj
[E, D, 2I] with gate and up interleaved column by column, down_proj [E, I, D]; released checkpoints
hold them in MXFP4 (``*_blocks`` / ``*_scales``), dequantized on load (see ``converters/mxfp4.py``)."""

from hfnative.models.args import MoEArgs

from .common import Family, Piece, attention_pieces, dense_args, layer_types_sliding, llama_norm_pieces, rename


def config_to_args(config):
    return dense_args(
        config,
        qkv_bias=config.attention_bias,
        output_proj_bias=config.attention_bias,
        attention_sinks=True,
        norm_scale_in_float32=True,
        moe=MoEArgs(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            softmax_after_top_k=True,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=config.swiglu_limit,
            swiglu_alpha=config.swiglu_alpha,
            aux_loss_coef=getattr(config, "router_aux_loss_coef", 0.0),
        ),
        **layer_types_sliding(config),
    )


def expert_pieces(layer_id: int) -> list[Piece]:
    hf, nat = f"model.layers.{layer_id}.mlp.", f"layers.{layer_id}.moe."
    gate, up = (0, 2), (1, 2)  # gate_up columns alternate gate, up
    return [
        rename(f"{hf}router.weight", f"{nat}router.weight"),
        rename(f"{hf}router.bias", f"{nat}router.bias"),
        Piece(f"{hf}experts.gate_up_proj", f"{nat}experts.w1", interleaved=gate, transposed=True),
        Piece(f"{hf}experts.gate_up_proj", f"{nat}experts.w3", interleaved=up, transposed=True),
        Piece(f"{hf}experts.gate_up_proj_bias", f"{nat}experts.b1", interleaved=gate),
        Piece(f"{hf}experts.gate_up_proj_bias", f"{nat}experts.b3", interleaved=up),
        Piece(f"{hf}experts.down_proj", f"{nat}experts.w2", transposed=True),
        rename(f"{hf}experts.down_proj_bias", f"{nat}experts.b2"),
    ]


def layer_pieces(args, layer_id):
    return attention_pieces(args, layer_id) + expert_pieces(layer_id) + llama_norm_pieces(layer_id)


FAMILY = Family("gpt_oss", ("GptOssForCausalLM",), config_to_args, layer_pieces)
