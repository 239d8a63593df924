"""Check a run's data before launch, as `datasets` will read it in the ranks.

Local files: each file is read once, record by record (JSON lines parsed, CSV rows split,
Parquet from its footer and columns), so a broken line, a missing column, a missing value or a
label that is no class of model.num_labels is named here rather than in a rank's traceback (on a
GPU, a CUDA device-side assert); the training rows left after the eval split must fill one
global batch. Hub ids: the dataset must be in the `datasets` cache, or (online) on the Hub. A
cached one, and a folder written by save_to_disk, are checked as local files are, from their
Arrow files (arrow_datasets.py finds and describes them).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dplaunch.config.schema import DataConfig
from dplaunch.data.arrow_datasets import (
    CONFIG_FIELD,
    PreparedDataset,
    check_hub_dataset,
    hub_layout_folder,
    saved_dataset,
    saved_folder,
)
from dplaunch.data.formats import (
    CSV_MISSING,
    class_number,
    eval_fraction_split,
    expand_files,
    is_local,
    label_ids,
    local_format,
    open_text,
)
from dplaunch.errors import UserError
from dplaunch.run_directory.environment import DATA_CHECK_MB_ENV
from dplaunch.tasks import task_of

# bytes of a dataset's files read line by line before launch (about 3 s of checking here): a
# corpus of many GB is checked on its first records of each file and its first 256 MB, not read
# whole at every launch (and on every node); its rows and bytes are then lower bounds.
# DPLAUNCH_DATA_CHECK_MB sets another budget (0: the first record of each file only)
FULL_CHECK_BYTES = 256 * 2**20


def check_data(
    data: DataConfig,
    task: str,
    global_batch_size: int | None = None,
    num_labels: int | None = None,
    *,
    classes_named: bool = True,
    notes: list[str] | None = None,
) -> tuple[str, ...] | None:
    """Raise UserError when files, records, columns or rows the run needs are missing, or (with
    NUM_LABELS, for sequence classification) a label is not one of its class numbers.

    With data.streaming the training data is checked on a bounded sample, the first records of
    each file (its length is not known here); NOTES gets a line saying so.

    Returns the class names of a prepared dataset's label column (a ClassLabel) when the run
    names no classes itself (CLASSES_NAMED false: neither data.label_names nor model.num_labels
    given): the labels were checked against them, and the caller makes them data.label_names."""
    needs = _Needs.of(data, task, num_labels)
    budget = _check_budget()
    packing = task_of(task).packs_by_default and task_of(task).packs(data.packing)
    training: _Summary | None = None
    dataset_classes: tuple[str, ...] | None = None
    _check_dataset_config(data)
    for field, dataset in (
        ("data.dataset", data.dataset),
        ("data.eval_dataset", data.eval_dataset),
    ):
        if dataset is None:
            continue
        streamed = data.streaming and field == "data.dataset"
        if streamed and hub_layout_folder(dataset):
            _check_stream_folder(dataset, data, needs, notes)
            continue
        if not is_local(dataset):
            prepared = _hub_dataset(dataset, data.dataset_config, field)
            if prepared is None:
                continue
        else:
            folder = saved_folder(dataset)
            prepared = saved_dataset(folder, field) if folder is not None else None
        if prepared is not None:
            if field == "data.eval_dataset":
                _check_saved_eval(prepared)
                _read_prepared_split(prepared, "", field, needs, False, budget)
            else:
                _check_saved_splits(prepared, data)
                needs, dataset_classes = _classes_of(prepared, data, needs, classes_named)
                training = _read_prepared(prepared, data, needs, packing, budget)
            continue
        files = _existing_files(dataset, field)
        fmt = local_format(files, field)
        if streamed:
            _check_stream_files(files, fmt, field, needs, notes)
            continue
        summary = _Summary(count_bytes=packing and field == "data.dataset", bytes_left=budget)
        _read_files(files, fmt, field, needs, summary)
        if field == "data.dataset":
            training = summary
    if (
        is_local(data.dataset)
        and saved_folder(data.dataset) is None
        and not (data.streaming and hub_layout_folder(data.dataset))
        and data.eval_split is not None
        and data.eval_split != data.split
    ):
        raise UserError(
            "data.eval_split",
            f"local files have a single split, so {data.eval_split!r} does not exist",
            "use data.eval_fraction or data.eval_dataset",
        )
    # sft and dpo leave examples out: sft_checks.py and preference_checks.py count what is kept
    counted_elsewhere = task_of(task).examples
    if training is not None and training.rows_known and global_batch_size and not counted_elsewhere:
        _check_one_global_batch(training, data, packing, global_batch_size)
    return dataset_classes


def _check_dataset_config(data: DataConfig) -> None:
    if data.dataset_config is not None and is_local(data.dataset):
        raise UserError(
            CONFIG_FIELD,
            "local files have no configurations",
            "drop data.dataset_config (it names a configuration of a hub dataset)",
        )


def _hub_dataset(dataset: str, dataset_config: str | None, field: str) -> PreparedDataset | None:
    """The prepared copy of a hub dataset in the datasets cache (None: the ranks download it)."""
    if field == "data.eval_dataset":
        raise UserError(
            field,
            f"{dataset} is not a local file",
            "give local file(s), or use data.eval_split for a hub dataset",
        )
    # a cached copy is checked by the caller; one the ranks will download, only for existing
    return check_hub_dataset(dataset, dataset_config, field)


def _existing_files(dataset: str | list[str], field: str) -> list[str]:
    """The data files FIELD names (globs expanded); each must be a file."""
    files = expand_files(dataset, field)
    for item in files:
        path = Path(item).expanduser()
        if path.is_dir():
            raise UserError(
                field,
                f"{item} is a directory, and no dataset saved with save_to_disk",
                "name the data files in it (a list of paths is fine)",
            )
        if not path.is_file():
            raise UserError(
                field,
                f"{item} does not exist",
                "check the path (relative paths are relative to the run file)",
            )
    return files


def _read_files(files: list[str], fmt: str, field: str, needs: _Needs, summary: _Summary) -> None:
    """Read FILES' records into SUMMARY, within its byte budget; refuse files with no records."""
    for item in files:
        _read_file(Path(item).expanduser(), fmt, field, needs, summary)
    if summary.rows == 0 and summary.rows_known:
        only = Path(files[0]).expanduser()
        problem = (
            f"{files[0]}: the file is empty"
            if len(files) == 1 and only.stat().st_size == 0
            else f"{', '.join(files)} hold(s) no records"
        )
        raise UserError(field, problem, "give a file with data")


