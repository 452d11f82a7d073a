"""Build the offline teacher that the distillation examples and tests distil into tiny-qwen3.

Writes, deterministically (fixed seed), examples/tiny-qwen3-teacher/: tiny-qwen3's tokenizer files copied
unchanged (so the vocabulary is the same, as distillation requires) and a randomly initialised Qwen3 about twice
the student's size (3 layers, hidden size 96, float32).

Usage (from the repository root, after examples/make_tiny_model.py):
  .venv/bin/python examples/make_teacher.py
"""

import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"  # everything here is local; never reach for the Hub

from transformers import AutoTokenizer, Qwen3ForCausalLM

from make_tiny_model import MODEL_DIR, build_model

TEACHER_DIR = MODEL_DIR.parent / "tiny-qwen3-teacher"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_teacher(tokenizer) -> Qwen3ForCausalLM:
    return build_model(tokenizer, seed=1, hidden_size=96, num_hidden_layers=3, num_attention_heads=6)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_teacher() -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    TEACHER_DIR.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(MODEL_DIR / name, TEACHER_DIR / name)
    teacher = build_teacher(tokenizer)
    teacher.save_pretrained(TEACHER_DIR)
    student = parameter_count(build_model(tokenizer))
    print(f"wrote {TEACHER_DIR}: {parameter_count(teacher)} parameters, {parameter_count(teacher) / student:.2f}x "
          f"the student's {student} (vocab {len(tokenizer)})")


if __name__ == "__main__":
    make_teacher()
