"""The data formats the ranks read and the launch check reads alike: local file kinds (a glob names
several; .gz, .bz2 and .xz files are read decompressed), CSV's missing cells, class numbers of
labels, and the eval split `datasets` makes."""

from __future__ import annotations

import glob
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from dplaunch.errors import UserError

LOCAL_FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
# compressed files are named FILE.jsonl.gz…: `datasets` and these readers decompress them
COMPRESSIONS = (".gz", ".bz2", ".xz")

# cells pandas (the CSV reader of `datasets`) reads as missing by default: these texts become None
CSV_MISSING = frozenset(
    {"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN"}
    | {"<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"}
)


def data_suffix(path: str | Path) -> str:
    """The suffix that says a file's format: ".jsonl" of both data.jsonl and data.jsonl.gz."""
    path = Path(path)
    if path.suffix in COMPRESSIONS:
        path = path.with_suffix("")
    return path.suffix


def is_glob(item: str) -> bool:
    """Whether a data path is a pattern (data/part-*.jsonl) rather than one file."""
    return glob.has_magic(item)


def is_local(dataset: str | list[str]) -> bool:
    """True when the dataset names local files rather than a hub id."""
    items = dataset if isinstance(dataset, list) else [dataset]
    return any(data_suffix(item) in LOCAL_FORMATS or Path(item).exists() for item in items)


def expand_files(dataset: str | list[str], field: str) -> list[str]:
    """The local files DATASET names, in order: a list's in its order, a glob's sorted (as
    `datasets` resolves one). A glob that matches nothing is refused by name."""
    files = []
    for item in dataset if isinstance(dataset, list) else [dataset]:
        if not is_glob(item):
            files.append(item)
            continue
        matches = sorted(
            path for path in glob.glob(str(Path(item).expanduser())) if Path(path).is_file()
        )
        if not matches:
            raise UserError(
                field,
                f"the pattern {item} matches no file",
                "check the pattern (relative paths are relative to the run file)",
            )
        files.extend(matches)
    return files


def open_text(path: Path, encoding: str = "utf-8", newline: str | None = None) -> IO[str]:
    """A data file opened as text, decompressed when it is .gz, .bz2 or .xz."""
    opener = _opener(path)
    if opener is None:
        return path.open(encoding=encoding, newline=newline)
    return opener(path, "rt", encoding=encoding, newline=newline)


def open_binary(path: Path) -> IO[bytes]:
    """A data file opened for reading bytes, decompressed when it is .gz, .bz2 or .xz."""
    opener = _opener(path)
    return path.open("rb") if opener is None else opener(path, "rb")


def is_compressed(path: str | Path) -> bool:
    """Whether a data file is read through a decompressor (no seeking into it)."""
    return Path(path).suffix in COMPRESSIONS


def _opener(path: Path):
    suffix = Path(path).suffix
    if suffix == ".gz":
        import gzip

        return gzip.open
    if suffix == ".bz2":
        import bz2

        return bz2.open
    if suffix == ".xz":
        import lzma

        return lzma.open
    return None


def local_format(files: list[str], field: str) -> str:
    """The `datasets` builder name for local files (json, csv, text, parquet, arrow)."""
    formats = {LOCAL_FORMATS.get(data_suffix(item)) for item in files}
    if None in formats or len(formats) != 1:
        raise UserError(
            field,
            f"cannot tell the format of {files}",
            f"use one of {', '.join(sorted(LOCAL_FORMATS))} files (all of one kind; "
            f"{', '.join(COMPRESSIONS)} compressed or not)",
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
