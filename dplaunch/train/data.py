"""Data: load with `datasets`, tokenise (pack for causal LM), and cut deterministic batches.

Batch order does not depend on the GPU count: each epoch is a seeded permutation, each optimizer
step takes the next `global_batch_size` samples, and micro-batch j of a step is always the same
samples. A data-parallel rank takes its own contiguous run of micro-batches; tensor-parallel
ranks of one group take the same ones. So a 2-rank run computes exactly the micro-batches a
1-rank run does, and a resumed run continues with exactly the next batch.

Speed: packed causal-LM blocks are stored as one int32 column of equal-length rows, and a
micro-batch is one gather from a zero-copy [samples, length] view of that Arrow column (no Python
int per token), so cutting batches costs microseconds next to a training step.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import socket
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dplaunch.config.schema import DataConfig
from dplaunch.planning.arrow_datasets import saved_folder
from dplaunch.planning.data_check import class_number, is_local, label_ids, local_format

IGNORE_INDEX = -100


def load_splits(data: DataConfig, seed: int) -> tuple[Any, Any | None]:
    """(train, eval or None) as `datasets.Dataset`s."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    def load(source: str | list[str], split: str) -> Any:
        folder = saved_folder(source)
        if folder is not None:  # written by save_to_disk: a Dataset, or a DatasetDict's split
            saved = load_from_disk(str(folder))
            return saved[split] if isinstance(saved, DatasetDict) else saved
        if is_local(source):
            files = source if isinstance(source, list) else [source]
            files = [str(Path(item).expanduser()) for item in files]
            return load_dataset(
                local_format(files, "data.dataset"), data_files=files, split="train"
            )
        return load_dataset(source, data.dataset_config, split=split)

    train = load(data.dataset, data.split)
    evaluation = None
    if data.eval_dataset is not None:
        evaluation = load(data.eval_dataset, "train")
    elif data.eval_split is not None:
        evaluation = load(data.dataset, data.eval_split)
    elif data.eval_fraction is not None:
        parts = train.train_test_split(test_size=data.eval_fraction, seed=seed, shuffle=True)
        train, evaluation = parts["train"], parts["test"]
    return train, evaluation


# tokenised datasets are cached next to the `datasets` cache of their source, under this prefix
TOKENIZED_PREFIX = "dplaunch-tokenized-"


