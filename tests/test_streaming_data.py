"""data.streaming, in this process: what each rank's data loader reads and hands out.

A stream gives the cached path's batches when the order is the same (one file, no shuffle, one
sample per record, nothing left out); 1 and 2 ranks (and 2 workers) make the same global batches
from disjoint lanes; a position saved at a step continues exactly on the same and on another
rank count; compressed, Parquet, Arrow, text files and a hub-layout folder read through
`datasets` give the same records; the launch check reads the first records of each file and
says so; what a stream cannot do is refused before launch. The real gloo ranks are in
test_streaming.py.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dplaunch.config.schema import DataConfig
from dplaunch.data import streams
from dplaunch.data.streams import Shard, parse_raw, read_raw
from dplaunch.train.data import Batcher, Sharding, attach_chat_template, tokenize
from dplaunch.train.mixture_stream import stream_lanes
from dplaunch.train.streaming import StreamBatcher
from dplaunch.train.tokenizer import byte_level_tokenizer
from tests.helpers import REPO, SFT_CONFIG, cache_hub_dataset, write_config

REVIEWS = REPO / "dplaunch/resources/data/reviews.jsonl"
CHATS = REPO / "dplaunch/resources/data/chat-train.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """44 reviews in one file (5 global batches of 8 and 4 left over) and 300 dealt over 4
    gzip-compressed files."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = REVIEWS.read_text().splitlines()
    (folder / "reviews-44.jsonl").write_text("\n".join(lines[:44]) + "\n")
    for part in range(4):
        with gzip.open(folder / f"part-{part}.jsonl.gz", "wt") as out:
            out.write("\n".join(lines[part:300:4]) + "\n")
    return folder


def stream(tokenizer, dataset, dp_rank=0, dp=1, *, task="causal-lm", batch=8, micro=2, **keys):
    """A rank's StreamBatcher over DATASET (DataConfig KEYS), the loss's token total being this
    rank's alone (a 1-rank run's, or what the tests compare without weights)."""
    resume = keys.pop("resume", None)
    start = keys.pop("start", 0)
    data = DataConfig(**{"dataset": str(dataset), "streaming": True, "max_length": 64, **keys})
    sharding = Sharding(dp_rank, dp, micro, batch // dp // micro)
    return StreamBatcher(
        stream_lanes(data, task, tokenizer, batch, 7),
        data,
        tokenizer,
        sharding,
        total_over_ranks=lambda tokens: tokens,
        writes_position=True,
        resume_from=None if resume is None else (resume, start),
    )


def rows(batches: list[dict]) -> list[tuple[int, ...]]:
    """The real tokens of each row of a step's micro-batches, in order."""
    out = []
    for batch in batches:
        mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
        out += [
            tuple(ids[keep.bool()].tolist())
            for ids, keep in zip(batch["input_ids"], mask, strict=True)
        ]
    return out


def equal_batches(left: list[dict], right: list[dict]) -> bool:
    return len(left) == len(right) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(left, right, strict=True)
    )


def test_without_shuffling_a_stream_gives_the_cached_paths_batches_over_epochs(tokenizer, corpus):
    from datasets import load_dataset

    source = corpus / "reviews-44.jsonl"
    data = DataConfig(dataset=str(source), max_length=64, packing=False, shuffle=False)
    cached = tokenize(
        load_dataset("json", data_files=[str(source)], split="train"), tokenizer, data, "causal-lm"
    )
    batcher = Batcher(
        cached, Sharding(0, 1, 2, 4), pad_id=0, task="causal-lm", seed=7, shuffle=False
    )
    assert batcher.steps_per_epoch == 5
    streamed = stream(tokenizer, source, packing=False, shuffle=False)
    # 12 steps: two epoch boundaries, where both leave out the 4 samples of no whole batch
    for step in range(12):
        assert equal_batches(batcher.micro_batches(step), streamed.micro_batches(step)), step
        assert "loss_scale" in batcher.micro_batches(step)[0]  # rows of unequal length: weighted
    assert streamed.epoch_at(11) == 2.0


