"""Supervised fine-tuning examples: their format, their checks, and which characters are answers.

Formats as TRL names them: *conversational* (a ``messages`` column: a list of ``{role,
content}``), *prompt-completion* (``prompt`` and ``completion`` columns: two strings, or two
message lists) and plain *text* (today's causal-LM packing). Conversations are rendered with
the tokenizer's chat template (or data.chat_template) by transformers' own renderer, the one
``apply_chat_template`` uses, so training sees the text generation will see.

The answers are found as character spans of the rendered text: assistant turn i spans from the
end of the conversation up to turn i rendered with the generation prompt, to the end of the
conversation up to and including turn i (its content and end-of-turn marker). That needs a
template whose rendering of a conversation's beginning is a prefix of the whole (every common
one); a template that is not is refused by name. Imports nothing heavy: the launch check runs
these functions without torch (transformers' renderer needs only jinja2).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

CONVERSATIONAL = "conversational"
PROMPT_COMPLETION = "prompt-completion"
TEXT = "text"
MESSAGES_COLUMN = "messages"
PROMPT_COLUMN = "prompt"
COMPLETION_COLUMN = "completion"
ROLES = ("system", "user", "assistant", "tool")
ANSWER_ROLE = "assistant"
# the fix of a record the check refuses
FIX_RECORD = "fix that record or drop it"


def resolve_format(declared: str | None, columns: Iterable[str], text_column: str) -> str:
    """The example format: data.format when set, else the columns say (TRL's rules)."""
    if declared is not None:
        return declared
    present = set(columns)
    if MESSAGES_COLUMN in present:
        return CONVERSATIONAL
    if PROMPT_COLUMN in present or COMPLETION_COLUMN in present:
        return PROMPT_COMPLETION
    if text_column in present:
        return TEXT
    from dplaunch.errors import UserError

    listed = ", ".join(sorted(present)) or "none"
    raise UserError(
        "data.format",
        f"cannot tell the examples' format from the columns ({listed})",
        f"give a {MESSAGES_COLUMN!r} column (conversations), {PROMPT_COLUMN!r} and "
        f"{COMPLETION_COLUMN!r} columns, or a {text_column!r} column (data.text_column), "
        "or set data.format",
    )


def needed_columns(fmt: str, text_column: str) -> tuple[str, ...]:
    """The columns every record of format FMT must have."""
    if fmt == CONVERSATIONAL:
        return (MESSAGES_COLUMN,)
    if fmt == PROMPT_COMPLETION:
        return (PROMPT_COLUMN, COMPLETION_COLUMN)
    return (text_column,)


def record_problem(record: Mapping[str, Any], fmt: str) -> tuple[str, str] | None:
    """(problem, fix) of a record the ranks cannot train on, else None. The problem text follows
    the record's place ("line 3 of data.jsonl ")."""
    if fmt == CONVERSATIONAL:
        return _messages_problem(record.get(MESSAGES_COLUMN), MESSAGES_COLUMN, need_answer=True)
    if fmt != PROMPT_COMPLETION:
        return None
    prompt, completion = record.get(PROMPT_COLUMN), record.get(COMPLETION_COLUMN)
    for column, value in ((PROMPT_COLUMN, prompt), (COMPLETION_COLUMN, completion)):
        if value is None:
            return f"has no {column!r}", f"give every record a {PROMPT_COLUMN} and a completion"
    if isinstance(prompt, str) != isinstance(completion, str):
        return (
            f"has a {_kind(prompt)} prompt and a {_kind(completion)} completion",
            "make both texts, or both lists of messages",
        )
    if isinstance(prompt, str):
        return None
    return _messages_problem(prompt, PROMPT_COLUMN, need_answer=False) or _messages_problem(
        completion, COMPLETION_COLUMN, need_answer=True
    )


def _kind(value: Any) -> str:
    return (
        "text"
        if isinstance(value, str)
        else "message-list"
        if isinstance(value, list)
        else "non-text"
    )


def _messages_problem(messages: Any, column: str, *, need_answer: bool) -> tuple[str, str] | None:
    if messages is None:
        return f"has no {column!r}", FIX_RECORD
    if not isinstance(messages, list):
        return (
            f"has {json.dumps(messages)[:40]} as {column!r}, not a list of messages",
            f"write {column} as a list of {{role, content}} objects",
        )
    if not messages:
        return f"has an empty {column!r} list", FIX_RECORD
    for number, message in enumerate(messages, 1):
        if not isinstance(message, Mapping):
            return f"message {number} of {column!r} is not a {{role, content}} object", FIX_RECORD
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return (
                f"message {number} of {column!r} has role {json.dumps(role)}, not one of "
                f"{', '.join(ROLES)}",
                FIX_RECORD,
            )
        if not isinstance(content, str) and not (role == ANSWER_ROLE and message.get("tool_calls")):
            return (
                f"message {number} of {column!r} has {json.dumps(content)[:40]} as content, not a text",
                FIX_RECORD,
            )
    if need_answer and not any(m.get("role") == ANSWER_ROLE for m in messages):
        return f"{column!r} has no assistant turn: nothing to train on", FIX_RECORD
    return None


def read_chat_template(value: str) -> str:
    """data.chat_template's text: a Jinja string itself, or the path of a file holding one."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    from dplaunch.errors import UserError

    if not path.is_file():
        raise UserError(
            "data.chat_template",
            f"{value} is neither a Jinja template (no {{{{ or {{%) nor an existing file",
            "give the template text, or the path of a .jinja file",
        )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            "data.chat_template", f"cannot read {path}: {exc}", "fix the file"
        ) from None


@dataclass(frozen=True)
class Example:
    """One rendered example: its text and the character spans trained on."""

    text: str
    answers: tuple[tuple[int, int], ...]


class TemplateError(ValueError):
    """A conversation the chat template does not render, or renders inconsistently."""


@dataclass(frozen=True)
class Renderer:
    """Turns records into Examples: the chat template (None for plain strings), the tokenizer's
    special tokens the template may name, and its end-of-sequence token (ends a completion)."""

    template: str | None
    special_tokens: Mapping[str, str]
    eos_token: str | None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        if self.template is None:
            raise TemplateError("there is no chat template")
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages],
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as exc:  # noqa: BLE001 — any template failure is the user's to fix
            raise TemplateError(f"the chat template fails to render it ({exc})") from None
        return rendered[0]

    def example(self, record: Mapping[str, Any], fmt: str) -> Example:
        """The record as text with its answer spans (record_problem must have passed)."""
        if fmt == CONVERSATIONAL:
            return self._conversation(list(record[MESSAGES_COLUMN]), 0)
        prompt, completion = record[PROMPT_COLUMN], record[COMPLETION_COLUMN]
        if isinstance(prompt, str):
            # as TRL: the completion ends with the end-of-sequence token, so generation learns to stop
            end = (
                self.eos_token if self.eos_token and not completion.endswith(self.eos_token) else ""
            )
            text = prompt + completion + end
            return Example(text, ((len(prompt), len(text)),) if len(text) > len(prompt) else ())
        start = self.render(list(prompt), add_generation_prompt=True)
        text = self.render([*prompt, *completion], add_generation_prompt=False)
        if not text.startswith(start):
            raise TemplateError(_NOT_PREFIX)
        return Example(text, ((len(start), len(text)),) if len(text) > len(start) else ())

    def _conversation(self, messages: list[dict], first: int) -> Example:
        text = self.render(messages, add_generation_prompt=False)
        spans = []
        for index, message in enumerate(messages):
            if index < first or message.get("role") != ANSWER_ROLE:
                continue
            start = self.render(messages[:index], add_generation_prompt=True) if index else ""
            end = self.render(messages[: index + 1], add_generation_prompt=False)
            if not (text.startswith(start) and text.startswith(end) and len(end) >= len(start)):
                raise TemplateError(_NOT_PREFIX)
            if len(end) > len(start):
                spans.append((len(start), len(end)))
        return Example(text, tuple(spans))


_NOT_PREFIX = (
    "the chat template renders the start of this conversation differently once later turns "
    "follow, so its answers cannot be told apart"
)


def answer_mask(offsets: list[tuple[int, int]], answers: Iterable[tuple[int, int]]) -> list[bool]:
    """Per token (by its character offsets): whether it starts inside an answer span."""
    spans = sorted(answers)
    mask, index = [], 0
    for start, _ in offsets:
        while index < len(spans) and spans[index][1] <= start:
            index += 1
        mask.append(index < len(spans) and spans[index][0] <= start)
    return mask


@dataclass
class Encoded:
    """Token ids and labels (IGNORE where not trained) of examples, and what was cut or left out."""

    input_ids: list[list[int]]
    labels: list[list[int]]
    truncated: int = 0
    too_long_dropped: int = 0
    no_answer_dropped: int = 0


IGNORE_INDEX = -100


def encode_examples(
    examples: list[Example],
    encode: Any,
    *,
    max_length: int,
    truncation: str,
    loss_on: str,
) -> Encoded:
    """Tokenise EXAMPLES with ENCODE (texts → list of (ids, offsets)); labels mark the answers.

    The first token of every example is never a label (nothing in the example predicts it: a
    packed block must not learn it from the example before). An example longer than MAX_LENGTH is
    cut (truncation "truncate") or left out ("drop"); one with no answer token left is left out."""
    out = Encoded([], [])
    for example, (ids, offsets) in zip(examples, encode([e.text for e in examples]), strict=True):
        if loss_on == "all":
            trained = [True] * len(ids)
        else:
            trained = answer_mask(offsets, example.answers)
        if len(ids) > max_length:
            if truncation == "drop":
                out.too_long_dropped += 1
                continue
            out.truncated += 1
            ids, trained = ids[:max_length], trained[:max_length]
        labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, trained, strict=True)]
        if labels:
            labels[0] = IGNORE_INDEX
        if all(label == IGNORE_INDEX for label in labels):
            out.no_answer_dropped += 1
            continue
        out.input_ids.append(list(ids))
        out.labels.append(labels)
    return out


def read_sample_prompts(path: str) -> list[str | list[dict]]:
    """train.sample_prompts: JSON lines {"prompt": text or a list of messages}; ValueError naming
    the line that is not one."""
    prompts: list[str | list[dict]] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            prompt = record.get("prompt") if isinstance(record, dict) else None
            problem = (
                _messages_problem(prompt, "prompt", need_answer=False)
                if isinstance(prompt, list)
                else None
                if isinstance(prompt, str)
                else ("is not a JSON object with a prompt (a text or a list of messages)", "")
            )
            if problem is not None:
                raise ValueError(f"line {number} of {path} {problem[0]}")
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Examples of these token LENGTHS into blocks of at most CAPACITY tokens: best fit, longest
    first (as TRL's "bfd"); each block lists its examples' indices in their order. Deterministic."""
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    blocks: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, block), sorted
    for index in order:
        size = lengths[index]
        place = bisect.bisect_left(free, (size, -1))
        if place == len(free):
            blocks.append([index])
            bisect.insort(free, (capacity - size, len(blocks) - 1))
            continue
        left, block = free.pop(place)
        blocks[block].append(index)
        bisect.insort(free, (left - size, block))
    return [sorted(block) for block in blocks]


