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
from dplaunch.run_directory.environment import DATA_CHECK_MB_ENV  # noqa: E402
from tests.helpers import (  # noqa: E402
    REPO,
    SFT_CONFIG,
    TINY_LLAMA,
    child_environment,
    refusal_line,
    run_cli,
)

IGNORE = -100
DPO_CONFIG = REPO / "configs" / "dpo.yaml"
SHIPPED = REPO / "dplaunch" / "resources" / "data"
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
    # dplaunch train's words: the record's line in its file
    with pytest.raises(UserError, match=r'message 1 \(role "bot"\) is left out.* \(line 3 of '):
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


def _spoilt(tmp_path, source: str, changes: dict) -> list[str]:
    """The --set flags of a run on the first 40 records of SOURCE (a shipped file) with
    CHANGES[n](record) applied to the record on line n."""
    records = [json.loads(line) for line in (SHIPPED / source).read_text().splitlines()[:40]]
    for number, change in changes.items():
        change(records[number - 1])
    path = tmp_path / source
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    flags = [f"data.dataset={path}", "data.eval_dataset=null", "train.sample_prompts=null"]
    return [part for flag in flags for part in ("--set", flag)]


def _same_responses(record: dict) -> None:
    record["rejected"] = record["chosen"]


def _content(value):
    def change(record: dict) -> None:
        record["messages"][1]["content"] = value

    return change


SPOILT = [
    (
        "dpo-pair",
        DPO_CONFIG,
        "pairs-train.jsonl",
        {23: _same_responses},
        "data.dataset: line 23 of {file} has the same chosen and rejected response: nothing to "
        "prefer — fix that record or drop it",
    ),
    (
        # a content 1 on line 6 makes `datasets` read the column as JSON, turning line 1's "1" into 1
        "chat-content",
        SFT_CONFIG,
        "chat-train.jsonl",
        {1: _content("1"), 6: _content(1)},
        "data.dataset: line 6 of {file} message 2 of 'messages' has 1 as content, not a text — "
        "fix that record or drop it",
    ),
]


@pytest.mark.parametrize(
    "config,source,changes,expected", [c[1:] for c in SPOILT], ids=[c[0] for c in SPOILT]
)
def test_a_record_train_refuses_is_refused_in_trains_words_before_datasets_reads_it(
    tmp_path, config, source, changes, expected
):
    flags = _spoilt(tmp_path, source, changes)
    line = refusal_line(run_cli("data", config, *flags))  # one line: no progress bar before it
    assert line == "dplaunch: error: " + expected.format(file=tmp_path / source)
    trained = run_cli("train", config, *flags, "--cpu", "--dry-run", "-o", tmp_path / "run")
    assert refusal_line(trained) == line


def test_a_pair_past_the_checks_budget_is_named_once_with_its_fix_and_no_progress_bar(tmp_path):
    # the launch check reads each file's first record only: the preview finds the pair itself
    flags = _spoilt(tmp_path, "pairs-train.jsonl", {23: _same_responses})
    result = run_cli("data", DPO_CONFIG, *flags, env=child_environment(**{DATA_CHECK_MB_ENV: "0"}))
    line = refusal_line(result, "data.dataset: pair 22 has the same chosen and rejected response")
    assert line.count(" — ") == 1 and line.endswith("— fix that record or drop it")


def test_a_start_past_the_end_is_refused_naming_the_count(tmp_path):
    result = run_cli("data", TINY_LLAMA, "--start", "5000")
    line = refusal_line(result, "--start: 5,000 is past the end: the data has ")
    assert "blocks" in line and "use a --start below" in line
    assert result.stdout == ""


def test_piped_the_preview_prints_no_progress_bar(tmp_path):
    texts = tmp_path / "texts.jsonl"  # new: `datasets` has no split of it cached
    texts.write_text(
        "".join(json.dumps({"text": f"review {n} of {tmp_path}"}) + "\n" for n in range(40))
    )
    result = run_cli("data", TINY_LLAMA, "--set", f"data.dataset={texts}", "--show", "1")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout.startswith("data: ")


def test_a_causal_lm_run_without_packing_shows_a_row_per_text_as_the_ranks_cut_it(capsys):
    from dplaunch.config.load import load_run_config
    from dplaunch.train.data import load_splits, tokenize
    from dplaunch.train.modeling import load_tokenizer

    shown = data_json(capsys, TINY_LLAMA, "data.packing=false", show=1)
    stats = shown["stats"]
    config = load_run_config(TINY_LLAMA, assignments=["data.packing=false"])
    training, _ = load_splits(config.data, config.train.seed)
    rows = tokenize(training, load_tokenizer(config.model), config.data, "causal-lm")
    assert stats["packing"] is False and "blocks" not in stats
    assert stats["rows"] == len(rows) == stats["texts"] == len(training)
    assert stats["tokens"] == sum(len(row["input_ids"]) for row in rows)
    assert stats["trained_tokens"] == stats["tokens"] - len(rows)
    (row,) = shown["examples"]
    assert len(row["tokens"]) == len(rows[0]["input_ids"]) < stats["max_length"]
    out = data_output(capsys, TINY_LLAMA, "data.packing=false", show=1)
    assert "concatenated" not in out and "no packing (data.packing: false): a row per text" in out
    assert "row 0: " in out
