"""The engine overheads of a profile, fitted to the short real steps `dplaunch calibrate` times.

Pure Python, like the rest of planning/. Calibrate's ranks step every engine family they can
(train/calibrate_engines.py: DDP, ZeRO-1, ZeRO-2, ZeRO-3, FSDP2, Ulysses on DDP) on small models
of their own — a few (hidden size, layers) shapes, one and two micro-batches a step — and record
each phase's median seconds (forward, backward, step, as the engines' phase clock times them).
For each timed step the forecast *without* overheads (planning/forecast.py: FLOPs at the
profile's dense and attention rates, every collective, the optimizer) is what the hardware's
rates explain; the rest is the engine's own work. The fit finds, family by family, the
non-negative coefficients of forecast.Overheads whose counts (forecast.overhead_counts: tensors,
gradient bytes, micro-batches, exchanges) best explain that rest, phase by phase (least squares).

The shapes differ in tensors (layers) and bytes (hidden size) independently, and the micro-batch
counts separate what is paid per micro-batch from what is paid per step, so a per-byte copy is
told apart from a per-tensor hook and from the step's fixed cost. Nothing here sees a benchmark:
the model then extrapolates to the run's own shape.

On a GPU the host runs ahead of the device: the forward and backward of calibrate's small
shapes take the host's time (the device is idle most of it), so their measured seconds are the
host's work itself; the step's overhead adds to the device's time as on CPU ranks.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields, replace

from dplaunch.planning.forecast import (
    EXCHANGE_TERMS,
    Overheads,
    default_overheads,
    engine_family,
    forecast_step,
    overhead_counts,
    overhead_units,
)
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.profiles import Profile
from dplaunch.planning.rules import ParallelDims
from dplaunch.planning.workload import Workload

PHASES = ("forward", "backward", "step")


@dataclass(frozen=True)
class TimedStep:
    """One step of an engine family as calibrate timed it: the layout and workload it ran, and
    the median seconds of each phase (``joined``: phases the engine times as one, DeepSpeed's
    backward and step)."""

    facts: ModelFacts
    dims: ParallelDims
    workload: Workload
    phases_s: dict[str, float]
    joined: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        """The family it measures: its engine's, or "ulysses" for sp > 1."""
        return "ulysses" if self.dims.sp > 1 else engine_family(self.dims)


@dataclass(frozen=True)
class Equation:
    """One measured phase (or joined phases): coefficient name → its count, and the seconds the
    overheads must explain."""

    counts: dict[str, float]
    seconds: float


def equations(step: TimedStep, profile: Profile) -> list[Equation]:
    """STEP's phases as equations: what is left of each measured phase once the forecast
    without overheads is taken off (on a GPU the forward's and backward's whole time: the host's,
    see the module docstring); joined phases summed into one."""
    bare = forecast_step(
        step.facts,
        step.dims,
        step.workload,
        profile,
        guard=step.workload.guard,
        clip=step.workload.clip,
        overheads=False,
    )
    gpu = not profile.device.upper().startswith("CPU")
    counts = overhead_units(overhead_counts(step.facts, step.dims, step.workload))
    left: dict[str, float] = {}
    for phase in PHASES:
        explained = sum(bare.phases.get(phase, {}).values())
        host_bound = gpu and phase != "step"
        left[phase] = step.phases_s.get(phase, 0.0) - (0.0 if host_bound else explained)
    groups = [tuple(step.joined)] if step.joined else []
    groups += [(phase,) for phase in PHASES if phase not in step.joined]
    result = []
    for group in groups:
        joined_counts: dict[str, float] = {}
        for phase in group:
            for name, count in counts[phase].items():
                joined_counts[name] = joined_counts.get(name, 0.0) + count
        result.append(Equation(joined_counts, sum(left[phase] for phase in group)))
    return result


@dataclass(frozen=True)
class OverheadFit:
    """The fitted overheads by family, and how well each explains its steps."""

    overheads: dict[str, Overheads]
    # family → root-mean-square of what the fit leaves unexplained, in seconds, and the steps
    residual_s: dict[str, float]
    steps: dict[str, int]

    def to_profile(self, profile: Profile) -> Profile:
        """PROFILE with these overheads (and a note of the fit's quality)."""
        table = {family: terms.to_dict() for family, terms in self.overheads.items()}
        note = "engine overheads fitted to calibrate's steps: " + ", ".join(
            f"{family} ({self.steps[family]} steps, ±{self.residual_s[family] * 1e3:.2g} ms)"
            for family in self.overheads
        )
        return replace(profile, overheads=table, notes=(*profile.notes, note))


