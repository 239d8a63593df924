"""data.streaming in the ranks: lanes (dplaunch/data/streams.py) that tokenise, render and pack
their records in the data loader's worker processes, and the batcher that makes each step's
micro-batches from this rank's lanes.

A lane makes one kind of sample: one per record (causal LM without packing, sft without
packing, sequence classification), full max_length blocks of its records' tokens (causal-LM
packing: each record's tokens and EOS, concatenated), or blocks of whole sft examples (best
fit, longest first, within windows of PACK_WINDOW examples). Its state, small and JSON, says
where it stands: `done` the last record (pass, number) it has used up, and how much of the next
one it has used (tokens) or how many blocks of its current window it has given. The batcher
keeps the state of the step it last handed out: a checkpoint saves it (data-position-N.json),
and a resumed rank on any GPU count starts each of its lanes there.

Memory stays bounded: a worker holds one window of raw records for each group it reads (its
lanes' share of them once dealt), at most ENCODE_BATCH encoded records a lane, and at most
`PREFETCH` steps ahead (the data loader's prefetch_factor). The loss of rows of unequal length is weighted by the tokens of the whole
global batch, which the ranks add up with one all-reduce a step (data.set_loss_scales).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dplaunch.config.schema import DataConfig
from dplaunch.data.example_tokens import IGNORE_INDEX
from dplaunch.data.streams import (
    GroupReader,
    Position,
    Shard,
    group_files,
    lane_groups,
    parse_raw,
    read_raw,
    stream_shards,
    window_size,
)
from dplaunch.run_directory.files import read_data_positions, write_data_position
from dplaunch.tasks import task_of
from dplaunch.train.data import (
    Sharding,
    collate_blocks,
    collate_rows,
    data_task,
    pack_rows,
    packs_texts,
    row_encoder,
    set_loss_scales,
)

# sft packing: the whole examples a lane packs together (a resumed lane re-reads at most these)
PACK_WINDOW = 64
# steps each worker prepares ahead of the training step (the data loader's prefetch_factor)
PREFETCH = 2
# records a lane parses and encodes at a time (one tokenizer call)
ENCODE_BATCH = 32
NOTHING_DONE = (0, -1)


@dataclass(frozen=True)
class StreamLayout:
    """What every rank and worker agrees on: the shards, the lanes (one per row of the global
    batch), their groups, and how records become samples."""

    shards: tuple[Shard, ...]
    lanes: int
    groups: int
    task: str
    kind: str  # "one" sample per record, "tokens" (causal-LM blocks), "examples" (sft blocks)
    max_length: int
    seed: int
    shuffle: bool
    buffer: int

    @property
    def lanes_per_group(self) -> int:
        return self.lanes // self.groups

    @classmethod
    def of(
        cls,
        data: DataConfig,
        task: str,
        global_batch_size: int,
        seed: int,
        shards: list[Shard],
        columns: list[str],
    ) -> StreamLayout:
        task = data_task(task, data, columns)
        if packs_texts(task, data):
            kind = "tokens"
        elif task_of(task).examples and task_of(task).packs(data.packing):
            kind = "examples"
        else:
            kind = "one"
        return cls(
            tuple(shards),
            global_batch_size,
            lane_groups(len(shards), global_batch_size),
            task,
            kind,
            data.max_length,
            seed,
            data.shuffle,
            data.shuffle_buffer,
        )

    def describe(self) -> str:
        """One line for the log: files, groups, how ranks split them."""
        per = "one file" if len(self.shards) == 1 else f"{len(self.shards)} files"
        return (
            f"streaming {per} in {self.groups} group(s) of {self.lanes_per_group} lane(s) "
            f"({'shuffled in windows of ' + str(window_size(self.lanes_per_group, True, self.buffer)) + ' records' if self.shuffle else 'in file order'})"
        )


class Lane:
    """The samples of one lane, made from its encoded records (see the module's docstring)."""

    def __init__(self, index: int, layout: StreamLayout, state: dict[str, Any] | None):
        state = state or {}
        self.index = index
        self.kind = layout.kind
        self.max_length = layout.max_length
        self.done: tuple[int, int] = tuple(state.get("done", NOTHING_DONE))  # type: ignore[assignment]
        # tokens of the record after `done` used up (tokens), or blocks of the window given (examples)
        self.used: int = int(state.get("used", 0))
        # records up to here were used before this lane was (re)started: not encoded again
        self.threshold = self.done
        # its records read but not yet parsed, and those encoded but not yet used
        self.raw: deque[tuple[tuple[int, int], Any, Shard, int]] = deque()
        self.queue: deque[tuple[tuple[int, int], dict | None]] = deque()
        self._skip = self.used
        self._chunks: deque[list] = deque()  # [tag, tokens, start] of the tokens lane
        self._buffered = 0
        self._blocks: deque[dict] = deque()  # the examples lane's packed blocks not yet given
        self._window_last: tuple[int, int] | None = None

    def state(self) -> dict[str, Any]:
        return {"done": list(self.done), "used": self.used}

    def needed(self) -> tuple[int, int]:
        """The (pass, record) a restart reads from (the window holding it)."""
        return (self.done[0], max(self.done[1], 0))

    def next_sample(self, pull: Callable[[], tuple[tuple[int, int], dict | None]]) -> dict:
        if self.kind == "tokens":
            return self._next_block(pull)
        if self.kind == "examples":
            return self._next_packed(pull)
        while True:
            tag, encoded = pull()
            self.done = tag
            if encoded is not None:
                return {**encoded, "pass": tag[0]}

    def _next_block(self, pull: Callable) -> dict:
        length = self.max_length
        while self._buffered < length:
            tag, encoded = pull()
            tokens = encoded["input_ids"] if encoded is not None else np.zeros(0, np.int32)
            start, self._skip = self._skip, 0
            self._chunks.append([tag, tokens, start])
            self._buffered += len(tokens) - start
        pieces, need = [], length
        pass_ = self._chunks[0][0][0]
        while need:
            chunk = self._chunks[0]
            take = min(len(chunk[1]) - chunk[2], need)
            pieces.append(chunk[1][chunk[2] : chunk[2] + take])
            chunk[2] += take
            need -= take
            self._buffered -= take
            while self._chunks and self._chunks[0][2] == len(self._chunks[0][1]):
                self.done = self._chunks.popleft()[0]
        self.used = self._chunks[0][2] if self._chunks else 0
        return {"input_ids": np.concatenate(pieces), "pass": pass_}

    def _next_packed(self, pull: Callable) -> dict:
        while not self._blocks:
            if self._window_last is not None:
                self.done, self.used = self._window_last, 0
            examples, tags = [], []
            while len(examples) < PACK_WINDOW:
                tag, encoded = pull()
                tags.append(tag)
                if encoded is not None:
                    examples.append(encoded)
            self._window_last = tags[-1]
            packed, _ = pack_rows(
                [e["input_ids"].tolist() for e in examples],
                [e["labels"].tolist() for e in examples],
                self.max_length,
            )
            blocks = [
                {
                    "input_ids": np.asarray(ids, np.int32),
                    "labels": np.asarray(labels, np.int32),
                    "position_ids": np.asarray(positions, np.int32),
                    "pass": tags[0][0],
                }
                for ids, labels, positions in zip(
                    packed["input_ids"], packed["labels"], packed["position_ids"], strict=True
                )
            ]
            skip, self._skip = self._skip, 0
            self._blocks = deque(blocks[skip:])
            self.used = skip
        self.used += 1
        return self._blocks.popleft()


class LaneWorker:
    """One data loader worker: its lanes, and a reader for each group they belong to."""

    def __init__(
        self,
        layout: StreamLayout,
        lanes: list[int],
        encode: Callable[[list[dict]], list[dict | None]],
        state: dict[str, Any],
    ):
        self.layout = layout
        self.encode = encode
        lane_states = state.get("lanes", {})
        self.lanes = [Lane(index, layout, lane_states.get(str(index))) for index in lanes]
        m = layout.lanes_per_group
        self.readers: dict[int, GroupReader] = {}
        self.positions: dict[int, dict[tuple[int, int], Position]] = {}
        starts = state.get("groups", {})
        for group in sorted({lane // m for lane in lanes}):
            own = {lane % m for lane in lanes if lane // m == group}
            start = (
                Position.from_list(starts[str(group)])
                if str(group) in starts
                else Position(0, 0, 0, 0, 0)
            )
            self.readers[group] = GroupReader(
                group_files(list(layout.shards), group, layout.groups),
                group,
                m,
                own,
                seed=layout.seed,
                shuffle=layout.shuffle,
                buffer=layout.buffer,
                start=start,
            )
            self.positions[group] = {(start.pass_, start.window): start}
        self._by_offset = {(lane.index // m, lane.index % m): lane for lane in self.lanes}

    def _read_window(self, group: int) -> None:
        reader = self.readers[group]
        window = reader.next_window()
        following = window.following
        self.positions[group][(following.pass_, following.window)] = following
        pass_ = window.position.pass_
        for offset, number, raw, shard, where in window.entries:
            lane = self._by_offset[(group, offset)]
            if (pass_, number) > lane.threshold:
                lane.raw.append(((pass_, number), raw, shard, where))

    def puller(self, lane: Lane) -> Callable[[], tuple[tuple[int, int], dict | None]]:
        group = lane.index // self.layout.lanes_per_group

        def pull() -> tuple[tuple[int, int], dict | None]:
            if not lane.queue:
                while not lane.raw:
                    self._read_window(group)
                # parsed and encoded as they are needed, a few at a time: the first step does
                # not wait for a whole window, and raw text is smaller than its tokens
                batch = [lane.raw.popleft() for _ in range(min(ENCODE_BATCH, len(lane.raw)))]
                records = [parse_raw(shard, raw, where) for _, raw, shard, where in batch]
                encoded = self.encode(records)
                lane.queue.extend(zip([tag for tag, *_ in batch], encoded, strict=True))
            return lane.queue.popleft()

        return pull

    def state(self) -> dict[str, Any]:
        """Where this worker's lanes stand, and where each of its groups' readers restarts."""
        m = self.layout.lanes_per_group
        groups = {}
        for group, reader in self.readers.items():
            needed = min(
                (lane.needed()[0], reader.window_of(lane.needed()[1]))
                for lane in self.lanes
                if lane.index // m == group
            )
            known = self.positions[group]
            for key in [key for key in known if key < needed]:
                del known[key]
            groups[str(group)] = known[needed].to_list()
        return {"lanes": {str(lane.index): lane.state() for lane in self.lanes}, "groups": groups}

    def steps(self, first_step: int) -> Iterator[dict[str, Any]]:
        """Each step's samples of these lanes, with the state after it."""
        pullers = [self.puller(lane) for lane in self.lanes]
        step = first_step
        while True:
            samples = {
                lane.index: lane.next_sample(pull)
                for lane, pull in zip(self.lanes, pullers, strict=True)
            }
            yield {"step": step, "samples": samples, "state": self.state()}
            step += 1


def record_encoder(
    tokenizer: Any, data: DataConfig, task: str, columns: list[str]
) -> Callable[[list[dict]], list[dict | None]]:
    """Records → their encoded samples (None for an sft example the cached path would drop too),
    with the cached path's row pass (data.row_encoder)."""
    encode = row_encoder(tokenizer, data, task, columns)
    facts = task_of(data_task(task, data, columns))

    def as_arrays(rows: dict[str, list], index: int) -> dict:
        out = {"input_ids": np.asarray(rows["input_ids"][index], np.int32)}
        if "labels" in rows:
            label = rows["labels"][index]
            out["labels"] = np.asarray(label, np.int32) if facts.own_labels else int(label)
        return out

    def encode_records(records: list[dict]) -> list[dict | None]:
        if facts.own_labels:  # one at a time: an example may be left out
            out = []
            for record in records:
                rows = encode({key: [value] for key, value in record.items()})
                out.append(as_arrays(rows, 0) if rows["input_ids"] else None)
            return out
        wanted = [data.text_column]
        if facts.classifies:
            wanted += [data.label_column] + (
                [data.text_pair_column] if data.text_pair_column else []
            )
        rows = encode({column: [record.get(column) for record in records] for column in wanted})
        return [as_arrays(rows, index) for index in range(len(records))]

    return encode_records


class StreamLanes:
    """One stream's lanes: its layout, its records' encoding, and the state of their position
    (train/mixture_stream.py's MixedLanes is a mixture's, with the same methods)."""

    def __init__(self, data: DataConfig, task: str, tokenizer: Any, lanes: int, seed: int):
        self.task = task
        shards = stream_shards(data)
        columns = [] if data.format else first_columns(shards)
        self.layout = StreamLayout.of(data, task, lanes, seed, shards, columns)
        self.encode = record_encoder(tokenizer, data, task, columns)

    def worker(self, lanes: list[int], state: dict[str, Any]) -> LaneWorker:
        """What a data loader worker reads for LANES, from STATE."""
        return LaneWorker(self.layout, lanes, self.encode, state)

    def merged(self, positions: list[dict]) -> dict[str, Any]:
        """The state in a checkpoint's position files (merged_position)."""
        return merged_position(positions, self.layout.lanes)

    def joined(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The state of several workers' lanes as one: each lane's, each group's earliest."""
        lanes: dict[str, Any] = {}
        groups: dict[str, list] = {}
        for state in states:
            lanes.update(state["lanes"])
            for group, start in state["groups"].items():
                known = groups.get(group)
                if known is None or Position.from_list(start) < Position.from_list(known):
                    groups[group] = start
        return {"lanes": lanes, "groups": groups}

    def at_start(self, state: dict[str, Any], lanes: list[int]) -> dict[str, Any]:
        """LANES' position before any step of this launch (STATE: the resumed one)."""
        own = state.get("lanes", {})
        return {
            "lanes": {
                str(lane): own.get(str(lane), Lane(lane, self.layout, None).state())
                for lane in lanes
            },
            "groups": state.get("groups", {}),
        }


class LaneDataset(torch.utils.data.IterableDataset):
    """The data loader's dataset: worker w makes the steps of the lanes in CHUNKS[w]."""

    def __init__(
        self, source: StreamLanes, chunks: list[list[int]], state: dict[str, Any], first_step: int
    ):
        super().__init__()
        self.source, self.chunks = source, chunks
        self.state, self.first_step = state, first_step

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        lanes = self.source.worker(self.chunks[worker], self.state)
        if info is None:
            return lanes.steps(self.first_step)
        return _handed_over(lanes.steps(self.first_step), worker)


# a worker's step that holds its data error instead (WORKER_ERROR: the message, the traceback)
WORKER_ERROR = "worker_error"


def _handed_over(steps: Iterator[dict[str, Any]], worker: int) -> Iterator[dict[str, Any]]:
    """A worker's steps; a record it cannot use (a ValueError: not JSON, a label that is no
    class, a pair the template cannot render) ends them with a step that holds the error, which
    the rank raises as its own (worker_error). torch would wrap it in "Caught ValueError in
    DataLoader worker process 0. Original Traceback …", and the rank's one line, cut at a few
    hundred characters, would lose the record's name."""
    import traceback

    try:
        yield from steps
    except ValueError as error:
        where = f"in the data loader's worker {worker}:\n" + "".join(
            traceback.format_exception(error)
        )
        yield {WORKER_ERROR: (str(error), where)}


def worker_error(part: dict[str, Any]) -> None:
    """Raise the data error a worker's step holds, with the worker's traceback as its note."""
    if WORKER_ERROR in part:
        message, where = part[WORKER_ERROR]
        error = ValueError(message)
        error.add_note(where)
        raise error


def _as_is(item: Any) -> Any:
    return item


def first_columns(shards: list[Shard]) -> list[str]:
    """The columns of the stream's first record (what data.format is told from)."""
    for shard in shards:
        for raw, _ in read_raw(shard, 0, 0):
            return list(parse_raw(shard, raw, 0))
    raise ValueError(f"the stream's files ({shards[0].name}, …) hold no records")


def merged_position(positions: list[dict], lanes: int) -> dict[str, Any]:
    """The state of every lane and group from the data-parallel ranks' position files of a
    checkpoint (any rank count wrote them): each lane's own entry, each group's earliest start."""
    state: dict[str, Any] = {"lanes": {}, "groups": {}}
    steps = {position["step"] for position in positions}
    if len(steps) > 1:
        raise ValueError(
            f"the checkpoint's stream positions disagree on the step ({sorted(steps)})"
        )
    for position in positions:
        state["lanes"].update(position["lanes"])
        for group, start in position["groups"].items():
            known = state["groups"].get(group)
            if known is None or Position.from_list(start) < Position.from_list(known):
                state["groups"][group] = start
    missing = [lane for lane in range(lanes) if str(lane) not in state["lanes"]]
    if missing:
        raise ValueError(
            f"the checkpoint's stream positions lack lane(s) {missing[:5]}: it was written for "
            "another global batch or by another data order"
        )
    state["step"] = steps.pop() if steps else 0
    return state


class StreamBatcher:
    """This rank's training batches from a stream (the cached path's Batcher, for data.streaming)."""

    def __init__(
        self,
        lanes: StreamLanes,
        data: DataConfig,
        tokenizer: Any,
        sharding: Sharding,
        *,
        total_over_ranks: Callable[[int], int],
        writes_position: bool,
        resume_from: tuple[Path, int] | None = None,
    ):
        """``lanes``: what the lanes read (train/mixture_stream.py's stream_lanes);
        ``resume_from``: the checkpoint whose stream positions this launch starts from, and its
        step (None: the stream's start)."""
        self.sharding = sharding
        self.pad_id = tokenizer.pad_token_id
        self.total_over_ranks = total_over_ranks
        self.writes_position = writes_position
        self.source = lanes
        self.layout = self.source.layout
        self.task = lanes.task
        self.own_labels = task_of(self.layout.task).own_labels
        self.flatten_packed = False
        # the stream's length is unknown: the run's length is train.max_steps
        self.steps_per_epoch: int | None = None
        per_rank = sharding.global_batch_size // sharding.data_parallel_size
        first = sharding.data_parallel_rank * per_rank
        self.lanes = list(range(first, first + per_rank))
        state: dict[str, Any] = {}
        start_step = 0
        if resume_from is not None:
            checkpoint, start_step = resume_from
            state = self.source.merged(read_data_positions(checkpoint))
            if state["step"] != start_step:
                raise ValueError(
                    f"{checkpoint} holds the stream position of step {state['step']}, not {start_step}"
                )
        workers = min(data.num_workers, per_rank)
        count = max(workers, 1)
        self.chunks = [
            self.lanes[per_rank * w // count : per_rank * (w + 1) // count] for w in range(count)
        ]
        dataset = LaneDataset(self.source, self.chunks, state, start_step)
        if workers:
            # forked workers must not share the tokenizer's thread pool
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=PREFETCH if workers else None,
            collate_fn=_as_is,
        )
        self._steps = iter(loader)  # the workers start now, while the model is built
        self._next_step = start_step
        # what a checkpoint before the first step of this launch saves
        self._position = {"step": start_step, **self.source.at_start(state, self.lanes)}
        self._pass = 0

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next step (steps come in order: it is a stream)."""
        if step != self._next_step:
            raise ValueError(f"a stream gives step {self._next_step} next, not step {step}")
        parts = [next(self._steps) for _ in self.chunks]
        samples: dict[int, dict] = {}
        for part in parts:
            worker_error(part)
            assert part["step"] == step, (part["step"], step)
            samples.update(part["samples"])
        rows = [samples[lane] for lane in self.lanes]
        self._pass = min(row.pop("pass") for row in rows)
        micro = self.sharding.micro_batch_size
        batches = [self._collate(rows[i : i + micro]) for i in range(0, len(rows), micro)]
        if not task_of(self.task).classifies and self.layout.kind != "tokens":
            tokens = [
                sum(_trained_tokens(row, self.own_labels) for row in rows[i : i + micro])
                for i in range(0, len(rows), micro)
            ]
            set_loss_scales(batches, tokens, self.total_over_ranks(sum(tokens)), self.sharding)
        self._next_step = step + 1
        self._position = {"step": step + 1, **self.source.joined([p["state"] for p in parts])}
        return batches

    def _collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.layout.kind == "tokens":
            return collate_blocks(np.stack([row["input_ids"] for row in rows]))
        return collate_rows(
            rows,
            pad_id=self.pad_id,
            task=self.task,
            own_labels=self.own_labels,
            flatten_packed=self.flatten_packed,
        )

    def epoch_at(self, step: int) -> float:
        """The pass over the data the last step's records came from (for the log)."""
        return float(self._pass)

    def save_position(self, checkpoint: Path) -> None:
        """Write this data-parallel rank's lanes' position into a checkpoint being saved (one
        rank of each data-parallel group: its tensor/pipeline/sequence peers read the same)."""
        if self.writes_position:
            write_data_position(checkpoint, self.sharding.data_parallel_rank, self._position)


def _trained_tokens(row: dict, own_labels: bool) -> int:
    """The tokens a row's loss averages over: its labels that are trained (sft), else its
    length less the first token (the cached Batcher's _trained_tokens, _predicted_tokens)."""
    if own_labels:
        return int(np.count_nonzero(np.asarray(row["labels"]) != IGNORE_INDEX))
    return max(len(row["input_ids"]) - 1, 0)