def _classes_of(
    prepared: PreparedDataset, data: DataConfig, needs: _Needs, classes_named: bool
) -> tuple[_Needs, tuple[str, ...] | None]:
    """The needs of a prepared dataset whose label column is a ClassLabel, and its class names
    when the run takes them (it names no classes itself). A run that names fewer classes than
    the ClassLabel holds is refused: its labels are class numbers up to the last of them."""
    names = prepared.class_names(data.split, needs.label) if needs.label else None
    if names is None:
        return needs, None
    if not classes_named:
        named = dataclasses.replace(
            needs, num_labels=len(names), label_names=names, ids=label_ids(names)
        )
        return named, names
    given = needs.num_labels if needs.num_labels is not None else len(needs.label_names or ())
    if given >= len(names):
        return needs, None
    listed = ", ".join(names[:8]) + (", …" if len(names) > 8 else "")
    held = f"column {needs.label!r} of {prepared.described} holds {len(names)} classes ({listed})"
    if data.label_names:
        raise UserError(
            "data.label_names",
            f"names {len(data.label_names)} classes, but {held}",
            f"name all {len(names)} in the dataset's order, or drop data.label_names "
            "(the dataset's class names are used)",
        )
    raise UserError(
        "model.num_labels",
        f"is {given}, but {held}",
        f"set model.num_labels to {len(names)}, or leave it out (the dataset's class names are used)",
    )


def _read_prepared(
    prepared: PreparedDataset, data: DataConfig, needs: _Needs, packing: bool, budget: int
) -> _Summary:
    """Check the training split of a prepared dataset, and its evaluation split; the training
    split's summary."""
    training = _read_prepared_split(prepared, data.split, "data.split", needs, packing, budget)
    if data.eval_split is not None and data.eval_split != data.split:
        _read_prepared_split(prepared, data.eval_split, "data.eval_split", needs, False, budget)
    return training


