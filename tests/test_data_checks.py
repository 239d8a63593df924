"""Data mistakes are caught before launch, as `datasets` would meet them in the ranks: a hub
dataset the ranks cannot load, a broken line anywhere in a file, a column missing from any file,
fewer rows than one global batch. Valid files `datasets` reads (a UTF-8 BOM, blank lines) pass.
Every case really runs `dplaunch train … --dry-run`."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from pathlib import Path

import pytest

from tests.helpers import (
    DEFAULT_CONFIG,
    TINY_LLAMA,
    cache_hub_dataset,
    child_environment,
    files_under,
    refusal_line,
    run_dplaunch,
)

# one global batch of 4 on one CPU rank, no evaluation cut: the row counts below are exact
SMALL_BATCH = ("--cpu", "--gpus", "1", "--global-batch", "4", "--micro-batch", "1")
NO_EVAL = ("--set", "data.eval_fraction=null")


def reviews(count: int, label: bool = True) -> list[dict]:
    rows = [
        {"text": f"review {i}: the tour was {'good' if i % 2 else 'poor'}"} for i in range(count)
    ]
    if label:
        for i, row in enumerate(rows):
            row["label"] = i % 2
    return rows


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def hub_environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The test environment with an empty Hugging Face home of its own."""
    env = child_environment(HF_HOME=str(tmp_path / "hf-home"), **extra)
    env.pop("HF_DATASETS_CACHE", None)
    env.pop("HF_HUB_CACHE", None)
    return env


def dry_run(tmp_path: Path, config: Path, *args, env: dict[str, str] | None = None):
    return run_dplaunch(
        "train", config, *args, "--dry-run", "-o", tmp_path / "run", env=env, timeout=120
    )


def refused(tmp_path: Path, config: Path, *args, env: dict[str, str] | None = None) -> str:
    """Run the command, insist on the one-line refusal with nothing written; return the line."""
    before = files_under(tmp_path)
    line = refusal_line(dry_run(tmp_path, config, *args, env=env))
    assert files_under(tmp_path) == before, "something was written"
    return line


def accepted(tmp_path: Path, config: Path, *args, env: dict[str, str] | None = None) -> None:
    result = dry_run(tmp_path, config, *args, env=env)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "run").exists()


# 1. hub datasets the ranks cannot load


def test_a_hub_dataset_missing_from_the_cache_is_refused_when_offline(tmp_path):
    line = refused(
        tmp_path,
        TINY_LLAMA,
        "--set",
        "data.dataset=someorg/nonexistent-ds",
        env=hub_environment(tmp_path, HF_HUB_OFFLINE="1"),
    )
    assert line.startswith("dplaunch: error: data.dataset: hub dataset 'someorg/nonexistent-ds'")
    assert "not in the datasets cache" in line and "offline" in line


def test_a_hub_dataset_in_the_datasets_cache_passes_offline(tmp_path):
    # the folder `load_dataset` falls back to offline: <namespace>___<snake_case name>/config/version/hash
    # (test_arrow_datasets checks what is in it)
    env = hub_environment(tmp_path, HF_HUB_OFFLINE="1")
    texts = {"text": [row["text"] for row in reviews(40)]}
    cache_hub_dataset(tmp_path / "hf-home", "someorg/TinyReviews", "default", {"train": texts})
    accepted(tmp_path, TINY_LLAMA, "--set", "data.dataset=someorg/TinyReviews", env=env)
    # HF_DATASETS_CACHE wins over HF_HOME, as in `datasets`
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    line = refused(
        tmp_path,
        TINY_LLAMA,
        "--set",
        "data.dataset=someorg/TinyReviews",
        env={**env, "HF_DATASETS_CACHE": str(elsewhere)},
    )
    assert str(elsewhere) in line


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The Hub's dataset-info endpoint: someorg/exists is there, anything else is not."""

    def do_GET(self):  # noqa: N802 (the http.server name)
        if self.path.startswith("/api/datasets/someorg/exists"):
            body, status, headers = b'{"id": "someorg/exists", "sha": "abc"}', 200, {}
        else:
            body, status = b'{"error": "Repository not found"}', 404
            headers = {"X-Error-Code": "RepoNotFound"}
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_online_a_hub_dataset_not_cached_is_asked_for_at_the_hub(tmp_path, fake_hub):
    env = hub_environment(tmp_path, HF_HUB_OFFLINE="0", HF_ENDPOINT=fake_hub)
    line = refused(tmp_path, TINY_LLAMA, "--set", "data.dataset=someorg/nonexistent-ds", env=env)
    assert "data.dataset: 'someorg/nonexistent-ds' is neither a local file nor a dataset" in line
    # one the Hub has is left for the ranks to download
    accepted(tmp_path, TINY_LLAMA, "--set", "data.dataset=someorg/exists", env=env)


