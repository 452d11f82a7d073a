"""Check that examples/tiny-qwen3 and examples/data load offline and that TRL trains on them.

Run from the repository root after make_tiny_model.py:
  .venv/bin/python examples/check_tiny_model.py

Asserts the tokenizer's special tokens and chat template (assistant mask, prompt/completion prefix),
that every row fits in MAX_TOKENS_PER_ROW, that a forward pass gives a finite loss near ln(vocab),
then runs TRL's SFTTrainer for 3 steps on each training file. Writes only under a temporary folder.
"""

import json
import math
import tempfile

from make_tiny_model import CHAT_TEMPLATE, DATA_DIR, MODEL_DIR  # also sets HF_HUB_OFFLINE=1

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

MAX_TOKENS_PER_ROW = 96  # the quickstart uses max_length 128; leave headroom


def read_jsonl(file_name: str) -> list[dict]:
    with open(DATA_DIR / file_name, encoding="utf-8") as file:
        return [json.loads(line) for line in file]


def check_special_tokens(tokenizer, model) -> None:
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.chat_template.strip() == CHAT_TEMPLATE.strip()
    assert model.config.vocab_size == len(tokenizer)
    for config in (model.config, model.generation_config):
        assert config.eos_token_id == tokenizer.eos_token_id and config.pad_token_id == tokenizer.pad_token_id


def check_conversation(tokenizer, messages: list[dict]) -> None:
    """The prompt renders as a prefix of the full chat, and the assistant mask covers exactly
    each assistant content followed by its <|im_end|>."""
    full_text = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert full_text.startswith(prompt_text), (prompt_text, full_text)

    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    input_ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assert len(input_ids) <= MAX_TOKENS_PER_ROW, (len(input_ids), messages)
    assert tokenizer.decode(input_ids) == full_text  # byte-level BPE round-trips exactly

    masked_spans, current_span = [], []
    for token_id, is_assistant in zip(input_ids, mask):
        if is_assistant:
            current_span.append(token_id)
        elif current_span:
            masked_spans.append(tokenizer.decode(current_span))
            current_span = []
    if current_span:
        masked_spans.append(tokenizer.decode(current_span))
    expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert masked_spans == expected, (masked_spans, expected)


def check_plain_text(tokenizer, rows: list[dict]) -> None:
    for row in rows:
        if "prompt" in row:
            prompt_ids = tokenizer(row["prompt"])["input_ids"]
            full_ids = tokenizer(row["prompt"] + row["completion"] + tokenizer.eos_token)["input_ids"]
            assert full_ids[: len(prompt_ids)] == prompt_ids, row
        else:
            full_ids = tokenizer(row["text"] + tokenizer.eos_token)["input_ids"]
        assert len(full_ids) <= MAX_TOKENS_PER_ROW, (len(full_ids), row)


def check_forward(tokenizer, model, messages: list[dict]) -> None:
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        loss = model(**encoded, labels=encoded["input_ids"]).loss.item()
    # A random init predicts close to uniformly, so the loss sits near ln(vocab size).
    assert abs(loss - math.log(len(tokenizer))) < 0.5, loss
    num_tokens = encoded["input_ids"].shape[1]
    print(f"forward pass: {num_tokens} tokens, loss {loss:.3f} (ln V = {math.log(len(tokenizer)):.3f})")


def run_sft(file_name: str, output_dir: str, **config_overrides) -> None:
    """Three SFTTrainer steps on one data file; fails if TRL rejects the data or the template."""
    train_dataset = load_dataset("json", data_files=str(DATA_DIR / file_name), split="train")
    eval_dataset = load_dataset("json", data_files=str(DATA_DIR / "eval_messages.jsonl"), split="train")
    config = SFTConfig(
        output_dir=output_dir,
        max_steps=3,
        per_device_train_batch_size=8,
        max_length=128,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        report_to="none",
        **config_overrides,
    )
    trainer = SFTTrainer(
        model=str(MODEL_DIR),
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset if "messages" in file_name else None,
        processing_class=AutoTokenizer.from_pretrained(MODEL_DIR),
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
    summary = f"SFT {file_name} {config_overrides or ''}: losses {[round(loss, 3) for loss in losses]}"
    if trainer.eval_dataset is not None:
        summary += f", eval_loss {trainer.evaluate()['eval_loss']:.3f}"
    print(summary)


def check_everything() -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    check_special_tokens(tokenizer, model)

    conversations = read_jsonl("sft_messages.jsonl") + read_jsonl("eval_messages.jsonl")
    for row in conversations:
        check_conversation(tokenizer, row["messages"])
    check_plain_text(tokenizer, read_jsonl("sft_prompt_completion.jsonl") + read_jsonl("sft_text.jsonl"))
    print(f"template and lengths: {len(conversations)} conversations ok")

    check_forward(tokenizer, model, conversations[0]["messages"])

    with tempfile.TemporaryDirectory(prefix="tiny-qwen3-sft-") as output_dir:
        run_sft("sft_messages.jsonl", output_dir, assistant_only_loss=True)
        run_sft("sft_prompt_completion.jsonl", output_dir)
        run_sft("sft_text.jsonl", output_dir)
    print("all checks passed")


if __name__ == "__main__":
    check_everything()
