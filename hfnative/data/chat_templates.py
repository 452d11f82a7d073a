"""Training versions of known chat templates, for `assistant_only_loss=True`.

The assistant-token mask comes from a chat template's `{% generation %} ... {% endgeneration %}` markers,
which most released templates lack. For the families hfnative runs, the chat_templates/ folder next to this
module holds a training version of each released template: it renders the same text as the original for
every conversation, with generation markers around what the model writes. An original template is
recognised by the sha256 of its text (a single trailing newline aside: Jinja drops it when rendering).

Where TRL 1.16 has a training version too, the marked tokens are the ones TRL marks on the same text. Two
differences: TRL's Qwen3 version shows a think block in every assistant turn, so it renders multi-turn
conversations differently from the released template (ours keeps the released text); and TRL has none for
Llama 3.1 / 3.2 (it raises), where hfnative swaps.
"""

import hashlib
import re
from functools import cache
from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent / "chat_templates"

# sha256 of a released template's text -> (its name, the file of its training version)
_TRAINING_VERSIONS = {
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": ("Qwen3", "qwen3.jinja"),
    "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326": (
        "Qwen3-Instruct-2507",
        "qwen3_instruct_2507.jinja",
    ),
    "55b2f4a26ac9ee719330a61a0c39d9e538b0e9322212f048326318cff4f8674a": ("Qwen2.5", "qwen2_5.jinja"),
    "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122": ("Llama 3", "llama3.jinja"),
    "93c0e9aa3629bbd77e68dbc0f5621f6e6b23aa8d74b932595cdb8d64684526d7": ("Llama 3.1", "llama3_1.jinja"),
    "d82792f95932f1c9cef5c4bd992f171225e3bf8c7b609b4557c9e1ec96be819f": ("Llama 3.2", "llama3_2.jinja"),
    "8d9e3a3c114fb2053ec500184677af4f7e5f8ec2582443cd535834e68b3ade29": ("Gemma 3", "gemma3.jinja"),
    "dcaee66df77bfbb789ec541fe713218da30225a526f1db97138fc39ee6dc56aa": ("Phi-3", "phi3.jinja"),
    "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90": ("Phi-3.5", "phi3_5.jinja"),
}

KNOWN_TEMPLATES = tuple(name for name, _ in _TRAINING_VERSIONS.values())


def has_generation_markers(chat_template) -> bool:
    """Whether a template (a string, or a dict of named templates: its "default") has `{% generation %}`."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    return isinstance(chat_template, str) and re.search(r"\{%-?\s*generation\s*-?%\}", chat_template) is not None


def template_text(tokenizer_or_template) -> str | None:
    """The chat template text of a tokenizer, a processor (its tokenizer's) or a template string; for a dict
    of named templates, the "default" one; None when there is none."""
    template = tokenizer_or_template
    if not isinstance(template, (str, dict)) and template is not None:
        template = getattr(template, "chat_template", None)
        if template is None:  # a processor without its own template uses its tokenizer's
            template = getattr(getattr(tokenizer_or_template, "tokenizer", None), "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.removesuffix("\n").encode("utf-8")).hexdigest()


def _known(tokenizer_or_template) -> tuple[str, str] | None:
    text = template_text(tokenizer_or_template)
    return _TRAINING_VERSIONS.get(_fingerprint(text)) if text is not None else None


def training_template_name(tokenizer_or_template) -> str | None:
    """The name of the known template (e.g. "Qwen3") that `tokenizer_or_template` has (the released one, or a
    version of it that hfnative ships), or None."""
    known = _known(tokenizer_or_template)
    if known:
        return known[0]
    text = template_text(tokenizer_or_template)
    return None if text is None else _shipped_versions().get(_fingerprint(text))


@cache
def _shipped_versions() -> dict[str, str]:
    """sha256 of each template file hfnative ships -> the name of the released template it is a version of."""
    names = {filename: name for name, filename in _TRAINING_VERSIONS.values()}
    names.update({filename: name for name, filename in _MULTI_TURN_VERSIONS.items()})
    return {_fingerprint(_read_template(filename)): name for filename, name in names.items()}


def training_chat_template(tokenizer_or_template) -> str | None:
    """The training version of a known chat template: the same rendered text, with `{% generation %}` markers
    around the assistant's output. Takes a tokenizer, a processor or the template text; returns None when the
    template is not one hfnative knows."""
    known = _known(tokenizer_or_template)
    return _read_template(known[1]) if known else None


@cache
def _read_template(filename: str) -> str:
    return (TEMPLATE_DIR / filename).read_text(encoding="utf-8")


# the known templates whose released text does not keep a conversation's rendering as a prefix of its
# continuations -> the file of their multi-turn version (which does), for tool-calling rollouts
_MULTI_TURN_VERSIONS = {"Qwen3": "qwen3_multiturn.jinja"}


def multi_turn_chat_template(tokenizer_or_template) -> str | None:
    """The multi-turn version of a known chat template whose released text re-renders earlier turns once a
    conversation goes on (Qwen3 hides the think blocks of turns before the last user query), or None. The
    multi-turn version renders every assistant turn alike, so a rollout can append tool results to the tokens it
    has and generate on."""
    filename = _MULTI_TURN_VERSIONS.get(training_template_name(tokenizer_or_template) or "")
    return _read_template(filename) if filename else None


STOP_NOT_TRAINED = (
    "The chat template does not include the assistant turn's end-of-turn token in the loss mask; the model may not "
    "learn to stop. The training loss still looks healthy, so this usually only surfaces at inference. Either set "
    "`assistant_only_loss=False` to train on the full sequence, or edit the chat template so the end-of-turn token "
    "falls inside `{% generation %}...{% endgeneration %}`."
)


def stop_token_trained(tokenizer, chat_template: str | None = None) -> bool:
    """Whether the template (``chat_template``, else the tokenizer's) puts an assistant turn's end-of-turn token in
    the assistant mask, as TRL checks it (its ``is_chat_template_stop_token_trained``): an assistant turn followed by
    a user turn is rendered, and the last masked token that is not whitespace must be one of the added tokens (an
    end-of-turn marker), not content."""
    messages = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"},
                {"role": "user", "content": "dummy"}]
    try:
        output = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True, chat_template=chat_template)
    except Exception:  # noqa: BLE001 - a template that cannot render this: not trained (TRL catches its errors too)
        return False
    added = set(tokenizer.get_added_vocab().values())
    masked = [token for token, on in zip(output["input_ids"], output["assistant_masks"]) if on]
    for token in reversed(masked):
        if tokenizer.decode([token]).strip() == "":
            continue
        return token in added
    return False
