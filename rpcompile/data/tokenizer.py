"""A byte-level tokenizer built with the ``tokenizers`` library: ids 0..255 are the bytes, then
three special tokens and a ChatML-style chat template. It needs no download, so the shipped demo
model and the tests have a real Hugging Face tokenizer folder to save and load."""

from __future__ import annotations

from typing import Any

__all__ = ["CHAT_TEMPLATE", "byte_tokenizer"]

EOS = "<|endoftext|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_chars() -> dict[int, str]:
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are shifted
    # past 255, so every byte is one visible character the BPE model can hold in its vocabulary.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, map(chr, printable)))
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return chars


def byte_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` whose token id ``b < 256`` is the byte ``b``; ``<|endoftext|>``
    (256, end of text and padding), ``<|im_start|>`` (257) and ``<|im_end|>`` (258) follow, and
    the chat template renders ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in _byte_chars().items()}
    # BPE without merges splits every pre-token into its byte characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, pad_token=EOS,
        additional_special_tokens=[TURN_START, TURN_END],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