def fit_overheads(steps: list[TimedStep], profile: Profile) -> OverheadFit:
    """The non-negative Overheads of each family that best explain its STEPS on PROFILE
    (least squares over every measured phase). Ulysses' exchange terms are fitted last, on what
    the fitted DDP terms leave of its steps. On a GPU the per-byte copy is the device's (its
    default: forecast.default_overheads), not fitted."""
    gpu = not profile.device.upper().startswith("CPU")
    by_family: dict[str, list[TimedStep]] = {}
    for step in steps:
        by_family.setdefault(step.family, []).append(step)
    fitted: dict[str, Overheads] = {}
    residual: dict[str, float] = {}
    for family in sorted(by_family, key=lambda name: name == "ulysses"):
        rows = [eq for step in by_family[family] for eq in equations(step, profile)]
        fixed: dict[str, float] = {}
        if family == "ulysses":
            # the DDP terms (measured, else defaults) are not the exchange's to explain
            base = fitted.get("ddp") or default_overheads(profile, "ddp")
            fixed = {f.name: getattr(base, f.name) for f in fields(Overheads)}
            fixed = {name: value for name, value in fixed.items() if name not in EXCHANGE_TERMS}
        else:
            fixed = dict.fromkeys(EXCHANGE_TERMS, 0.0)
        if gpu:
            fixed["backward_byte_s"] = default_overheads(profile, family).backward_byte_s
        values, rms = solve(rows, fixed)
        if family == "ulysses":  # its own terms only: the rest is DDP's
            values = {name: values[name] for name in EXCHANGE_TERMS}
        fitted[family] = Overheads(**values)
        residual[family] = rms
    return OverheadFit(
        fitted, residual, {family: len(steps) for family, steps in by_family.items()}
    )


def solve(rows: list[Equation], fixed: dict[str, float]) -> tuple[dict[str, float], float]:
    """The coefficients ≥ 0 minimising Σ (Σ coefficient × count − seconds)² over ROWS, those of
    FIXED held at their value; (every coefficient, the root-mean-square residual)."""
    names = [f.name for f in fields(Overheads)]
    free = [
        name
        for name in names
        if name not in fixed and any(row.counts.get(name, 0.0) for row in rows)
    ]
    targets = [
        row.seconds - sum(value * row.counts.get(name, 0.0) for name, value in fixed.items())
        for row in rows
    ]
    matrix = [[row.counts.get(name, 0.0) for name in free] for row in rows]
    coefficients = non_negative_least_squares(matrix, targets)
    values = dict.fromkeys(names, 0.0) | fixed | dict(zip(free, coefficients, strict=True))
    errors = [
        sum(values[name] * row.counts.get(name, 0.0) for name in names) - row.seconds
        for row in rows
    ]
    rms = math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0
    return values, rms


def non_negative_least_squares(matrix: list[list[float]], targets: list[float]) -> list[float]:
    """x ≥ 0 minimising |A x − b|² for a few columns: every subset of columns that may be
    positive is solved (columns scaled to 1, normal equations), the best feasible one kept."""
    columns = len(matrix[0]) if matrix else 0
    scale = [max((abs(row[j]) for row in matrix), default=0.0) or 1.0 for j in range(columns)]
    scaled = [[row[j] / scale[j] for j in range(columns)] for row in matrix]
    best, best_error = [0.0] * columns, _error(scaled, [0.0] * columns, targets)
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            solution = _least_squares([[row[j] for j in subset] for row in scaled], targets)
            if solution is None or any(value < 0 for value in solution):
                continue
            x = [0.0] * columns
            for j, value in zip(subset, solution, strict=True):
                x[j] = value
            error = _error(scaled, x, targets)
            if error < best_error - 1e-15:
                best, best_error = x, error
    return [value / scale[j] for j, value in enumerate(best)]


def _error(matrix: list[list[float]], x: list[float], targets: list[float]) -> float:
    return sum(
        (sum(a * b for a, b in zip(row, x, strict=True)) - t) ** 2
        for row, t in zip(matrix, targets, strict=True)
    )


def _least_squares(matrix: list[list[float]], targets: list[float]) -> list[float] | None:
    """Solve AᵀA x = Aᵀb (Gaussian elimination with pivoting); None when singular."""
    n = len(matrix[0])
    normal = [
        [sum(row[i] * row[j] for row in matrix) for j in range(n)]
        + [sum(row[i] * t for row, t in zip(matrix, targets, strict=True))]
        for i in range(n)
    ]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(normal[r][col]))
        if abs(normal[pivot][col]) < 1e-12:
            return None
        normal[col], normal[pivot] = normal[pivot], normal[col]
        for r in range(n):
            if r != col:
                factor = normal[r][col] / normal[col][col]
                normal[r] = [a - factor * b for a, b in zip(normal[r], normal[col], strict=True)]
    return [normal[i][n] / normal[i][i] for i in range(n)]


__all__ = [
    "Equation",
    "OverheadFit",
    "TimedStep",
    "equations",
    "fit_overheads",
    "non_negative_least_squares",
    "solve",
]
