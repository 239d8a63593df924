"""Which characters of a rendered example are answers: the text the model is trained to write.

An example is rendered to one text, as the model sees it at inference, and its answers are
character spans of that text (dplaunch.data.example_tokens turns them into token labels).

- A text prompt and completion: the text is prompt + completion + the end-of-sequence token; the
  answer is everything after the prompt.
- A conversation whose chat template marks the assistant's output with ``{% generation %}`` …
  ``{% endgeneration %}``: the marked text is the answer (transformers'
  ``return_assistant_tokens_mask``, as TRL's ``assistant_only_loss`` uses it).
- Any other conversation is rendered whole, and each assistant turn is found in that text. It
  starts where the conversation up to it, rendered with the generation prompt, leaves the whole
  text (the model is given that prompt at inference). It ends after its own text (its content, or
  its tool calls) and what the template closes a turn with: what the template writes after the
  turn when it is the last message, as far as the whole text agrees, or else the special token
  that follows it (gpt-oss's ``<|end|>``, GLM's next ``<|user|>``). So templates that render the
  last turn differently from earlier ones (Qwen3, DeepSeek-R1 and gpt-oss drop earlier turns'
  reasoning; Phi-3 ends the conversation with its EOS token) train the text the model is shown.
- A prompt and completion given as messages: the completion is everything after the point where
  the prompt rendered with the generation prompt and the whole conversation part (TRL's
  ``common_prefix_length``, in characters).

Per example and torch-free: the launch check, the ranks and ``dplaunch data`` all call these.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dplaunch.data.conversations import (
    ANSWER_ROLE,
    COMPLETION_COLUMN,
    CONVERSATIONAL,
    PROMPT_COLUMN,
    conversation_of,
    normalized_messages,
)

# appended to a turn's text to find where the template writes it (a private-use character)
_SENTINEL = "\U000f0000"
# the names a template may use for the tools and its extra variables, as records carry them
TOOLS_COLUMN = "tools"
TEMPLATE_KWARGS_COLUMN = "chat_template_kwargs"


@dataclass(frozen=True)
class Example:
    """One rendered example: its text, the character spans trained on, and what the tokenizer
    adds around it (``bos``: the special tokens ``tokenizer(text)`` puts first, for texts given
    as they are). ``unclosed``: answers that end with no end-of-turn token (the model never
    learns to stop there); ``prompt_differs``: a message prompt that the template renders
    differently alone than followed by its completion."""

    text: str
    answers: tuple[tuple[int, int], ...]
    bos: bool = False
    unclosed: int = 0
    prompt_differs: bool = False


class TemplateError(ValueError):
    """A conversation the chat template does not render, or renders inconsistently; or, with
    FIX, a record the ranks cannot train on (its text: "PROBLEM — FIX")."""

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(f"{problem} — {fix}" if fix else problem)
        self.problem, self.fix = problem, fix


def has_generation_markers(template: str | None) -> bool:
    """Whether the template marks the assistant's output ({% generation %} … {% endgeneration %})."""
    return template is not None and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


