"""The tokenised-data cache: written once, read back identically, never stale."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dplaunch.config.schema import DataConfig
from dplaunch.train.data import Batcher, Sharding, load_splits, tokenize, tokenized_cache_file
from dplaunch.train.tokenizer import byte_level_tokenizer

TASK = "causal-lm"


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "texts.jsonl"
    rows = [{"text": f"review {i}: " + "good value " * (i % 7 + 1)} for i in range(300)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def data_config(path, **changes) -> DataConfig:
    return DataConfig(**{"dataset": str(path), "max_length": 16, "eval_fraction": 0.1, **changes})


class CannotTokenise:
    """The byte-level tokenizer's definition, but tokenising anything fails: a cache hit needs none."""

    def __init__(self, real):
        self.eos_token_id = real.eos_token_id

    def __call__(self, *args, **kwargs):
        raise AssertionError("tokenised again instead of reading the cache")


class PidLogging:
    """The byte-level tokenizer, noting in a file which process each call ran in."""

    def __init__(self, real, log):
        self.real, self.log = real, log
        self.eos_token_id = real.eos_token_id

    def __call__(self, *args, **kwargs):
        with open(self.log, "a") as log:
            log.write(f"{os.getpid()}\n")
        return self.real(*args, **kwargs)


def blocks(dataset) -> np.ndarray:
    batcher = Batcher(dataset, Sharding(0, 1, 4, 1), pad_id=0, task=TASK, seed=1)
    packed = batcher._packed_blocks
    assert packed is not None, "cached blocks lost the zero-copy packed path"
    return packed[list(range(len(packed)))]


def test_tokenised_data_is_cached_once_and_read_back_identically(corpus):
    tokenizer = byte_level_tokenizer()
    config = data_config(corpus)
    train, _ = load_splits(config, seed=3)
    cache_file = tokenized_cache_file(train, tokenizer, config, TASK)
    assert cache_file is not None and not cache_file.exists()
    first = tokenize(train, tokenizer, config, TASK, cache_file)
    assert cache_file.is_file()
    in_memory = tokenize(train, tokenizer, config, TASK)
    assert in_memory.cache_files == []

    # a later run: the same files and settings name the same cache file, read without tokenising
    again, _ = load_splits(config, seed=3)
    assert tokenized_cache_file(again, byte_level_tokenizer(), config, TASK) == cache_file
    read = tokenize(again, CannotTokenise(tokenizer), config, TASK, cache_file)
    assert len(read) == len(in_memory) == len(first) > 0
    np.testing.assert_array_equal(blocks(read), blocks(in_memory))
    np.testing.assert_array_equal(blocks(first), blocks(in_memory))


def test_anything_the_tokens_depend_on_names_another_cache_file(corpus, tmp_path):
    tokenizer = byte_level_tokenizer()
    config = data_config(corpus)
    train, evaluation = load_splits(config, seed=3)
    base = tokenized_cache_file(train, tokenizer, config, TASK)
    assert base is not None

    def name(config=config, seed=3, tokenizer=tokenizer, split=0, task=TASK):
        return tokenized_cache_file(load_splits(config, seed)[split], tokenizer, config, task)

    assert name(split=1) not in (None, base)  # the evaluation split
    assert name(config=data_config(corpus, max_length=32)) != base
    assert name(config=data_config(corpus, packing=False)) != base
    assert name(seed=4) != base  # another eval_fraction cut
    other = byte_level_tokenizer()
    other.backend_tokenizer.post_processor = None  # no EOS appended by the template
    assert name(tokenizer=other) != base
    # the same file with other contents
    corpus.write_text(corpus.read_text().replace("good", "poor"))
    assert name() != base


def test_datasets_held_only_in_memory_are_tokenised_in_memory(corpus):
    from datasets import Dataset

    tokenizer = byte_level_tokenizer()
    config = data_config(corpus)
    memory_only = Dataset.from_dict({"text": ["one text", "another text"] * 40})
    assert tokenized_cache_file(memory_only, tokenizer, config, TASK) is None
    assert len(tokenize(memory_only, tokenizer, config, TASK)) > 0