def test_online_the_hub_decides_between_several_cached_configurations(tmp_path, fake_hub):
    # offline `datasets` refuses to pick one (test_arrow_datasets); online the Hub's default decides
    texts = {"text": [row["text"] for row in reviews(40)]}
    for config in ("cola", "sst2"):
        cache_hub_dataset(tmp_path / "hf-home", "someorg/exists", config, {"train": texts})
    env = hub_environment(tmp_path, HF_HUB_OFFLINE="0", HF_ENDPOINT=fake_hub)
    accepted(tmp_path, TINY_LLAMA, "--set", "data.dataset=someorg/exists", env=env)
    line = refused(
        tmp_path,
        TINY_LLAMA,
        "--set",
        "data.dataset=someorg/exists",
        env={**env, "HF_HUB_OFFLINE": "1"},
    )
    assert "data.dataset_config: hub dataset 'someorg/exists' has several configurations" in line


def test_online_an_unreachable_hub_is_refused_when_the_dataset_is_not_cached(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = hub_environment(tmp_path, HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{port}")
    line = refused(tmp_path, TINY_LLAMA, "--set", "data.dataset=someorg/nonexistent-ds", env=env)
    assert "data.dataset: " in line and "the Hub cannot be reached" in line


# 2. every file, every line, Parquet too


def test_a_parquet_file_without_the_text_column_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = reviews(40)
    bad, good = tmp_path / "sentences.parquet", tmp_path / "texts.parquet"
    pq.write_table(pa.table({"sentence": [r["text"] for r in rows]}), bad)
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), good)
    line = refused(tmp_path, TINY_LLAMA, "--set", f"data.dataset={bad}")
    assert (
        "data.text_column: column 'text' is not in" in line and "its columns are sentence" in line
    )
    accepted(tmp_path, TINY_LLAMA, "--set", f"data.dataset={good}")


def test_every_file_of_a_list_is_checked(tmp_path):
    good, other = tmp_path / "good.jsonl", tmp_path / "other.jsonl"
    good.write_text(jsonl(reviews(40)))
    other.write_text(jsonl([{"content": row["text"]} for row in reviews(40)]))
    line = refused(tmp_path, TINY_LLAMA, "--set", f"data.dataset=[{good},{other}]")
    assert f"data.text_column: column 'text' is not in {other}" in line
    accepted(tmp_path, TINY_LLAMA, "--set", f"data.dataset=[{good},{good}]")


def test_a_json_lines_file_broken_after_its_first_line_is_refused(tmp_path):
    broken = tmp_path / "broken.jsonl"
    lines = jsonl(reviews(40)).splitlines()
    lines[30] = lines[30][:-1]  # the closing brace lost
    broken.write_text("\n".join(lines) + "\n")
    line = refused(tmp_path, DEFAULT_CONFIG, "--set", f"data.dataset={broken}")
    assert f"data.dataset: line 31 of {broken} is not valid JSON" in line


def test_a_record_without_its_label_is_refused(tmp_path):
    rows = reviews(40)
    del rows[12]["label"]
    path = tmp_path / "reviews.jsonl"
    path.write_text(jsonl(rows))
    line = refused(tmp_path, DEFAULT_CONFIG, "--set", f"data.dataset={path}")
    assert f"data.label_column: line 13 of {path} has no 'label'" in line


