"""Datasets `datasets` has prepared as Arrow are checked before launch as local files are, and
trained on: hub datasets from the `datasets` cache (how a cluster's compute nodes, cut off from
the Hub, get their data) and folders written by `save_to_disk`.

The cache is written as `datasets` prepares a download (tests.helpers.cache_hub_dataset), and
each layout's verdict is compared with what `load_dataset` itself makes of it offline. Saved
folders are written by `datasets` itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import (
    DEFAULT_CONFIG,
    TINY_LLAMA,
    cache_hub_dataset,
    child_environment,
    files_under,
    read_metrics,
    refusal_line,
    run_dplaunch,
)

NAME = "someorg/TinyReviews"
CLASSES = ["neg", "pos", "neutral"]


def split(count: int, first: int = 0) -> dict[str, list]:
    return {
        "sentence": [f"review {first + i}: the tour was fine" for i in range(count)],
        "label": [(first + i) % 3 for i in range(count)],
    }


def hub_env(home: Path, **extra: str) -> dict[str, str]:
    env = child_environment(HF_HOME=str(home), **extra)  # offline (HF_HUB_OFFLINE=1)
    env.pop("HF_DATASETS_CACHE", None)
    return env


def dry_run(tmp_path: Path, home: Path, *args: str, env: dict[str, str] | None = None):
    """`dplaunch train --dry-run` of the default classification run on the cached dataset."""
    return run_dplaunch(
        "train",
        DEFAULT_CONFIG,
        *("--cpu", "--gpus", "1", "--global-batch", "4", "--micro-batch", "1"),
        *("--dry-run", "-o", tmp_path / "run"),
        *("--set", f"data.dataset={NAME}", "--set", "data.text_column=sentence"),
        *("--set", "data.label_names=null", "--set", "data.eval_fraction=null"),
        *args,
        env=env or hub_env(home),
        timeout=120,
    )


def load_dataset_verdict(home: Path, config: str | None, split_name: str) -> bool:
    """Whether `load_dataset(NAME, config, split=split_name)` reads the cache offline."""
    code = (
        "import sys, datasets\n"
        "try:\n"
        f"    datasets.load_dataset({NAME!r}, {config!r}, split={split_name!r})\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "    sys.exit(3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=hub_env(home),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode in (0, 3), result.stderr[-2000:]
    return result.returncode == 0


def _renamed_config(folder: Path) -> None:
    # prepared with extra arguments: dataset_info.json names another configuration than its
    # folder, and `datasets` does not take such a folder for the plain configuration
    info = json.loads((folder / "dataset_info.json").read_text())
    info["config_name"] = "sst2-custom"
    (folder / "dataset_info.json").write_text(json.dumps(info))


# (cached configurations, data.dataset_config, data.split, change to the cache)
LAYOUTS = {
    "one configuration, none named": (["sst2"], None, "train", None),
    "one configuration, named": (["sst2"], "sst2", "train", None),
    "two configurations, none named": (["cola", "sst2"], None, "train", None),
    "two configurations, one named": (["cola", "sst2"], "cola", "train", None),
    "a configuration that is not cached": (["sst2"], "mnli", "train", None),
    "a split that is not there": (["sst2"], "sst2", "test", None),
    "the validation split": (["sst2"], None, "validation", None),
    "a folder prepared for other arguments": (["sst2"], "sst2", "train", _renamed_config),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_a_cached_dataset_is_accepted_exactly_when_load_dataset_reads_it_offline(tmp_path, layout):
    configs, named, split_name, change = LAYOUTS[layout]
    home = tmp_path / "hf"
    for config in configs:
        folder = cache_hub_dataset(
            home, NAME, config, {"train": split(12), "validation": split(6)}, {"label": CLASSES}
        )
        if change is not None:
            change(folder)
    args = ["--set", f"data.split={split_name}"]
    if named:
        args += ["--set", f"data.dataset_config={named}"]
    result = dry_run(tmp_path, home, *args)
    assert result.returncode in (0, 2), result.stderr[-2000:]
    expected = load_dataset_verdict(home, named, split_name)
    assert (result.returncode == 0) == expected, result.stderr[-600:]
    if not expected:
        line = refusal_line(result)
        assert line.startswith("dplaunch: error: data."), line  # a data field, named


@pytest.fixture(scope="module")
def reviews_cache(tmp_path_factory) -> Path:
    """HF_HOME with someorg/TinyReviews (sst2): 12 training rows, 6 validation rows, 3 classes
    in a ClassLabel; shards of 4 rows as Arrow record batches of 4."""
    home = tmp_path_factory.mktemp("hub") / "hf"
    cache_hub_dataset(
        home, NAME, "sst2", {"train": split(12), "validation": split(6)}, {"label": CLASSES}, 3
    )
    return home


def _with(rows: dict[str, list], column: str, index: int, value) -> dict[str, list]:
    changed = {name: list(values) for name, values in rows.items()}
    changed[column][index] = value
    return changed


# name: (training rows, validation rows, class names, extra arguments, refusal line start)
MISTAKES = {
    "a text column the dataset lacks": (
        split(12),
        split(6),
        CLASSES,
        ["--set", "data.text_column=text"],
        "data.text_column: column 'text' is not in hub dataset 'someorg/TinyReviews' (sst2)"
        " — its columns are label, sentence",
    ),
    "a null text": (
        _with(split(12), "sentence", 9, None),
        split(6),
        CLASSES,
        [],
        "data.text_column: someorg/TinyReviews (sst2) train[9] has no 'sentence' (null)",
    ),
    "a label -1 in the evaluation split": (
        split(12),
        _with(split(6), "label", 5, -1),
        CLASSES,
        ["--set", "data.eval_split=validation"],
        "data.label_column: someorg/TinyReviews (sst2) validation[5] has 'label' -1, not one of "
        "the classes 0 to 2",
    ),
    "fewer classes than the ClassLabel": (
        split(12),
        split(6),
        CLASSES,
        ["--set", "model.num_labels=2"],
        "model.num_labels: is 2, but column 'label' of hub dataset 'someorg/TinyReviews' (sst2) "
        "holds 3 classes (neg, pos, neutral)",
    ),
    "fewer class names than the ClassLabel": (
        split(12),
        split(6),
        CLASSES,
        ["--set", "data.label_names=[bad,good]"],
        "data.label_names: names 2 classes, but column 'label' of hub dataset",
    ),
    "an integer label past model.num_labels": (
        _with(split(12), "label", 10, 7),
        split(6),
        None,
        ["--set", "model.num_labels=3"],
        "data.label_column: someorg/TinyReviews (sst2) train[10] has 'label' 7, not one of the "
        "classes 0 to 2",
    ),
    "fewer rows than one global batch": (
        split(12),
        split(6),
        CLASSES,
        ["--global-batch", "16"],
        "train.global_batch_size: the training set has 12 samples, fewer than one global batch",
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES, ids=list(MISTAKES))
def test_a_cached_hub_dataset_is_checked_like_local_files(tmp_path, mistake):
    train_rows, validation_rows, classes, args, expected = MISTAKES[mistake]
    home = tmp_path / "hf"
    cache_hub_dataset(
        home,
        NAME,
        "sst2",
        {"train": train_rows, "validation": validation_rows},
        {"label": classes} if classes else None,
        shards=3,
    )
    before = files_under(tmp_path)
    line = refusal_line(dry_run(tmp_path, home, *args))
    assert line.startswith(f"dplaunch: error: {expected}"), line
    assert files_under(tmp_path) == before, "something was written"


def test_the_record_batches_past_the_budget_are_not_read_but_the_rows_are_exact(tmp_path):
    home = tmp_path / "hf"
    cache_hub_dataset(
        home,
        NAME,
        "sst2",
        {"train": _with(split(12), "label", 10, -1), "validation": split(6)},
        {"label": CLASSES},
        shards=3,
    )
    refused = refusal_line(dry_run(tmp_path, home))
    assert "train[10] has 'label' -1" in refused
    # budget 0: the first record batch only, so the label of row 10 is not seen …
    lean = hub_env(home, DPLAUNCH_DATA_CHECK_MB="0")
    assert dry_run(tmp_path, home, env=lean).returncode == 0
    # … but the row count is dataset_info.json's, whole
    line = refusal_line(dry_run(tmp_path, home, "--global-batch", "16", env=lean))
    assert "the training set has 12 samples" in line


def test_packed_texts_of_a_cached_dataset_are_counted_in_bytes(tmp_path):
    # causal LM: the blocks a packed run can make are bounded by the texts' bytes, read from Arrow
    home = tmp_path / "hf"
    texts = {"text": [f"review {i}: the tour was fine" for i in range(12)]}  # 326 bytes
    cache_hub_dataset(home, NAME, "default", {"train": texts})
    args = ("--cpu", "--gpus", "1", "--dry-run", "--set", f"data.dataset={NAME}")
    args += ("--set", "data.eval_fraction=null", "--micro-batch", "1")
    ok = run_dplaunch("train", TINY_LLAMA, *args, "--global-batch", "5", env=hub_env(home))
    assert ok.returncode == 0, ok.stderr[-2000:]
    line = refusal_line(
        run_dplaunch("train", TINY_LLAMA, *args, "--global-batch", "6", env=hub_env(home))
    )
    assert (
        "the training texts make at most 5 blocks of data.max_length 64 tokens (326 bytes in 12 rows)"
        in line
    )


def test_a_configuration_for_local_files_is_refused(tmp_path, reviews_cache):
    line = refusal_line(
        run_dplaunch(
            "train",
            DEFAULT_CONFIG,
            *("--cpu", "--dry-run", "--set", "data.dataset_config=sst2"),
            env=hub_env(reviews_cache),
        )
    )
    assert line == (
        "dplaunch: error: data.dataset_config: local files have no configurations — drop "
        "data.dataset_config (it names a configuration of a hub dataset)"
    )


def test_a_cached_hub_dataset_trains_offline_and_its_class_label_names_the_classes(
    tmp_path, reviews_cache
):
    run_dir = tmp_path / "run"
    result = run_dplaunch(
        "train",
        DEFAULT_CONFIG,
        *("--cpu", "--gpus", "1", "--global-batch", "4", "-o", run_dir),
        *("--set", f"data.dataset={NAME}", "--set", "data.dataset_config=sst2"),
        *("--set", "data.text_column=sentence", "--set", "data.label_names=null"),
        *("--set", "data.eval_fraction=null", "--set", "data.eval_split=validation"),
        *("--set", "train.max_steps=2", "--set", "train.eval_every=2"),
        env=hub_env(reviews_cache),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: data.label_names: neg, pos, neutral (the dataset's ClassLabel 'label')" in (
        result.stdout + result.stderr
    )
    saved = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert saved["data"]["dataset_config"] == "sst2"
    assert saved["data"]["label_names"] == CLASSES and saved["model"]["num_labels"] == 3
    metrics = read_metrics(run_dir)
    header = metrics[0]
    assert (header["train_samples"], header["eval_samples"]) == (12, 6)  # train and validation
    assert [row["step"] for row in metrics if row["type"] == "eval"] == [0, 2]
    exported = json.loads((run_dir / "model" / "config.json").read_text())
    assert exported["id2label"] == {"0": "neg", "1": "pos", "2": "neutral"}


# folders written by save_to_disk


def save(folder: Path, splits: dict[str, dict[str, list]] | dict[str, list], classes=CLASSES):
    """save_to_disk a DatasetDict (SPLITS by name) or, given columns, one Dataset; 3 shards.
    The labels are a ClassLabel of CLASSES, or (None) plain integers."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    label = ClassLabel(names=classes) if classes else Value("int64")
    features = Features({"sentence": Value("string"), "label": label})
    if "sentence" in splits:
        Dataset.from_dict(splits, features=features).save_to_disk(str(folder), num_shards=3)
    else:
        DatasetDict(
            {name: Dataset.from_dict(rows, features=features) for name, rows in splits.items()}
        ).save_to_disk(str(folder), num_shards={name: 2 for name in splits})
    return folder


