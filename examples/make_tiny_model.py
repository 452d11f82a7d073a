"""Build the tiny offline model and data that the quickstart trains on.

Writes, deterministically (fixed seeds, fixed order):
  examples/data/sft_messages.jsonl           200 conversations   {"messages": [...]}
  examples/data/sft_prompt_completion.jsonl  200 plain-text pairs {"prompt": ..., "completion": ...}
  examples/data/sft_text.jsonl               200 documents        {"text": ...}
  examples/data/eval_messages.jsonl           32 conversations whose questions never appear verbatim in training
  examples/tiny-qwen3/                        byte-level BPE tokenizer + ChatML template + random Qwen3

Usage (from the repository root):
  .venv/bin/python examples/make_tiny_model.py     # regenerate everything
  .venv/bin/python examples/check_tiny_model.py    # verify the files load and TRL trains on them
"""

import json
import os
import random
from pathlib import Path
from typing import NamedTuple

os.environ["HF_HUB_OFFLINE"] = "1"  # everything here is local; never reach for the Hub

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EXAMPLES_DIR = Path(__file__).resolve().parent
DATA_DIR = EXAMPLES_DIR / "data"
MODEL_DIR = EXAMPLES_DIR / "tiny-qwen3"

PAD_TOKEN, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOKENIZER_VOCAB_SIZE = 1024

