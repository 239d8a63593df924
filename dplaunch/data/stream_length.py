"""data.count_stream: a stream's length in steps, counted before launch so that train.epochs
can set the run's length (a stream's is otherwise unknown, and train.max_steps must).

One pass over the files counts their records without parsing or tokenising them (lines of JSON
lines and text files, compressed or not; Parquet's footer; Arrow's batch lengths). A pass of a
group of files (dplaunch/data/streams.py) gives each of its m lanes floor(records / m) records,
and a step takes one sample of every lane, so a pass is min over groups of that many steps when
each record is one sample. Packed samples are counted from the tokens of the first records of
each file (the launch tokenizer, no torch): an estimate, which the plan's note says.

The same count gives the size of a run's evaluation sets (evaluation_samples), which the job's
time counts (planning/job_time.py).
"""

from __future__ import annotations

import math
from typing import Any

from dplaunch.data.example_tokens import pack_lengths
from dplaunch.data.streams import Shard, lane_groups, parse_raw, read_raw
from dplaunch.errors import UserError
from dplaunch.tasks import task_of

FIELD = "data.count_stream"
# records of each file whose tokens estimate a packed pass's length
SAMPLED_RECORDS = 200


def count_records(shard: Shard) -> int:
    """The records of one file of a stream, as the stream reads them."""
    if shard.kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(shard.path).metadata.num_rows
    if shard.kind == "arrow":
        return sum(1 for _ in read_raw(shard, 0, 0))
    from pathlib import Path

    from dplaunch.data.formats import open_binary

    with open_binary(Path(shard.path)) as handle:
        if shard.kind == "text":
            return sum(1 for _ in handle)
        return sum(1 for line in handle if line.strip())


def steps_per_pass(
    shards: list[Shard], counts: list[int], global_batch_size: int, samples_per_record: float
) -> int:
    """Steps one pass over the files makes: the group whose lanes run out first decides."""
    groups = lane_groups(len(shards), global_batch_size)
    lanes = global_batch_size // groups
    per_group = [
        sum(counts[number] for number in range(len(shards)) if number % groups == group)
        for group in range(groups)
    ]
    return min(math.floor(records // lanes * samples_per_record) for records in per_group)


def stream_length(config: Any, task: str, packing: bool) -> tuple[int, str]:
    """(steps a pass, the plan's note) of config's stream; TASK is the data's (sft on plain
    texts is causal-lm), PACKING whether several records make one sample or one several."""
    from dplaunch.data.streams import stream_shards

    data = config.data
    shards = stream_shards(data)
    if any(shard.kind == "hub" for shard in shards):
        raise UserError(
            FIELD,
            f"counts the records of local files, and {data.dataset} is a hub dataset",
            "set train.max_steps instead",
        )
    counts = [count_records(shard) for shard in shards]
    ratio, how = 1.0, "one sample a record"
    if packing:
        ratio = _samples_per_record(config, task, shards)
        how = f"about {ratio:.3g} packed samples a record, from the first records' tokens"
    steps = steps_per_pass(shards, counts, config.train.global_batch_size, ratio)
    if steps < 1:
        raise UserError(
            FIELD,
            f"{sum(counts):,} records in {len(shards)} file(s) make no whole step of global "
            f"batch {config.train.global_batch_size}",
            "give more data or a smaller global batch",
        )
    note = (
        f"data.count_stream: {sum(counts):,} records in {len(shards)} file(s), {steps:,} steps a "
        f"pass ({how})"
    )
    return steps, note


def _samples_per_record(config: Any, task: str, shards: list[Shard]) -> float:
    """Packed samples per record, from the tokens of each file's first records."""
    from dplaunch.data.sft_checks import launch_tokenizer
    from dplaunch.data.sft_examples import SftExamples

    data = config.data
    tokenizer = launch_tokenizer(config)
    if tokenizer.encode is None:
        raise UserError(
            FIELD,
            f"cannot count the tokens of packed data without the tokenizer's tokenizer.json "
            f"({tokenizer.name})",
            "set train.max_steps instead",
        )
    records = []
    for shard in shards:
        for number, (raw, _) in enumerate(read_raw(shard, 0, 0)):
            if number == SAMPLED_RECORDS:
                break
            records.append(parse_raw(shard, raw, number))
    if not task_of(task).own_labels:  # each text and its end-of-sequence token, cut into blocks
        texts = [str(record.get(data.text_column, "")) for record in records]
        tokens = sum(len(ids) + 1 for ids, _ in tokenizer.encode(texts))
        return tokens / len(records) / data.max_length
    pipeline = SftExamples.of(data, list(records[0]), tokenizer)
    encoded = pipeline.tokens([pipeline.example(record) for record in records])
    blocks = pack_lengths([len(ids) for ids in encoded.input_ids], data.max_length)
    return len(blocks) / len(records)


def evaluation_samples(config: Any) -> int | None:
    """The samples one evaluation of CONFIG's run goes through (each of data.eval_datasets'
    together), counted as count_stream counts a stream: the records of local files, a causal-lm
    set's packed blocks estimated from its first records' tokens (sft's evaluation sets are
    never packed). 0 without evaluation; None when a set cannot be counted before launch (a hub
    split, a hub dataset)."""
    from dplaunch.data.mixture import evaluation_data, source_data

    data = config.data
    sets: list[tuple[Any, float]] = []  # (the data section a set is read with, its share)
    if data.eval_split is not None:
        return None
    if data.eval_dataset is not None:
        sets.append((data.model_copy(update={"dataset": data.eval_dataset}), 1.0))
    if data.eval_fraction is not None:
        sources = [source_data(data, s) for s in data.mixture] if data.mixture else [data]
        sets += [(source, data.eval_fraction) for source in sources]
    sets += [(evaluation_data(data, source), 1.0) for source in (data.eval_datasets or {}).values()]
    total = 0.0
    for source, share in sets:
        counted = _records_and_blocks(config.model_copy(update={"data": source}))
        if counted is None:
            return None
        total += counted * share
    return round(total)


def _records_and_blocks(config: Any) -> float | None:
    """The samples of CONFIG's one dataset read whole: its records, or its packed blocks."""
    from dplaunch.data.streams import stream_shards

    try:
        shards = stream_shards(config.data)
        if any(shard.kind == "hub" for shard in shards):
            return None
        records = sum(count_records(shard) for shard in shards)
        from dplaunch.data.sft_checks import data_task_of

        # sft's evaluation sets are never packed; its plain texts are (Task.packs_evaluation)
        task = task_of(data_task_of(config))
        if task.packs_evaluation and task.packs(config.data.packing) and records:
            return records * _samples_per_record(config, task.name, shards)
    except (UserError, OSError):
        return None
    return float(records)
