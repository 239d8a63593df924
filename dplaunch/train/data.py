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

from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dplaunch.config.schema import DataConfig
from dplaunch.planning.data_check import is_local, local_format

IGNORE_INDEX = -100


def load_splits(data: DataConfig, seed: int) -> tuple[Any, Any | None]:
    """(train, eval or None) as `datasets.Dataset`s."""
    from datasets import load_dataset

    def load(source: str | list[str], split: str) -> Any:
        if is_local(source):
            files = source if isinstance(source, list) else [source]
            files = [str(Path(item).expanduser()) for item in files]
            return load_dataset(
                local_format(files, "data.dataset"), data_files=files, split="train"
            )
        return load_dataset(source, split=split)

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


def tokenize(dataset: Any, tokenizer: Any, data: DataConfig, task: str) -> Any:
    """Token ids (and labels) ready for batching; causal-LM texts are packed into full blocks."""
    columns = dataset.column_names
    if task == "sequence-classification":

        def encode(batch: dict[str, list]) -> dict[str, list]:
            pair = batch[data.text_pair_column] if data.text_pair_column else None
            out = tokenizer(
                batch[data.text_column], pair, truncation=True, max_length=data.max_length
            )
            return {
                "input_ids": out["input_ids"],
                "labels": [int(x) for x in batch[data.label_column]],
            }

        return dataset.map(encode, batched=True, remove_columns=columns, keep_in_memory=True)

    packing = data.packing if data.packing is not None else True
    eos = tokenizer.eos_token_id

    def encode_lm(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer(batch[data.text_column], add_special_tokens=False)["input_ids"]
        ids = [row + [eos] if eos is not None else row for row in ids]
        if not packing:
            return {"input_ids": [row[: data.max_length] for row in ids]}
        # one flat int32 array cut into full blocks: Arrow takes it without a Python int per token
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=sum(map(len, ids)))
        usable = (len(flat) // data.max_length) * data.max_length
        return {"input_ids": flat[:usable].reshape(-1, data.max_length)}

    # packing concatenates across rows, so use large map batches to lose little at block edges
    return dataset.map(
        encode_lm, batched=True, batch_size=10_000, remove_columns=columns, keep_in_memory=True
    )


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

    def epoch_order(self, epoch: int) -> list[int]:
        """The sample order of an epoch: a permutation seeded by (seed, epoch)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def step_micro_batches(
        self, order: list[int], step_in_epoch: int
    ) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for one optimizer step."""
        shard = self.sharding
        start = step_in_epoch * shard.global_batch_size
        per_rank = shard.micro_batch_size * shard.gradient_accumulation_steps
        mine = order[
            start + shard.data_parallel_rank * per_rank : start
            + (shard.data_parallel_rank + 1) * per_rank
        ]
        return [
            self.collate(mine[i : i + shard.micro_batch_size])
            for i in range(0, per_rank, shard.micro_batch_size)
        ]

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