def _check_saved_splits(saved: PreparedDataset, data: DataConfig) -> None:
    # a folder saved from one Dataset has no split names: data.split and eval_split mean nothing
    if not saved.single:
        return
    one = f"{saved.name} was saved from one Dataset, which has no splits"
    if data.split != "train":
        raise UserError("data.split", one, "drop data.split (or save a DatasetDict)")
    if data.eval_split is not None:
        raise UserError(
            "data.eval_split",
            one,
            "use data.eval_fraction, or data.eval_dataset with another saved folder",
        )


def _check_saved_eval(saved: PreparedDataset) -> None:
    # data.eval_dataset names one dataset: a DatasetDict folder would leave the split unsaid
    if saved.single:
        return
    first = sorted(saved.splits)[0]
    raise UserError(
        "data.eval_dataset",
        f"{saved.name} holds several splits ({', '.join(sorted(saved.splits))})",
        f"name one split's folder ({saved.directory / first}), or give this folder as "
        "data.dataset and pick a split with data.eval_split",
    )


def _read_prepared_split(
    prepared: PreparedDataset,
    split_name: str,
    split_field: str,
    needs: _Needs,
    count_bytes: bool,
    budget: int,
) -> _Summary:
    """Check one split of a prepared dataset as local files are checked: its columns from
    dataset_info.json, then its Arrow records (nulls, labels, text bytes) within the budget.
    Its row count is exact even when the budget stops the checking: dataset_info.json's in the
    hub cache; a saved folder's record batches are counted to the end (metadata only).
    SPLIT_FIELD is data.split or data.eval_split, or data.eval_dataset for a saved Dataset."""
    import pyarrow as pa

    # the field naming the dataset itself, for what is wrong with it rather than its split
    source_field = "data.eval_dataset" if split_field == "data.eval_dataset" else "data.dataset"

    split = prepared.split(split_name, split_field)
    for field, column in needs.columns:
        if column not in split.features:
            listed = ", ".join(sorted(split.features)) or "none"
            raise UserError(
                field,
                f"column {column!r} is not in {prepared.described}",
                f"its columns are {listed}",
            )
    summary = _Summary(count_bytes=count_bytes, bytes_left=budget)
    columns = sorted({column for _, column in needs.columns})
    texts = [column for _, column in needs.texts]
    rows = 0
    for path in split.files:
        try:
            with pa.memory_map(str(path)) as source:
                for batch in pa.ipc.open_stream(source):
                    if summary.partial:  # budget spent: only the rows are counted
                        if split.rows is not None:
                            break
                        rows += batch.num_rows
                        continue
                    table = pa.Table.from_batches([batch]).select(columns)

                    def where(index: int, first: int = rows) -> str:
                        return prepared.row(split_name, first + index)

                    _check_table_rows(table, where, needs)
                    if count_bytes:
                        summary.text_bytes += sum(_text_bytes(table.column(c)) for c in texts)
                    rows += table.num_rows
                    summary.spend(table.nbytes)
        except (OSError, pa.ArrowException) as exc:
            raise UserError(
                source_field,
                f"cannot read {path} of {prepared.described} ({exc})",
                "load or save the dataset again",
            ) from None
    summary.rows = split.rows if split.rows is not None else rows
    if summary.rows == 0:
        where = (
            prepared.described
            if prepared.single
            else f"split {split_name!r} of {prepared.described}"
        )
        raise UserError(
            source_field if prepared.single else split_field,
            f"{where} has no rows",
            "give data"
            if prepared.single
            else f"use another split (there are {', '.join(sorted(prepared.splits))})",
        )
    # the rows are exact; only the text bytes (packing) are a lower bound once the budget is spent
    summary.partial = summary.partial and count_bytes
    return summary


# data.streaming: bytes of each training file read before launch (its first records), within
# FULL_CHECK_BYTES over all files, but never less than STREAM_FILE_MIN_BYTES a file
STREAM_FILE_BYTES = 2**20
STREAM_FILE_MIN_BYTES = 64 * 2**10


