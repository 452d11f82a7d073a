"""A tiny offline tokenizer (and Qwen3 model) for tests: nothing is downloaded.

`build_tiny_tokenizer()` trains a byte-level BPE on a few sentences, so any text tokenizes, and wraps it
as a `PreTrainedTokenizerFast` with ChatML special tokens and a chat template that has
`{% generation %}` markers (for `return_assistant_tokens_mask`), accepts `tools`, and reads the
`enable_thinking` chat-template kwarg.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|endoftext|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

CHATML_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{%- endif %}"
    "{%- endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What color is the sky? The sky is blue. Grass is green.",
    "user assistant system tool You are a helpful assistant.",
    "Once upon a time there was a little robot who liked to count: one two three four five.",
    "def add(a, b): return a + b  # numbers 0123456789",
]


def build_tiny_tokenizer(
    add_bos: bool = False, with_pad: bool = True, chat_template: str = CHATML_TEMPLATE
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of 320 tokens with ChatML specials; `add_bos` prepends <|bos|> on encode."""
    specials = [EOS, PAD, IM_START, IM_END, BOS]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    if add_bos:
        bos_id = backend.token_to_id(BOS)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=PAD if with_pad else None,
        bos_token=BOS if add_bos else None,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def save_tiny_qwen3(path, vocab_size: int) -> str:
    """Save a random 1-layer Qwen3 (hidden 32) to `path` and return the path as a string."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)