@dataclass(frozen=True)
class Renderer:
    """Turns records into Examples.

    ``template``: the chat template (None for plain strings); ``tool_template``: the one a
    tokenizer names "tool_use", for records with tools; ``special_tokens``: the named special
    tokens the template may use (bos_token, eos_token…); ``eos_token`` ends a text completion;
    ``end_tokens``: the tokenizer's special tokens, one of which ends a turn; ``tools`` and
    ``template_kwargs``: run-wide ``apply_chat_template(tools=…, **kwargs)`` arguments (a
    record's own ``tools`` and ``chat_template_kwargs`` columns win)."""

    template: str | None
    special_tokens: Mapping[str, str]
    eos_token: str | None
    end_tokens: tuple[str, ...] = ()
    tools: list[dict] | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tool_template: str | None = None

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        *,
        tools: list | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        spans: bool = False,
    ) -> Any:
        """The conversation as the template writes it (apply_chat_template's text); with SPANS,
        (text, the {% generation %} spans)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        tools = self.tools if tools is None else tools
        template = self.tool_template if tools and self.tool_template else self.template
        if template is None:
            raise TemplateError("there is no chat template")
        kwargs = {**self.special_tokens, **self.template_kwargs, **(template_kwargs or {})}
        try:
            rendered, indices = render_jinja_template(
                conversations=[messages],
                tools=tools or None,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=spans,
                **kwargs,
            )
        except Exception as exc:  # noqa: BLE001 — any template failure is the user's to fix
            raise TemplateError(f"the chat template fails to render it ({exc})") from None
        if spans:
            return rendered[0], [tuple(span) for span in indices[0]]
        return rendered[0]

    def example(self, record: Mapping[str, Any], fmt: str) -> Example:
        """The record as text with its answer spans (record_problem must have passed)."""
        tools, kwargs = _record_tools(record), _record_kwargs(record)
        if fmt == CONVERSATIONAL:
            messages = normalized_messages(conversation_of(record))
            return _Conversation(self, messages, tools, kwargs).example()
        prompt, completion = record[PROMPT_COLUMN], record[COMPLETION_COLUMN]
        if isinstance(prompt, str):
            # as TRL: the completion ends with the end-of-sequence token, so generation learns to stop
            end = (
                self.eos_token if self.eos_token and not completion.endswith(self.eos_token) else ""
            )
            text = prompt + completion + end
            answers = ((len(prompt), len(text)),) if len(text) > len(prompt) else ()
            closed = bool(self.eos_token) and text.endswith(self.eos_token)
            return Example(text, answers, bos=True, unclosed=int(bool(answers) and not closed))
        prompt, completion = normalized_messages(prompt), normalized_messages(completion)
        conversation = _Conversation(self, [*prompt, *completion], tools, kwargs)
        start = conversation.render(prompt, add_generation_prompt=True)
        text = conversation.text
        begins = conversation.agreed(start)
        answers = ((begins, len(text)),) if len(text) > begins else ()
        unclosed = int(bool(answers) and not conversation.closed(begins, len(text)))
        return Example(text, answers, unclosed=unclosed, prompt_differs=begins < len(start))


def _record_tools(record: Mapping[str, Any]) -> list | None:
    tools = record.get(TOOLS_COLUMN)
    if isinstance(tools, str):  # TRL's datasets store them as JSON text (Arrow needs one schema)
        tools = json.loads(tools) if tools.strip() else None
    return tools


def _record_kwargs(record: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = record.get(TEMPLATE_KWARGS_COLUMN)
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs) if kwargs.strip() else None
    return {key: value for key, value in (kwargs or {}).items() if value is not None}


def _common_prefix(left: str, right: str) -> int:
    return len(os.path.commonprefix([left, right]))


@functools.cache
def _special_pattern(tokens: tuple[str, ...]) -> re.Pattern | None:
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


class _Conversation:
    """One conversation of a record, rendered whole, and its assistant turns found in it."""

    def __init__(
        self, renderer: Renderer, messages: list[dict], tools: list | None, kwargs: dict
    ) -> None:
        self.renderer, self.messages = renderer, messages
        self.tools, self.kwargs = tools, kwargs
        self.markers = has_generation_markers(
            renderer.tool_template
            if (tools or renderer.tools) and renderer.tool_template
            else renderer.template
        )
        if self.markers:
            self.text, self.marked = self.render(messages, False, spans=True)
        else:
            self.text, self.marked = self.render(messages, False), []
        self._check_every_message_rendered()

    def agreed(self, other: str, start: int = 0, other_start: int = 0) -> int:
        """How far the text from START and OTHER from OTHER_START agree, in characters of the text,
        never ending inside a special token (<|end|> and <|endoftext|> share "<|")."""
        place = start + _common_prefix(self.text[start:], other[other_start:])
        pattern = _special_pattern(self.renderer.end_tokens)
        if pattern is not None and 0 < place < len(self.text):
            longest = len(self.renderer.end_tokens[0])
            window = max(0, place - longest)
            for match in pattern.finditer(self.text, window, place + longest):
                if match.start() < place < match.end():
                    return max(match.start(), start)
        return place

    def render(self, messages: list[dict], add_generation_prompt: bool, spans: bool = False) -> Any:
        return self.renderer.render(
            messages,
            add_generation_prompt,
            tools=self.tools,
            template_kwargs=self.kwargs,
            spans=spans,
        )

    def example(self) -> Example:
        answers = self.marked if self.markers else self._find_turns()
        answers = [(start, end) for start, end in answers if end > start]
        unclosed = sum(not self.closed(start, end) for start, end in answers)
        return Example(self.text, tuple(answers), unclosed=unclosed)

    def closed(self, start: int, end: int) -> bool:
        """Whether the answer text ends with an end-of-turn (special) token."""
        tail = self.text[start:end].rstrip()
        return any(tail.endswith(token) for token in self.renderer.end_tokens)

    def _check_every_message_rendered(self) -> None:
        # a role the template does not know, or tool calls it has no place for, are often left
        # out silently: never train on a conversation the template has cut
        for number, message in enumerate(self.messages, 1):
            content, role = message.get("content"), message.get("role")
            if role != ANSWER_ROLE and isinstance(content, str) and content.strip():
                if content.strip() not in self.text:
                    raise TemplateError(
                        f"message {number} (role {json.dumps(role)}) is left out by the chat "
                        "template, which does not render that role"
                    )
            if (
                role == ANSWER_ROLE
                and message.get("tool_calls")
                and not self._calls_rendered(number - 1)
            ):
                raise TemplateError(
                    f"the tool calls of message {number} are left out by the chat template, "
                    "which does not render tool calls"
                )

    def _calls_rendered(self, index: int) -> bool:
        marked = _marked(self.messages[index], at_start=False, calls=True)
        if marked is None:
            return True  # tool calls without a name: nothing to look for
        changed = [*self.messages[:index], marked, *self.messages[index + 1 :]]
        return _SENTINEL in self.render(changed, add_generation_prompt=False)

    def _find_turns(self) -> list[tuple[int, int]]:
        spans, previous_end = [], 0
        for index, message in enumerate(self.messages):
            if message.get("role") != ANSWER_ROLE:
                continue
            start = self._turn_start(index)
            if start < previous_end:
                raise TemplateError(_NOT_PREFIX)
            end = self._turn_end(index, start)
            if end < start:
                raise TemplateError(_NOT_FOUND)
            end = self._through_end_token(start, end)
            spans.append((start, end))
            previous_end = max(end, start)
        return spans

    def _turn_start(self, index: int) -> int:
        """Where the conversation up to turn INDEX, with the generation prompt, leaves the text."""
        try:
            prompt = self.render(self.messages[:index], add_generation_prompt=True)
        except TemplateError:
            if index:
                raise
            # a conversation that opens with the assistant: its text starts the answer
            return self._own_text(index, at_start=True)
        return self.agreed(prompt)

    def _turn_end(self, index: int, start: int) -> int:
        """The end of turn INDEX's own text and of what the template closes it with."""
        last = self.render(self.messages[: index + 1], add_generation_prompt=False)
        if self.text.startswith(last):
            return len(last)  # rendered as in the whole conversation, closing included
        agreed = self.agreed(last)
        own_end = self._own_text(index)
        if agreed >= own_end:
            return agreed  # the same up to the closing (Phi-3: the EOS token follows at the end)
        # the turn renders differently as the last message (reasoning kept): its closing is
        # what follows its own text there, as far as the whole conversation agrees
        alone = self._own_text(index, messages=self.messages[: index + 1])
        return self.agreed(last, own_end, alone)

    def _own_text(
        self, index: int, *, at_start: bool = False, messages: list[dict] | None = None
    ) -> int:
        """Where turn INDEX's own text ends (starts, AT_START) in the rendering of MESSAGES (the
        whole conversation): a mark added to its content, or to its last tool call's name,
        shows where the template writes it."""
        messages = self.messages if messages is None else messages
        rendered = self.text if messages is self.messages else self.render(messages, False)
        marked = _marked(messages[index], at_start)
        if marked is None:
            raise TemplateError(_NOT_FOUND)
        changed = [*messages[:index], marked, *messages[index + 1 :]]
        with_mark = self.render(changed, add_generation_prompt=False)
        place = _common_prefix(rendered, with_mark)
        if with_mark[place : place + len(_SENTINEL)] != _SENTINEL or (
            with_mark[place + len(_SENTINEL) :] != rendered[place:]
        ):
            raise TemplateError(_NOT_FOUND)
        return place

    def _through_end_token(self, start: int, end: int) -> int:
        """END moved past the special token that follows it, when the answer has none yet: a
        template that closes a turn with the next message's tag (GLM's <|user|>) or only at
        the end (gpt-oss's <|end|> of earlier turns) trains that tag, as TRL's templates do."""
        if self.closed(start, end):
            return end
        for token in self.renderer.end_tokens:
            if self.text.startswith(token, end):
                return end + len(token)
        return end


