"""Tiny transformers configs, two or more per supported family, each stressing a different feature.

Built with transformers' own config classes; models are random-initialised with a fixed seed and
saved to disk, so the tests exercise the same loading code as a real Hub checkpoint.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo3Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=256)

CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2),
    "llama-mha-tied-llama3": lambda: LlamaConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama-linear-headdim12-bias": lambda: LlamaConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ),
    "llama-yarn": lambda: LlamaConfig(
        **COMMON,
        num_attention_heads=2,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "mistral-gqa-window": lambda: MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=5),
    "mistral-mha": lambda: MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4, sliding_window=None),
    "qwen2-gqa": lambda: Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2),
    "qwen2-tied-sliding-layers": lambda: Qwen2Config(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    "qwen3-gqa": lambda: Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen3-mha-tied-bias": lambda: Qwen3Config(
        **COMMON, num_attention_heads=2, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, attention_bias=True
    ),
    "qwen3moe-topk-norm": lambda: Qwen3MoeConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
    ),
    "qwen3moe-sparse-step": lambda: Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3},
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        num_experts=3,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[2],
    ),
    "mixtral-top2": lambda: MixtralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "mixtral-window-top1": lambda: MixtralConfig(
        **COMMON, num_attention_heads=2, num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=1, sliding_window=5
    ),
    "phi3-gqa": lambda: Phi3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "phi3-partial-rotary-window": lambda: Phi3Config(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        sliding_window=6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "gemma3-alternating": lambda: Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3},
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        sliding_window_pattern=2,
        query_pre_attn_scalar=16,
    ),
    "gemma3-softcap-linear-untied": lambda: Gemma3TextConfig(
        **COMMON,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=5.0,
        tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "olmo3-sliding-gqa": lambda: Olmo3Config(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=2,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "olmo3-tied-yarn-bias-full": lambda: Olmo3Config(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=4,
        eos_token_id=2,
        tie_word_embeddings=True,
        attention_bias=True,
        layer_types=["full_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.2},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "gptoss-alternating-yarn": lambda: GptOssConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64,
        },
    ),
    # a clamp limit the tiny activations reach, so the clamped SwiGLU's both sides are exercised
    "gptoss-tied-top1-clamped": lambda: GptOssConfig(
        **{**COMMON, "num_hidden_layers": 3},
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=3,
        num_experts_per_tok=1,
        swiglu_limit=0.1,
        swiglu_alpha=1.3,
        tie_word_embeddings=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
# transformers runs these model types only with its eager attention (no SDPA path)
EAGER_ONLY = {"gpt_oss"}

ONE_PER_FAMILY = [
    "llama-gqa",
    "mistral-gqa-window",
    "qwen2-gqa",
    "qwen3-gqa",
    "qwen3moe-topk-norm",
    "mixtral-top2",
    "phi3-gqa",
    "gemma3-softcap-linear-untied",
    "olmo3-sliding-gqa",
    "gptoss-alternating-yarn",
]


def make_hf_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    attention = "eager" if config.model_type in EAGER_ONLY else "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    with torch.no_grad():  # norms start at exactly 1 (or 0 for Gemma); perturb them so they are tested
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.1)
            elif param_name.endswith("sinks") or param_name.endswith("_bias"):  # GPT-OSS: small or zero at init
                param.add_(torch.randn_like(param))
    return model.eval()


def save_hf_model(name: str, directory, dtype: torch.dtype = torch.float32, max_shard_size="50GB"):
    model = make_hf_model(name, dtype)
    model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    return model
