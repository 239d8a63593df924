"""The data formats the ranks read and the launch check reads alike: local file kinds, CSV's
missing cells, class numbers of labels, and the eval split `datasets` makes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from dplaunch.errors import UserError

LOCAL_FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
}

# cells pandas (the CSV reader of `datasets`) reads as missing by default: these texts become None
CSV_MISSING = frozenset(
    {"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN"}
    | {"<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"}
)


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


def eval_fraction_split(rows: int, eval_fraction: float) -> tuple[int, int]:
    """(training, evaluation) rows of `Dataset.train_test_split(test_size=eval_fraction)`.

    The same float arithmetic as `datasets` (ceil of fraction × rows held out), so the count
    matches the ranks' split to the row: 0.07 × 100 is 7.000000000000001, which holds out 8."""
    if rows == 0:
        return 0, 0  # `datasets` hands an empty dataset back as both splits
    held_out = math.ceil(eval_fraction * rows)
    return rows - held_out, held_out


def label_ids(label_names: Sequence[str] | None) -> dict[str, int]:
    """data.label_names as {name: class number} (empty without names)."""
    return {name: number for number, name in enumerate(label_names or ())}


def class_number(
    value: object, ids: Mapping[str, int] | None = None, csv_cell: bool = False
) -> int | None:
    """The class number of a label, None when it has none: the ranks train on this number, and
    the launch check refuses a None (or a number outside model.num_labels).

    A text that names a class in IDS (see label_ids) is that class. Otherwise ints, bools, whole
    floats and texts int() reads are numbers. A CSV cell (the launch check reads the raw text)
    is typed by pandas before the ranks see it, so "1.0" there is the float 1.0."""
    if ids and isinstance(value, str) and value in ids:
        return ids[value]
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            if not csv_cell:
                return None
        try:
            number = float(value)
        except ValueError:
            return None
        return int(number) if number.is_integer() else None
    return None
