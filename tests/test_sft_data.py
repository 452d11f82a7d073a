"""hfnative.data against TRL 1.16 as the oracle: the prepared rows of `SFTTrainer(...).train_dataset`
and the batches of `trainer.data_collator` must be identical, format by format and packing by packing.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from _tiny_tokenizer import CHATML_TEMPLATE, EOS, IM_END, build_tiny_tokenizer, save_tiny_qwen3  # noqa: E402
from datasets import Dataset, IterableDataset  # noqa: E402

from hfnative.data import (  # noqa: E402
    LanguageModelingCollator,
    pack_dataset,
    pad_token_id_for,
    prepare_sft_dataset,
    uses_padding_free,
)

trl = pytest.importorskip("trl")
from trl import SFTConfig, SFTTrainer  # noqa: E402
from trl.data_utils import pack_dataset as trl_pack_dataset  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

# ---------------------------------------------------------------------------------------------- data

TEXT = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "What color is the sky?"},
    {"text": "Grass is green.<|endoftext|>"},  # already ends with EOS: none is added
    {"text": "Once upon a time there was a little robot who liked to count: one two three four five."},
    {"text": "one"},
    {"text": ""},
]

CHATS = [
    [{"role": "user", "content": "What color is the sky?"}, {"role": "assistant", "content": "Blue."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "one two three"},
        {"role": "user", "content": "And five?"},
        {"role": "assistant", "content": "four five"},
    ],
    [{"role": "user", "content": "def add(a, b)?"}, {"role": "assistant", "content": "return a + b"}],
]
MESSAGES = [{"messages": chat} for chat in CHATS]

PROMPT_COMPLETION = [
    {"prompt": "What color is the sky?", "completion": " The sky is blue."},
    {"prompt": "Grass is", "completion": " green."},
    {"prompt": "Once upon a time there was a little robot who liked to count", "completion": ": one two."},
    {"prompt": "The quick brown", "completion": " fox jumps over the lazy dog."},
]

CONVERSATIONAL_PROMPT_COMPLETION = [{"prompt": chat[:-1], "completion": chat[-1:]} for chat in CHATS]

PRETOKENIZED = [
    {"input_ids": [5, 6, 7, 8, 9, 10], "completion_mask": [0, 0, 0, 1, 1, 1]},
    {"input_ids": [11, 12, 13], "completion_mask": [0, 1, 1]},
    {"input_ids": list(range(20, 60)), "completion_mask": [0] * 38 + [1, 1]},  # completion cut by max_length
]

BASE = {"max_length": 48}


def _case(name, rows, config=None, *, tokenizer=None, formatting_func=None, iterable=False, batch_size=3):
    config = {**BASE, **(config or {})}
    return pytest.param(rows, config, tokenizer or {}, formatting_func, iterable, batch_size, id=name)


CASES = [
    _case("text", TEXT),
    _case("text-short-max-length", TEXT, {"max_length": 12}),
    _case("text-keep-end", TEXT, {"max_length": 12, "truncation_mode": "keep_end"}),
    _case("text-no-max-length", TEXT, {"max_length": None}),
    _case("text-bos-eos-override", TEXT, {"eos_token": IM_END}, tokenizer={"add_bos": True}),
    _case("text-no-pad-token-eos-override", TEXT, {"eos_token": IM_END}, tokenizer={"with_pad": False}),
    _case("text-shuffled", TEXT, {"shuffle_dataset": True, "seed": 3}),
    _case("text-field", [{"content": row["text"]} for row in TEXT], {"dataset_text_field": "content"}),
    _case("messages", MESSAGES, {"max_length": 64}),
    _case(
        "messages-eos-override-in-template",
        MESSAGES,
        {"max_length": 64, "eos_token": EOS},
        tokenizer={"chat_template": CHATML_TEMPLATE + "{{ eos_token }}"},
    ),
    _case("messages-assistant-only", MESSAGES, {"max_length": 64, "assistant_only_loss": True}),
    _case(
        "messages-tools-and-template-kwargs",
        [
            {**MESSAGES[0], "tools": '[{"name": "add"}]', "chat_template_kwargs": {"enable_thinking": False}},
            {**MESSAGES[2], "tools": None, "chat_template_kwargs": {"enable_thinking": True}},
        ],
        {"max_length": 128},
    ),
    _case(
        "sharegpt-conversations",
        [{"conversations": [{"from": m["role"], "value": m["content"]} for m in chat]} for chat in CHATS],
        {"max_length": 64},
    ),
    _case("prompt-completion", PROMPT_COMPLETION, {"max_length": 40}),
    _case("prompt-completion-full-loss", PROMPT_COMPLETION, {"max_length": 40, "completion_only_loss": False}),
    _case("prompt-completion-bos", PROMPT_COMPLETION, {"max_length": 40}, tokenizer={"add_bos": True}),
    _case("conversational-prompt-completion", CONVERSATIONAL_PROMPT_COMPLETION, {"max_length": 64}),
    _case(
        "conversational-prompt-completion-tools-thinking-off",  # the prompt alone renders differently
        [
            {**row, "tools": [{"name": "add"}], "chat_template_kwargs": {"enable_thinking": False}}
            for row in CONVERSATIONAL_PROMPT_COMPLETION
        ],
        {"max_length": 128},
    ),
    _case(
        "conversational-prompt-completion-assistant-only",
        CONVERSATIONAL_PROMPT_COMPLETION,
        {"max_length": 64, "assistant_only_loss": True},
    ),
    _case("pretokenized", PRETOKENIZED, {"max_length": 39}),
    _case("pretokenized-completion-only", PRETOKENIZED, {"max_length": 39, "completion_only_loss": True}),
    _case(
        "pretokenized-labels",
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, -100]}],
    ),
    _case(
        "formatting-func",
        [{"question": "What color is the sky?", "answer": "Blue."}, {"question": "Grass?", "answer": "Green."}],
        formatting_func=lambda row: f"Q: {row['question']} A: {row['answer']}",
    ),
    _case("bfd", TEXT, {"max_length": 40, "packing": True}),
    _case("bfd-conversational", MESSAGES, {"max_length": 64, "packing": True}),
    _case("bfd-prompt-completion", PROMPT_COMPLETION, {"max_length": 40, "packing": True}),
    _case("bfd-split", TEXT, {"max_length": 20, "packing": True, "packing_strategy": "bfd_split"}),
    _case("bfd-pad-to-multiple", TEXT, {"max_length": 40, "packing": True, "pad_to_multiple_of": 16}),
    _case("bfd-shuffled", TEXT, {"max_length": 40, "packing": True, "shuffle_dataset": True, "seed": 3}),
    _case("wrapped", TEXT, {"max_length": 20, "packing": True, "packing_strategy": "wrapped"}),
    _case(
        "wrapped-padding-free",
        TEXT,
        {"max_length": 20, "packing": True, "packing_strategy": "wrapped", "padding_free": True},
    ),
    _case("padding-free", TEXT, {"max_length": None, "padding_free": True}),
    _case(
        "padding-free-pad-to-multiple",
        MESSAGES,
        {"max_length": None, "padding_free": True, "pad_to_multiple_of": 8},
    ),
    _case("padded-pad-to-multiple", MESSAGES, {"max_length": 64, "pad_to_multiple_of": 8}),
    _case("iterable-text", TEXT, {"max_steps": 1}, iterable=True),
    _case("iterable-bfd", TEXT, {"max_length": 30, "packing": True, "max_steps": 1}, iterable=True),
    _case(
        "bfd-two-processes",
        [{"text": "one two three four five"[: 1 + i % 23]} for i in range(300)],
        {"max_length": 48, "packing": True, "dataset_num_proc": 2},
        batch_size=64,
    ),
    _case(
        "bfd-more-than-one-block",
        [{"text": "one two three four five"[: 1 + i % 23]} for i in range(1100)],
        {"max_length": 48, "packing": True},
        batch_size=64,
    ),
]

# the SFTConfig fields that are arguments of prepare_sft_dataset (the rest configure the trainer)
PREPARE_ARGS = (
    "dataset_text_field",
    "max_length",
    "packing",
    "packing_strategy",
    "padding_free",
    "completion_only_loss",
    "assistant_only_loss",
    "eos_token",
    "dataset_kwargs",
    "dataset_num_proc",
    "truncation_mode",
    "shuffle_dataset",
    "seed",
)

# --------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), len(build_tiny_tokenizer()))


def as_dataset(rows, iterable):
    if not iterable:
        return Dataset.from_list(rows)
    return IterableDataset.from_generator(lambda: iter(rows))


def rows_of(dataset):
    return list(dataset) if isinstance(dataset, IterableDataset) else dataset.to_list()


def trl_prepare(model_path, output_dir, rows, config, tokenizer_kwargs, formatting_func, iterable):
    """TRL's prepared dataset and collator (with its own fresh tokenizer: TRL sets pad/eos on it)."""
    args = SFTConfig(
        output_dir=str(output_dir), use_cpu=True, report_to="none", bf16=False, disable_tqdm=True, **config
    )
    trainer = SFTTrainer(
        model=model_path,
        args=args,
        train_dataset=as_dataset(rows, iterable),
        processing_class=build_tiny_tokenizer(**tokenizer_kwargs),
        formatting_func=formatting_func,
    )
    return trainer.train_dataset, trainer.data_collator


