"""The ranks' side of data.mixture and data.eval_datasets (cached data): every source loaded and
tokenised with its own keys, the training sources laid end to end, and the batcher whose steps
take the rows dplaunch/data/mixture.py's schedule names. A stream's mixture is
dplaunch/train/mixture_stream.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dplaunch.config.schema import DataConfig, DataSource
from dplaunch.data.mixture import (
    MixtureOrder,
    MixtureSchedule,
    evaluation_data,
    source_data,
    source_name,
)
from dplaunch.tasks import task_of
from dplaunch.train.data import Batcher, Sharding, for_evaluation

# (data section) → (training split or None when streamed, evaluation split or None), read as the
# ranks read a run's data (data.load_splits)
Loader = Callable[[DataConfig], tuple[Any | None, Any | None]]
# (a split, the data section it is tokenised with, what it is for the log) → its samples
Tokenizer = Callable[[Any, DataConfig, str], Any]


@dataclass
class RunData:
    """A run's tokenised data: the training samples (a mixture's sources end to end; None when
    streamed), each source's count, and each evaluation set by its metrics' prefix."""

    train: Any | None
    sizes: list[int] | None = None
    evaluation: dict[str, Any] = field(default_factory=dict)


def load_run_data(data: DataConfig, task: str, load: Loader, tokenized: Tokenizer) -> RunData:
    """The training and evaluation data of the run, one source at a time."""
    if data.mixture is None:
        train_raw, eval_raw = load(data)
        train = tokenized(train_raw, data, "training") if train_raw is not None else None
        run = RunData(train)
        if eval_raw is not None:
            run.evaluation["eval"] = tokenized(eval_raw, for_evaluation(data, task), "evaluation")
    else:
        parts, held = [], []
        for index, source in enumerate(data.mixture):
            sourced = source_data(data, source)
            train_raw, eval_raw = load(sourced)
            what = f"source {index} ({source_name(source)})"
            if train_raw is not None:
                parts.append(tokenized(train_raw, sourced, f"training {what}"))
            if eval_raw is not None:
                held.append(
                    tokenized(eval_raw, for_evaluation(sourced, task), f"evaluation {what}")
                )
        run = RunData(joined(parts) if parts else None, [len(part) for part in parts] or None)
        if held:
            run.evaluation["eval"] = joined(held)
        if data.eval_dataset is not None:
            run.evaluation["eval"] = _evaluation_set(
                data, DataSource(dataset=data.eval_dataset), task, load, tokenized, "evaluation"
            )
    for name, source in (data.eval_datasets or {}).items():
        run.evaluation[f"eval_{name}"] = _evaluation_set(
            data, source, task, load, tokenized, f"evaluation set {name}"
        )
    return run


def _evaluation_set(
    data: DataConfig, source: DataSource, task: str, load: Loader, tokenized: Tokenizer, what: str
) -> Any:
    """SOURCE's whole split, tokenised as an evaluation set is."""
    sourced = evaluation_data(data, source)
    raw, _ = load(sourced)
    return tokenized(raw, for_evaluation(sourced, task), what)


def joined(parts: list[Any]) -> Any:
    """Tokenised sources end to end, in the first one's column types; a ValueError when they
    hold different kinds of sample (a source of plain texts beside conversations, under sft)."""
    from datasets import concatenate_datasets

    first = parts[0]
    for index, part in enumerate(parts[1:], 1):
        if sorted(part.column_names) != sorted(first.column_names):
            raise ValueError(
                f"the mixture's source {index} tokenises into {sorted(part.column_names)}, "
                f"source 0 into {sorted(first.column_names)}: a mixture's sources must be one "
                "kind of sample (all plain texts, or all examples)"
            )
    same = [
        part if part.features == first.features else part.cast(first.features) for part in parts
    ]
    return concatenate_datasets(same) if len(same) > 1 else first


class MixtureBatcher(Batcher):
    """The batcher of a mixture: step t's row j is lane j's sample of the schedule (data/mixture.py),
    the same on any rank count and after any resume; the rest is the Batcher's."""

    def __init__(
        self,
        dataset: Any,
        sharding: Sharding,
        sizes: list[int],
        weights: list[float],
        *,
        pad_id: int,
        task: str,
        seed: int,
        shuffle: bool = True,
    ):
        super().__init__(dataset, sharding, pad_id=pad_id, task=task, seed=seed, shuffle=shuffle)
        schedule = MixtureSchedule(tuple(weights), sharding.global_batch_size, seed)
        self.order = MixtureOrder(schedule, sizes, seed=seed, shuffle=shuffle)

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the optimizer step after STEP steps (any step)."""
        return self.step_micro_batches(self.order.step_rows(step), 0)


def training_batcher(
    run_data: RunData,
    data: DataConfig,
    sharding: Sharding,
    *,
    pad_id: int,
    task: str,
    seed: int,
    settings: Any = None,
) -> Batcher:
    """This rank's batcher of the run's cached training data (a mixture's, or one dataset's)."""
    assert run_data.train is not None
    if task_of(task).prompts:  # grpo: each step's prompts, whose completions the ranks sample
        from dplaunch.train.grpo import PromptBatcher

        assert settings is not None
        return PromptBatcher(
            run_data.train, sharding, settings=settings, pad_id=pad_id, task=task, seed=seed,
            shuffle=data.shuffle,
        )  # fmt: skip
    if data.mixture is None:
        return Batcher(
            run_data.train, sharding, pad_id=pad_id, task=task, seed=seed, shuffle=data.shuffle
        )
    assert run_data.sizes is not None
    return MixtureBatcher(
        run_data.train,
        sharding,
        run_data.sizes,
        [source.weight for source in data.mixture],
        pad_id=pad_id,
        task=task,
        seed=seed,
        shuffle=data.shuffle,
    )
