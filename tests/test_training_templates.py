"""hfnative's training chat templates against the released templates they stand in for, and against TRL 1.16.

The released templates are read from TRL's installed chat_templates/ folder (TRL is a dev dependency), as are
TRL's own training versions, which are the oracle for the assistant masks. For every shipped template:
the rendered text equals the released template's on many conversations; the assistant mask equals TRL's
training template's wherever TRL renders the same text, and covers exactly the assistant turns everywhere;
an SFT run with assistant_only_loss=True on a tokenizer that carries a released template matches TRL's
loss; an unknown template still gets the clear error.
"""

import logging
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest  # noqa: E402
from _tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import hfnative  # noqa: E402
from hfnative.data import prepare_sft_dataset  # noqa: E402
from hfnative.data.chat_templates import (  # noqa: E402
    KNOWN_TEMPLATES,
    has_generation_markers,
    training_chat_template,
    training_template_name,
)

trl = pytest.importorskip("trl")

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
TINY_QWEN3 = str(Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3")

# released template (a file in TRL's folder) -> TRL's training version of it (None: TRL 1.16 has none)
FAMILIES = {
    "qwen3": "qwen3_training",
    "qwen3_instruct_2507": "qwen3_instruct_2507_training",
    "qwen2_5": "qwen2_5_training",
    "llama3": "llama3_training",
    "llama3_1": None,
    "llama3_2": None,
    "gemma3": "gemma3_training",
    "phi3": "phi3_training",
    "phi3_5": "phi3_5_training",
}
# how an assistant turn's marked span ends, per family
TURN_ENDS = {
    "qwen": ("<|im_end|>\n",),
    "llama": ("<|eot_id|>", "<|eom_id|>"),
    "gemma": ("<end_of_turn>\n",),
    "phi3": ("<|end|>\n", "<|end|>\n<|endoftext|>"),
}
SPECIAL_TOKENS = [
    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
    "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]  # fmt: skip


def _released(name: str) -> str:
    return (TRL_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer with BOS, EOS and every family's turn markers as special tokens."""
    tokenizer = build_tiny_tokenizer(add_bos=True)
    tokenizer.add_tokens(SPECIAL_TOKENS, special_tokens=True)
    return tokenizer


# --- conversations -------------------------------------------------------------------------------------------


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str = "", **fields) -> dict:
    return {"role": "assistant", "content": text, **fields}


def tool(content) -> dict:
    return {"role": "tool", "content": content}


def call(name: str = "get_weather", arguments=None, wrapped: bool = True) -> dict:
    function = {"name": name, "arguments": {"city": "Paris"} if arguments is None else arguments}
    return {"type": "function", "function": function} if wrapped else function


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK, ASK_2 = user("What color is the sky?"), user("And grass?")
REPLY, REPLY_2 = assistant("The sky is blue."), assistant("Grass is green.")
ASK_WEATHER = user("Weather in Paris?")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = {"tools": [WEATHER_TOOL]}


def _common() -> list[tuple[str, list[dict], dict]]:
    return [
        ("single", [ASK, REPLY], {}),
        ("system", [SYSTEM, ASK, REPLY], {}),
        ("multi-turn", [SYSTEM, ASK, REPLY, ASK_2, REPLY_2], {}),
        ("ends-on-user", [ASK, REPLY, ASK_2], {}),
        ("whitespace", [user("  Hi there \n"), assistant("\n Hello!  \n")], {}),
    ]


def _qwen_tools() -> list[tuple[str, list[dict], dict]]:
    two_calls = assistant("Let me check.", tool_calls=[call(), call(arguments={"city": "Rome"})])
    unwrapped_call = call(arguments='{"city": "Oslo"}', wrapped=False)  # no "function" level, arguments as text
    return [
        ("tool-call", [SYSTEM, ASK_WEATHER, assistant(tool_calls=[call()]), tool("Sunny"), REPLY], TOOLS),
        ("two-calls-with-text", [ASK_WEATHER, two_calls, tool("Sunny"), tool("Rainy"), REPLY], TOOLS),
        ("string-arguments", [ASK_WEATHER, assistant(tool_calls=[unwrapped_call])], {}),
    ]


def _qwen3_thinking() -> list[tuple[str, list[dict], dict]]:
    thought = assistant("Blue.", reasoning_content="\nRayleigh scattering.\n")
    multi_step = [
        ASK_WEATHER,
        assistant(reasoning_content="Call the tool.", tool_calls=[call()]),
        tool("Sunny"),
        user("<tool_response>\nWarm\n</tool_response>"),  # a wrapped tool response is not a new query
        assistant("Sunny and warm.", reasoning_content="Summarize."),
    ]
    return [
        ("reasoning", [ASK, thought], {}),
        ("inline-think", [ASK, assistant("<think>\nLook up.\n</think>\n\nBlue.")], {}),
        ("reasoning-in-history", [ASK, thought, ASK_2, assistant("Green.", reasoning_content="Chlorophyll.")], {}),
        ("multi-step-tool", multi_step, TOOLS),
        ("thinking-off", [ASK, REPLY, ASK_2], {"enable_thinking": False}),
        ("thinking-on", [ASK, REPLY, ASK_2], {"enable_thinking": True}),
    ]


def _llama3_tools(builtin: bool) -> list[tuple[str, list[dict], dict]]:
    calling = {"role": "assistant", "tool_calls": [call()]}
    in_user_message = [SYSTEM, ASK_WEATHER, calling, tool("Sunny"), REPLY]
    cases = [
        ("tools-in-user-message", in_user_message, {**TOOLS, "date_string": "1 May"}),
        (
            "tools-in-system",
            [ASK_WEATHER, calling, {"role": "ipython", "content": {"sky": "clear"}}, REPLY],
            {**TOOLS, "tools_in_user_message": False},
        ),
    ]
    if builtin:
        search = {"role": "assistant", "tool_calls": [call("brave_search", {"query": "Paris weather"})]}
        messages = [user("Search it."), search, {"role": "ipython", "content": "Sunny"}, REPLY]
        cases.append(("builtin-tools", messages, {"builtin_tools": ["brave_search", "wolfram_alpha"]}))
    return cases


def _gemma3_content() -> list[tuple[str, list[dict], dict]]:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is it? "}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    ]
    return [("content-blocks", messages, {})]


def conversations(family: str) -> list[tuple[str, list[dict], dict]]:
    extra = {
        "qwen3": _qwen_tools() + _qwen3_thinking(),
        "qwen3_instruct_2507": _qwen_tools(),
        "qwen2_5": _qwen_tools()[:2],  # it has no string-arguments branch: tojson quotes them (same in both)
        "llama3_1": _llama3_tools(builtin=True),
        "llama3_2": _llama3_tools(builtin=False),
        "gemma3": _gemma3_content(),
        "phi3_5": [("empty-system", [{"role": "system", "content": ""}, ASK, REPLY], {})],
    }
    return _common() + extra.get(family, [])


def _render(tokenizer, template: str, messages, kwargs, **options):
    return tokenizer.apply_chat_template(messages, chat_template=template, **kwargs, **options)


# --- (a) same text -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_training_template_renders_the_released_templates_text(tokenizer, family):
    released = _released(family)
    ours = training_chat_template(released)
    assert ours is not None and has_generation_markers(ours) and not has_generation_markers(released)
    for name, messages, kwargs in conversations(family):
        for add_generation_prompt in (False, True):
            options = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
            expected = _render(tokenizer, released, messages, kwargs, **options)
            assert _render(tokenizer, ours, messages, kwargs, **options) == expected, (name, add_generation_prompt)


def test_gemma3_still_rejects_roles_that_do_not_alternate(tokenizer):
    messages = [ASK, ASK_2]
    for template in (_released("gemma3"), training_chat_template(_released("gemma3"))):
        with pytest.raises(Exception, match="Conversation roles must alternate"):
            _render(tokenizer, template, messages, {}, tokenize=False)


# --- (b) the assistant mask ----------------------------------------------------------------------------------


def _marked_spans(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    spans, current = [], []
    for token, bit in zip(ids, mask):
        if bit:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current)), current.clear()
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def _reply_text(message: dict) -> str:
    """A piece of text the assistant turn must contain: its reply, else its (first) tool call's name."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(block.get("text", "") for block in content)
    if content:
        return content.split("</think>")[-1].strip()
    call = message["tool_calls"][0]
    return call.get("function", call)["name"]


@pytest.mark.parametrize("family", FAMILIES)
def test_assistant_mask_covers_exactly_the_assistant_turns_as_trl_marks_them(tokenizer, family):
    released, ours = _released(family), training_chat_template(_released(family))
    trl_training = _released(FAMILIES[family]) if FAMILIES[family] else None
    turn_ends = next(ends for prefix, ends in TURN_ENDS.items() if family.startswith(prefix))
    compared_with_trl = set()
    for name, messages, kwargs in conversations(family):
        if family == "llama3_2":  # its date comes from the clock unless given
            kwargs = {"date_string": "01 Jan 2025", **kwargs}
        options = dict(tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        got = _render(tokenizer, ours, messages, kwargs, **options)
        assert got["input_ids"] == _render(tokenizer, released, messages, kwargs, return_dict=True)["input_ids"]

        # the oracle: TRL's training template, wherever it renders the same text as the released one
        if trl_training is not None:
            theirs = _render(tokenizer, trl_training, messages, kwargs, **options)
            if theirs["input_ids"] == got["input_ids"]:
                assert got["assistant_masks"] == theirs["assistant_masks"], name
                compared_with_trl.add(name)
            else:  # TRL's Qwen3 version shows every turn's think block; the released template only later ones
                assert family == "qwen3", name

        # and for every conversation: one marked span per assistant turn, holding its reply, ending the turn
        spans = _marked_spans(tokenizer, got["input_ids"], got["assistant_masks"])
        replies = [message for message in messages if message["role"] == "assistant"]
        assert len(spans) == len(replies), (name, spans)
        for span, reply in zip(spans, replies):
            assert _reply_text(reply) in span and span.endswith(turn_ends), (name, span)
    if family == "qwen3":  # TRL renders these as the released template does: thinking and tool calls compared
        assert {"single", "reasoning", "inline-think", "multi-step-tool", "string-arguments"} <= compared_with_trl


# --- the registry ------------------------------------------------------------------------------------------------


def test_registry_recognises_released_templates_by_their_exact_text(tokenizer):
    for family in FAMILIES:
        released = _released(family)
        assert training_chat_template(released) == training_chat_template(released.rstrip("\n") + "\n")
        assert training_chat_template(released + " ") is None
        assert training_chat_template(released.replace("assistant", "Assistant")) is None
    assert training_chat_template(_released("qwen3_training")) is None  # already marked: nothing to swap
    assert training_chat_template(None) is None
    tokenizer = build_tiny_tokenizer(chat_template=_released("qwen2_5"))
    assert training_template_name(tokenizer) == "Qwen2.5" and training_chat_template(tokenizer) is not None
    tokenizer.chat_template = {"default": _released("phi3"), "tool_use": "{{ messages }}"}
    assert training_template_name(tokenizer) == "Phi-3"
    assert len(set(KNOWN_TEMPLATES)) == len(FAMILIES)


# --- (c) end to end: the swap trains as TRL does ---------------------------------------------------------------

# single-query conversations: TRL's Qwen3 training version renders them as the released template does
ROWS = [
    {"messages": [user("Compute 15 - 14."), assistant("15 - 14 = 1.")]},
    {"messages": [SYSTEM, user("Define 'apple'."), assistant("A round fruit.")]},
    {"messages": [ASK, assistant("Blue.", reasoning_content="Rayleigh scattering.")]},
    {"messages": [user("Say hi."), assistant("Hi!")]},
    {"messages": [SYSTEM, user("Count to three."), assistant("one two three")]},
    {"messages": [user("Add 2 and 3."), assistant("<think>\n2 + 3\n</think>\n\n5")]},
]


def _sft_run(module, tmp_path, released: str):
    tokenizer = AutoTokenizer.from_pretrained(TINY_QWEN3)
    tokenizer.chat_template = released
    args = module.SFTConfig(
        output_dir=str(tmp_path / module.__name__),
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        per_device_train_batch_size=3,
        learning_rate=3e-3,
        max_length=64,
        assistant_only_loss=True,
    )
    dataset = Dataset.from_list(ROWS)
    trainer = module.SFTTrainer(model=TINY_QWEN3, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "loss" in entry]


def test_sft_with_a_released_template_trains_on_the_assistant_turns_like_trl(tmp_path, caplog):
    released = _released("qwen3")
    trl_trainer, theirs = _sft_run(trl, tmp_path, released)
    with caplog.at_level(logging.INFO, logger="hfnative.data.prepare"):
        trainer, ours = _sft_run(hfnative, tmp_path, released)
    assert "Qwen3 chat template has no {% generation %} markers" in caplog.text

    # labels cover exactly what the training version marks; the prompt is left out
    tokenizer, template = trainer.processing_class, training_chat_template(released)
    for row, prepared in zip(ROWS, trainer.train_dataset):
        marked = _render(tokenizer, template, row["messages"], {}, return_dict=True, return_assistant_tokens_mask=True)
        assert prepared["input_ids"] == marked["input_ids"]
        assert [label != -100 for label in prepared["labels"]] == [bool(bit) for bit in marked["assistant_masks"]]
        assert 0 < sum(marked["assistant_masks"]) < len(marked["input_ids"])

    assert len(ours) == len(theirs) == 2
    for mine, reference in zip(ours, theirs):
        assert mine["num_tokens"] == reference["num_tokens"]
        for key in ("loss", "grad_norm", "mean_token_accuracy"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (mine["step"], key)

    # as TRL, the swap is for tokenizing only: the tokenizer and the saved chat template stay the released one
    assert tokenizer.chat_template == trl_trainer.processing_class.chat_template == released
    trainer.save_model()
    assert AutoTokenizer.from_pretrained(trainer.args.output_dir).chat_template == released


# --- (d) an unknown template -------------------------------------------------------------------------------------


def test_unknown_template_without_markers_gets_the_clear_error():
    tokenizer = build_tiny_tokenizer(chat_template=_released("qwen3") + "{# edited #}")
    with pytest.raises(ValueError, match=r"\{% generation %\}.*not one that hfnative swaps.*Qwen3, .*Phi-3\.5"):
        prepare_sft_dataset(ROWS[:2], tokenizer, assistant_only_loss=True)
