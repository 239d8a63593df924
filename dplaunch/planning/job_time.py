"""How long a run's job takes, from its step forecast: the hours and GPU-hours `dplaunch plan`
shows and the time limit `dplaunch slurm` asks for.

A job is its steps (train.max_steps × the forecast's step), and what it does besides them:

- start-up: START_UP_S for the imports, process groups and engine (measured 10–60 s on CPU
  ranks here, minutes on a GPU node whose file system is cold), plus every node reading the
  model's weights at READ_BYTES_PER_S;
- evaluation: each evaluation (train.eval_every's, the one at step 0, the one after the last
  step) is the forward of the evaluation set, one global batch of its samples per forecast
  forward phase; a set whose size cannot be counted before launch (a hub split) is not counted,
  and the job says so;
- checkpoints: every save (train.checkpoint_every's; train.keep_best's one per evaluation)
  writes the weights and optimizer states at WRITE_BYTES_PER_S per node, and the end of the run
  writes the exported model.

The rates are assumptions stated here, not measurements of the cluster: a parallel file system
usually reads and writes faster per node. `dplaunch slurm` adds MARGIN (the forecast's stated
accuracy) and the time-limit signal's lead to the total and rounds up to whole minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dplaunch.planning.estimate import count_parameters
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.workload import Workload

# imports, process groups and the engine before the first step (the weights' read on top)
START_UP_S = 120.0
# a node's read rate of the model's files and write rate of a checkpoint's
READ_BYTES_PER_S = 1e9
WRITE_BYTES_PER_S = 1e9
# dplaunch slurm's time limit: the forecast × (1 + MARGIN); the forecast aims at ±20 %
MARGIN = 0.2


@dataclass(frozen=True)
class RunSchedule:
    """What a run does: its steps, its evaluations and checkpoints (from the run file)."""

    steps: int
    evaluations: int
    # samples of one evaluation (None: the run evaluates on a set not counted before launch)
    eval_samples: int | None
    saves: int
    nodes: int = 1

    @classmethod
    def of(
        cls, train: Any, *, evaluates: bool, eval_samples: int | None, nodes: int
    ) -> RunSchedule | None:
        """TRAIN's schedule (a TrainConfig); None when its length is unknown before launch
        (train.epochs: the ranks count an epoch's steps)."""
        steps = train.max_steps
        if steps is None:
            return None
        evaluations = 0
        if evaluates:  # one at step 0 with eval_every, one after the last step
            every = train.eval_every
            evaluations = (1 + steps // every + (steps % every != 0)) if every else 1
        saves = steps // train.checkpoint_every if train.checkpoint_every else 0
        saves += evaluations - (1 if train.eval_every else 0) if train.keep_best else 0
        return cls(steps, evaluations, eval_samples if evaluates else 0, saves, nodes)


@dataclass(frozen=True)
class JobTime:
    """A job's seconds, part by part."""

    steps: int
    start_up_s: float
    steps_s: float
    evaluation_s: float
    checkpoint_s: float
    # the evaluations' samples are unknown here: evaluation_s counts none of them
    evaluation_uncounted: bool = False

    @property
    def total_s(self) -> float:
        return self.start_up_s + self.steps_s + self.evaluation_s + self.checkpoint_s

    @property
    def hours(self) -> float:
        return self.total_s / 3600

    def words(self) -> str:
        """The parts, for the job's lines."""
        evaluation = (
            "evaluation not counted (its set's size is unknown before launch)"
            if self.evaluation_uncounted
            else f"evaluation {_minutes(self.evaluation_s)}"
        )
        return (
            f"{self.steps:,} steps {_minutes(self.steps_s)}, start-up {_minutes(self.start_up_s)}, "
            f"{evaluation}, checkpoints and export {_minutes(self.checkpoint_s)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "start_up_s": round(self.start_up_s, 3),
            "steps_s": round(self.steps_s, 3),
            "evaluation_s": None if self.evaluation_uncounted else round(self.evaluation_s, 3),
            "checkpoint_s": round(self.checkpoint_s, 3),
            "total_s": round(self.total_s, 3),
        }


@dataclass(frozen=True)
class JobSetting:
    """What a job's time needs besides a layout's forecast: its schedule and the bytes it reads
    and writes (the same on every layout of the run)."""

    schedule: RunSchedule
    global_batch_size: int
    # the weights as the export writes them (and each node reads at start-up); one checkpoint
    weights_bytes: float
    checkpoint_bytes: float

    @classmethod
    def of(cls, schedule: RunSchedule, facts: ModelFacts, workload: Workload) -> JobSetting:
        weights, states = checkpoint_bytes(facts, workload)
        return cls(schedule, workload.global_batch_size or 1, weights, states)

    def time(self, forecast: Any) -> JobTime:
        """The seconds of this job on the layout FORECAST (a planning.forecast.Forecast) is for."""
        schedule = self.schedule
        nodes = max(schedule.nodes, 1)
        start_up = START_UP_S + self.weights_bytes / READ_BYTES_PER_S
        forward = sum(forecast.phases.get("forward", {}).values())
        batches = math.ceil((schedule.eval_samples or 0) / self.global_batch_size)
        saves = schedule.saves * self.checkpoint_bytes
        return JobTime(
            steps=schedule.steps,
            start_up_s=start_up,
            steps_s=schedule.steps * forecast.step_time_s,
            evaluation_s=schedule.evaluations * batches * forward,
            # rank 0 writes the exported model at the end
            checkpoint_s=saves / (nodes * WRITE_BYTES_PER_S)
            + self.weights_bytes / WRITE_BYTES_PER_S,
            evaluation_uncounted=schedule.evaluations > 0 and schedule.eval_samples is None,
        )


def checkpoint_bytes(facts: ModelFacts, workload: Workload) -> tuple[float, float]:
    """(the model's weights as the export writes them, one checkpoint): a checkpoint holds every
    trained parameter (a LoRA run's adapters alone), its fp32 AdamW moments and, under mixed
    precision, its fp32 master copy."""
    params = count_parameters(facts, workload.task, workload.num_labels).total
    element = 2 if workload.mixed_precision in ("bf16", "fp16") else 4
    trained = params
    if workload.lora is not None:
        from dplaunch.planning.lora import count_lora

        trained = count_lora(facts, workload.lora, workload.task, workload.num_labels).trainable
    master = 4 * trained if element == 2 else 0
    return float(params * element), float(trained * (element + 8) + master)


def run_schedule(config: Any, nodes: int) -> RunSchedule | None:
    """CONFIG's steps, evaluations (their samples counted in the files) and checkpoints (None:
    train.max_steps unset)."""
    from dplaunch.config.schema import evaluation_prefixes
    from dplaunch.data.stream_length import evaluation_samples

    evaluates = bool(evaluation_prefixes(config.data))
    samples = evaluation_samples(config) if evaluates else 0
    return RunSchedule.of(config.train, evaluates=evaluates, eval_samples=samples, nodes=nodes)


def time_limit(job: JobTime, signal_seconds: int) -> int:
    """`dplaunch slurm`'s time limit in seconds: JOB × (1 + MARGIN) and the time-limit signal's
    lead, rounded up to whole minutes."""
    return 60 * math.ceil((job.total_s * (1 + MARGIN) + signal_seconds) / 60)


def steps_that_fit(job: JobTime, limit_s: float, signal_seconds: int) -> int:
    """How many of JOB's steps a time limit of LIMIT_S seconds holds before its signal, start-up
    and the per-step share of evaluation and checkpoints taken out."""
    per_step = (job.steps_s + job.evaluation_s + job.checkpoint_s) / max(job.steps, 1)
    usable = limit_s - signal_seconds - job.start_up_s
    return max(0, min(job.steps, math.floor(usable / per_step))) if per_step > 0 else job.steps


def _minutes(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