def tokenized_cache_file(dataset: Any, tokenizer: Any, data: DataConfig, task: str) -> Path | None:
    """Where the tokenised form of DATASET is cached, or None when it cannot be cached safely.

    The name is a digest of everything the tokens depend on: the source dataset's `datasets`
    fingerprint (changes with the files' contents, the split, the eval_fraction cut), the
    tokenizer's full definition, the data fields that shape the tokens, the task and the source of
    tokenize() itself, so a change to any of them is a new file, never a stale one. No cache for
    datasets held only in memory, tokenizers without a serialisable definition (slow, Python
    ones), when `datasets` caching is off, or when the cache folder is not writable.
    """
    import datasets

    fingerprint = getattr(dataset, "_fingerprint", None)
    files = getattr(dataset, "cache_files", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not (datasets.is_caching_enabled() and fingerprint and files and backend is not None):
        return None
    folder = Path(files[0]["filename"]).parent
    if not os.access(folder, os.W_OK):
        return None
    definition = json.loads(backend.to_str())
    # transformers sets these per call (truncation=True, max_length…): not part of the tokenizer
    definition.pop("truncation", None)
    definition.pop("padding", None)
    key = {
        "dataset": fingerprint,
        "tokenizer": definition,
        "tokenizer_class": type(tokenizer).__name__,
        "eos": tokenizer.eos_token_id,
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "data": data.model_dump(
            include={
                "text_column",
                "text_pair_column",
                "label_column",
                "label_names",
                "max_length",
                "packing",
            }
        ),
        "task": task,
        "code": _tokenize_source(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{TOKENIZED_PREFIX}{digest}.arrow"


def _tokenize_source() -> str:
    # the code that makes the tokens and labels; an install without sources falls back to the
    # version
    try:
        return inspect.getsource(tokenize) + inspect.getsource(class_number)
    except OSError:
        from dplaunch import __version__

        return __version__


def tokenize(
    dataset: Any, tokenizer: Any, data: DataConfig, task: str, cache_file: Path | None = None
) -> Any:
    """Token ids (and labels) ready for batching; causal-LM texts are packed into full blocks.

    Two passes. Rows are tokenised one by one, in `data.num_workers` processes when set; then one
    process assembles the result (packing cuts each run of 10,000 rows into blocks), so the tokens
    do not depend on the worker count. With CACHE_FILE (see tokenized_cache_file) the result is
    read from it when it exists, else written there (the row pass goes to a temporary file beside
    it, removed afterwards); without, everything stays in memory."""
    from datasets import Dataset

    if cache_file is not None and cache_file.is_file():
        return Dataset.from_file(str(cache_file))
    workers = data.num_workers if data.num_workers > 1 else None
    packing = task == "causal-lm" and (data.packing if data.packing is not None else True)
    eos = tokenizer.eos_token_id
    ids = label_ids(data.label_names)

    def label(value: Any) -> int:
        number = class_number(value, ids)
        if number is None:  # past the launch check's budget (DPLAUNCH_DATA_CHECK_MB)
            named = " nor one of data.label_names" if ids else ""
            raise ValueError(
                f"{value!r} in column {data.label_column!r} is not a class number{named}"
            )
        return number

    def encode(batch: dict[str, list]) -> dict[str, list]:
        if task == "sequence-classification":
            pair = batch[data.text_pair_column] if data.text_pair_column else None
            out = tokenizer(
                batch[data.text_column], pair, truncation=True, max_length=data.max_length
            )
            return {
                "input_ids": out["input_ids"],
                "labels": [label(x) for x in batch[data.label_column]],
            }
        ids = tokenizer(batch[data.text_column], add_special_tokens=False)["input_ids"]
        ids = [row + [eos] if eos is not None else row for row in ids]
        return {"input_ids": ids if packing else [row[: data.max_length] for row in ids]}

    def pack(batch: Any) -> dict[str, Any]:
        # one flat int32 array of the rows' tokens cut into full blocks (no Python int per token)
        column = batch.column("input_ids").combine_chunks()
        offsets = column.offsets.to_numpy()
        flat = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        usable = (len(flat) // data.max_length) * data.max_length
        return {"input_ids": flat[:usable].astype(np.int32).reshape(-1, data.max_length)}

    def store(name: Path | None) -> dict[str, Any]:
        if name is None:
            return {"keep_in_memory": True}
        return {
            "keep_in_memory": False,
            "cache_file_name": str(name),
            "load_from_cache_file": False,
            "new_fingerprint": hashlib.sha256(str(name).encode()).hexdigest()[:32],
        }

    # the row pass's file is this process's own: ranks of several nodes may share the folder
    rows_file = (
        cache_file.with_name(f"{cache_file.stem}-rows-{socket.gethostname()}-{os.getpid()}.arrow")
        if cache_file is not None
        else None
    )
    rows = dataset.map(
        encode,
        batched=True,
        remove_columns=dataset.column_names,
        num_proc=workers,
        desc="tokenising",
        **store(rows_file),
    )
    try:
        if packing:
            # packing concatenates across rows: 10,000-row runs lose little at block edges
            assembled = rows.with_format("arrow").map(
                pack, batched=True, batch_size=10_000, desc="packing", **store(cache_file)
            )
        else:
            assembled = rows.map(batched=True, desc="storing", **store(cache_file))
        return assembled.with_format(None)
    finally:
        if rows_file is not None:
            # only the row pass's own files (one per worker): an empty map hands back its source's
            for entry in rows.cache_files:
                path = Path(entry["filename"])
                if path.name.startswith(rows_file.stem):
                    path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Sharding:
    """This rank's place in the data: which data-parallel shard it reads."""

    data_parallel_rank: int
    data_parallel_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size


class Batcher:
    """Deterministic batches for training and evaluation on one rank."""

    def __init__(self, dataset: Any, sharding: Sharding, *, pad_id: int, task: str, seed: int):
        self.dataset = dataset
        self.sharding = sharding
        self.pad_id = pad_id
        self.task = task
        self.seed = seed
        self.steps_per_epoch = len(dataset) // sharding.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of an epoch: a permutation seeded by (seed, epoch), as one int64
        array (8 bytes a sample; a list of Python ints would take about 36)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=generator).numpy()

    def step_micro_batches(
        self, order: np.ndarray, step_in_epoch: int
    ) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for one optimizer step."""
        shard = self.sharding
        start = step_in_epoch * shard.global_batch_size
        per_rank = shard.micro_batch_size * shard.gradient_accumulation_steps
        mine = order[
            start + shard.data_parallel_rank * per_rank : start
            + (shard.data_parallel_rank + 1) * per_rank
        ].tolist()
        batches = [
            self.collate(mine[i : i + shard.micro_batch_size])
            for i in range(0, per_rank, shard.micro_batch_size)
        ]
        if self.task != "sequence-classification" and self._packed_blocks is None:
            step = order[start : start + shard.global_batch_size]
            self._weight_by_tokens(batches, mine, step)
        return batches

    def _weight_by_tokens(
        self, batches: list[dict[str, torch.Tensor]], mine: list[int], step: np.ndarray
    ) -> None:
        """Give each micro-batch of rows of unequal length its loss_scale: n·accum·dp / N, with n
        its predicted tokens and N those of the whole step over every data-parallel rank.

        An HF causal-LM loss is a mean over its micro-batch's tokens. Scaled so, the backward's
        ÷accum (Accelerate, DeepSpeed) and the gradient average over dp ranks leave the mean over
        every token of the global batch, as one big batch would give: the same gradient on any
        rank count and micro-batch size (HF Trainer's num_items_in_batch). Equal-length rows
        (packed blocks) need none: every micro-batch then holds the same number of tokens."""
        tokens = self._predicted_tokens
        shard = self.sharding
        total = max(int(tokens[step].sum()), 1)
        copies = shard.gradient_accumulation_steps * shard.data_parallel_size
        for i, batch in enumerate(batches):
            rows = mine[i * shard.micro_batch_size : (i + 1) * shard.micro_batch_size]
            # integer numerator: exactly 1.0 when every micro-batch holds as many tokens
            share = int(tokens[rows].sum()) * copies / total
            batch["loss_scale"] = torch.tensor(share, dtype=torch.float32)

    @cached_property
    def _predicted_tokens(self) -> np.ndarray:
        """Tokens each sample's loss averages over (its length less the first, which nothing
        predicts), in dataset order."""
        import pyarrow.compute as pc

        column = self.dataset.with_format("arrow")["input_ids"]  # in select()/shuffle order too
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        return np.maximum(lengths - 1, 0)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Right-pad a micro-batch; causal-LM labels are the inputs with padding ignored."""
        blocks = self._packed_blocks
        if blocks is not None:
            # equal-length rows: one gather, no padding
            input_ids = torch.from_numpy(blocks[indices].astype(np.int64))
            attention = torch.ones_like(input_ids)
            rows = None
        else:
            rows = [self.dataset[i] for i in indices]
            width = max(len(row["input_ids"]) for row in rows)
            input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            attention = torch.zeros((len(rows), width), dtype=torch.long)
            for r, row in enumerate(rows):
                ids = torch.tensor(row["input_ids"], dtype=torch.long)
                input_ids[r, : len(ids)] = ids
                attention[r, : len(ids)] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention}
        if self.task == "sequence-classification":
            assert rows is not None
            batch["labels"] = torch.tensor([row["labels"] for row in rows], dtype=torch.long)
        else:
            batch["labels"] = input_ids.masked_fill(attention == 0, IGNORE_INDEX)
        return batch

    @cached_property
    def _packed_blocks(self) -> np.ndarray | None:
        """The causal-LM blocks as a zero-copy [samples, length] view, when every row has the same
        length and the dataset is a plain in-order Arrow table; None otherwise (rows one by one).
        Built on first use: computing the epoch order needs none of it."""
        dataset = self.dataset
        if (
            self.task == "sequence-classification"
            or not hasattr(dataset, "data")
            or getattr(dataset, "_indices", None) is not None  # a select/shuffle mapping
            or len(dataset) == 0
        ):
            return None
        column = dataset.data.column("input_ids").combine_chunks()
        offsets = column.offsets.to_numpy()
        width = int(offsets[1] - offsets[0])
        if width == 0 or column.null_count or not np.all(np.diff(offsets) == width):
            return None
        values = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        return values.reshape(len(dataset), width)

    def eval_micro_batches(self, batch_size: int) -> list[tuple[dict[str, torch.Tensor], int]]:
        """This rank's evaluation batches as (batch, real rows). Every rank gets the same number of
        batches (short shards repeat a sample with weight 0), since ZeRO-3 forwards are collective."""
        shard = self.sharding
        total = len(self.dataset)
        mine = list(range(shard.data_parallel_rank, total, shard.data_parallel_size))
        longest = -(-total // shard.data_parallel_size)
        batches = []
        for start in range(0, longest, batch_size):
            chunk = mine[start : start + batch_size]
            real = len(chunk)
            wanted = min(batch_size, longest - start)
            chunk = chunk + [0] * (wanted - real)
            batches.append((self.collate(chunk), real))
        return batches
