"""Tool calls in and out of the chat template (TRL's tool-calling rollouts, trainers/rollout/tool_calling.py): completions
parsed into assistant messages with transformers' ``parse_response`` and a response template for the chat template,
the template checked for tool calling, a multi-turn version of it when the model's renders only the last turn's
reasoning, and the tokens a template renders for a list of messages."""

from __future__ import annotations

import copy

from hfnative.data.chat_templates import multi_turn_chat_template, training_template_name

# --- parsing completions into messages ---------------------------------------------------------------------------

# transformers' response templates (the format ``tokenizer.parse_response`` reads) for the tool-calling formats of the
# chat templates hfnative recognises: Qwen's JSON inside <tool_call> tags (after an optional think block), and Llama
# 3.1 / 3.2's bare JSON object with "parameters" for its arguments
_QWEN_TOOL_CALLS = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
_LLAMA3_TOOL_CALLS = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}<\|eot_id\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|eot_id\|>\s*", "content": "text"},
    },
}
RESPONSE_TEMPLATES = {
    "Qwen3": _QWEN_TOOL_CALLS, "Qwen3-Instruct-2507": _QWEN_TOOL_CALLS, "Qwen2.5": _QWEN_TOOL_CALLS,
    "Llama 3.1": _LLAMA3_TOOL_CALLS, "Llama 3.2": _LLAMA3_TOOL_CALLS,
}


def tokenizer_of(processing_class):
    return getattr(processing_class, "tokenizer", processing_class)


def add_response_parser(processing_class) -> None:
    """Give the tokenizer a response template for parsing tool calls when it has none (TRL's add_response_schema
    for the templates hfnative recognises: Qwen2.5, Qwen3, Llama 3.1 / 3.2); a tokenizer that has one keeps it."""
    tokenizer = tokenizer_of(processing_class)
    if getattr(tokenizer, "response_template", None) is not None:
        return
    template = RESPONSE_TEMPLATES.get(training_template_name(processing_class) or "")
    if template is None:
        raise ValueError(
            "tools: the chat template is not one whose tool-call format hfnative knows (Qwen2.5, Qwen3, Llama 3.1, "
            "Llama 3.2), so the model's tool calls cannot be parsed: set `tokenizer.response_template` (see "
            "transformers' response-parsing docs) before building the trainer"
        )
    tokenizer.response_template = copy.deepcopy(template)


def _normalize_tool_calls(tool_calls) -> None:
    """TRL's checks of parsed tool calls: a list of dicts, each with a string name; missing arguments become {}."""
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list")
    for index, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool_calls[{index}] must be a dict")
        target = call.get("function", call)
        if not isinstance(target, dict) or not isinstance(target.get("name"), str):
            raise ValueError(f"tool_calls[{index}] has no string name")
        if target.get("arguments") is None:
            target["arguments"] = {}


def parse_completion(processing_class, ids: list[int], prefix: list[int], tools=None) -> dict:
    """One completion as an assistant message (``content``, and ``tool_calls`` when it made any), parsed after the
    tokens ``prefix`` that came before it, its arguments typed by the ``tools``' schemas; a completion that does not
    parse (a malformed call, a cut-off reply) is its decoded text, as TRL's parse_response falls back."""
    tokenizer = tokenizer_of(processing_class)
    try:
        message = tokenizer.parse_response(ids, prefix=prefix, tools=tools or None)
        if message is None:
            raise ValueError("nothing parsed")
        content = message.get("content")
        if isinstance(content, str) and tokenizer.eos_token:
            message["content"] = content.removesuffix(tokenizer.eos_token)
        if not message.get("content"):
            message["content"] = ""
        if "tool_calls" in message:
            _normalize_tool_calls(message["tool_calls"])
    except (ValueError, TypeError):
        message = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return message


# --- the chat template --------------------------------------------------------------------------------------------

_SENTINELS = ("tool_name_5e1f", "tool_arg_key_9c2d", "tool_arg_value_77ab", "tool_result_03fe")


def check_tool_calling_template(processing_class) -> None:
    """Refuse a chat template that cannot render a whole tool exchange (user, assistant with a tool call, tool):
    one that raises on it, or drops the call's name or arguments or the tool's result (TRL's check)."""
    from jinja2 import TemplateError

    name, key, value, result = _SENTINELS
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": {key: value}}}]},
                {"role": "tool", "name": name, "content": result}]
    text = None
    if getattr(processing_class, "chat_template", None) is not None:
        try:
            text = processing_class.apply_chat_template(messages, tokenize=False)
        except (TemplateError, TypeError):
            text = None
    if text is None or not all(sentinel in text for sentinel in _SENTINELS):
        raise ValueError(
            "The provided chat template does not support tool calling. The template must be able to render a "
            "full tool-calling conversation (user -> assistant with tool_calls -> tool)."
        )


def dummy_exchange(name: str) -> list[dict]:
    return [{"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]


def turns_chat_template(processing_class) -> str | None:
    """The template multi-turn rollouts render with: None (the tokenizer's own) when rendering a tool result after
    an assistant turn leaves that turn's tokens as they were, else hfnative's multi-turn version of a known
    template; any other template is refused (the tokens of a continued rollout would not be the ones trained on)."""
    before = render_ids(processing_class, dummy_exchange("dummy"), None, {}, generation_prompt=False)
    after = render_ids(processing_class, dummy_exchange("dummy") + [{"role": "tool", "name": "dummy", "content": "dummy"}],
                        None, {}, generation_prompt=True)
    if after[: len(before)] == before:
        return None
    template = multi_turn_chat_template(processing_class)
    if template is None:
        raise ValueError(
            "tools: the chat template re-renders an assistant turn once a tool result follows it, and hfnative has no "
            "multi-turn version of it (it has one for Qwen3): give the tokenizer a template whose rendering of a "
            "conversation is a prefix of the rendering of its continuations"
        )
    return template


def render_ids(processing_class, messages, chat_template, chat_template_kwargs, generation_prompt: bool) -> list[int]:
    ids = processing_class.apply_chat_template(messages, tokenize=True, return_dict=False, chat_template=chat_template,
                                               add_generation_prompt=generation_prompt, **chat_template_kwargs)
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


__all__ = ["RESPONSE_TEMPLATES", "add_response_parser", "check_tool_calling_template", "parse_completion",
           "dummy_exchange", "render_ids", "tokenizer_of", "turns_chat_template"]
