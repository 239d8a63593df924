"""Streams (data.streaming): the training records read while training, in an order that does not
depend on the GPU count. Torch-free: the ranks' data loader workers read through this module,
and the launch check finds the same files.

Lanes. Row j of every global batch (G rows) is the next sample of *lane* j, and data-parallel
rank r owns the contiguous lanes of its rows, r·G/dp … (r+1)·G/dp − 1, as the cached path gives
rank r its contiguous slice of each step's samples. A lane is one deterministic sequence of
samples (its records tokenised, rendered, packed by itself), so a global batch is the same on
any rank count and a checkpoint that records where each lane stands resumes on any other.

Groups. The F files (shards) are dealt to K = gcd(F, G) groups, file f to group f mod K, and
the lanes to groups in contiguous runs of m = G/K. A group's files are read one after another
(each *pass* in a seeded order with data.shuffle), cut into windows of B records (B a multiple
of m: data.shuffle_buffer rounded up), each window permuted by a seeded permutation with
data.shuffle, and dealt round-robin: the window's q-th record goes to the group's lane q mod m.
A pass's last m − 1 records at most (an incomplete round) are left out, as the cached path
leaves out the samples of an incomplete last batch. So with one file (K = 1), no shuffle and
one sample per record, lane j's t-th record is record t·G + j: the cached path's order.

When K is a multiple of the data-parallel size each rank opens only its own groups' files ("by
file shard"); otherwise ranks share a group's files and each parses only its own lanes'
records ("interleaved examples"). A position is (pass, window, file, record, byte offset), so
a resumed reader seeks (plain JSON lines and text files), skips rows (Parquet, Arrow), or
decompresses up to the record (.gz, .bz2, .xz).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dplaunch.errors import UserError

# without data.shuffle, records are read in windows of about this many (rounded to whole rounds)
READ_WINDOW = 1024
# the formats a stream reads; CSV (typed by pandas in the cached path) is not one of them
STREAM_FORMATS = ("json", "text", "parquet", "arrow")


@dataclass(frozen=True)
class Shard:
    """One file of a stream, or one shard of a hub dataset read by `datasets`' streaming mode
    (SOURCE its id or folder, with CONFIG, SPLIT and the shard's INDEX of COUNT)."""

    path: str
    kind: str  # json, text, parquet, arrow, hub
    source: str | None = None
    config: str | None = None
    split: str | None = None
    index: int = 0
    count: int = 1

    @property
    def name(self) -> str:
        if self.kind == "hub":
            return f"{self.source} shard {self.index} of {self.count}"
        return self.path


@dataclass(frozen=True, order=True)
class Position:
    """Where a window starts: the pass, the window's number in it, the file's place in the
    pass's order, the record's number in that file, and its byte offset when the file can be
    seeked (plain JSON lines and text files; None otherwise)."""

    pass_: int
    window: int
    file: int
    record: int
    offset: int | None

    def to_list(self) -> list:
        return [self.pass_, self.window, self.file, self.record, self.offset]

    @classmethod
    def from_list(cls, value: list) -> Position:
        return cls(*value)


def lane_groups(shards: int, global_batch_size: int) -> int:
    """K: the groups a stream's files are dealt to (gcd of files and rows, rank-count free)."""
    return math.gcd(shards, global_batch_size)


def window_size(lanes_per_group: int, shuffle: bool, buffer: int) -> int:
    """B: records per window, a whole number of rounds of the group's lanes."""
    wanted = buffer if shuffle else READ_WINDOW
    return lanes_per_group * max(1, math.ceil(wanted / lanes_per_group))


def group_files(shards: list[Shard], group: int, groups: int) -> list[Shard]:
    """The files of GROUP, in the stream's order."""
    return [shard for number, shard in enumerate(shards) if number % groups == group]


def pass_order(count: int, seed: int, pass_: int, group: int, shuffle: bool) -> list[int]:
    """The order a group reads its COUNT files in during a pass (seeded with data.shuffle)."""
    if not shuffle:
        return list(range(count))
    return np.random.default_rng([seed, pass_, group, 1]).permutation(count).tolist()


def window_order(size: int, seed: int, position: Position, group: int, shuffle: bool) -> np.ndarray:
    """The permutation of a window of SIZE records (identity without data.shuffle)."""
    if not shuffle:
        return np.arange(size)
    return np.random.default_rng([seed, position.pass_, group, position.window, 2]).permutation(
        size
    )


def stream_shards(data: Any, field: str = "data.dataset") -> list[Shard]:
    """The shards DATA's training set streams from: local files (a glob, a list), the Arrow files
    of a save_to_disk folder (or, offline, of a hub dataset prepared in the `datasets` cache), or
    a hub dataset's (or hub-layout folder's) shards in `datasets`' streaming mode. Raises
    UserError for what a stream cannot read."""
    from dplaunch.data.arrow_datasets import (
        cached_dataset,
        hub_layout_folder,
        saved_dataset,
        saved_folder,
    )
    from dplaunch.data.formats import expand_files, is_local, local_format
    from dplaunch.hub import hub_offline

    source = data.dataset
    folder = saved_folder(source)
    if folder is not None:
        split = saved_dataset(folder, field).split(data.split, "data.split")
        return [Shard(str(path), "arrow") for path in split.files]
    if is_local(source) and not hub_layout_folder(source):
        files = [str(Path(item).expanduser()) for item in expand_files(source, field)]
        kind = local_format(files, field)
        if kind not in STREAM_FORMATS:
            raise UserError(
                field,
                f"a stream reads JSON lines, Parquet, Arrow or text files, not {kind} ({files[0]})",
                "convert the files (to JSON lines or Parquet), or set data.streaming: false",
            )
        return [Shard(path, kind) for path in files]
    if hub_offline() and isinstance(source, str):
        # offline, a hub dataset prepared in the `datasets` cache is streamed from its Arrow
        # files (`datasets`' streaming mode would need the Hub)
        prepared = cached_dataset(source, data.dataset_config, field)
        if prepared is not None:
            split = prepared.split(data.split, "data.split")
            return [Shard(str(path), "arrow") for path in split.files]
    return hub_shards(source, data.dataset_config, data.split)


def hub_shards(source: str, config: str | None, split: str) -> list[Shard]:
    """A hub dataset's (or a folder in the hub's layout) shards, as `datasets` streams them."""
    from datasets import load_dataset

    dataset = load_dataset(source, config, split=split, streaming=True)
    count = dataset.n_shards
    return [
        Shard(f"{source}#{index}", "hub", source, config, split, index, count)
        for index in range(count)
    ]


def first_records(data: Any, count: int) -> list[dict[str, Any]]:
    """The first COUNT records of a stream, file after file, in the files' order."""
    records: list[dict[str, Any]] = []
    for shard in stream_shards(data):
        for number, (raw, _) in enumerate(read_raw(shard, 0, 0)):
            if len(records) == count:
                return records
            records.append(parse_raw(shard, raw, number))
    return records


def read_raw(shard: Shard, record: int, offset: int | None) -> Iterator[tuple[Any, int | None]]:
    """The raw records of SHARD from number RECORD on (at byte OFFSET when known), each with the
    byte offset of the record after it (None where the file cannot be seeked). Raw: a JSON line's
    bytes, a text line, an (Arrow batch, row) pair, or a hub record; parse_raw makes a dict."""
    if shard.kind in ("json", "text"):
        yield from _read_lines(shard, record, offset)
    elif shard.kind == "parquet":
        yield from _read_parquet(shard, record)
    elif shard.kind == "arrow":
        yield from _read_arrow(shard, record)
    else:
        yield from _read_hub(shard, record)


def parse_raw(shard: Shard, raw: Any, where: int) -> dict[str, Any]:
    """A raw record as a dict of columns; ValueError naming the file and record otherwise."""
    if shard.kind == "json":
        try:
            record = json.loads(raw)
        except ValueError as error:
            raise ValueError(f"record {where + 1} of {shard.name} is not JSON: {error}") from None
        if not isinstance(record, dict):
            raise ValueError(f"record {where + 1} of {shard.name} is not a JSON object")
        return record
    if shard.kind == "text":
        return {"text": raw}
    if shard.kind in ("parquet", "arrow"):
        batch, row = raw
        return batch.slice(row, 1).to_pylist()[0]
    return raw


def _read_lines(shard: Shard, record: int, offset: int | None) -> Iterator[tuple[Any, int | None]]:
    from dplaunch.data.formats import is_compressed, open_binary

    path = Path(shard.path)
    seekable = not is_compressed(path)
    with open_binary(path) as handle:
        number = 0
        position = 0
        if seekable and offset is not None:
            handle.seek(offset)
            number, position = record, offset
        for line in handle:
            position += len(line)
            if shard.kind == "json":
                if not line.strip():
                    continue  # `datasets` skips blank lines of JSON lines
                raw: Any = line
            else:
                raw = line.rstrip(b"\n").rstrip(b"\r").decode("utf-8")
            if number >= record:
                yield raw, position if seekable else None
            number += 1


def _read_parquet(shard: Shard, record: int) -> Iterator[tuple[Any, None]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(shard.path)
    first = 0
    for group in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if first + rows <= record:
            first += rows
            continue
        for batch in parquet.iter_batches(row_groups=[group], batch_size=8192):
            for row in range(max(0, record - first), batch.num_rows):
                yield (batch, row), None
            first += batch.num_rows


def _read_arrow(shard: Shard, record: int) -> Iterator[tuple[Any, None]]:
    import pyarrow as pa

    with pa.memory_map(shard.path) as source:
        try:
            batches: Any = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:  # the IPC file format rather than a stream (save_to_disk's)
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        first = 0
        for batch in batches:
            if first + batch.num_rows > record:
                for row in range(max(0, record - first), batch.num_rows):
                    yield (batch, row), None
            first += batch.num_rows


def _read_hub(shard: Shard, record: int) -> Iterator[tuple[Any, None]]:
    from datasets import load_dataset

    dataset = load_dataset(shard.source, shard.config, split=shard.split, streaming=True)
    part = dataset.shard(num_shards=shard.count, index=shard.index)
    for item in part.skip(record) if record else part:
        yield item, None


@dataclass
class Window:
    """A window's records for some lanes of a group: (lane offset in the group, the lane's
    record number t in the pass, raw record, shard, record number in its file)."""

    position: Position
    entries: list[tuple[int, int, Any, Shard, int]]
    # the position of the window after this one
    following: Position


class GroupReader:
    """Reads the windows of one group, pass after pass, for the lanes OWN (offsets in the group):
    only their records are kept; the others' are passed over unparsed."""

    def __init__(
        self,
        files: list[Shard],
        group: int,
        lanes_per_group: int,
        own: set[int],
        *,
        seed: int,
        shuffle: bool,
        buffer: int,
        start: Position,
    ):
        self.files = files
        self.group = group
        self.lanes = lanes_per_group
        self.own = own
        self.seed = seed
        self.shuffle = shuffle
        self.window = window_size(lanes_per_group, shuffle, buffer)
        self.position = start
        self._raw: Iterator | None = None
        # (pass, file) the open iterator reads, and the record number of its next record
        self._open: tuple[int, int] | None = None
        self._next_record = 0

    def _order(self, pass_: int) -> list[int]:
        return pass_order(len(self.files), self.seed, pass_, self.group, self.shuffle)

    def next_window(self) -> Window:
        """Read the window at self.position and move to the next one."""
        start = self.position
        order = self._order(start.pass_)
        raws: list[tuple[Any, Shard, int]] = []
        file, record, offset = start.file, start.record, start.offset
        while len(raws) < self.window and file < len(order):
            shard = self.files[order[file]]
            if self._open != (start.pass_, file) or self._next_record != record:
                self._raw = read_raw(shard, record, offset)
                self._open = (start.pass_, file)
            assert self._raw is not None
            for raw, after in self._raw:
                raws.append((raw, shard, record))
                record, offset = record + 1, after
                if len(raws) == self.window:
                    break
            else:
                file, record, offset = file + 1, 0, 0
                self._open = None
            self._next_record = record
        last = file >= len(order)
        following = (
            Position(start.pass_ + 1, 0, 0, 0, 0)
            if last
            else Position(start.pass_, start.window + 1, file, record, offset)
        )
        self.position = following
        rounds = len(raws) // self.lanes  # an incomplete last round is left out
        if last and start.window == 0 and rounds == 0:
            names = ", ".join(shard.name for shard in self.files[:3])
            raise ValueError(
                f"the stream's files {names} hold {len(raws)} record(s), fewer than the "
                f"{self.lanes} lanes reading them: give more data, fewer files, or a smaller "
                "global batch"
            )
        permutation = window_order(len(raws), self.seed, start, self.group, self.shuffle)
        first_round = start.window * (self.window // self.lanes)
        entries = []
        for q in range(rounds * self.lanes):
            lane = q % self.lanes
            if lane in self.own:
                raw, shard, number = raws[permutation[q]]
                entries.append((lane, first_round + q // self.lanes, raw, shard, number))
        return Window(start, entries, following)

    def window_of(self, round_: int) -> int:
        """The window of a pass holding the lanes' record number ROUND_."""
        return round_ * self.lanes // self.window