# 3. valid files `datasets` reads are not refused


def test_a_csv_file_with_a_utf8_bom_passes(tmp_path):
    path = tmp_path / "bom.csv"
    rows = "".join(f"{row['text']},{row['label']}\n" for row in reviews(40))
    path.write_text("\ufefftext,label\n" + rows, encoding="utf-8")
    accepted(tmp_path, DEFAULT_CONFIG, *SMALL_BATCH, "--set", f"data.dataset={path}")
    # the BOM is not part of a column name, in a refusal either
    line = refused(
        tmp_path, DEFAULT_CONFIG, "--set", f"data.dataset={path}", "--set", "data.text_column=body"
    )
    assert line.endswith("its columns are label, text"), line


def test_a_json_lines_file_with_a_blank_first_line_passes(tmp_path):
    path = tmp_path / "blankfirst.jsonl"
    path.write_text("\n" + jsonl(reviews(40)) + "\n  \n")
    accepted(tmp_path, DEFAULT_CONFIG, *SMALL_BATCH, "--set", f"data.dataset={path}")


def test_an_empty_file_is_called_empty(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    line = refused(tmp_path, DEFAULT_CONFIG, "--set", f"data.dataset={path}")
    assert f"data.dataset: {path}: the file is empty" in line


# 4. one global batch of training rows, after the eval cut the ranks make


def test_fewer_rows_than_one_global_batch_are_refused(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text(jsonl(reviews(5)))
    line = refused(tmp_path, DEFAULT_CONFIG, *NO_EVAL, "--set", f"data.dataset={path}")
    assert line.startswith("dplaunch: error: train.global_batch_size: the training set has 5 ")
    assert "fewer than one global batch of 32" in line


def test_the_row_count_is_the_one_after_the_ranks_eval_cut(tmp_path):
    # 100 rows, eval_fraction 0.07: `datasets` holds out ceil(0.07 × 100) = ceil(7.000000000000001) = 8
    path = tmp_path / "hundred.csv"
    path.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in reviews(100)))
    common = ("--cpu", "--gpus", "1", "--micro-batch", "1", "--set", f"data.dataset={path}")
    common += ("--set", "data.eval_fraction=0.07")
    accepted(tmp_path, DEFAULT_CONFIG, *common, "--global-batch", "92")
    line = refused(tmp_path, DEFAULT_CONFIG, *common, "--global-batch", "93")
    assert (
        "train.global_batch_size: the training set has 92 samples (100 rows less 8 held out" in line
    )


def test_packed_texts_that_cannot_fill_one_global_batch_are_refused(tmp_path):
    # the tiny Llama packs byte-level tokens into blocks of 64: 5 short reviews make 3 at most
    path = tmp_path / "tiny.jsonl"
    path.write_text(jsonl(reviews(5, label=False)))
    line = refused(tmp_path, TINY_LLAMA, "--set", f"data.dataset={path}")
    assert "train.global_batch_size: the training texts make at most" in line
    assert "fewer than one global batch of 8" in line


def test_the_eval_cut_is_the_one_datasets_makes():
    from datasets import Dataset

    from dplaunch.data.formats import eval_fraction_split

    for rows in (1, 2, 3, 7, 10, 29, 30, 31, 100, 200, 333):
        table = Dataset.from_dict({"text": ["x"] * rows})
        for fraction in (0.01, 0.05, 0.07, 0.1, 0.2, 0.3, 0.5, 0.7, 0.99):
            expected = eval_fraction_split(rows, fraction)
            if expected[0] == 0:
                with pytest.raises(ValueError):  # `datasets` refuses an empty training split
                    table.train_test_split(test_size=fraction, seed=1)
                continue
            parts = table.train_test_split(test_size=fraction, seed=1)
            assert (len(parts["train"]), len(parts["test"])) == expected, (rows, fraction)