def _check_stream_files(
    files: list[str], fmt: str, field: str, needs: _Needs, notes: list[str] | None
) -> None:
    """A stream's files, each on its first records: readable, JSON lines (not one document),
    with the columns and values the run needs."""
    from dplaunch.data.streams import STREAM_FORMATS

    if fmt not in STREAM_FORMATS:
        raise UserError(
            field,
            f"a stream reads JSON lines, Parquet, Arrow or text files, not {fmt} ({files[0]})",
            "convert the files (to JSON lines or Parquet), or set data.streaming: false",
        )
    per_file = max(STREAM_FILE_MIN_BYTES, min(STREAM_FILE_BYTES, FULL_CHECK_BYTES // len(files)))
    rows = 0
    for item in files:
        summary = _Summary(bytes_left=per_file)
        _read_file(Path(item).expanduser(), fmt, field, needs, summary, lines_only=True)
        rows += summary.rows
    if rows == 0:
        raise UserError(field, f"{', '.join(files[:3])} hold(s) no records", "give files with data")
    if notes is not None:
        notes.append(
            f"data.streaming: the data check read the first records of each of {len(files)} "
            f"file(s) (up to {per_file // 2**10:,} KiB a file), not the whole data; the ranks "
            "read the rest while training, and a bad record past these stops the run there"
        )


# records of each shard of a hub-layout folder read before launch, and shards read at most
STREAM_SHARD_RECORDS = 100
STREAM_SHARDS_CHECKED = 64


def _check_stream_folder(
    folder: str, data: DataConfig, needs: _Needs, notes: list[str] | None
) -> None:
    """A hub-layout folder streamed by `datasets`: the first records of its shards."""
    from dplaunch.data.streams import hub_shards, parse_raw, read_raw

    try:
        shards = hub_shards(str(Path(folder).expanduser()), data.dataset_config, data.split)
    except Exception as exc:  # noqa: BLE001 — `datasets` says what it cannot read
        raise UserError(
            "data.dataset",
            f"`datasets` cannot stream the folder {folder} ({type(exc).__name__}: {exc})",
            "give data files, or a folder in the Hub's layout (data/train-*.jsonl, …)",
        ) from None
    for shard in shards[:STREAM_SHARDS_CHECKED]:
        seen: set[str] = set()
        records = _Summary()
        problems: list[tuple[str, str, str]] = []
        for number, (raw, _) in enumerate(read_raw(shard, 0, 0)):
            if number == STREAM_SHARD_RECORDS:
                break
            record = parse_raw(shard, raw, number)
            seen.update(record)
            records.rows += 1
            _check_record(
                record, f"record {number + 1}", Path(shard.name), needs, records, problems
            )
        _finish_records(Path(shard.name), needs, seen, records, problems, _Summary())
    if notes is not None:
        notes.append(
            f"data.streaming: the data check read the first {STREAM_SHARD_RECORDS} records of "
            f"{min(len(shards), STREAM_SHARDS_CHECKED)} of {len(shards)} shard(s) of {folder}, "
            "not the whole data; the ranks read the rest while training"
        )


@dataclass
class _Summary:
    """What the check learnt from a dataset's files."""

    rows: int = 0
    # UTF-8 bytes of the text column(s) over all rows: bounds the tokens a packed run can make
    text_bytes: int = 0
    # False when a file's rows could not be counted (a JSON file holding one object)
    rows_known: bool = True
    # whether text_bytes is needed (packed training data): Parquet columns are read only then
    count_bytes: bool = False
    # what may still be read (FULL_CHECK_BYTES); once spent, each further file gives its first
    # record only, and rows and text_bytes are lower bounds (partial)
    bytes_left: int = dataclasses.field(default_factory=lambda: FULL_CHECK_BYTES)
    partial: bool = False

    def spend(self, size: int) -> bool:
        """Count ``size`` bytes read; True when the budget is spent (stop reading this file)."""
        self.bytes_left -= size
        if self.bytes_left <= 0:
            self.partial = True
        return self.partial


def _check_budget() -> int:
    """Bytes the check may read: DPLAUNCH_DATA_CHECK_MB megabytes, else FULL_CHECK_BYTES."""
    raw = os.environ.get(DATA_CHECK_MB_ENV, "").strip()
    if not raw:
        return FULL_CHECK_BYTES
    try:
        megabytes = float(raw)
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0 or math.isinf(megabytes):
        raise UserError(
            DATA_CHECK_MB_ENV,
            f"{raw!r} is not a number of megabytes",
            f"set it to 0 or more (0: each file's first record only), or unset it for "
            f"{FULL_CHECK_BYTES // 2**20}",
        )
    return int(megabytes * 2**20)


LABEL_FIELD = "data.label_column"
# the fix for a record with a missing or wrong value
DROP_RECORD = "fix that record or drop it"


@dataclass(frozen=True)
class _Needs:
    """What every record must carry: its text column(s), and for sequence classification a
    label that is a class number below num_labels (when that is known) or a class name."""

    texts: tuple[tuple[str, str], ...]  # (field, column)
    label: str | None = None
    num_labels: int | None = None
    label_names: tuple[str, ...] | None = None
    ids: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, data: DataConfig, task: str, num_labels: int | None) -> _Needs:
        if task_of(task).examples:
            # the examples' columns: sft_checks.py and preference_checks.py read every record
            return cls(())
        texts = [("data.text_column", data.text_column)]
        if data.text_pair_column:
            texts.append(("data.text_pair_column", data.text_pair_column))
        if not task_of(task).classifies:
            return cls(tuple(texts))
        names = tuple(data.label_names) if data.label_names else None
        return cls(tuple(texts), data.label_column, num_labels, names, label_ids(names))

    @property
    def columns(self) -> list[tuple[str, str]]:
        """(field, column) of every column a record must have."""
        return [*self.texts, *([(LABEL_FIELD, self.label)] if self.label else [])]

    def label_problem(
        self, value: object, where: str, csv_cell: bool = False
    ) -> tuple[str, str] | None:
        """(problem, fix) when VALUE (not None) is no label the ranks can train on, else None."""
        number = class_number(value, self.ids, csv_cell)
        if number is None:
            shown = repr(value) if csv_cell else json.dumps(value)[:40]
            if self.label_names:
                listed = ", ".join(self.label_names[:8]) + (
                    ", …" if len(self.label_names) > 8 else ""
                )
                return (
                    f"{where} has {shown} as {self.label!r}, neither a class number nor one of "
                    f"data.label_names ({listed})",
                    "fix that record, or add its class to data.label_names",
                )
            classes = f"0 to {self.num_labels - 1}" if self.num_labels else "0, 1, …"
            return (
                f"{where} has {shown} as {self.label!r}, not a class number",
                f"write each label as its class number ({classes}), or name the classes in "
                "data.label_names",
            )
        if self.num_labels is None or 0 <= number < self.num_labels:
            return None
        return (
            f"{where} has {self.label!r} {number}, not one of the classes 0 to "
            f"{self.num_labels - 1} of model.num_labels {self.num_labels}",
            "fix that record: class numbers start at 0"
            if number < 0
            else f"name {number + 1} or more classes in data.label_names, or fix that record"
            if self.label_names
            else f"set model.num_labels to {number + 1} or more, or fix that record",
        )


def _read_file(
    path: Path, fmt: str, field: str, needs: _Needs, summary: _Summary, lines_only: bool = False
) -> None:
    try:
        if fmt == "text":
            _read_text(path, needs, summary)
        elif fmt == "csv":
            _read_csv(path, needs, summary)
        elif fmt == "json":
            _read_json(path, field, needs, summary, lines_only)
        elif fmt == "arrow":
            _read_arrow(path, needs, summary)
        else:
            _read_parquet(path, needs, summary)
    except UserError:
        raise
    except UnicodeDecodeError as exc:
        raise UserError(
            field,
            f"cannot read {path}: not UTF-8 text (byte {exc.start})",
            "save it as UTF-8",
        ) from None
    except (OSError, ValueError, csv.Error) as exc:
        raise UserError(field, f"cannot read {path}: {exc}", "fix or replace the file") from None


def _missing_column(
    field: str, column: str, path: Path, columns: set[str] | list[str]
) -> UserError:
    listed = ", ".join(sorted(columns)) if columns else "none"
    return UserError(field, f"column {column!r} is not in {path}", f"its columns are {listed}")


def _read_text(path: Path, needs: _Needs, summary: _Summary) -> None:
    # the text builder: one row per line (universal newlines), blank lines included
    for field, column in needs.columns:
        if column != "text":
            raise _missing_column(field, column, path, ["text"])
    with open_text(path) as handle:
        for line in handle:
            summary.rows += 1
            summary.text_bytes += len(line.rstrip("\n").encode())
            if summary.spend(len(line)):
                break


def _read_csv(path: Path, needs: _Needs, summary: _Summary) -> None:
    # pandas as `datasets` calls it: a UTF-8 BOM is no part of the first column's name, blank
    # lines are skipped (before the header too), and the cells in CSV_MISSING are missing
    # pandas takes cells of any length; the csv module's default limit is 128 KiB
    csv.field_size_limit(2**31 - 1)
    with open_text(path, encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle)
        header: list[str] | None = None
        positions: list[tuple[str, str, int]] = []
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if header is None:
                header = row
                for field, column in needs.columns:
                    if column not in header:
                        raise _missing_column(field, column, path, header)
                    positions.append((field, column, header.index(column)))
                continue
            summary.rows += 1
            for field, column, index in positions:
                value = row[index] if index < len(row) else ""
                where = f"line {reader.line_num} of {path}"
                if value in CSV_MISSING:
                    raise UserError(
                        field,
                        f"{where} has no {column!r} ({value!r} reads as missing)",
                        "fill it in or drop that row",
                    )
                if field != LABEL_FIELD:
                    summary.text_bytes += len(value.encode())
                elif problem := needs.label_problem(value, where, csv_cell=True):
                    raise UserError(field, *problem)
            if summary.spend(sum(map(len, row)) + len(row)):
                break
        if header is None:
            return  # no header at all: the file holds no rows


_WHITESPACE = re.compile(r"\s*")


def _read_json(
    path: Path, field: str, needs: _Needs, summary: _Summary, lines_only: bool = False
) -> None:
    """JSON lines, one record at a time; a file that is one JSON document (an array of records,
    or one object spread over lines) is read whole, as `datasets` falls back to, unless
    LINES_ONLY (a stream reads one object per line)."""
    decoder = json.JSONDecoder()
    seen: set[str] = set()
    records = _Summary()
    problems: list[tuple[str, str, str]] = []  # (field, problem, fix) of the first bad record
    with open_text(path, encoding="utf-8-sig") as handle:
        for number, line in enumerate(handle, 1):
            position = _WHITESPACE.match(line).end()
            while position < len(line):
                try:
                    record, position = decoder.raw_decode(line, position)
                except ValueError as exc:
                    if lines_only:
                        raise _not_a_json_line(field, path, number, exc.msg) from None
                    return _read_json_document(path, field, needs, summary, number, exc)
                position = _WHITESPACE.match(line, position).end()
                if not isinstance(record, dict):
                    if lines_only:
                        raise _not_a_json_line(field, path, number, "not an object")
                    return _read_json_document(path, field, needs, summary, number, None)
                seen.update(record)
                records.rows += 1
                _check_record(record, f"line {number}", path, needs, records, problems)
            if summary.spend(len(line)):
                break
    _finish_records(path, needs, seen, records, problems, summary)


def _not_a_json_line(field: str, path: Path, line: int, problem: str) -> UserError:
    return UserError(
        field,
        f"line {line} of {path} is no JSON object ({problem}): a stream reads JSON lines",
        "write one JSON object per line, or set data.streaming: false",
    )


def _read_json_document(
    path: Path,
    field: str,
    needs: _Needs,
    summary: _Summary,
    line: int,
    error: ValueError | None,
) -> None:
    if path.stat().st_size > summary.bytes_left:
        summary.partial = True  # not one record per line, and too big to read whole here
        return
    with open_text(path, encoding="utf-8-sig") as handle:
        text = handle.read()
    try:
        document = json.loads(text)
    except ValueError:
        # objects one after another over several lines each (`jq . in.jsonl`): datasets reads
        # them as rows too
        document = _concatenated_objects(text)
    if isinstance(document, dict):
        # one object: `datasets` makes it one row; its shape is for `datasets` to judge
        summary.rows_known = False
        return
    if not isinstance(document, list) or not all(isinstance(item, dict) for item in document):
        problem = f"not valid JSON: {error.msg}" if error is not None else "not a JSON object"
        raise UserError(
            field,
            f"line {line} of {path} is {problem}",
            "fix that line (JSON lines: one object per line)",
        )
    seen: set[str] = set()
    records = _Summary()
    problems: list[tuple[str, str, str]] = []
    for number, record in enumerate(document, 1):
        seen.update(record)
        records.rows += 1
        _check_record(record, f"record {number}", path, needs, records, problems)
    _finish_records(path, needs, seen, records, problems, summary)


def _concatenated_objects(text: str) -> list[dict] | None:
    """The JSON objects of ``text`` written one after another, or None when it is not that."""
    decoder, objects, position = json.JSONDecoder(), [], _WHITESPACE.match(text).end()
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        objects.append(value)
        position = _WHITESPACE.match(text, position).end()
    return objects


def _check_record(
    record: dict,
    where: str,
    path: Path,
    needs: _Needs,
    records: _Summary,
    problems: list[tuple[str, str, str]],
) -> None:
    for field, column in needs.columns:
        value = record.get(column)
        if field != LABEL_FIELD and isinstance(value, str):
            records.text_bytes += len(value.encode())
            continue
        if problems:
            continue
        if value is None:
            problems.append((field, f"{where} of {path} has no {column!r}", DROP_RECORD))
        elif field != LABEL_FIELD:
            problem = f"{where} of {path} has {json.dumps(value)[:40]} as {column!r}, not a text"
            problems.append((field, problem, DROP_RECORD))
        elif label := needs.label_problem(value, f"{where} of {path}"):
            problems.append((field, *label))


def _finish_records(
    path: Path,
    needs: _Needs,
    seen: set[str],
    records: _Summary,
    problems: list[tuple[str, str, str]],
    summary: _Summary,
) -> None:
    # a column no record has is the likelier mistake (a wrong name): say that first
    if records.rows:
        for field, column in needs.columns:
            if column not in seen:
                raise _missing_column(field, column, path, seen)
    if problems:
        raise UserError(*problems[0])
    summary.rows += records.rows
    summary.text_bytes += records.text_bytes


def _read_parquet(path: Path, needs: _Needs, summary: _Summary) -> None:
    # the footer names the columns, counts the rows and (as most writers fill it in) each column's
    # nulls per row group; the labels are read to check them, the texts only for packing
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        for field, column in needs.columns:
            if column not in names:
                raise _missing_column(field, column, path, names)
        summary.rows += parquet.metadata.num_rows
        texts = [column for _, column in needs.texts]
        first_row = 1
        for group in range(parquet.metadata.num_row_groups):
            metadata = parquet.metadata.row_group(group)
            wanted, unknown = _columns_with_nulls(metadata, needs)
            counted = not summary.partial
            if counted:
                wanted |= unknown
                wanted |= {needs.label} if needs.label else set()
                wanted |= set(texts) if summary.count_bytes else set()
            if wanted:
                table = parquet.read_row_group(group, columns=sorted(wanted))
                _check_table_rows(
                    table, lambda index, first=first_row: f"row {first + index} of {path}", needs
                )
                if counted:
                    size = sum(_text_bytes(table.column(c)) for c in texts if c in wanted)
                    summary.text_bytes += size
                    summary.spend(table.nbytes)
            first_row += metadata.num_rows
    except UserError:
        raise
    except Exception as exc:  # pyarrow's ArrowInvalid is a ValueError, but not all its errors are
        raise ValueError(f"not a readable Parquet file ({exc})") from None


def _read_arrow(path: Path, needs: _Needs, summary: _Summary) -> None:
    # an Arrow IPC stream (what `datasets` writes) or file: columns, then records in the budget
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
                schema = reader.schema
            except pa.ArrowInvalid:
                opened = pa.ipc.open_file(source)
                batches = (opened.get_batch(i) for i in range(opened.num_record_batches))
                schema = opened.schema
            for field, column in needs.columns:
                if column not in schema.names:
                    raise _missing_column(field, column, path, schema.names)
            first_row = 1
            for batch in batches:
                summary.rows += batch.num_rows
                if summary.partial:
                    continue
                table = pa.Table.from_batches([batch])
                _check_table_rows(
                    table, lambda index, first=first_row: f"row {first + index} of {path}", needs
                )
                if summary.count_bytes:
                    summary.text_bytes += sum(_text_bytes(table.column(c)) for _, c in needs.texts)
                summary.spend(table.nbytes)
                first_row += batch.num_rows
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 — pyarrow's errors are not all ValueErrors
        raise ValueError(f"not a readable Arrow file ({exc})") from None


def _columns_with_nulls(metadata, needs: _Needs) -> tuple[set[str], set[str]]:
    """The needed columns a row group's statistics say hold a null, and those it has no null
    count for (they are read to know, within the budget)."""
    flagged, unknown = set(), {column for _, column in needs.columns}
    for index in range(metadata.num_columns):
        chunk = metadata.column(index)
        stats = chunk.statistics
        if chunk.path_in_schema in unknown and stats is not None and stats.has_null_count:
            unknown.discard(chunk.path_in_schema)
            if stats.null_count:
                flagged.add(chunk.path_in_schema)
    return flagged, unknown


def _check_table_rows(table, where: Callable[[int], str], needs: _Needs) -> None:
    """Nulls in the needed columns of an Arrow TABLE and its labels; WHERE names row i of it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for field, column in needs.columns:
        if column in table.column_names and table.column(column).null_count:
            index = pc.index(pc.is_null(table.column(column)), True).as_py()
            raise UserError(
                field,
                f"{where(index)} has no {column!r} (null)",
                "fill it in or drop that row",
            )
    if needs.label is None or needs.label not in table.column_names:
        return
    labels = table.column(needs.label)
    if pa.types.is_integer(labels.type) or pa.types.is_boolean(labels.type):
        if needs.num_labels is None:
            return
        numbers = labels.cast(pa.int64())
        outside = pc.or_(pc.less(numbers, 0), pc.greater_equal(numbers, needs.num_labels))
        if not pc.any(outside).as_py():
            return
        index = pc.index(outside, True).as_py()
        values = [(index, numbers[index].as_py())]
    else:  # floats, texts, categories: one by one, as the ranks' int() takes them
        values = enumerate(labels.to_pylist())
    for index, value in values:
        if problem := needs.label_problem(value, where(index)):
            raise UserError(LABEL_FIELD, *problem)


def _text_bytes(column) -> int:
    # binary_length has kernels for (large_)string only: a dictionary column (a pandas category)
    # or a string_view column is cast first; a column that is no text counts nothing here
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
            column = pc.cast(column, pa.large_string())
        return pc.sum(pc.binary_length(column)).as_py() or 0
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return 0


def _check_one_global_batch(
    training: _Summary, data: DataConfig, packing: bool, global_batch_size: int
) -> None:
    if training.partial:
        return  # 256 MB read and more to come: plenty for any global batch
    rows, held_out = training.rows, 0
    if data.eval_fraction is not None:
        rows, held_out = eval_fraction_split(training.rows, data.eval_fraction)
    after_split = (
        f" ({_count(training.rows, 'row')} less {held_out} held out by data.eval_fraction {data.eval_fraction})"
        if held_out
        else ""
    )
    if not packing:
        if rows >= global_batch_size:
            return
        raise UserError(
            "train.global_batch_size",
            f"the training set has {_count(rows, 'sample')}{after_split}, fewer than one global batch of "
            f"{global_batch_size}",
            f"use a global batch of {rows} or less, or give more data"
            if rows
            else "give more data",
        )
    # packed causal LM: samples are blocks of max_length tokens. A tokenizer makes at most about
    # one token per UTF-8 byte (the byte-level one exactly that), plus a prefix and the EOS per
    # row, so this bound is never below the ranks' count (held-out rows are not subtracted)
    tokens = training.text_bytes + 2 * training.rows
    blocks = tokens // data.max_length
    if blocks >= global_batch_size:
        return
    raise UserError(
        "train.global_batch_size",
        f"the training texts make at most {blocks} blocks of data.max_length {data.max_length} "
        f"tokens ({_count(training.text_bytes, 'byte')} in {_count(training.rows, 'row')}), fewer than one global "
        f"batch of {global_batch_size}",
        (f"use a global batch of {blocks} or less, " if blocks else "")
        + "a smaller data.max_length, or more data",
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
