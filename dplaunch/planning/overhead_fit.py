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
from typing import Any

from dplaunch.planning.forecast import (
    DEVICE_TERMS,
    EXCHANGE_TERMS,
    Overheads,
    _facts_key,
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


def unexplained(step: TimedStep, profile: Profile) -> dict[str, float]:
    """Each measured phase of STEP less what the forecast without overheads gives it (on a GPU
    the forward's and backward's whole time: the host's, see the module docstring)."""
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
    left: dict[str, float] = {}
    for phase in PHASES:
        explained = sum(bare.phases.get(phase, {}).values())
        host_bound = gpu and phase != "step"
        left[phase] = step.phases_s.get(phase, 0.0) - (0.0 if host_bound else explained)
    return left


def equations(
    step: TimedStep, profile: Profile, paired: dict[str, float] | None = None
) -> list[Equation]:
    """STEP's phases as equations (joined phases summed into one): the seconds :func:`unexplained`
    leaves; with PAIRED (DDP's at the same shape and micro-batches), less DDP's forward and
    backward, so that only what this engine adds to them remains."""
    left = unexplained(step, profile)
    for phase in ("forward", "backward"):
        left[phase] -= (paired or {}).get(phase, 0.0)
    counts = overhead_units(overhead_counts(step.facts, step.dims, step.workload))
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


def _shape_key(step: TimedStep) -> tuple:
    """What pairs a step with DDP's: the model, the micro-batch and how many a rank runs."""
    work = step.workload
    per_rank = work.global_batch_size // max(work.micro_batch * step.dims.dp, 1)
    return (_facts_key(step.facts), work.micro_batch, work.seq_len, per_rank)


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


# What each family may add to DDP's forward and backward (every op's dispatch, which all engines
# pay), by what its engine does: ZeRO-1/2 copy gradients into their buckets; ZeRO-3 and FSDP2
# also fetch, copy in and release every weight; DDP copies nothing (its gradients are views of
# its buckets), so it has no per-byte term — one fitted there would be a rate's error at
# calibrate's shapes, not a cost. Each family's step is its own (DeepSpeed steps otherwise).
BASE_TERMS = ("forward_s", "forward_tensor_s", "backward_s", "backward_tensor_s")
STEP_TERMS = ("step_s", "step_tensor_s")
EXTRA_TERMS = {
    "ddp": (*BASE_TERMS, *STEP_TERMS),
    "zero1": ("forward_s", "backward_s", "backward_tensor_s", "backward_byte_s", *STEP_TERMS),
    "zero2": ("forward_s", "backward_s", "backward_tensor_s", "backward_byte_s", *STEP_TERMS),
    "zero3": (*BASE_TERMS, "forward_byte_s", "backward_byte_s", *STEP_TERMS),
    "fsdp": (*BASE_TERMS, "forward_byte_s", "backward_byte_s", *STEP_TERMS),
    "ulysses": EXCHANGE_TERMS,
}


def fit_overheads(steps: list[TimedStep], profile: Profile) -> OverheadFit:
    """The non-negative Overheads of each family that best explain its STEPS on PROFILE (least
    squares over every measured phase). DDP first; every other family's forward and backward are
    DDP's and what its engine adds (EXTRA_TERMS), fitted on its phases less DDP's at the same
    shape and micro-batches (what both pay alike — a rate's error at calibrate's shapes — is
    not the engine's); its step is its own. Ulysses' exchange terms are what sp adds to DDP's
    steps. On a GPU the per-byte copies are the device's (their defaults:
    forecast.default_overheads), not fitted."""
    gpu = not profile.device.upper().startswith("CPU")
    by_family: dict[str, list[TimedStep]] = {}
    for step in steps:
        by_family.setdefault(step.family, []).append(step)
    ddp_left = {_shape_key(s): unexplained(s, profile) for s in by_family.get("ddp", [])}
    fitted: dict[str, Overheads] = {}
    residual: dict[str, float] = {}
    for family in sorted(by_family, key=lambda name: (name != "ddp", name == "ulysses")):
        ddp = fitted.get("ddp") or default_overheads(profile, "ddp")
        rows, base = [], {}
        for step in by_family[family]:
            paired = ddp_left.get(_shape_key(step)) if family != "ddp" else None
            if family != "ddp" and paired is None:  # no DDP step to pair with: DDP's terms
                base = {name: getattr(ddp, name) for name in BASE_TERMS}
            rows += equations(step, profile, paired)
        if family == "ulysses":
            rows = [row for row in rows if any(row.counts.get(n) for n in EXCHANGE_TERMS)]
        free = set(EXTRA_TERMS.get(family, EXTRA_TERMS["zero3"]))
        fixed = {}
        if gpu:  # copies are the device's: in a host-bound step they do not show
            defaults = default_overheads(profile, family)
            fixed = {name: getattr(defaults, name) for name in DEVICE_TERMS}
            free -= set(DEVICE_TERMS)
        values, rms = solve(rows, free, base, fixed)
        if family == "ulysses":  # its own terms only: the rest is DDP's
            values = {name: values[name] for name in EXCHANGE_TERMS}
        elif family != "ddp" and not base:  # paired: the extras on top of DDP's
            values = {
                name: value + (getattr(ddp, name) if name in BASE_TERMS else 0.0)
                for name, value in values.items()
            }
        fitted[family] = Overheads(**values)
        residual[family] = rms
    return OverheadFit(
        fitted, residual, {family: len(steps) for family, steps in by_family.items()}
    )


def timed_steps(record: dict[str, Any]) -> list[TimedStep]:
    """The steps of calibrate's record (train/calibrate_engines.py's ``engine_steps``)."""
    steps = []
    for step in record.get("steps", []):
        dims = ParallelDims(
            step["world_size"],
            step["gpus_per_node"],
            zero_stage=step["zero_stage"],
            fsdp=step["fsdp"],
            sp=step["sp"],
        )
        workload = Workload(
            micro_batch=step["micro_batch"],
            seq_len=step["seq_len"],
            mixed_precision=step["mixed_precision"],
            global_batch_size=step["global_batch_size"],
            guard=step["on_nonfinite"] != "off",
            clip=step["max_grad_norm"] > 0,
        )
        facts = ModelFacts.from_config_dict(step["model_config"])
        steps.append(TimedStep(facts, dims, workload, step["phases_s"], tuple(step["joined"])))
    return steps


def fitted_profile(profile: Profile, record: dict[str, Any] | None) -> Profile:
    """PROFILE with the overheads fitted to calibrate's engine steps (RECORD: the ranks'
    ``engine_steps``); what was left out or failed is noted; without steps PROFILE as it is,
    noted (the forecast then takes the defaults)."""
    steps = timed_steps(record or {})
    notes = [
        f"engine steps not run: {', '.join(record[key])} ({why})"
        for key, why in (("left_out", "over the budget"), ("failed", "failed here"))
        if record and record.get(key)
    ]
    if not steps:
        notes.append("engine overheads not measured: the forecast takes its defaults")
        return replace(profile, notes=(*profile.notes, *notes))
    fitted = fit_overheads(steps, profile).to_profile(profile)
    return replace(fitted, notes=(*fitted.notes, *notes))


def solve(
    rows: list[Equation],
    free: set[str],
    base: dict[str, float] | None = None,
    fixed: dict[str, float] | None = None,
) -> tuple[dict[str, float], float]:
    """The coefficients minimising Σ (Σ coefficient × count − seconds)² over ROWS: each of FREE
    is BASE's value plus an extra ≥ 0, FIXED's held at their value, the others BASE's (or 0);
    (every coefficient, the root-mean-square residual)."""
    base, fixed = base or {}, fixed or {}
    names = [f.name for f in fields(Overheads)]
    known = {name: fixed.get(name, base.get(name, 0.0)) for name in names}
    extra = [
        name
        for name in names
        if name in free and name not in fixed and any(row.counts.get(name, 0.0) for row in rows)
    ]
    targets = [
        row.seconds - sum(value * row.counts.get(name, 0.0) for name, value in known.items())
        for row in rows
    ]
    matrix = [[row.counts.get(name, 0.0) for name in extra] for row in rows]
    added = non_negative_least_squares(matrix, targets)
    values = known | {name: known[name] + x for name, x in zip(extra, added, strict=True)}
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
    "fitted_profile",
    "timed_steps",
    "non_negative_least_squares",
    "solve",
]
