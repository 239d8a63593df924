"""The run's way from sft records to trained tokens, in one piece the launch check, the ranks and
`dplaunch data` share: the format, the chat template with the run's tools and template
variables, the tokenizer's encoder and data.max_length, data.truncation, data.loss_on.

The tokenizer comes as a TokenizerView: the ranks give the HF tokenizer's (train/data.py), the
launch check the `tokenizers` core of tokenizer.json (sft_checks.py), so neither needs the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dplaunch.config.schema import DataConfig
from dplaunch.data import conversations
from dplaunch.data.answer_spans import Example, Renderer, TemplateError, end_tokens
from dplaunch.data.example_tokens import Encoded, TokenizedExample, encode_examples

# texts → [(ids, character offsets)], without special tokens
Encode = Callable[[list[str]], list[tuple[list[int], list[tuple[int, int]]]]]


@dataclass(frozen=True)
class TokenizerView:
    """What the sft pipeline needs of a tokenizer: its name, chat template(s) (a text, or named
    ones), its named special tokens (bos_token…), every special token's text, an encoder, and
    the ids it puts before a text of its own accord (BOS), or None without an encoder."""

    name: str
    chat_template: Any
    named_special: Mapping[str, str]
    special_texts: Sequence[str]
    encode: Encode | None
    leading: tuple[int, ...] = ()


def chat_templates(value: Any) -> tuple[str | None, str | None]:
    """(default, tool_use) of a tokenizer's chat template: one text, a dict of named ones (HF
    tokenizers), or a list of {name, template} (tokenizer_config.json)."""
    if isinstance(value, list):
        value = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
    if isinstance(value, dict):
        return value.get("default"), value.get("tool_use")
    return value, None


def make_renderer(data: DataConfig, tokenizer: TokenizerView) -> Renderer:
    """The chat template (data.chat_template, else the tokenizer's) with the run's tools and
    template variables, the special tokens it names, and those an answer may end with."""
    default, tool_use = chat_templates(tokenizer.chat_template)
    if data.chat_template:
        default, tool_use = conversations.read_chat_template(data.chat_template), None
    return Renderer(
        default,
        dict(tokenizer.named_special),
        tokenizer.named_special.get("eos_token"),
        end_tokens([*tokenizer.special_texts, *tokenizer.named_special.values()]),
        tools=data.tools,
        template_kwargs=dict(data.chat_template_kwargs),
        tool_template=tool_use,
    )


@dataclass(frozen=True)
class SftExamples:
    """Records of one format → Examples → tokens, as every rank trains on them."""

    fmt: str
    renderer: Renderer
    tokenizer: TokenizerView
    data: DataConfig

    @classmethod
    def of(cls, data: DataConfig, columns: Sequence[str], tokenizer: TokenizerView) -> SftExamples:
        fmt = conversations.resolve_format(data.format, columns, data.text_column)
        return cls(fmt, make_renderer(data, tokenizer), tokenizer, data)

    def example(self, record: Mapping[str, Any]) -> Example:
        """RECORD rendered, its answers found; TemplateError (the problem — its fix) when the
        ranks cannot train on it."""
        problem = conversations.record_problem(record, self.fmt)
        if problem is not None:
            raise TemplateError(problem[0], problem[1] or None)
        return self.renderer.example(record, self.fmt)

    def tokens(
        self, examples: list[Example], details: list[TokenizedExample] | None = None
    ) -> Encoded:
        """EXAMPLES as token ids and labels (encode_examples); DETAILS receives each one's."""
        if self.tokenizer.encode is None:
            raise ValueError(f"the tokenizer {self.tokenizer.name} has no encoder here")
        return encode_examples(
            examples,
            self.tokenizer.encode,
            leading=self.tokenizer.leading,
            max_length=self.data.max_length,
            truncation=self.data.truncation,
            loss_on=self.data.loss_on,
            details=details,
        )
