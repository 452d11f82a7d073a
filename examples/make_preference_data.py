"""Build the shipped preference data for DPO from the shipped conversations.

Writes, deterministically (fixed seed, fixed order):
  examples/data/preference.jsonl   200 rows {"prompt": [messages], "chosen": [reply], "rejected": [reply]}

Each row's prompt is a conversation of data/sft_messages.jsonl up to its last assistant turn; "chosen"
is that conversation's own reply, "rejected" the reply to another question (a fluent wrong answer).

Usage (from the repository root):
  .venv/bin/python examples/make_preference_data.py
"""

import json
import random
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
SOURCE = DATA_DIR / "sft_messages.jsonl"
TARGET = DATA_DIR / "preference.jsonl"
SEED = 0


def preference_rows(conversations: list[list[dict]], seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    replies = [messages[-1]["content"] for messages in conversations]
    rows = []
    for index, messages in enumerate(conversations):
        chosen = replies[index]
        other = rng.randrange(len(replies))
        while replies[other] == chosen:
            other = rng.randrange(len(replies))
        rows.append({
            "prompt": messages[:-1],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": replies[other]}],
        })
    return rows


def main() -> None:
    with open(SOURCE) as f:
        conversations = [json.loads(line)["messages"] for line in f]
    rows = preference_rows(conversations)
    with open(TARGET, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {TARGET}")


if __name__ == "__main__":
    main()
