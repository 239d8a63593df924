"""data.mixture: several datasets trained together by weight. Torch-free: the launch checks, the
ranks (cached and streamed) and `dplaunch data` all read the schedule here.

The rule. Row j of every global batch (G rows) is *lane* j, as for a stream (data/streams.py).
Lane j's step t comes from a source chosen by a seeded weighted interleave: with the sources'
shares w_1 … w_k (weight ÷ the weights' sum), the step is source 1 when
⌊(t+1)·w_1 + φ⌋ > ⌊t·w_1 + φ⌋; otherwise it is the next of the lane's remaining steps, which
the same rule deals among sources 2 … k with their shares renormalised (w_2 / (1 − w_1), …), the
last taking what is left. Each level's phase φ is frac(u + j·γ), u drawn from train.seed and γ
the golden ratio's fraction, so the lanes are out of step and every global batch holds about
w_s·G rows of source s. After t steps a lane has drawn source s ⌊t·w_s + φ⌋ times (within one
of t·w_s at the first level, within two below it), so over a run each source's share of the
trained samples is its weight; the rule depends on (seed, weights, G) alone, never on the rank
count or on where a run resumed.

Which sample. The k-th draw of source s on lane j is the source's sample m = k·G + j; with n_s
samples, m is the sample at m mod n_s of the source's epoch ⌊m / n_s⌋ order (a permutation
seeded by (seed, s, epoch) with data.shuffle, its own order without). A source that runs out
repeats: its epochs are counted on their own. A stream's lane j takes its source's lane j's
next sample, which for one file without shuffling is record m too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dplaunch.config.schema import SOURCE_KEYS, DataConfig, DataSource

# the lanes' phases step by the golden ratio's fraction: as evenly spread as any count of lanes
GOLDEN = (math.sqrt(5) - 1) / 2


def source_data(data: DataConfig, source: DataSource) -> DataConfig:
    """The data section SOURCE is read with: data's keys, its own where it sets them; one dataset,
    no mixture and no evaluation keys but data.eval_fraction (its share held out)."""
    update: dict[str, Any] = {
        "dataset": source.dataset,
        "mixture": None,
        "eval_split": None,
        "eval_dataset": None,
        "eval_datasets": None,
    }
    update.update(
        {key: getattr(source, key) for key in SOURCE_KEYS if getattr(source, key) is not None}
    )
    return data.model_copy(update=update)


def evaluation_data(data: DataConfig, source: DataSource) -> DataConfig:
    """The data section an evaluation set of data.eval_datasets is read with (as a training set:
    its whole split)."""
    return source_data(data, source).model_copy(update={"eval_fraction": None, "streaming": False})


def source_name(source: DataSource) -> str:
    """A source as the log and the report name it: its dataset."""
    dataset = source.dataset
    return ", ".join(dataset) if isinstance(dataset, list) else str(dataset)


def shares(weights: list[float]) -> list[float]:
    """Each weight ÷ the weights' sum."""
    total = float(sum(weights))
    return [float(weight) / total for weight in weights]


