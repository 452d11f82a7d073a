"""Build examples/tiny-qwen3-hd32/: a tiny random Qwen3 with head_dim 32 and the quickstart's tokenizer.

vLLM's CPU attention needs a head_dim of at least 32; examples/tiny-qwen3 has 16. The tokenizer is the
one examples/make_tiny_model.py trains (same corpus, same settings), so token ids mean the same in both.
The weights are drawn with a wider init (std 0.1) than transformers' default so the logits are spread
out and greedy decoding has few near-ties between backends.

Usage (from the repository root):
  .venv/bin/python examples/make_vllm_model.py
"""

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # everything here is local; never reach for the Hub

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_model import EXAMPLES_DIR, make_datasets, tokenizer_corpus, train_tokenizer  # noqa: E402

MODEL_DIR = EXAMPLES_DIR / "tiny-qwen3-hd32"


def build_model(tokenizer) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def main() -> None:
    tokenizer = train_tokenizer(tokenizer_corpus(make_datasets()))
    tokenizer.save_pretrained(MODEL_DIR)
    build_model(tokenizer).save_pretrained(MODEL_DIR)
    print(f"wrote {MODEL_DIR} (vocab {len(tokenizer)}, head_dim 32)")


if __name__ == "__main__":
    main()
