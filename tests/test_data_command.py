"""`dplaunch data RUN.yaml` shows what the ranks will train on: the same tokens, labels and packed
blocks as the ranks' tokenize(), the statistics a user checks, each pitfall once, and the trained
tokens marked ([[…]] in plain text, colours on a terminal). In-process: nothing is launched."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from dplaunch.commands.data import run_data  # noqa: E402
from dplaunch.config.flags import RunFlags  # noqa: E402
from dplaunch.errors import UserError  # noqa: E402
from tests.helpers import SFT_CONFIG, TINY_LLAMA  # noqa: E402

IGNORE = -100
# configs/sft.yaml with blocks of 160 tokens: some conversations are cut, some lose every answer
CUT = ["data.max_length=160"]


def data_output(capsys, config=SFT_CONFIG, *assignments, **options) -> str:
    chosen = {"show": 2, "start": 0, "blocks": 1, "boundaries": False, "as_json": False}
    chosen.update(options)
    flags = RunFlags(config=config, assignments=list(assignments))
    assert run_data(flags, **chosen) == 0
    return capsys.readouterr().out


def data_json(capsys, config=SFT_CONFIG, *assignments, **options) -> dict:
    return json.loads(data_output(capsys, config, *assignments, as_json=True, **options))


def ranks_rows(*assignments: str, packing: bool) -> list[dict]:
    """The training rows the ranks build for configs/sft.yaml (train/data.py, as loop.py calls it)."""
    from dplaunch.config.load import load_run_config
    from dplaunch.train.data import attach_chat_template, load_splits, tokenize
    from dplaunch.train.modeling import load_tokenizer

    config = load_run_config(SFT_CONFIG, assignments=[*assignments, f"data.packing={packing}"])
    tokenizer = load_tokenizer(config.model)
    attach_chat_template(tokenizer, config.data, "sft")
    training, _ = load_splits(config.data, config.train.seed)
    return list(tokenize(training, tokenizer, config.data, "sft"))


def test_the_preview_shows_the_tokens_labels_and_blocks_the_ranks_train_on(capsys):
    shown = data_json(capsys, SFT_CONFIG, *CUT, show=30)
    stats = shown["stats"]
    rows = ranks_rows(*CUT, packing=False)
    blocks = ranks_rows(*CUT, packing=True)
    # kept examples are the ranks' rows, in order; their trained tokens are the ranks' labels
    assert stats["kept"] == len(rows) == 1930 and stats["examples"] == 2000
    assert stats["dropped_no_answer"] == 70 and stats["truncated"] == 468
    assert stats["trained_tokens"] == sum(
        label != IGNORE for row in rows for label in row["labels"]
    )
    assert stats["tokens"] == sum(len(row["input_ids"]) for row in rows)
    kept = [e for e in shown["examples"] if any(e["trained"])]
    dropped = {w["example"] for w in stats["warnings"] if w["name"] == "no_answer_dropped"}
    assert len(kept) >= 25 and not dropped & {e["index"] for e in kept}
    for example, row in zip(kept, rows, strict=False):
        assert example["trained"] == [label != IGNORE for label in row["labels"]]
    # packing: the ranks' blocks, the shown one kept apart by its position ids
    assert stats["packing"]["blocks"] == len(blocks) == stats["samples"]
    assert stats["global_batches_per_epoch"] == len(blocks) // 16
    real = sum(len(block["input_ids"]) for block in blocks)
    assert stats["packing"]["efficiency"] == pytest.approx(real / (len(blocks) * 160), abs=1e-4)
    (block,) = stats["blocks_shown"]
    theirs = blocks[block["block"]]
    assert block["tokens"] == len(theirs["input_ids"]) and block["isolated"]
    starts = [span["tokens"][0] for span in block["examples"]]
    assert len(starts) > 1 and [i for i, p in enumerate(theirs["position_ids"]) if p == 0] == starts


def test_json_gives_each_shown_examples_tokens_and_mask_in_the_issues_shape(capsys):
    shown = data_json(capsys, SFT_CONFIG, show=2, start=5)
    assert set(shown) == {"stats", "examples"}
    assert [e["index"] for e in shown["examples"]] == [5, 6]
    for example in shown["examples"]:
        assert set(example) == {"index", "tokens", "trained"}
        assert len(example["tokens"]) == len(example["trained"])
        text = "".join(example["tokens"])
        assert text.startswith("<s>") and text.endswith("</s>")
        answers = "".join(
            t for t, keep in zip(example["tokens"], example["trained"], strict=True) if keep
        )
        assert answers.endswith("</s>") and "user" not in answers


def test_plain_output_marks_the_trained_tokens_and_warns_of_each_pitfall_once(capsys):
    out = data_output(capsys, SFT_CONFIG, *CUT, show=1, start=4, boundaries=True)
    lines = out.splitlines()
    assert lines[1].startswith(
        "conversations: 2,000 — 1,930 kept (468 cut to 160 tokens), 70 dropped"
    )
    assert "trained tokens: " in out and "global batches per epoch: " in out
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert [w.split(":")[1].strip() for w in warnings][0] == "ANSWERS CUT"
    assert len(warnings) == 3 and all("(e.g. example " in w for w in warnings)
    assert "example 4: " in out and "(truncated)" in out
    # token boundaries: | between tokens; the trained ones inside [[…]]
    assert "[[" in out and "]]" in out and "|" in out
    assert "position ids restart at 0 at each example: each attends only to itself" in out


def test_a_terminal_gets_colours_instead_of_marks(capsys, monkeypatch):
    # the terminal as rich sees it, fixed on the class: with FORCE_COLOR alone, rich once saw
    # no terminal in a full suite under xdist (the same run passed before; cause not found)
    from rich.console import Console

    monkeypatch.setattr(Console, "is_terminal", property(lambda _console: True))
    monkeypatch.setattr(Console, "is_dumb_terminal", property(lambda _console: False))
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)
    out = data_output(capsys, SFT_CONFIG, show=1, blocks=0)
    assert "\x1b[" in out and "[[" not in out


def test_an_answer_token_that_begins_in_the_prompt_is_counted_and_warned_once(capsys, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "Review: dull. Sentiment: ", "completion": "negative"}] * 3
    rows += [{"prompt": "Review: great. Sentiment:", "completion": " positive"}] * 3
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [f"data.dataset={pairs}", "data.eval_dataset=null", "train.sample_prompts=null"]
    overrides += ["data.packing=false", "train.global_batch_size=2"]
    # a BPE tokenizer: " negative" is one token, whose space ends the prompt
    from tests.chat_tokenizers import bpe_tokenizer

    tokenizer = bpe_tokenizer(
        ["<s>", "</s>", "<unk>"], {"bos_token": "<s>", "eos_token": "</s>"}, bos="<s>"
    )
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    overrides += [f"model.tokenizer={tmp_path / 'tokenizer'}", "data.chat_template=null"]
    shown = data_json(capsys, SFT_CONFIG, *overrides, show=1)
    stats = shown["stats"]
    (warning,) = [w for w in stats["warnings"] if w["name"] == "straddling_examples"]
    assert warning["count"] == 3 and warning["example"] == 0 and stats["straddling_tokens"] == 3
    (example,) = shown["examples"]
    trained = [t for t, keep in zip(example["tokens"], example["trained"], strict=True) if keep]
    assert example["tokens"][0] == "<s>" and trained == [" negative", "</s>"]


def test_a_record_the_ranks_cannot_train_on_is_one_line_naming_it(capsys, tmp_path):
    chats = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    chats.write_text("".join(json.dumps(r) + "\n" for r in [good, good, bad]))
    template = tmp_path / "two-roles.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
        "{{ m['role'] + ': ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(UserError, match=r'example 2 message 1 \(role "bot"\) is left out'):
        data_output(
            capsys,
            SFT_CONFIG,
            f"data.dataset={chats}",
            "data.eval_dataset=null",
            "train.sample_prompts=null",
            f"data.chat_template={template}",
        )


def test_a_causal_lm_run_shows_its_blocks_every_token_trained(capsys):
    shown = data_json(capsys, TINY_LLAMA, show=1)
    stats = shown["stats"]
    assert stats["task"] == "causal-lm" and stats["blocks"] > 0
    (block,) = shown["examples"]
    assert len(block["tokens"]) == stats["block_tokens"] and block["trained"][1:] == [True] * (
        len(block["trained"]) - 1
    )