@dataclass(frozen=True)
class MixtureSchedule:
    """Which source each lane's step comes from, and how many draws of each it made before
    (the module's rule)."""

    weights: tuple[float, ...]
    lanes: int
    seed: int
    # per level (every source but the last): its share among the sources from it on
    _levels: tuple[float, ...] = field(init=False)
    # per level and lane: its phase
    _phases: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = shares(list(self.weights))
        levels, left = [], 1.0
        for share in parts[:-1]:
            levels.append(min(share / left, 1.0) if left > 0 else 0.0)
            left -= share
        offsets = np.random.default_rng([self.seed, 7]).random(max(len(levels), 1))
        lanes = np.arange(self.lanes, dtype=np.float64)
        phases = np.stack([np.modf(offset + lanes * GOLDEN)[0] for offset in offsets])
        object.__setattr__(self, "_levels", tuple(levels))
        object.__setattr__(self, "_phases", phases)

    @property
    def sources(self) -> int:
        return len(self.weights)

    def draws_before(self, step: int | np.ndarray) -> np.ndarray:
        """[sources, lanes]: each lane's draws of each source in its steps before STEP (an int,
        or one per lane)."""
        left = np.broadcast_to(np.asarray(step, dtype=np.int64), (self.lanes,)).copy()
        counts = np.zeros((self.sources, self.lanes), dtype=np.int64)
        for level, share in enumerate(self._levels):
            taken = np.floor(left * share + self._phases[level]).astype(np.int64)
            counts[level] = taken
            left = left - taken
        counts[-1] = left
        return counts

    def step_sources(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(the source of each lane's STEP, how many draws of it the lane made before)."""
        before, after = self.draws_before(step), self.draws_before(step + 1)
        chosen = np.argmax(after - before, axis=0)
        lanes = np.arange(self.lanes)
        return chosen, before[chosen, lanes]

    def totals(self, steps: int) -> np.ndarray:
        """The samples each source gives in the first STEPS steps (over every lane)."""
        return self.draws_before(steps).sum(axis=1)


def sample_numbers(schedule: MixtureSchedule, steps: int, source: int) -> np.ndarray:
    """The sample numbers m (the module's rule) SOURCE gives in the first STEPS steps, in lane
    order."""
    draws = schedule.draws_before(steps)[source]
    lanes = schedule.lanes
    return np.concatenate(
        [np.arange(count, dtype=np.int64) * lanes + lane for lane, count in enumerate(draws)]
        or [np.zeros(0, np.int64)]
    )


class MixtureOrder:
    """The cached path's rows of each step: the schedule's samples, as rows of the sources'
    samples laid end to end (source s's sample i is row offsets[s] + i)."""

    def __init__(self, schedule: MixtureSchedule, sizes: list[int], *, seed: int, shuffle: bool):
        if any(size == 0 for size in sizes):
            raise ValueError(f"a mixture's source has no samples (sizes {sizes})")
        self.schedule, self.sizes = schedule, list(sizes)
        self.offsets = np.cumsum([0, *sizes])[:-1]
        self.seed, self.shuffle = seed, shuffle
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def order(self, source: int, epoch: int) -> np.ndarray:
        """SOURCE's sample order in its EPOCH (seeded by (seed, source, epoch) with shuffle)."""
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * self.schedule.sources:  # a run moves forward
                self._orders.clear()
            size = self.sizes[source]
            self._orders[key] = (
                np.random.default_rng([self.seed, source, epoch, 5]).permutation(size)
                if self.shuffle
                else np.arange(size)
            )
        return self._orders[key]

    def rows(self, source: int, numbers: np.ndarray) -> np.ndarray:
        """The rows of SOURCE's sample NUMBERS (m: epoch m // n, place m mod n)."""
        size = self.sizes[source]
        epochs, places = np.divmod(numbers, size)
        out = np.empty(len(numbers), dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self.order(source, int(epoch))[places[chosen]]
        return out + self.offsets[source]

    def step_rows(self, step: int) -> np.ndarray:
        """The G rows of STEP, row j from lane j."""
        sources, draws = self.schedule.step_sources(step)
        numbers = draws * self.schedule.lanes + np.arange(self.schedule.lanes)
        rows = np.empty(self.schedule.lanes, dtype=np.int64)
        for source in np.unique(sources):
            chosen = sources == source
            rows[chosen] = self.rows(int(source), numbers[chosen])
        return rows


def mixture_report(
    data: DataConfig,
    schedule: MixtureSchedule,
    steps: int,
    lengths: list[np.ndarray | None],
    *,
    seed: int,
) -> list[dict[str, Any]]:
    """What the first STEPS steps train of each source: its dataset, weight, samples, tokens
    (LENGTHS: each source's samples' tokens, None where unknown: a stream) and epochs."""
    assert data.mixture is not None
    known = [length for length in lengths if length is not None]
    order = (
        MixtureOrder(schedule, [len(length) for length in lengths], seed=seed, shuffle=data.shuffle)
        if len(known) == len(lengths)
        else None
    )
    report = []
    for index, source in enumerate(data.mixture):
        numbers = sample_numbers(schedule, steps, index)
        entry: dict[str, Any] = {
            "dataset": source_name(source),
            "weight": source.weight,
            "share": round(shares([s.weight for s in data.mixture])[index], 6),
            "examples": int(len(numbers)),
            "tokens": None,
        }
        length = lengths[index]
        if length is not None and order is not None:
            rows = order.rows(index, numbers) - order.offsets[index]
            entry["tokens"] = int(np.asarray(length, dtype=np.int64)[rows].sum())
            entry["epochs"] = round(len(numbers) / max(len(length), 1), 4)
        report.append(entry)
    return report
