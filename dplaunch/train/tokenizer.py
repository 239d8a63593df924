"""A built-in byte-level tokenizer (259 tokens) for randomly initialised models: no download needed."""

from __future__ import annotations

from dplaunch.data.byte_level import byte_level_core


def byte_level_tokenizer():
    """Every UTF-8 byte is one token; ids 0-2 are <pad>, <s>, </s>. Saves/loads like any HF tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=byte_level_core(),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=1 << 20,
    )