def test_sft_examples_stream_rendered_masked_and_weighted_as_the_cached_path(tokenizer, tmp_path):
    from datasets import load_dataset

    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(CHATS.read_text().splitlines()[:60]) + "\n")
    template = yaml.safe_load(SFT_CONFIG.read_text())["data"]["chat_template"]
    keys = {"chat_template": template, "max_length": 256, "shuffle": False}
    attach_chat_template(tokenizer, DataConfig(dataset=str(source), **keys), "sft")
    data = DataConfig(dataset=str(source), packing=False, **keys)
    cached = tokenize(
        load_dataset("json", data_files=[str(source)], split="train"), tokenizer, data, "sft"
    )
    assert len(cached) == 60  # nothing left out: the orders are the same
    batcher = Batcher(cached, Sharding(0, 1, 2, 4), pad_id=0, task="sft", seed=7, shuffle=False)
    streamed = stream(tokenizer, source, task="sft", packing=False, **keys)
    for step in range(9):  # past the epoch boundary at 7
        expected, got = batcher.micro_batches(step), streamed.micro_batches(step)
        assert (got[0]["labels"] == -100).any() and "loss_scale" in got[0]
        assert equal_batches(expected, got), step


KINDS = {
    "packed texts": {"packing": True},
    "one text a sample": {"packing": False},
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shuffle", [False, True], ids=["file order", "shuffled"])
def test_two_ranks_read_disjoint_lanes_that_make_the_global_batch_and_resume_on_1_or_2(
    tokenizer, corpus, tmp_path, kind, shuffle
):
    files = corpus / "part-*.jsonl.gz"
    keys = {**KINDS[kind], "shuffle": shuffle, "shuffle_buffer": 50}
    one = stream(tokenizer, files, **keys)
    # rank 1 through 2 data loader worker processes
    two = [
        stream(tokenizer, files, 0, 2, **keys),
        stream(tokenizer, files, 1, 2, num_workers=2, **keys),
    ]
    straight = []
    for step in range(40):  # several passes of every lane
        expected = rows(one.micro_batches(step))
        first, second = rows(two[0].micro_batches(step)), rows(two[1].micro_batches(step))
        assert first + second == expected, step
        assert len(set(first) & set(second)) == 0 or kind == "packed texts"
        straight.append(expected)
        if step == 17:
            for rank in two:
                rank.save_position(tmp_path)
    assert one.epoch_at(39) >= 1.0
    again = {"resume": tmp_path, "start": 18}
    on_one = stream(tokenizer, files, num_workers=2, **keys, **again)
    on_two = [stream(tokenizer, files, rank, 2, **keys, **again) for rank in (0, 1)]
    for step in range(18, 40):
        assert rows(on_one.micro_batches(step)) == straight[step], step
        assert (
            rows(on_two[0].micro_batches(step)) + rows(on_two[1].micro_batches(step))
            == straight[step]
        )


def test_shuffled_windows_hold_every_record_once_a_pass_in_a_seeded_order(corpus):
    source = corpus / "reviews-44.jsonl"
    lines = source.read_bytes().splitlines(keepends=True)

    def first_pass(seed: int, shuffle: bool) -> list[list[bytes]]:
        reader = streams.GroupReader(
            [Shard(str(source), "json")], 0, 8, set(range(8)), seed=seed, shuffle=shuffle,
            buffer=16, start=streams.Position(0, 0, 0, 0, 0),
        )  # fmt: skip
        windows = []
        while reader.position.pass_ == 0:
            windows.append([entry[2] for entry in reader.next_window().entries])
        return windows

    plain, shuffled = first_pass(7, False), first_pass(7, True)
    assert [len(window) for window in shuffled] == [16, 16, 8]  # 44 records: 4 left out
    assert plain == [lines[:40]]
    # each window a permutation of its own records; the last one's incomplete round left out
    assert sorted(shuffled[0]) == sorted(lines[:16]) and shuffled[0] != lines[:16]
    assert sorted(shuffled[1]) == sorted(lines[16:32]) and set(shuffled[2]) < set(lines[32:])
    assert first_pass(7, True) == shuffled and first_pass(8, True) != shuffled


def test_files_of_every_kind_give_the_same_records_and_resume_at_a_record(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"text": f"review {i} ünïcode", "label": i % 2} for i in range(25)]
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "a.jsonl").write_text(lines.replace("\n", "\n\n", 3))  # blank lines are skipped
    for opener, suffix in ((gzip.open, "gz"), (bz2.open, "bz2"), (lzma.open, "xz")):
        with opener(tmp_path / f"a.jsonl.{suffix}", "wt") as out:
            out.write(lines)
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=7)
    with (
        pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table, max_chunksize=4)
    with (
        pa.OSFile(str(tmp_path / "b.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table, max_chunksize=6)
    (tmp_path / "a.txt").write_text("".join(r["text"] + "\r\n" for r in records))
    shards = [Shard(str(tmp_path / name), kind) for name, kind in [
        ("a.jsonl", "json"), ("a.jsonl.gz", "json"), ("a.jsonl.bz2", "json"), ("a.jsonl.xz", "json"),
        ("a.parquet", "parquet"), ("a.arrow", "arrow"), ("b.arrow", "arrow"), ("a.txt", "text"),
    ]]  # fmt: skip
    for shard in shards:
        read = [parse_raw(shard, raw, i) for i, (raw, _) in enumerate(read_raw(shard, 0, 0))]
        expected = [{"text": r["text"]} for r in records] if shard.kind == "text" else records
        assert read == expected, shard
        # from record 11: at its byte offset where the file can seek, by counting otherwise
        offsets = [after for _, after in read_raw(shard, 0, 0)]
        offset = offsets[10] if offsets[10] is not None else 0
        later = [parse_raw(shard, raw, 0) for raw, _ in read_raw(shard, 11, offset)]
        assert later == expected[11:], shard


def test_a_hub_layout_folder_streams_through_datasets_as_its_files_read_directly(
    tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lines = REVIEWS.read_text().splitlines()
    (tmp_path / "hub" / "data").mkdir(parents=True)
    (tmp_path / "files").mkdir()
    for part in range(2):
        text = "\n".join(lines[part * 40 : part * 40 + 40]) + "\n"
        (tmp_path / "hub" / "data" / f"train-{part:05d}-of-00002.jsonl").write_text(text)
        (tmp_path / "files" / f"train-{part}.jsonl").write_text(text)
    hub = stream(tokenizer, tmp_path / "hub", packing=False)
    assert [shard.kind for shard in hub.layout.shards] == ["hub", "hub"]
    files = stream(tokenizer, tmp_path / "files" / "train-*.jsonl", packing=False)
    for step in range(12):
        assert equal_batches(hub.micro_batches(step), files.micro_batches(step)), step


def test_offline_a_hub_dataset_in_the_datasets_cache_streams_from_its_arrow_files(
    tokenizer, tmp_path, monkeypatch
):
    texts = [json.loads(line)["text"] for line in REVIEWS.read_text().splitlines()[:48]]
    cache_hub_dataset(
        tmp_path / "hf", "someone/reviews", "plain", {"train": {"text": texts}}, shards=2
    )
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = stream(tokenizer, "someone/reviews", packing=False, dataset_config="plain")
    assert [shard.kind for shard in hub.layout.shards] == ["arrow", "arrow"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:24]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[24:]))
    files = stream(tokenizer, tmp_path / "?.jsonl", packing=False)
    for step in range(8):
        assert equal_batches(hub.micro_batches(step), files.micro_batches(step)), step


def test_a_rank_of_a_stream_split_by_file_opens_only_its_own_files(tokenizer, corpus, monkeypatch):
    opened = []
    real = streams.read_raw

    def spy(shard, record, offset):
        opened.append(Path(shard.path).name)
        return real(shard, record, offset)

    monkeypatch.setattr(streams, "read_raw", spy)
    rank = stream(tokenizer, corpus / "part-*.jsonl.gz", 1, 2, shuffle=False)
    for step in range(30):
        rank.micro_batches(step)
    # 4 files, global batch 8: 4 groups of 2 lanes; rank 1's lanes 4-7 are groups 2 and 3
    assert set(opened) == {"part-2.jsonl.gz", "part-3.jsonl.gz"}


def test_a_stream_too_small_for_its_lanes_says_so(tokenizer, tmp_path):
    source = tmp_path / "few.jsonl"
    source.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(5)))
    with pytest.raises(ValueError, match="hold 5 record"):
        stream(tokenizer, source, packing=False).micro_batches(0)