def saved_dry_run(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    return run_dplaunch(
        "train",
        DEFAULT_CONFIG,
        *("--cpu", "--gpus", "1", "--global-batch", "4", "--micro-batch", "1"),
        *("--dry-run", "-o", tmp_path / "run"),
        *("--set", "data.text_column=sentence", "--set", "data.label_names=null"),
        *("--set", "data.eval_fraction=null"),
        *args,
        env=env,
        timeout=120,
    )


def test_a_saved_dataset_dict_trains_with_a_saved_split_for_evaluation(tmp_path):
    folder = save(tmp_path / "reviews", {"train": split(12), "test": split(6, first=12)})
    run_dir = tmp_path / "run"
    result = run_dplaunch(
        "train",
        DEFAULT_CONFIG,
        *("--cpu", "--gpus", "1", "--global-batch", "4", "-o", run_dir),
        *("--set", f"data.dataset={folder}", "--set", f"data.eval_dataset={folder / 'test'}"),
        *("--set", "data.text_column=sentence", "--set", "data.label_names=null"),
        *("--set", "data.eval_fraction=null", "--set", "train.max_steps=2"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    header = read_metrics(run_dir)[0]
    assert (header["train_samples"], header["eval_samples"]) == (12, 6)
    exported = json.loads((run_dir / "model" / "config.json").read_text())
    assert exported["id2label"] == {"0": "neg", "1": "pos", "2": "neutral"}


SAVED_MISTAKES = {
    "a split the dataset dict lacks": (
        "dict",
        ["--set", "data.split=training"],
        "data.split: saved dataset {folder} has no split 'training' — its splits are test, train",
    ),
    "a dataset dict as the evaluation set": (
        "dict",
        ["--set", "data.eval_dataset={folder}"],
        "data.eval_dataset: {folder} holds several splits (test, train) — name one split's "
        "folder ({folder}/test), or give this folder as data.dataset",
    ),
    "a split of one saved Dataset": (
        "one",
        ["--set", "data.split=validation"],
        "data.split: {folder} was saved from one Dataset, which has no splits",
    ),
    "an evaluation split of one saved Dataset": (
        "one",
        ["--set", "data.eval_split=test"],
        "data.eval_split: {folder} was saved from one Dataset, which has no splits",
    ),
    "a null text": ("null", [], "data.text_column: {folder}[10] has no 'sentence' (null)"),
    "a label past the classes": (
        "label",
        ["--set", "data.eval_split=test", "--set", "model.num_labels=3"],
        "data.label_column: {folder} test[4] has 'label' 5, not one of the classes 0 to 2",
    ),
    "fewer rows than one global batch": (
        "dict",
        ["--global-batch", "16"],
        "train.global_batch_size: the training set has 12 samples, fewer than one global batch",
    ),
    "an empty saved Dataset for evaluation": (
        "empty eval",
        ["--set", "data.eval_dataset={folder}/test"],
        "data.eval_dataset: saved dataset {folder}/test has no rows — give data",
    ),
    "a folder that holds no saved dataset": (
        "plain",
        [],
        "data.dataset: {folder} is a directory, and no dataset saved with save_to_disk",
    ),
}


@pytest.mark.parametrize("mistake", SAVED_MISTAKES, ids=list(SAVED_MISTAKES))
def test_a_saved_dataset_is_checked_like_local_files(tmp_path, mistake):
    kind, args, expected = SAVED_MISTAKES[mistake]
    folder = tmp_path / "reviews"
    if kind == "dict":
        save(folder, {"train": split(12), "test": split(6)})
    elif kind == "one":
        save(folder, split(12))
    elif kind == "null":
        save(folder, _with(split(12), "sentence", 10, None))
    elif kind == "empty eval":
        save(folder, {"train": split(12), "test": split(0)})
    elif kind == "label":
        save(folder, {"train": split(12), "test": _with(split(6), "label", 4, 5)}, None)
    else:
        folder.mkdir()
        (folder / "notes.txt").write_text("not a dataset")
    args = [arg.format(folder=folder) for arg in args]
    before = files_under(tmp_path)
    line = refusal_line(saved_dry_run(tmp_path, "--set", f"data.dataset={folder}", *args))
    assert line.startswith(f"dplaunch: error: {expected.format(folder=folder)}"), line
    assert files_under(tmp_path) == before, "something was written"


def test_the_rows_of_a_saved_dataset_are_counted_past_the_budget(tmp_path):
    # saved folders have no row count: past the budget the record batches are counted, not read
    folder = save(tmp_path / "reviews", _with(split(12), "label", 11, 4), None)
    lean = child_environment(DPLAUNCH_DATA_CHECK_MB="0")
    base = ("--set", f"data.dataset={folder}", "--set", "model.num_labels=3")
    assert saved_dry_run(tmp_path, *base, env=lean).returncode == 0  # row 11 not read
    line = refusal_line(saved_dry_run(tmp_path, *base))
    assert f"{folder}[11] has 'label' 4, not one of the classes 0 to 2" in line
    line = refusal_line(saved_dry_run(tmp_path, *base, "--global-batch", "16", env=lean))
    assert "the training set has 12 samples" in line