def our_prepare(rows, config, tokenizer_kwargs, formatting_func, iterable):
    tokenizer = build_tiny_tokenizer(**tokenizer_kwargs)
    kwargs = {key: config[key] for key in PREPARE_ARGS if key in config}
    dataset = prepare_sft_dataset(as_dataset(rows, iterable), tokenizer, formatting_func=formatting_func, **kwargs)
    collator = LanguageModelingCollator(
        pad_token_id=pad_token_id_for(tokenizer, config.get("eos_token")),
        padding_free=uses_padding_free(
            config.get("padding_free", False), config.get("packing", False), config.get("packing_strategy", "bfd")
        ),
        pad_to_multiple_of=config.get("pad_to_multiple_of"),
    )
    return dataset, collator


def assert_same_batch(ours: dict, theirs: dict):
    assert list(ours) == list(theirs)
    for key, expected in theirs.items():
        if isinstance(expected, torch.Tensor):
            assert ours[key].dtype == expected.dtype, key
            assert torch.equal(ours[key], expected), key
        else:
            assert ours[key] == expected, key


def model_inputs(row):
    return {key: row[key] for key in ("input_ids", "labels", "seq_lengths") if key in row}


# ----------------------------------------------------------------------------------- parity with TRL


@pytest.mark.parametrize("rows, config, tokenizer_kwargs, formatting_func, iterable, batch_size", CASES)
def test_prepared_rows_and_batches_match_trl(
    model_path, tmp_path, rows, config, tokenizer_kwargs, formatting_func, iterable, batch_size
):
    trl_dataset, trl_collator = trl_prepare(
        model_path, tmp_path, rows, config, tokenizer_kwargs, formatting_func, iterable
    )
    dataset, collator = our_prepare(rows, config, tokenizer_kwargs, formatting_func, iterable)

    assert type(dataset) is type(trl_dataset)
    if not iterable:
        assert dataset.column_names == trl_dataset.column_names
    ours, theirs = rows_of(dataset), rows_of(trl_dataset)
    assert len(theirs) > 0
    assert ours == theirs

    assert collator.pad_token_id == trl_collator.pad_token_id
    for start in range(0, len(theirs), batch_size):
        batch = [model_inputs(row) for row in theirs[start : start + batch_size]]
        assert_same_batch(collator(batch), trl_collator(batch))