def test_a_bad_record_deep_in_a_stream_is_named_by_the_rank_whose_worker_read_it(
    tokenizer, tmp_path
):
    # a data loader worker's error reaches the rank wrapped by torch ("Caught ValueError in
    # DataLoader worker process 0. Original Traceback …"): the rank's line lost the record
    source = tmp_path / "texts.jsonl"
    lines = [json.dumps({"text": f"review {i}"}) for i in range(60)]
    lines[36] = "{not json"
    source.write_text("\n".join(lines) + "\n")
    batcher = stream(tokenizer, source, packing=False, num_workers=1)
    with pytest.raises(ValueError) as failed:
        for step in range(8):
            batcher.micro_batches(step)
    assert str(failed.value).startswith(f"record 37 of {source} is not JSON: ")
    # the worker's own traceback is kept, for the rank's error file
    (note,) = failed.value.__notes__
    assert "in the data loader's worker 0:" in note and "parse_raw" in note


def test_the_bad_records_line_is_named_when_torchrun_times_a_kill_to_the_same_second(tmp_path):
    # rank 1 reports the record; torchrun, closing the job, SIGKILLs rank 0 and gives both
    # failures the same whole second: the kill (counted a second earlier, as a death that causes
    # the others' connection errors) was named instead, and the record's line was lost
    import datetime
    import time

    from dplaunch.launching.process import RankWatch

    errors = tmp_path / "errors"
    record = f"[rank 1] ValueError: record 50000 of big.jsonl is not JSON (traceback: {errors}/rank-1.txt)"
    peer = record.replace(
        "ValueError: record 50000 of big.jsonl is not JSON",
        "RuntimeError: Connection reset by peer",
    )

    def last_line_after(line: str) -> str:
        watch = RankWatch(errors)
        assert watch.filter(line) == []  # held back for the end
        # torchrun's report, its times whole seconds taken after the line: the same second
        second = datetime.datetime.fromtimestamp(int(time.time())).strftime("%Y-%m-%d_%H:%M:%S")
        report = [
            "Traceback (most recent call last):",
            '  File "accelerate", line 1, in <module>',
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "=" * 60,
            "dplaunch.train FAILED",
            "-" * 60,
            "Failures:",
            "[1]:",
            f"  time      : {second}",
            "  rank      : 1 (local_rank: 1)",
            "  exitcode  : 1 (pid: 4243)",
            "-" * 60,
            "Root Cause (first observed failure):",
            "[0]:",
            f"  time      : {second}",
            "  rank      : 0 (local_rank: 0)",
            "  exitcode  : -9 (pid: 4242)",
            "=" * 60,
        ]
        assert [watch.filter(each) for each in report] == [[]] * len(report)
        return watch.report(1, tmp_path)[-1]

    assert last_line_after(record) == record
    # a rank that only lost its peer still follows the death that caused it
    assert last_line_after(peer).startswith("[rank 0] was killed by signal 9 (SIGKILL)")


