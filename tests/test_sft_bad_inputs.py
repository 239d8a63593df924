"""Supervised fine-tuning data the ranks could not train on is refused before launch: one line
naming the record (or the key) and the fix, exit code 2, nothing written. The cases run the
command line in this process (tests/helpers.run_cli), one of them as a process too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import (
    SFT_CONFIG,
    TINY_LLAMA,
    child_environment,
    files_under,
    refusal_line,
    run_cli,
    run_dplaunch,
)

GOOD_PAIR = {"prompt": "2+2=", "completion": "4"}
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def _with_records(*records, extra: tuple = (), good: dict = GOOD):
    """A run of configs/sft.yaml on a JSON-lines file of GOOD and then RECORDS."""

    def build(tmp: Path) -> list:
        path = tmp / "chat.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in (good, *records)))
        return ["train", SFT_CONFIG, "--set", f"data.dataset={path}", *extra]

    return build


def _template_file(text: str):
    def build(tmp: Path) -> list:
        path = tmp / "template.jinja"
        path.write_text(text)
        return ["train", SFT_CONFIG, "--set", f"data.chat_template={path}"]

    return build


def _with_records_and_template(template: str, *records):
    def build(tmp: Path) -> list:
        path = tmp / "template.jinja"
        path.write_text(template)
        return [*_with_records(*records)(tmp), "--set", f"data.chat_template={path}"]

    return build


def _prompts_file(text: str):
    def build(tmp: Path) -> list:
        path = tmp / "prompts.jsonl"
        path.write_text(text)
        return ["train", SFT_CONFIG, "--set", f"train.sample_prompts={path}"]

    return build


# renders user and assistant turns only: any other role is left out of the text
ONLY_USER_AND_ASSISTANT = (
    "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
    "{{ bos_token + m['role'] + '\\n' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)


def _message(role, content):
    return {"role": role, "content": content}


CASES = [
    (
        "messages-not-a-list",
        _with_records({"messages": "hello"}),
        "data.dataset: line 2 of {tmp}/chat.jsonl has \"hello\" as 'messages', not a list of messages",
    ),
    (
        "role-the-template-leaves-out",
        _with_records_and_template(
            ONLY_USER_AND_ASSISTANT,
            {"messages": [_message("bot", "hi"), _message("assistant", "yo")]},
        ),
        'data.chat_template: message 1 (role "bot") is left out by the chat template, which '
        "does not render that role (line 2 of {tmp}/chat.jsonl)",
    ),
    (
        "role-not-a-name",
        _with_records({"messages": [_message(5, "hi"), _message("assistant", "yo")]}),
        "line 2 of {tmp}/chat.jsonl message 1 of 'messages' has role 5, not a name such as user",
    ),
    (
        "no-assistant-turn",
        _with_records({"messages": [_message("user", "hi")]}),
        "line 2 of {tmp}/chat.jsonl 'messages' has no assistant turn: nothing to train on",
    ),
    (
        "content-not-text",
        _with_records({"messages": [_message("user", 5), _message("assistant", "yo")]}),
        "message 1 of 'messages' has 5 as content, not a text",
    ),
    (
        "missing-completion",
        _with_records(
            {"prompt": "a", "completion": "b"},
            {"prompt": "c"},
            good=GOOD_PAIR,
        ),
        "line 3 of {tmp}/chat.jsonl has no 'completion'",
    ),
    (
        "prompt-text-completion-messages",
        _with_records(
            {"prompt": "a", "completion": [_message("assistant", "b")]},
            good=GOOD_PAIR,
        ),
        "has a text prompt and a message-list completion — make both texts, or both lists",
    ),
    (
        "template-fails-to-render",
        _template_file("{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}"),
        "data.chat_template: the chat template fails to render it (",
    ),
    (
        "template-raises",
        _template_file("{{ raise_exception('only user turns, please') }}"),
        "data.chat_template: the chat template fails to render it (only user turns, please)",
    ),
    (
        # before: "0 conversations kept pack into 0 blocks … use a larger data.max_length"
        "template-renders-no-assistant-turn",
        _template_file(
            "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
            "{% endfor %}"
        ),
        "data.chat_template: the chat template renders no assistant turn of line 1 of",
    ),
    (
        "no-chat-template",
        lambda t: ["train", SFT_CONFIG, "--set", "data.chat_template=null"],
        "data.chat_template: the tokenizer byte-level has no chat template to render the "
        "conversations of",
    ),
    (
        "chat-template-file-missing",
        lambda t: ["train", SFT_CONFIG, "--set", f"data.chat_template={t}/nope.jinja"],
        "is neither a Jinja template",
    ),
    (
        "sft-key-without-sft",
        lambda t: ["train", TINY_LLAMA, "--set", "data.loss_on=all"],
        "data.loss_on: is for supervised fine-tuning, but model.task is causal-lm — remove it",
    ),
    (
        "packing-with-pipeline",
        lambda t: ["train", SFT_CONFIG, "--cpu", "--gpus", "2", "--pp", "2"],
        "data.packing: packed examples need their position ids",
    ),
    (
        "all-dropped-by-truncation",
        lambda t: [
            "train",
            SFT_CONFIG,
            "--set",
            "data.max_length=40",
            "--set",
            "data.truncation=drop",
        ],
        "train.global_batch_size: 0 conversations kept pack into 0 blocks (2,000 left out)",
    ),
    (
        "bad-sample-prompt",
        _prompts_file('{"prompt": "fine"}\n{"question": "where is the prompt"}\n'),
        "train.sample_prompts: line 2 of {tmp}/prompts.jsonl is not a JSON object with a prompt",
    ),
]


@pytest.mark.parametrize("builder,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_sft_input_is_one_line_exit_2_and_nothing_written(tmp_path, builder, expected):
    argv = [*builder(tmp_path), "-o", tmp_path / "run"]
    before = files_under(tmp_path)
    result = run_cli(*argv, env=child_environment(), timeout=120)
    refusal_line(result, expected.replace("{tmp}", str(tmp_path)))
    assert files_under(tmp_path) == before, "something was written"


def test_a_bad_conversation_in_a_process_is_one_line_and_no_traceback(tmp_path):
    [(builder, expected)] = [c[1:] for c in CASES if c[0] == "messages-not-a-list"]
    result = run_dplaunch(*builder(tmp_path), "-o", tmp_path / "run", timeout=120)
    refusal_line(result, expected.replace("{tmp}", str(tmp_path)))
    assert not (tmp_path / "run").exists()


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 12


def test_sample_prompts_may_be_one_text_per_line(tmp_path):
    # as the reference says; before: "line 1 … is not a JSON object with a prompt"
    from dplaunch.data.conversations import read_sample_prompts

    texts = tmp_path / "prompts.txt"
    texts.write_text("Review: dull.\nPositive or negative?\n\nName a colour.\n")
    assert read_sample_prompts(str(texts)) == [
        "Review: dull.",
        "Positive or negative?",
        "Name a colour.",
    ]
    texts.write_text('What is 2+2?\n{"prompt": "half a JSON line"\n')
    with pytest.raises(ValueError, match="line 2 of .* starts like a JSON object but is not one"):
        read_sample_prompts(str(texts))
