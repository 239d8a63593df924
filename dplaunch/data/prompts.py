"""Prompt-only records (model.task: grpo), as TRL's GRPOTrainer reads them, rendered and tokenised.

A record's ``prompt`` is a text or a conversation (a list of ``{role, content}`` messages; the
chat template renders it with the generation prompt, as sft renders a prompt). Its other columns
(``answer``, ``solution``…) are not trained on: they are handed to the reward functions beside
the completions. A text prompt is tokenised as TRL does, with the tokenizer's leading special
tokens (BOS); a rendered conversation holds its own. A prompt longer than ``data.max_length``
tokens keeps its last ones (its question ends it); the plan says how many were cut.

Torch-free: the launch check (a TokenizerView of the tokenizers core) and the ranks (the HF
tokenizer's view, train/data.py) tokenise with the same code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dplaunch.config.schema import DataConfig
from dplaunch.data import conversations
from dplaunch.data.answer_spans import Renderer, TemplateError
from dplaunch.data.conversations import PROMPT_COLUMN
from dplaunch.data.sft_examples import TokenizerView, make_renderer

FIX_PROMPT = (
    f"give every record a {PROMPT_COLUMN!r}: a text, or a list of {{role, content}} messages "
    "(TRL's prompt-only format)"
)


def prompt_problem(record: Mapping[str, Any]) -> tuple[str, str] | None:
    """(what is wrong, the fix) of a record whose prompt the ranks cannot render, else None."""
    prompt = record.get(PROMPT_COLUMN)
    if prompt is None:
        return f"has no {PROMPT_COLUMN!r}", FIX_PROMPT
    if isinstance(prompt, str):
        return None if prompt.strip() else (f"has an empty {PROMPT_COLUMN!r}", FIX_PROMPT)
    if not isinstance(prompt, list):
        return f"has a {PROMPT_COLUMN!r} that is neither a text nor a list of messages", FIX_PROMPT
    return conversations.messages_problem(prompt, PROMPT_COLUMN, need_answer=False)


def is_conversation(record: Mapping[str, Any]) -> bool:
    """Whether the record's prompt is a list of messages (its completion is one then, too)."""
    return isinstance(record.get(PROMPT_COLUMN), list)


@dataclass(frozen=True)
class PromptExamples:
    """Prompt records → the text and tokens the policy continues."""

    renderer: Renderer
    tokenizer: TokenizerView
    max_length: int

    @classmethod
    def of(cls, data: DataConfig, tokenizer: TokenizerView) -> PromptExamples:
        return cls(make_renderer(data, tokenizer), tokenizer, data.max_length)

    def text(self, record: Mapping[str, Any]) -> str:
        """The prompt as the model reads it: a text as it is, a conversation rendered by the chat
        template with the generation prompt (TemplateError when it cannot be)."""
        prompt = record[PROMPT_COLUMN]
        if isinstance(prompt, str):
            return prompt
        if self.renderer.template is None:
            raise TemplateError("there is no chat template to render its messages")
        tools = record.get("tools")
        kwargs = record.get("chat_template_kwargs")
        return self.renderer.render(
            conversations.normalized_messages(prompt),
            True,
            tools=tools if isinstance(tools, list) else None,
            template_kwargs=kwargs if isinstance(kwargs, Mapping) else None,
        )

    def ids(self, record: Mapping[str, Any]) -> tuple[list[int], int]:
        """(the prompt's token ids, how many leading ones data.max_length cut)."""
        assert self.tokenizer.encode is not None
        ids = self.tokenizer.encode([self.text(record)])[0][0]
        if isinstance(record[PROMPT_COLUMN], str):
            ids = [*self.tokenizer.leading, *ids]
        cut = max(len(ids) - self.max_length, 0)
        return ids[cut:], cut
