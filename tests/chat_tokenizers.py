"""Offline chat tokenizers for token-level tests: a small byte-level BPE tokenizer (GPT-2 style,
trained here on a few thousand words with the `tokenizers` library, so `` positive`` is one
token) with the special tokens of a model family, and that family's real chat template as TRL
ships it (read from the installed trl package, never copied into this repository)."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

WORDS = (
    "the a an review museum hotel film book was is dull great good bad positive negative what "
    "reviewed sum add and twice that answer question user assistant system tool weather city "
    "paris london get temperature think reasoning hello hi yes no okay sure it of in sentiment "
    "called result function name value degrees sunny rainy"
).split()

# family → (TRL template file, special tokens, named special tokens, other added tokens)
QWEN_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
QWEN_ADDED = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
DEEPSEEK_TOKENS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]  # fmt: skip
DEEPSEEK_NAMED = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
FAMILIES: dict[str, tuple[str, list[str], dict[str, str], list[str]]] = {
    "qwen2.5": ("qwen2_5", QWEN_TOKENS, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, QWEN_ADDED),
    "qwen3": ("qwen3", QWEN_TOKENS, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, QWEN_ADDED),
    "phi3": (
        "phi3",
        ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|endoftext|>"],
        {"eos_token": "<|endoftext|>"},
        [],
    ),
    "phi3.5": (
        "phi3_5",
        ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|endoftext|>"],
        {"eos_token": "<|endoftext|>"},
        [],
    ),
    "gpt-oss": (
        "gptoss",
        ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>", "<|endoftext|>"],
        {"eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
        [],
    ),
    "deepseek-v3": ("deepseekv3", DEEPSEEK_TOKENS, DEEPSEEK_NAMED, []),
    "deepseek-r1-distill": ("deepseek_r1_distill", DEEPSEEK_TOKENS, DEEPSEEK_NAMED, []),
    "nemotron-3-nano": (
        "nemotron_3_nano",
        QWEN_TOKENS,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        QWEN_ADDED,
    ),
    "glm-4-moe": (
        "glm4moe",
        ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"],
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    ),
}  # fmt: skip


def trl_template(name: str) -> str:
    """A chat template as TRL ships it (trl/chat_templates/NAME.jinja)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(
        encoding="utf-8"
    )


@functools.cache
def _core_json(specials: tuple[str, ...], added: tuple[str, ...], bos: str | None) -> str:
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )

    def corpus():
        for number, (a, b, c) in enumerate(itertools.product(WORDS, repeat=3)):
            if number % 5 == 0:
                yield f"{a} {b} {c}. {a.capitalize()}: {b}? {c}!\n"

    core.train_from_iterator(corpus(), trainer)
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if bos is not None:  # as Llama and Gemma: tokenizer(text) starts with the BOS token
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, core.token_to_id(bos))]
        )
    return core.to_str()


def bpe_tokenizer(
    specials: list[str] = (), named: dict[str, str] | None = None, added: list[str] = (),
    template: str | None = None, bos: str | None = None,
) -> Any:  # fmt: skip
    """A small byte-level BPE tokenizer with these special and added tokens (BOS: put before
    every text by `tokenizer(text)`), as an HF tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    named = dict(named or {})
    everything = tuple(dict.fromkeys([*specials, *named.values()]))
    core = Tokenizer.from_str(_core_json(everything, tuple(added), bos))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **named)
    tokenizer.chat_template = template
    return tokenizer


def family_tokenizer(family: str) -> Any:
    """The BPE tokenizer with FAMILY's special tokens and its original chat template."""
    name, specials, named, added = FAMILIES[family]
    return bpe_tokenizer(specials, named, added, trl_template(name))
