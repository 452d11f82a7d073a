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

from transformers import Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_model import EXAMPLES_DIR, build_model, make_datasets, tokenizer_corpus, train_tokenizer  # noqa: E402

MODEL_DIR = EXAMPLES_DIR / "tiny-qwen3-hd32"


def build_hd32_model(tokenizer) -> Qwen3ForCausalLM:
    # init std 0.1: larger logit gaps, so greedy decoding rarely meets near-ties between the engines
    return build_model(tokenizer, hidden_size=128, head_dim=32, intermediate_size=256, initializer_range=0.1)


def main() -> None:
    tokenizer = train_tokenizer(tokenizer_corpus(make_datasets()))
    tokenizer.save_pretrained(MODEL_DIR)
    build_hd32_model(tokenizer).save_pretrained(MODEL_DIR)
    print(f"wrote {MODEL_DIR} (vocab {len(tokenizer)}, head_dim 32)")


if __name__ == "__main__":
    main()