def test_the_cached_path_reads_globs_and_compressed_files_and_keeps_file_order(
    tokenizer, corpus, tmp_path
):
    from dplaunch.train.data import load_splits

    data = DataConfig(dataset=str(corpus / "part-*.jsonl.gz"), max_length=64, shuffle=False)
    train, _ = load_splits(data, 7)
    first = [json.loads(line)["text"] for line in gzip.open(corpus / "part-0.jsonl.gz", "rt")]
    assert train["text"][: len(first)] == first and len(train) == 300
    order = Batcher(
        tokenize(train, tokenizer, data, "causal-lm"),
        Sharding(0, 1, 2, 4),
        pad_id=0,
        task="causal-lm",
        seed=7,
        shuffle=False,
    )
    assert order.epoch_order(3).tolist() == list(range(len(order.dataset)))


# ---------------------------------------------------------------------------------------------
# before launch: the check of a stream, and what a stream cannot do


def cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """`dplaunch ARGS` in this process: (exit status, stdout, stderr)."""
    from dplaunch.cli import main

    monkeypatch.setattr(sys, "argv", ["dplaunch", *map(str, args)])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as stopped:
        main()
    out = capsys.readouterr()
    return stopped.value.code, out.out, out.err


def stream_run_file(tmp_path: Path, dataset, **data) -> Path:
    keys = {"dataset": str(dataset), "streaming": True, "eval_fraction": None, **data}
    return write_config(tmp_path / "stream.yaml", data=keys, train={"max_steps": 6})