def test_packed_rows_without_labels_are_dropped_and_others_unchanged(model_path, tmp_path, caplog):
    # A prompt longer than max_length fills a packed row of its own with no completion token: TRL keeps that
    # row, we drop it (and log it); every other row is TRL's, in TRL's order.
    rows = PROMPT_COMPLETION + [{"prompt": "Once upon a time there was a little robot who liked", "completion": " x"}]
    config = {"max_length": 30, "packing": True}
    trl_dataset, _ = trl_prepare(model_path, tmp_path, rows, config, {}, None, False)
    with caplog.at_level("WARNING", logger="hfnative.data.prepare"):
        dataset, _ = our_prepare(rows, config, {}, None, False)
    theirs = trl_dataset.to_list()
    labeled = [row for row in theirs if any(label != -100 for label in row["labels"])]
    assert len(labeled) < len(theirs)
    assert dataset.to_list() == labeled
    assert f"Dropped {len(theirs) - len(labeled)} of {len(theirs)} packed rows" in caplog.text


def test_rows_without_labels_are_dropped_without_max_length_too(model_path, tmp_path):
    # TRL drops label-less rows only as part of truncation (max_length set, no packing); we always drop them
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, -100]}]
    trl_dataset, _ = trl_prepare(model_path, tmp_path, rows, {"max_length": None}, {}, None, False)
    assert len(trl_dataset) == 2
    assert prepare_sft_dataset(rows, build_tiny_tokenizer(), max_length=None).to_list() == rows[:1]
    streamed = prepare_sft_dataset(IterableDataset.from_generator(lambda: iter(rows)), build_tiny_tokenizer())
    assert list(streamed) == rows[:1]


def test_unpacked_rows_without_labels_are_dropped_like_trl_and_counted(caplog):
    rows = [{"prompt": "What color is the sky? " * 4, "completion": " Blue."}, PROMPT_COMPLETION[1]]
    with caplog.at_level("WARNING", logger="hfnative.data.prepare"):
        dataset = prepare_sft_dataset(rows, build_tiny_tokenizer(), max_length=16)
    assert len(dataset) == 1
    assert "Dropped 1 of 2 rows" in caplog.text