def _marked(message: dict, at_start: bool, calls: bool = False) -> dict | None:
    """MESSAGE with a mark at the start or end of its content, else (or with CALLS) at the end
    of its last tool call's name; None when it has neither."""
    content = message.get("content")
    if isinstance(content, str) and content and not calls:
        text = _SENTINEL + content if at_start else content + _SENTINEL
        return {**message, "content": text}
    calls = message.get("tool_calls")
    if not at_start and isinstance(calls, list) and calls and isinstance(calls[-1], Mapping):
        call = dict(calls[-1])
        target = call.get("function") if isinstance(call.get("function"), Mapping) else call
        if isinstance(target.get("name"), str):
            target = {**target, "name": target["name"] + _SENTINEL}
            call = {**call, "function": target} if "function" in call else target
            return {**message, "tool_calls": [*calls[:-1], call]}
    return None


_NOT_PREFIX = (
    "the chat template renders the start of this conversation differently once later turns "
    "follow, so its answers cannot be told apart"
)
_NOT_FOUND = (
    "the chat template does not write an assistant turn's text where it can be found (it "
    "changes the text, or renders nothing for it), so its answer cannot be located"
)


def end_tokens(special_tokens: Iterable[str]) -> tuple[str, ...]:
    """The tokenizer's special tokens as Renderer.end_tokens: longest first, so that of two
    tokens where one starts the other (<|end|>, <|endoftext|>) the whole one is taken."""
    return tuple(sorted({token for token in special_tokens if token}, key=lambda t: (-len(t), t)))