def special_tokens_of(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens a chat template may name (bos_token, eos_token…), from a
    tokenizer_config.json or a tokenizer's special_tokens_map (values may be {content: …})."""
    tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token"):
        value = tokenizer_config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


class CountedExamples:
    """What the launch check and the ranks say about the examples cut or left out."""

    def __init__(self, encoded: Encoded, total: int, fmt: str, max_length: int, truncation: str):
        self.encoded, self.total, self.fmt = encoded, total, fmt
        self.max_length, self.truncation = max_length, truncation

    @cached_property
    def noun(self) -> str:
        return "conversations" if self.fmt == CONVERSATIONAL else "examples"

    def lines(self) -> list[str]:
        """One line per kind of example cut or left out (none when every example fits)."""
        e, lines = self.encoded, []
        longer = e.truncated + e.too_long_dropped
        if longer:
            action = (
                "truncated" if self.truncation == "truncate" else "dropped (data.truncation: drop)"
            )
            lines.append(
                f"{longer:,} of {self.total:,} {self.noun} exceed {self.max_length:,} tokens "
                f"(data.max_length): {action}"
            )
        if e.no_answer_dropped:
            lines.append(
                f"{e.no_answer_dropped:,} of {self.total:,} {self.noun} have no answer token "
                "left after truncation: dropped (raise data.max_length to keep them)"
            )
        return lines