def test_tokenising_workers_change_neither_the_tokens_nor_the_cache_file(corpus):
    tokenizer = byte_level_tokenizer()
    one, several = data_config(corpus), data_config(corpus, num_workers=2)
    train, _ = load_splits(one, seed=3)
    cache_file = tokenized_cache_file(train, tokenizer, one, TASK)
    assert tokenized_cache_file(train, tokenizer, several, TASK) == cache_file
    by_one = tokenize(train, tokenizer, one, TASK)
    log = corpus.with_name("pids.txt")
    by_two = tokenize(train, PidLogging(tokenizer, log), several, TASK)
    pids = set(log.read_text().split())
    assert len(pids) == 2 and str(os.getpid()) not in pids  # two worker processes tokenised
    np.testing.assert_array_equal(blocks(by_two), blocks(by_one))
    cached = tokenize(train, tokenizer, several, TASK, cache_file)
    np.testing.assert_array_equal(blocks(cached), blocks(by_one))
    # only the result is left beside the dataset's cache, not the workers' row files
    assert sorted(cache_file.parent.glob("dplaunch-tokenized-*")) == [cache_file]


def test_classification_rows_are_cached_with_their_labels(tmp_path):
    path = tmp_path / "labelled.jsonl"
    rows = [{"text": "fine " * (i % 5 + 1), "label": i % 2} for i in range(120)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = byte_level_tokenizer()
    config = data_config(path, max_length=8)
    train, _ = load_splits(config, seed=3)
    task = "sequence-classification"
    cache_file = tokenized_cache_file(train, tokenizer, config, task)
    assert cache_file != tokenized_cache_file(train, tokenizer, config, TASK)
    written = tokenize(
        train,
        tokenizer,
        config,
        task,
        cache_file,
    )
    read = tokenize(train, CannotTokenise(tokenizer), config, task, cache_file)
    in_memory = tokenize(train, tokenizer, config, task)
    for dataset in (written, read):
        assert dataset["labels"] == in_memory["labels"]
        assert dataset["input_ids"] == in_memory["input_ids"]
    assert max(len(ids) for ids in in_memory["input_ids"]) == 8  # truncated to max_length
    # the labels depend on data.label_names (a text label that names a class is its number)
    named = data_config(path, max_length=8, label_names=["0", "1"])
    assert tokenized_cache_file(train, tokenizer, named, task) != cache_file


def test_an_empty_split_is_cached_without_touching_its_source(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text('{"text": "only one row"}\n')
    tokenizer = byte_level_tokenizer()
    config = DataConfig(dataset=str(path), max_length=8)
    train, _ = load_splits(config, seed=3)
    empty = train.select([])
    sources = [entry["filename"] for entry in train.cache_files]
    cache_file = tokenized_cache_file(empty, tokenizer, config, TASK)
    assert len(tokenize(empty, tokenizer, config, TASK, cache_file)) == 0
    assert all(os.path.exists(source) for source in sources)
    assert len(train) == 1


def test_a_cached_corpus_of_many_chunks_is_batched_from_the_file_without_a_copy(tmp_path):
    """A cached dataset's column comes in chunks (one per 10,000 rows): the blocks are views of
    the mapped file, not one joined copy of the corpus in every rank (11 GB a rank at 2 GB)."""
    import tracemalloc

    import pyarrow as pa
    from datasets import Dataset

    rows, width, per_chunk = 4000, 256, 500
    ids = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    table = pa.Table.from_batches(
        [
            pa.record_batch(
                [pa.array(list(ids[i : i + per_chunk]), pa.list_(pa.int32()))], ["input_ids"]
            )
            for i in range(0, rows, per_chunk)
        ]
    )
    path = tmp_path / "blocks.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    dataset = Dataset.from_file(str(path))
    assert dataset.data.column("input_ids").num_chunks == rows // per_chunk

    batcher = Batcher(dataset, Sharding(0, 1, 4, 1), pad_id=0, task=TASK, seed=1)
    tracemalloc.start()  # numpy's allocations; Arrow's own pool counts apart
    arrow_before = pa.total_allocated_bytes()
    packed = batcher._packed_blocks
    built = tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes() - arrow_before
    tracemalloc.stop()
    assert packed is not None and len(packed) == rows
    assert built < ids.nbytes / 20, f"{built} bytes allocated for {ids.nbytes} bytes of blocks"
    across = [3, per_chunk - 1, per_chunk, rows - 1, 0, 2 * per_chunk + 7]
    np.testing.assert_array_equal(batcher.collate(across)["input_ids"].numpy(), ids[across])
    np.testing.assert_array_equal(packed[list(range(rows))], ids)