# ChatML as Qwen writes it. The assistant's content and its closing <|im_end|> sit inside
# {% generation %} so return_assistant_tokens_mask (TRL's assistant_only_loss) trains the model to stop.
CHAT_TEMPLATE = r"""{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
            {{- message.content + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant. Answer in one sentence."]

COUNTRY_CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
    ("Greece", "Athens"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Hungary", "Budapest"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Nigeria", "Abuja"), ("Ghana", "Accra"), ("Morocco", "Rabat"), ("Japan", "Tokyo"),
    ("China", "Beijing"), ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Peru", "Lima"),
    ("Chile", "Santiago"), ("Argentina", "Buenos Aires"), ("Colombia", "Bogota"), ("Brazil", "Brasilia"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Russia", "Moscow"), ("Turkey", "Ankara"),
]

# (from unit, to unit, how many "to" units in one "from" unit)
UNIT_CONVERSIONS = [
    ("kilometres", "metres", 1000), ("metres", "centimetres", 100), ("kilograms", "grams", 1000),
    ("litres", "millilitres", 1000), ("hours", "minutes", 60), ("minutes", "seconds", 60),
    ("days", "hours", 24), ("weeks", "days", 7), ("years", "months", 12),
]

WORD_DEFINITIONS = [
    ("apple", "a round fruit with red or green skin"), ("river", "a large stream of water flowing to the sea"),
    ("mountain", "a very high hill"), ("teacher", "a person who helps others learn"),
    ("bread", "a food made from flour, water and yeast"), ("clock", "a device that shows the time"),
    ("bridge", "a structure that lets people cross over a river or road"),
    ("library", "a place where books are kept for people to read"), ("winter", "the coldest season of the year"),
    ("ocean", "a very large area of salt water"), ("planet", "a large body that moves around a star"),
    ("doctor", "a person who treats people who are ill"), ("garden", "a piece of land where plants are grown"),
    ("island", "a piece of land with water all around it"), ("kitchen", "a room where food is cooked"),
    ("forest", "a large area covered with trees"), ("pencil", "a thin stick used for writing or drawing"),
    ("desert", "a dry area with very little rain"), ("window", "an opening in a wall that lets in light"),
    ("market", "a place where people buy and sell goods"),
]

# Short common words for the spelling tasks (reverse, count letters).
SPELLING_WORDS = [
    "cat", "dog", "sun", "moon", "star", "tree", "book", "fish", "bird", "rain", "snow", "milk", "lamp",
    "door", "road", "ship", "apple", "table", "chair", "water", "house", "green", "light", "music",
    "paper", "river", "stone", "train", "banana", "orange", "garden", "window", "purple", "yellow",
]


class QuestionAnswer(NamedTuple):
    question: str
    answer: str
    fact: str  # the same knowledge as a plain statement, for the language-modelling file


def arithmetic(rng: random.Random) -> QuestionAnswer:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    symbol, word, result = rng.choice([("+", "plus", a + b), ("-", "minus", a - b), ("*", "times", a * b)])
    if symbol == "-" and a < b:  # keep answers non-negative
        a, b, result = b, a, b - a
    question = rng.choice([f"What is {a} {symbol} {b}?", f"Compute {a} {symbol} {b}."])
    return QuestionAnswer(question, f"{a} {symbol} {b} = {result}.", f"{a} {word} {b} is {result}.")


def capital(rng: random.Random) -> QuestionAnswer:
    country, city = rng.choice(COUNTRY_CAPITALS)
    question = rng.choice([f"What is the capital of {country}?", f"Which city is the capital of {country}?"])
    statement = f"The capital of {country} is {city}."
    return QuestionAnswer(question, statement, statement)


def unit_conversion(rng: random.Random) -> QuestionAnswer:
    from_unit, to_unit, factor = rng.choice(UNIT_CONVERSIONS)
    amount = rng.randint(2, 12)  # from 2 so every unit stays plural
    statement = f"{amount} {from_unit} is {amount * factor} {to_unit}."
    return QuestionAnswer(f"How many {to_unit} are in {amount} {from_unit}?", statement, statement)


def definition(rng: random.Random) -> QuestionAnswer:
    word, meaning = rng.choice(WORD_DEFINITIONS)
    question = rng.choice([f"What does the word '{word}' mean?", f"Define '{word}'."])
    return QuestionAnswer(question, f"'{word}' means {meaning}.", f"The word {word} means {meaning}.")


def reverse_word(rng: random.Random) -> QuestionAnswer:
    word = rng.choice(SPELLING_WORDS)
    statement = f"The word '{word}' reversed is '{word[::-1]}'."
    return QuestionAnswer(f"Reverse the word '{word}'.", statement, statement)


def count_letters(rng: random.Random) -> QuestionAnswer:
    word = rng.choice(SPELLING_WORDS)
    if rng.random() < 0.5:
        statement = f"The word '{word}' has {len(word)} letters."
        return QuestionAnswer(f"How many letters are in the word '{word}'?", statement, statement)
    letter = rng.choice(sorted(set(word)))
    count = word.count(letter)
    statement = f"The letter '{letter}' appears {count} time{'s' if count > 1 else ''} in '{word}'."
    return QuestionAnswer(f"How many times does the letter '{letter}' appear in '{word}'?", statement, statement)


TASKS = [arithmetic, capital, unit_conversion, definition, reverse_word, count_letters]


def draw_question_answer(rng: random.Random, held_out_questions: set[str]) -> QuestionAnswer:
    """One question from a random task, redrawn until it is not one of the held-out (eval) questions."""
    while True:
        pair = rng.choice(TASKS)(rng)
        if pair.question not in held_out_questions:
            return pair


def make_conversation(rng: random.Random, held_out_questions: set[str]) -> dict:
    """{"messages": [...]}: optional system prompt, then one or two user/assistant turns."""
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.choice([1, 1, 2])):
        pair = draw_question_answer(rng, held_out_questions)
        messages.append({"role": "user", "content": pair.question})
        messages.append({"role": "assistant", "content": pair.answer})
    return {"messages": messages}


def make_prompt_completion(rng: random.Random, held_out_questions: set[str]) -> dict:
    # The completion starts with a space so "Answer:" ends on a token boundary and the tokenized
    # prompt stays a prefix of the tokenized prompt + completion.
    pair = draw_question_answer(rng, held_out_questions)
    return {"prompt": f"Question: {pair.question}\nAnswer:", "completion": f" {pair.answer}"}


def make_text(rng: random.Random, held_out_questions: set[str]) -> dict:
    facts = [draw_question_answer(rng, held_out_questions).fact for _ in range(rng.randint(2, 4))]
    return {"text": " ".join(facts)}


def make_datasets() -> dict[str, list[dict]]:
    """All four files' rows. Each file has its own seed so resizing one leaves the others unchanged."""
    eval_rows = [make_conversation(random.Random(1000 + i), set()) for i in range(32)]
    eval_questions = {m["content"] for row in eval_rows for m in row["messages"] if m["role"] == "user"}
    rng_messages, rng_pairs, rng_text = random.Random(1), random.Random(2), random.Random(3)
    return {
        "sft_messages.jsonl": [make_conversation(rng_messages, eval_questions) for _ in range(200)],
        "sft_prompt_completion.jsonl": [make_prompt_completion(rng_pairs, eval_questions) for _ in range(200)],
        "sft_text.jsonl": [make_text(rng_text, eval_questions) for _ in range(200)],
        "eval_messages.jsonl": eval_rows,
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as file:
        for row in rows:
            file.write(json.dumps(row, ensure_ascii=False) + "\n")


def tokenizer_corpus(datasets: dict[str, list[dict]]) -> list[str]:
    """Every string the tokenizer will see, with role names as the chat template writes them."""
    corpus = []
    for rows in datasets.values():
        for row in rows:
            if "messages" in row:
                corpus += [f"{m['role']}\n{m['content']}" for m in row["messages"]]
            elif "prompt" in row:
                corpus.append(row["prompt"] + row["completion"])
            else:
                corpus.append(row["text"])
    return corpus


def train_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 / Qwen style) with the ChatML special tokens at ids 0, 1, 2."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)  # exact offsets for assistant masks
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[PAD_TOKEN, TURN_START, TURN_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=None,
        eos_token=TURN_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


# tiny-qwen3's shape; the other shipped checkpoints (make_teacher.py, make_vllm_model.py) change some of it
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128)


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **shape) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 (``seed``) over ``tokenizer``: TINY_SHAPE with ``shape``'s changes."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        **{**TINY_SHAPE, **shape},
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def make_everything() -> None:
    datasets = make_datasets()
    for file_name, rows in datasets.items():
        write_jsonl(DATA_DIR / file_name, rows)
    tokenizer = train_tokenizer(tokenizer_corpus(datasets))
    tokenizer.save_pretrained(MODEL_DIR)
    build_model(tokenizer).save_pretrained(MODEL_DIR)
    print(f"wrote {DATA_DIR} and {MODEL_DIR} (vocab {len(tokenizer)})")


if __name__ == "__main__":
    make_everything()