def test_a_large_corpus_is_checked_on_a_budget_and_every_files_first_record(tmp_path, monkeypatch):
    # a corpus of many GB is not read whole at every launch: past FULL_CHECK_BYTES each file
    # gives its first record only (its columns are still checked) and no batch check is made
    from dplaunch.config.schema import DataConfig
    from dplaunch.data import checks
    from dplaunch.errors import UserError

    monkeypatch.setattr(checks, "FULL_CHECK_BYTES", 2000)
    big = tmp_path / "big.jsonl"
    big.write_text(jsonl(reviews(200)) + "{broken\n")  # ~10 kB; the broken line is not reached
    unlabelled = tmp_path / "unlabelled.jsonl"
    unlabelled.write_text(jsonl(reviews(3, label=False)))

    data = DataConfig(dataset=[str(big)], eval_fraction=None)
    checks.check_data(data, "sequence-classification", global_batch_size=10**6)
    data = DataConfig(dataset=[str(big), str(unlabelled)], eval_fraction=None)
    with pytest.raises(UserError, match=r"column 'label' is not in .*unlabelled\.jsonl"):
        checks.check_data(data, "sequence-classification", global_batch_size=4)

    # within the budget the same file is read to its end
    monkeypatch.setattr(checks, "FULL_CHECK_BYTES", 10**6)
    with pytest.raises(UserError, match=r"line 201 of .*big\.jsonl is not valid JSON"):
        checks.check_data(
            DataConfig(dataset=[str(big)], eval_fraction=None), "sequence-classification", 4
        )

    # DPLAUNCH_DATA_CHECK_MB sets the budget: 0 checks each file's first record only
    monkeypatch.setenv("DPLAUNCH_DATA_CHECK_MB", "0")
    checks.check_data(
        DataConfig(dataset=[str(big)], eval_fraction=None), "sequence-classification", 4
    )
    monkeypatch.setenv("DPLAUNCH_DATA_CHECK_MB", "0.5")
    with pytest.raises(UserError, match=r"line 201 of .*big\.jsonl is not valid JSON"):
        checks.check_data(
            DataConfig(dataset=[str(big)], eval_fraction=None), "sequence-classification", 4
        )


def test_a_data_check_budget_that_is_no_number_is_refused(tmp_path):
    env = child_environment(DPLAUNCH_DATA_CHECK_MB="lots")
    line = refused(tmp_path, DEFAULT_CONFIG, env=env)
    assert line == (
        "dplaunch: error: DPLAUNCH_DATA_CHECK_MB: 'lots' is not a number of megabytes — set it "
        "to 0 or more (0: each file's first record only), or unset it for 256"
    )


