"""A small PPO run (tiny-qwen3 policy, random one-label Qwen3 reward and value models) shared by the PPO tests; run as
a script (``python _ppo_worker.py OUTPUT_DIR MODELS_DIR KILL_AT_STEP``) it trains and SIGKILLs itself when step
KILL_AT_STEP begins (a run that dies without saving anything more)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "tiny-qwen3")
STEPS, SAVED = 4, 2


def save_classifier(folder: Path, seed: int, kv_heads: int = 1) -> str:
    """A random one-label Qwen3 sequence classifier with tiny-qwen3's tokenizer (``kv_heads`` key/value heads of its 2
    query heads: 2 splits over 2 tensor-parallel ranks)."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    config = Qwen3Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=16, num_labels=1, pad_token_id=0)
    torch.manual_seed(seed)
    Qwen3ForSequenceClassification(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(MODEL) / name, Path(folder) / name)
    return str(folder)


def prompt_rows(n: int = 8) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    words = ["sky", "fox", "robot", "count", "blue", "grass", "tree", "sun"]
    return [{"input_ids": tokenizer(f"Tell me about the {words[i % 8]} number {i}" + " again" * (i % 3))["input_ids"]}
            for i in range(n)]


def ppo_trainer(output_dir, models_dir, callbacks=(), policy: str = MODEL, **extra):
    """PPO on 8 prompts, 4 updates of 4 rollouts (two passes over the data), saving at update 2; ``policy``: the
    policy's folder (tiny-qwen3's tokenizer in any case)."""
    import hfnative
    from datasets import Dataset
    from transformers import AutoTokenizer

    models_dir = Path(models_dir)
    folders = [models_dir / "reward", models_dir / "value"]
    for seed, folder in enumerate(folders, start=1):
        if not (folder / "config.json").exists():
            save_classifier(folder, seed)
    settings = dict(output_dir=str(output_dir), use_cpu=True, bf16=False, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, num_ppo_epochs=2, response_length=6, stop_token="eos",
                    total_episodes=16, learning_rate=3e-4, lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1,
                    report_to=[], disable_tqdm=True, save_strategy="steps", save_steps=SAVED, seed=5)
    settings.update(extra)
    return hfnative.PPOTrainer(hfnative.PPOConfig(**settings), AutoTokenizer.from_pretrained(MODEL, padding_side="left"),
                               str(policy), None, str(folders[0]), Dataset.from_list(prompt_rows()), str(folders[1]),
                               callbacks=list(callbacks))


class KillAtStep(TrainerCallback):
    """SIGKILL this process when step ``step`` begins."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    torch.set_num_threads(1)
    ppo_trainer(sys.argv[1], sys.argv[2], callbacks=[KillAtStep(int(sys.argv[3]))]).train()
