"""Check a run's data before launch: files exist, the named columns are there (reads one record)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from dplaunch.config.schema import DataConfig
from dplaunch.errors import UserError

LOCAL_FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
}


def is_local(dataset: str | list[str]) -> bool:
    """True when the dataset names local files rather than a hub id."""
    items = dataset if isinstance(dataset, list) else [dataset]
    return any(Path(item).suffix in LOCAL_FORMATS or Path(item).exists() for item in items)


def local_format(files: list[str], field: str) -> str:
    """The `datasets` builder name for local files (json, csv, text, parquet)."""
    formats = {LOCAL_FORMATS.get(Path(item).suffix) for item in files}
    if None in formats or len(formats) != 1:
        raise UserError(
            field,
            f"cannot tell the format of {files}",
            f"use one of {', '.join(sorted(LOCAL_FORMATS))} files (all of one kind)",
        )
    return formats.pop()


def check_data(data: DataConfig, task: str, global_batch_size: int | None = None) -> None:
    """Raise UserError when files or columns the run needs are missing."""
    needed = [data.text_column]
    if data.text_pair_column:
        needed.append(data.text_pair_column)
    if task == "sequence-classification":
        needed.append(data.label_column)
    for field, dataset in (
        ("data.dataset", data.dataset),
        ("data.eval_dataset", data.eval_dataset),
    ):
        if dataset is None:
            continue
        if not is_local(dataset):
            if field == "data.eval_dataset":
                raise UserError(
                    field,
                    f"{dataset} is not a local file",
                    "give local file(s), or use data.eval_split for a hub dataset",
                )
            continue
        files = dataset if isinstance(dataset, list) else [dataset]
        for item in files:
            path = Path(item).expanduser()
            if not path.is_file():
                raise UserError(
                    field,
                    f"{item} does not exist",
                    "check the path (relative paths are relative to the run file)",
                )
        fmt = local_format(files, field)
        columns = _columns(Path(files[0]).expanduser(), fmt)
        if columns is None:
            continue
        for column, name in zip(needed, _column_fields(data, task), strict=True):
            if column not in columns:
                raise UserError(
                    name,
                    f"column {column!r} is not in {files[0]}",
                    f"its columns are {', '.join(sorted(columns))}",
                )
    if is_local(data.dataset) and data.eval_split is not None and data.eval_split != data.split:
        raise UserError(
            "data.eval_split",
            f"local files have a single split, so {data.eval_split!r} does not exist",
            "use data.eval_fraction or data.eval_dataset",
        )


def _column_fields(data: DataConfig, task: str) -> list[str]:
    names = ["data.text_column"]
    if data.text_pair_column:
        names.append("data.text_pair_column")
    if task == "sequence-classification":
        names.append("data.label_column")
    return names


def _columns(path: Path, fmt: str) -> set[str] | None:
    try:
        if fmt == "text":
            return {"text"}
        if fmt == "csv":
            with path.open(newline="") as handle:
                return set(next(csv.reader(handle), []))
        if fmt == "json":
            with path.open() as handle:
                first = handle.readline().strip()
                if first.startswith("["):
                    return None  # a JSON array: `datasets` will check it
                record = json.loads(first) if first else {}
            return set(record) if isinstance(record, dict) else None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(
            "data.dataset", f"cannot read {path}: {exc}", "fix or replace the file"
        ) from None
    return None  # parquet: `datasets` checks it in the ranks