@pytest.mark.parametrize("encoding", ["dictionary", "string_view"])
def test_packed_parquet_texts_in_any_arrow_string_type_pass(tmp_path, encoding):
    # a pandas category column is stored dictionary-encoded; datasets loads both kinds
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = pa.array([row["text"] for row in reviews(60)])
    column = texts.dictionary_encode() if encoding == "dictionary" else texts.cast(pa.string_view())
    path = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"text": column}), path)
    result = run_dplaunch(
        "train",
        TINY_LLAMA,
        *SMALL_BATCH,
        *NO_EVAL,
        "--set",
        f"data.dataset={path}",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    assert result.returncode == 0, result.stderr


def test_json_objects_pretty_printed_one_after_another_pass_and_are_counted(tmp_path):
    # `jq . reviews.jsonl > pretty.jsonl`: each object over several lines; datasets reads the rows
    path = tmp_path / "pretty.jsonl"
    path.write_text("".join(json.dumps(row, indent=2) + "\n" for row in reviews(5)))
    common = (*SMALL_BATCH, *NO_EVAL, "--set", f"data.dataset={path}", "--dry-run")
    result = run_dplaunch("train", DEFAULT_CONFIG, *common, "-o", tmp_path / "a")
    assert result.returncode == 0, result.stderr
    # its 5 rows are counted: a global batch of 6 is more than they make
    result = run_dplaunch(
        "train", DEFAULT_CONFIG, *common, "--global-batch", "6", "-o", tmp_path / "b"
    )
    assert result.returncode == 2 and "the training set has 5 samples" in result.stderr


# 5. labels: class numbers below model.num_labels, as the ranks' int() reads them


NAMES = ["negative", "positive"]


def _label_files(tmp_path: Path) -> dict[str, tuple[Path, str | None, list[str] | None]]:
    """name → (a file of 40 reviews with one label or value changed in row 31, the refusal's
    text or None when it passes, the data.label_names it is checked with)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def json_file(name: str, value, names: bool = False) -> Path:
        rows = reviews(40)
        for row in rows if names else []:
            row["label"] = NAMES[row["label"]]
        rows[30]["label"] = value
        path = tmp_path / f"{name}.jsonl"
        path.write_text(jsonl(rows))
        return path

    def csv_file(name: str, cell: str, names: bool = False) -> Path:
        rows = [
            f"{row['text']},{NAMES[row['label']] if names else row['label']}" for row in reviews(40)
        ]
        rows[30] = f"odd one,{cell}"
        path = tmp_path / f"{name}.csv"
        path.write_text("text,label\n" + "\n".join(rows) + "\n")
        return path

    def parquet_file(name: str, labels, texts=None) -> Path:
        path = tmp_path / f"{name}.parquet"
        texts = texts or [row["text"] for row in reviews(40)]
        pq.write_table(pa.table({"text": texts, "label": labels}), path, row_group_size=16)
        return path

    ints = [i % 2 for i in range(40)]
    outside = "not one of the classes 0 to 1 of model.num_labels 2"
    unnamed = "neither a class number nor one of data.label_names (negative, positive)"
    return {
        "json ints": (json_file("ints", 1), None, None),
        "json whole float": (json_file("whole", 1.0), None, None),
        "json bool": (json_file("bool", True), None, None),
        "json out of range": (json_file("seven", 7), f"has 'label' 7, {outside}", None),
        "json negative": (json_file("negative", -1), "class numbers start at 0", None),
        "json word": (
            json_file("word", "positive"),
            "\"positive\" as 'label', not a class",
            None,
        ),
        "json fraction": (json_file("fraction", 1.5), "1.5 as 'label', not a class number", None),
        "json names": (json_file("names", "positive", names=True), None, NAMES),
        "json names and a number": (json_file("mixed", 1, names=True), None, NAMES),
        "json unknown name": (
            json_file("unknown", "neutral", names=True),
            f"\"neutral\" as 'label', {unnamed}",
            NAMES,
        ),
        "csv whole float": (csv_file("whole", "1.0"), None, None),
        "csv out of range": (csv_file("two", "2"), f"has 'label' 2, {outside}", None),
        "csv word": (csv_file("word", "pos"), "'pos' as 'label', not a class number", None),
        "csv names": (csv_file("names", "negative", names=True), None, NAMES),
        "csv unknown name": (
            csv_file("unknown", "Positive", names=True),
            f"'Positive' as 'label', {unnamed}",
            NAMES,
        ),
        "parquet ints": (parquet_file("ints", ints), None, None),
        "parquet out of range": (
            parquet_file("five", ints[:30] + [5] + ints[31:]),
            f"row 31 of {tmp_path / 'five.parquet'} has 'label' 5",
            None,
        ),
        "parquet fraction": (
            parquet_file("fraction", [float(i) for i in ints[:30]] + [0.5] + ints[31:]),
            "0.5 as 'label', not a class number",
            None,
        ),
        "parquet names": (parquet_file("names", [NAMES[i] for i in ints]), None, NAMES),
        "parquet null label": (
            parquet_file("nolabel", ints[:30] + [None] + ints[31:]),
            "row 31 of",
            None,
        ),
        "parquet null text": (
            parquet_file("notext", ints, [r["text"] for r in reviews(30)] + [None] * 10),
            f"data.text_column: row 31 of {tmp_path / 'notext.parquet'} has no 'text' (null)",
            None,
        ),
    }


def test_labels_are_refused_exactly_when_the_ranks_would_train_on_wrong_ones(tmp_path):
    # each case: the pre-launch check, which reads the raw file, against what the ranks make of
    # it (datasets loads and types it, the loop's tokenize() turns labels into class numbers): a
    # refusal exactly when the ranks fail, or train on a label outside 0..num_labels-1 or unlike
    # the one written (a class name counts as its position in data.label_names)
    from dplaunch.config.schema import DataConfig
    from dplaunch.data import checks
    from dplaunch.errors import UserError
    from dplaunch.train.data import load_splits, tokenize
    from dplaunch.train.tokenizer import byte_level_tokenizer

    task, num_labels = "sequence-classification", 2
    for name, (path, refusal, names) in _label_files(tmp_path).items():
        data = DataConfig(dataset=str(path), eval_fraction=None, max_length=32, label_names=names)
        try:
            checks.check_data(data, task, global_batch_size=4, num_labels=num_labels)
            said = None
        except UserError as error:
            said = str(error)
        try:
            train, _ = load_splits(data, seed=0)
            written = [
                (names or []).index(value) if value in (names or []) else value
                for value in train[data.label_column]
            ]
            labels = tokenize(train, byte_level_tokenizer(), data, task)["labels"]
            wrong = any(
                not 0 <= label < num_labels or label != value
                for label, value in zip(labels, written, strict=True)
            )
        except Exception:  # the ranks' traceback
            wrong = True
        assert wrong == (refusal is not None), name
        if refusal is None:
            assert said is None, f"{name}: {said}"
        else:
            assert said is not None and refusal in said, f"{name}: {said}"


def test_a_label_outside_num_labels_is_refused_before_launch_in_one_line(tmp_path):
    rows = reviews(40)
    rows[17]["label"] = 3
    path = tmp_path / "reviews.jsonl"
    path.write_text(jsonl(rows))
    unnamed = ("--set", f"data.dataset={path}", "--set", "data.label_names=null")
    line = refused(tmp_path, DEFAULT_CONFIG, *unnamed)
    assert line == (
        f"dplaunch: error: data.label_column: line 18 of {path} has 'label' 3, not one of the "
        "classes 0 to 1 of model.num_labels 2 — set model.num_labels to 4 or more, or fix that "
        "record"
    )
    accepted(tmp_path, DEFAULT_CONFIG, *unnamed, "--set", "model.num_labels=4")
    # the default run file names its two classes: more classes are more names
    line = refused(tmp_path, DEFAULT_CONFIG, "--set", f"data.dataset={path}")
    assert line.endswith("— name 4 or more classes in data.label_names, or fix that record")
    accepted(
        tmp_path,
        DEFAULT_CONFIG,
        "--set",
        f"data.dataset={path}",
        "--set",
        "data.label_names=[a,b,c,d]",
    )
    # one class trains nothing (the cross-entropy of one class is 0): refused in the run file
    line = refused(tmp_path, DEFAULT_CONFIG, *unnamed, "--set", "model.num_labels=1")
    assert "model.num_labels: 1 is invalid" in line and "regression is not supported" in line


def test_label_names_that_cannot_name_the_classes_are_refused(tmp_path):
    # the default run file names its classes [negative, positive]; num_labels follows them
    cases = [
        (("--set", "data.label_names=[negative]"), "data.label_names: names fewer than 2 classes"),
        (
            ("--set", "data.label_names=[neg,pos,neg]"),
            "data.label_names: 'neg' is listed twice (classes 0 and 2)",
        ),
        (
            ("--set", "model.num_labels=3"),
            "model.num_labels: is 3, but data.label_names lists 2 classes",
        ),
        (
            (TINY_LLAMA, "--set", "data.label_names=[a,b]"),
            "data.label_names: names classes, but model.task is causal-lm",
        ),
    ]
    for args, expected in cases:
        config, rest = (args[0], args[1:]) if args[0] == TINY_LLAMA else (DEFAULT_CONFIG, args)
        line = refused(tmp_path, config, *rest)
        assert line.startswith(f"dplaunch: error: {expected}"), line
    # three names and no model.num_labels: three classes
    accepted(tmp_path, DEFAULT_CONFIG, "--set", "data.label_names=[negative,positive,mixed]")