# ------------------------------------------------------------------- packing and collation, directly


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
@pytest.mark.parametrize("seq_length", [7, 32])
def test_pack_dataset_matches_trl(strategy, seq_length):
    rng = random.Random(seq_length)
    lengths = [rng.choice([0, 1, 2, 3, 5, 8, 13, 21, 40]) for _ in range(2300)]  # 3 blocks of 1000 rows
    ids = [[rng.randrange(300) for _ in range(n)] for n in lengths]
    dataset = Dataset.from_dict({"input_ids": ids, "labels": [[-100] + row[1:] if row else [] for row in ids]})
    expected = trl_pack_dataset(dataset, seq_length, strategy).to_dict()
    assert pack_dataset(dataset, seq_length, strategy).to_dict() == expected


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("return_position_ids", [False, True])
@pytest.mark.parametrize("pad_to_multiple_of", [None, 8])
@pytest.mark.parametrize("packed", [False, True])
def test_collator_matches_trl(padding_free, return_position_ids, pad_to_multiple_of, packed):
    rng = random.Random(0)
    examples = []
    for _ in range(4):
        docs = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))] if packed else [rng.randint(1, 9)]
        ids = [rng.randrange(300) for _ in range(sum(docs))]
        example = {"input_ids": ids, "labels": [t if rng.random() < 0.7 else -100 for t in ids]}
        if packed:
            example["seq_lengths"] = docs
        examples.append(example)
    options = {"pad_token_id": 1, "padding_free": padding_free, "pad_to_multiple_of": pad_to_multiple_of}
    options["return_position_ids"] = return_position_ids
    expected = DataCollatorForLanguageModeling(**options)(examples)
    assert_same_batch(LanguageModelingCollator(**options)(examples), expected)
    # without "labels", the labels are the input ids
    unlabeled = [{"input_ids": example["input_ids"]} for example in examples]
    expected = DataCollatorForLanguageModeling(**options)(unlabeled)
    assert_same_batch(LanguageModelingCollator(**options)(unlabeled), expected)


def test_padding_free_positions_restart_per_document():
    batch = LanguageModelingCollator(pad_token_id=0, padding_free=True)(
        [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]}, {"input_ids": [6, 7], "seq_lengths": [2]}]
    )
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, 7]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 7]
    assert "attention_mask" not in batch


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "rows, kwargs, match",
    [
        ([{"text": "a"}, {"txt": "b"}], {}, r"Row 1 .*'txt'.*Accepted formats"),
        ([{"text": "a"}], {"dataset_text_field": "txt"}, r"Row 0 .*dataset_text_field='text'"),
        ([{"prompt": "a"}], {}, r"Row 0 .*needs a \"completion\""),
        ([{"prompt": "a", "completion": CHATS[0]}], {}, r"both be strings or both be lists of messages"),
        ([{"text": "a"}, {"messages": CHATS[0]}], {}, r"Row 1 is conversational but the dataset is language modeling"),
        ([{"messages": []}], {}, r"Row 0 .*Accepted formats"),
        ([{"input_ids": [1, 2]}, {"input_ids": None, "text": "x"}], {}, r"Row 1 is language modeling"),
        (TEXT, {"assistant_only_loss": True}, r"assistant_only_loss=True needs a conversational dataset"),
        (TEXT, {"eos_token": "<|nope|>"}, r"eos_token '<\|nope\|>' is not in the vocabulary"),
        (TEXT, {"packing": True, "max_length": None}, r"packing=True needs max_length"),
        (TEXT, {"padding_free": True}, r"padding_free=True without packing"),
        (TEXT, {"packing": True, "packing_strategy": "first_fit"}, r"packing_strategy must be one of"),
        (TEXT, {"truncation_mode": "middle"}, r"truncation_mode must be"),
        (PROMPT_COMPLETION, {"formatting_func": lambda row: row["prompt"]}, r"formatting_func turns rows"),
        ([], {}, r"The dataset is empty"),
        (
            [{"messages": [{"role": "user", "content": "hi"}]}],
            {"assistant_only_loss": True},
            r"Row 0 has no assistant token",
        ),
        (
            [{"text": "a", "completion_mask": [1]}],
            {"dataset_kwargs": {"skip_prepare_dataset": True}},
            r"mask columns but no 'labels'",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(rows, kwargs, match):
    with pytest.raises(ValueError, match=match):
        prepare_sft_dataset(rows, build_tiny_tokenizer(), **kwargs)


def test_assistant_only_loss_needs_generation_markers():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    with pytest.raises(ValueError, match=r"\{% generation %\}"):
        prepare_sft_dataset(MESSAGES, tokenizer, assistant_only_loss=True)


def test_not_a_dataset_is_a_type_error():
    with pytest.raises(TypeError, match="list of dicts"):
        prepare_sft_dataset("train.jsonl", build_tiny_tokenizer())


def test_list_of_dicts_is_the_same_as_a_dataset():
    tokenizer = build_tiny_tokenizer()
    from_list = prepare_sft_dataset(MESSAGES, tokenizer, max_length=64)
    assert from_list.to_list() == prepare_sft_dataset(Dataset.from_list(MESSAGES), tokenizer, max_length=64).to_list()
