"""Supervised fine-tuning records: their format, their checks, and their messages.

Formats as TRL names them: *conversational* (a ``messages`` column: a list of ``{role,
content}``; or ShareGPT's ``conversations`` of ``{from, value}``), *prompt-completion*
(``prompt`` and ``completion`` columns: two strings, or two message lists) and plain *text*
(today's causal-LM packing). A message's role is any the chat template renders (``human`` and
``gpt`` of ShareGPT are ``user`` and ``assistant``); its content a text, or a list of text
parts (``{"type": "text", "text": …}``, joined). How a record is rendered and which characters
are its answers: dplaunch.data.answer_spans. Imports nothing heavy: the launch check runs these
functions without torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

CONVERSATIONAL = "conversational"
PROMPT_COMPLETION = "prompt-completion"
TEXT = "text"
MESSAGES_COLUMN = "messages"
# ShareGPT's column of {from, value} messages (TRL and axolotl read it as messages)
SHAREGPT_COLUMN = "conversations"
PROMPT_COLUMN = "prompt"
COMPLETION_COLUMN = "completion"
ANSWER_ROLE = "assistant"
# ShareGPT's speakers as chat templates name them (FastChat, axolotl, LLaMA-Factory)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
# the fix of a record the check refuses
FIX_RECORD = "fix that record or drop it"


def resolve_format(declared: str | None, columns: Iterable[str], text_column: str) -> str:
    """The example format: data.format when set, else the columns say (TRL's rules)."""
    if declared is not None:
        return declared
    present = set(columns)
    if MESSAGES_COLUMN in present or SHAREGPT_COLUMN in present:
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
        f"give a {MESSAGES_COLUMN!r} (or ShareGPT {SHAREGPT_COLUMN!r}) column, {PROMPT_COLUMN!r} and "
        f"{COMPLETION_COLUMN!r} columns, or a {text_column!r} column (data.text_column), "
        "or set data.format",
    )


# the columns each declared data.format needs, and how to say them (text: data.text_column,
# which checks.py names)
FORMAT_COLUMNS = {
    CONVERSATIONAL: (
        ((MESSAGES_COLUMN,), (SHAREGPT_COLUMN,)),
        f"a {MESSAGES_COLUMN!r} (or ShareGPT {SHAREGPT_COLUMN!r}) column",
    ),
    PROMPT_COMPLETION: (
        ((PROMPT_COLUMN, COMPLETION_COLUMN),),
        f"{PROMPT_COLUMN!r} and {COMPLETION_COLUMN!r} columns",
    ),
}


def check_declared_format(declared: str, columns: Iterable[str], data: Any) -> None:
    """Refuse data.format DECLARED when the first record's COLUMNS do not hold that format
    (DATA: the data section, for the text column and the dataset's name)."""
    present = set(columns)
    if declared not in FORMAT_COLUMNS:
        return
    options, wanted = FORMAT_COLUMNS[declared]
    if any(all(column in present for column in option) for option in options):
        return
    from dplaunch.errors import UserError

    try:
        found = resolve_format(None, present, data.text_column)
    except UserError:
        found = None
    listed = ", ".join(sorted(present)) or "none"
    raise UserError(
        "data.format",
        f"is {declared}, which needs {wanted}, but the first record of {data.dataset} has "
        f"the columns {listed}",
        f"remove data.format (these columns say {found}), or give the records {wanted}"
        if found is not None
        else f"give the records {wanted}, or set data.format to their format",
    )


def record_problem(record: Mapping[str, Any], fmt: str) -> tuple[str, str] | None:
    """(problem, fix) of a record the ranks cannot train on, else None. The problem text follows
    the record's place ("line 3 of data.jsonl ")."""
    if fmt == CONVERSATIONAL:
        column = MESSAGES_COLUMN if MESSAGES_COLUMN in record else SHAREGPT_COLUMN
        return messages_problem(record.get(column), column, need_answer=True)
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
    return messages_problem(prompt, PROMPT_COLUMN, need_answer=False) or messages_problem(
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


def conversation_of(record: Mapping[str, Any]) -> Any:
    """The messages of a conversational record: its ``messages``, else its ShareGPT ``conversations``."""
    messages = record.get(MESSAGES_COLUMN)
    return record.get(SHAREGPT_COLUMN) if messages is None else messages


def normalized_messages(messages: list) -> list[dict]:
    """MESSAGES as chat templates take them: ShareGPT's {from, value} as {role, content}
    (human → user, gpt → assistant), text parts joined into one text, and no key whose value
    is None at any depth (as apply_chat_template drops them; Arrow fills a missing key of a
    nested record with None, which a template would render)."""
    return [_normalized(message) for message in messages]


def _normalized(message: Mapping[str, Any]) -> dict:
    message = dict(message)
    if "role" not in message and "from" in message:
        speaker = message.pop("from")
        message["role"] = SHAREGPT_ROLES.get(speaker, speaker)
    if "content" not in message and "value" in message:
        message["content"] = message.pop("value")
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = "".join(part["text"] for part in content)
    return _without_none(message)


def _without_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_none(item) for item in value]
    return value


def messages_problem(messages: Any, column: str, *, need_answer: bool) -> tuple[str, str] | None:
    """(problem, fix) of a list of messages in COLUMN the ranks cannot train on, else None;
    NEED_ANSWER: it must hold an assistant turn."""
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
        problem = _message_problem(_normalized_keys(message))
        if problem is not None:
            return f"message {number} of {column!r} {problem}", FIX_RECORD
    roles = [_normalized_keys(m).get("role") for m in messages]
    if need_answer and ANSWER_ROLE not in roles:
        return f"{column!r} has no assistant turn: nothing to train on", FIX_RECORD
    return None


def _normalized_keys(message: Mapping[str, Any]) -> dict:
    # the role and content of a ShareGPT message, before its content is checked
    role = message.get("role")
    if role is None and "from" in message:
        role = SHAREGPT_ROLES.get(message["from"], message["from"])
    content = message.get("content", message.get("value"))
    return {**message, "role": role, "content": content}


def _message_problem(message: dict) -> str | None:
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        return f"has role {json.dumps(role)}, not a name such as user or assistant"
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                shown = json.dumps(kind) if kind else json.dumps(part)[:40]
                return (
                    f"has a {shown} content part: only text parts "
                    '({"type": "text", "text": …}) are trained on'
                )
        return None
    if not isinstance(content, str) and not (role == ANSWER_ROLE and message.get("tool_calls")):
        return f"has {json.dumps(content)[:40]} as content, not a text"
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


def read_sample_prompts(path: str) -> list[str | list[dict]]:
    """train.sample_prompts: JSON lines {"prompt": text or a list of messages}, or (when the
    first line is no JSON object) one text per line; ValueError naming the line that is neither."""
    prompts: list[str | list[dict]] = []
    with open(path, encoding="utf-8") as handle:
        lines = [(number, line) for number, line in enumerate(handle, 1) if line.strip()]
    if lines and not _is_json_object(lines[0][1]):
        for number, line in lines:
            if line.lstrip().startswith("{"):
                raise ValueError(
                    f"line {number} of {path} starts like a JSON object but is not one (a file "
                    "of texts has no JSON lines)"
                )
            prompts.append(line.rstrip("\r\n"))
        return prompts
    for number, line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        problem = (
            messages_problem(prompt, "prompt", need_answer=False)
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


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


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