def test_the_check_of_a_stream_reads_the_first_records_of_each_file_and_says_so(
    tmp_path, corpus, monkeypatch, capsys
):
    run_file = stream_run_file(tmp_path, corpus / "part-*.jsonl.gz")
    code, out, err = cli(
        monkeypatch, capsys, "train", run_file, "--cpu", "--dry-run", "-o", tmp_path / "run"
    )
    assert code == 0, err
    assert "the data check read the first records of each of 4 file(s)" in out
    # a bad record in the first records of a file is named before launch
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    code, _, err = cli(
        monkeypatch, capsys, "train", stream_run_file(tmp_path, bad / "*.jsonl"), "--dry-run"
    )
    assert code == 2 and "line 2 of" in err and "not a text" in err, err


@pytest.mark.parametrize(
    ("data", "train", "expected"),
    [
        ({}, {"max_steps": None}, "train.max_steps: is unset, and a stream's length is unknown"),
        ({"eval_fraction": 0.1}, {}, "data.eval_fraction: holds out a fraction of the whole data"),
        (
            {"dataset": "CSV"},
            {},
            "a stream reads JSON lines, Parquet, Arrow or text files, not csv",
        ),
        ({"dataset": "DOCUMENT"}, {}, "line 1 of"),
        ({"streaming": False, "shuffle_buffer": 5}, {}, "data.shuffle_buffer: is for streaming"),
    ],
    ids=[
        "no max_steps",
        "eval_fraction",
        "csv",
        "a JSON document",
        "a stream key without streaming",
    ],
)
def test_what_a_stream_cannot_do_is_refused_before_launch(
    tmp_path, corpus, monkeypatch, capsys, data, train, expected
):
    (tmp_path / "a.csv").write_text("text\nhello\n")
    (tmp_path / "doc.json").write_text('[{"text": "a"},\n {"text": "b"}]\n')
    dataset = {"CSV": tmp_path / "a.csv", "DOCUMENT": tmp_path / "doc.json"}.get(
        data.pop("dataset", ""), corpus / "reviews-44.jsonl"
    )
    keys = {"dataset": str(dataset), "streaming": True, "eval_fraction": None, **data}
    run_file = write_config(tmp_path / "r.yaml", data=keys, train={"max_steps": 6, **train})
    code, _, err = cli(monkeypatch, capsys, "train", run_file, "--dry-run", "-o", tmp_path / "run")
    assert code == 2 and expected in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_window_size_and_groups_do_not_depend_on_the_rank_count():
    assert streams.lane_groups(4, 8) == 4 and streams.lane_groups(1, 512) == 1
    assert streams.lane_groups(1024, 512) == 512 and streams.lane_groups(10, 32) == 2
    assert (
        streams.window_size(8, True, 10_000) == 10_000 and streams.window_size(24, True, 100) == 120
    )
    assert np.array_equal(
        streams.window_order(5, 1, streams.Position(0, 0, 0, 0, 0), 0, False), np.arange(5)
    )


def test_count_stream_counts_the_records_so_that_epochs_set_the_length(
    tmp_path, corpus, monkeypatch, capsys
):
    from dplaunch.data.stream_length import count_records

    assert [count_records(Shard(str(path), "json")) for path in sorted(corpus.glob("part-*"))] == [
        75
    ] * 4
    keys = {"packing": False, "count_stream": True}
    run_file = stream_run_file(tmp_path, corpus / "part-*.jsonl.gz", **keys)
    flags = ("--set", "train.max_steps=null", "--set", "train.epochs=2", "--dry-run")
    code, out, err = cli(monkeypatch, capsys, "train", run_file, *flags, "-o", tmp_path / "run")
    assert code == 0, err
    # 4 files, global batch 8: 4 groups of 2 lanes, each 75 records → 37 steps a pass
    assert (
        "data.count_stream: 300 records in 4 file(s), 37 steps a pass (one sample a record)" in out
    )
    assert "2 epoch(s) → train.max_steps 74" in out
    assert "max_steps: 74" in out  # the run.yaml the ranks read


def test_dplaunch_data_shows_a_streams_first_records_without_reading_it_whole(
    tmp_path, corpus, monkeypatch, capsys
):
    run_file = stream_run_file(tmp_path, corpus / "part-*.jsonl.gz")
    code, out, err = cli(monkeypatch, capsys, "data", run_file, "--show", "1")
    assert code == 0, err
    assert "data.streaming: the first 300 records of the stream" in out
