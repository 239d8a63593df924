"""data.mixture with data.streaming: each source a stream of its own (its lanes, groups and
windows: dplaunch/data/streams.py), and lane j of the mixture takes, at each step, the next
sample of lane j of the source the schedule names (dplaunch/data/mixture.py). A source's lane
moves only when it is drawn, and a source that runs out starts its next pass, as a single stream
does. The position a checkpoint keeps is every source's lanes and groups; any rank count resumes
it, as a single stream's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dplaunch.config.schema import DataConfig
from dplaunch.data.mixture import MixtureSchedule, source_data, source_name
from dplaunch.train.streaming import LaneWorker, StreamLanes, StreamLayout


@dataclass(frozen=True)
class MixtureLayout:
    """What the batcher asks of a stream's layout, for a mixture of streams (one kind of
    sample: the launch check refuses sources of another)."""

    sources: tuple[StreamLayout, ...]
    names: tuple[str, ...]
    weights: tuple[float, ...]

    @property
    def kind(self) -> str:
        return self.sources[0].kind

    @property
    def task(self) -> str:
        return self.sources[0].task

    @property
    def lanes(self) -> int:
        return self.sources[0].lanes

    def describe(self) -> str:
        total = sum(self.weights)
        return "a mixture of streams: " + "; ".join(
            f"{name} {weight / total:.0%} ({layout.describe()})"
            for name, weight, layout in zip(self.names, self.weights, self.sources, strict=True)
        )


class MixedLanes(StreamLanes):
    """A mixture's lanes: every source's StreamLanes and the schedule that deals their steps."""

    def __init__(self, data: DataConfig, task: str, tokenizer: Any, lanes: int, seed: int):
        assert data.mixture is not None
        self.task = task
        self.parts = [
            StreamLanes(source_data(data, source), task, tokenizer, lanes, seed)
            for source in data.mixture
        ]
        weights = tuple(source.weight for source in data.mixture)
        self.schedule = MixtureSchedule(weights, lanes, seed)
        self.layout = MixtureLayout(  # type: ignore[assignment]
            tuple(part.layout for part in self.parts),
            tuple(source_name(source) for source in data.mixture),
            weights,
        )

    def worker(self, lanes: list[int], state: dict[str, Any]) -> MixedWorker:  # type: ignore[override]
        sources = state.get("sources") or [{} for _ in self.parts]
        workers = [part.worker(lanes, own) for part, own in zip(self.parts, sources, strict=True)]
        return MixedWorker(self.schedule, workers)

    def merged(self, positions: list[dict]) -> dict[str, Any]:
        steps = {position["step"] for position in positions}
        states = [
            part.merged([{"step": p["step"], **p["sources"][index]} for p in positions])
            for index, part in enumerate(self.parts)
        ]
        return {"step": steps.pop() if len(steps) == 1 else -1, "sources": states}

    def joined(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "sources": [
                part.joined([state["sources"][index] for state in states])
                for index, part in enumerate(self.parts)
            ]
        }

    def at_start(self, state: dict[str, Any], lanes: list[int]) -> dict[str, Any]:
        sources = state.get("sources") or [{} for _ in self.parts]
        return {
            "sources": [
                part.at_start(own, lanes) for part, own in zip(self.parts, sources, strict=True)
            ]
        }


class MixedWorker:
    """One data loader worker of a mixture: for each of its lanes, each source's lane."""

    def __init__(self, schedule: MixtureSchedule, workers: list[LaneWorker]):
        self.schedule, self.workers = schedule, workers

    def state(self) -> dict[str, Any]:
        return {"sources": [worker.state() for worker in self.workers]}

    def steps(self, first_step: int) -> Iterator[dict[str, Any]]:
        """Each step's samples of these lanes (each from its source's lane), with the state
        after it."""
        pullers = [[worker.puller(lane) for lane in worker.lanes] for worker in self.workers]
        step = first_step
        while True:
            chosen, _ = self.schedule.step_sources(step)
            samples = {}
            for place, lane in enumerate(self.workers[0].lanes):
                source = int(chosen[lane.index])
                own = self.workers[source].lanes[place]
                samples[own.index] = own.next_sample(pullers[source][place])
            yield {"step": step, "samples": samples, "state": self.state()}
            step += 1


def stream_lanes(data: DataConfig, task: str, tokenizer: Any, lanes: int, seed: int) -> StreamLanes:
    """The lanes of DATA's stream (train/streaming.py), or of its mixture's streams dealt by
    weight (MixedLanes)."""
    if data.mixture is None:
        return StreamLanes(data, task, tokenizer, lanes, seed)
    return MixedLanes(data, task, tokenizer, lanes, seed)
