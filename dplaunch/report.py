"""`dplaunch report`: plots and a text summary from the metrics.jsonl of one or more runs (and,
for forecast.png, the forecast in their plan.json).

metrics.jsonl (written by dplaunch/train/metrics.py, rank 0) holds one JSON object per line:
a ``header`` (the plan: world size, dp/tp/pp, ZeRO stage, batch sizes), ``train`` lines (step,
loss, lr, tokens_per_s, elapsed_s, optional memory_gb), ``eval`` lines (step, eval_* metrics) and
a final ``summary`` (missing when the run crashed). A resumed run appends to the same file: a new
header starts a new segment whose elapsed_s restarts at 0, and steps after the last checkpoint
are logged again (the later line wins).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dplaunch.errors import UserError
from dplaunch.run_directory.layout import METRICS_FILE, REPORT_SUMMARY_FILE

# the first steps are warm-up (compilation, allocator, data loader start) and bias the throughput
WARMUP_FRACTION = 0.1


@dataclass
class RunMetrics:
    """The records of one run's metrics.jsonl, deduplicated by step, in step order."""

    name: str
    path: Path
    header: dict[str, Any]
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    summary: dict[str, Any] | None
    # segments (one per header): how many times the run was started or resumed
    segments: int
    wall_s: float
    unreadable_lines: int = 0


@dataclass
class RunSummary:
    """The numbers summary.txt reports for one run."""

    name: str
    steps: int
    final_loss: float | None
    final_eval: dict[str, float]
    mean_tokens_per_s: float | None
    wall_s: float
    completed: bool
    segments: int
    header: dict[str, Any] = field(default_factory=dict)
    # the summary line's step time against the forecast (train/loop.py), when the run had one
    forecast: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReportResult:
    """What make_report wrote."""

    out_dir: Path
    plots: list[Path]
    summary_path: Path
    runs: list[RunSummary]


def read_metrics(run_dir: Path, name: str | None = None) -> RunMetrics:
    """Parse a run directory's metrics.jsonl (or the file itself); torn lines are skipped."""
    path = run_dir / METRICS_FILE if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise UserError(
            "report", f"{run_dir} has no {METRICS_FILE}", "give a dplaunch run directory"
        )
    header: dict[str, Any] = {}
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    summary = None
    segments, unreadable = 0, 0
    wall_done, segment_elapsed = 0.0, 0.0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            unreadable += 1  # a line cut short when the run was killed
            continue
        if not isinstance(record, dict):
            unreadable += 1
            continue
        kind = record.get("type")
        if kind == "header":
            if not header:
                header = record
            wall_done += segment_elapsed
            segment_elapsed = 0.0
            segments += 1
            summary = None  # a later segment restarted the run: its summary is what counts
        elif kind == "train" and "step" in record:
            train[int(record["step"])] = record
            segment_elapsed = max(segment_elapsed, float(record.get("elapsed_s") or 0.0))
        elif kind == "eval" and "step" in record:
            evals[int(record["step"])] = record
        elif kind == "summary":
            summary = record
            segment_elapsed = max(segment_elapsed, float(record.get("wall_s") or 0.0))
    return RunMetrics(
        name=name or path.parent.name,
        path=path,
        header=header,
        train=[train[step] for step in sorted(train)],
        eval=[evals[step] for step in sorted(evals)],
        summary=summary,
        segments=max(segments, 1),
        wall_s=wall_done + segment_elapsed,
        unreadable_lines=unreadable,
    )


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def summarize(run: RunMetrics) -> RunSummary:
    """Steps, final loss and eval metrics, throughput after warm-up, wall time."""
    last_step = run.train[-1]["step"] if run.train else 0
    if run.summary is not None:
        last_step = max(last_step, int(run.summary.get("step") or 0))
    final_loss = _finite(run.train[-1].get("loss")) if run.train else None
    final_eval: dict[str, float] = {}
    if run.eval:
        for key, value in run.eval[-1].items():
            number = _finite(value)
            if key.startswith("eval_") and number is not None:
                final_eval[key] = number
    # mean over the log lines after the first 10% of steps (all of them if that leaves none)
    rates = [
        (r["step"], _finite(r.get("tokens_per_s")))
        for r in run.train
        if _finite(r.get("tokens_per_s"))
    ]
    steady = [rate for step, rate in rates if step > WARMUP_FRACTION * last_step] or [
        rate for _, rate in rates
    ]
    return RunSummary(
        name=run.name,
        steps=int(last_step),
        final_loss=final_loss,
        final_eval=final_eval,
        mean_tokens_per_s=sum(steady) / len(steady) if steady else None,
        wall_s=run.wall_s,
        completed=run.summary is not None,
        segments=run.segments,
        header=run.header,
        forecast={
            key: value
            for key, value in (run.summary or {}).items()
            if key in ("step_time_s", "mfu") or key.startswith("forecast_")
        },
    )


def _layout_line(header: dict[str, Any]) -> str:
    if not header:
        return "no header line"
    parts = [
        f"world {header.get('world_size', '?')}",
        f"dp {header.get('data_parallel_size', '?')}",
        f"tp {header.get('tensor_parallel_size', '?')}",
        f"pp {header.get('pipeline_parallel_size', '?')}",
        f"ZeRO {header.get('zero_stage', '?')}",
    ]
    if header.get("offload") not in (None, "none"):
        parts.append(f"offload {header['offload']}")
    parts.append(
        f"global batch {header.get('global_batch_size', '?')} = micro "
        f"{header.get('micro_batch_size', '?')} × accum "
        f"{header.get('gradient_accumulation_steps', '?')} × dp {header.get('data_parallel_size', '?')}"
    )
    if header.get("mixed_precision"):
        parts.append(str(header["mixed_precision"]))
    return ", ".join(parts)


def format_summary(runs: list[RunSummary]) -> str:
    """summary.txt: one block per run."""
    blocks = []
    for run in runs:
        status = "completed" if run.completed else "no summary line (crashed or still running)"
        if run.segments > 1:
            status += f", resumed {run.segments - 1}×"
        lines = [
            f"{run.name}",
            f"  layout           {_layout_line(run.header)}",
            f"  status           {status}",
            f"  steps            {run.steps}",
            f"  final loss       {run.final_loss:.4f}"
            if run.final_loss is not None
            else "  final loss       -",
        ]
        for key, value in run.final_eval.items():
            lines.append(f"  {key:<16} {value:.4f}")
        if run.mean_tokens_per_s is not None:
            lines.append(
                f"  tokens/s         {run.mean_tokens_per_s:.1f} "
                f"(mean, first {WARMUP_FRACTION:.0%} of steps excluded)"
            )
        else:
            lines.append("  tokens/s         -")
        lines.append(f"  wall time        {run.wall_s:.1f} s")
        lines += _forecast_lines(run.forecast)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def _forecast_lines(forecast: dict[str, Any]) -> list[str]:
    """The measured median step beside the forecast, and the note when it was more than 25 % off."""
    if "step_time_s" not in forecast:
        return []
    measured = f"  step time        {forecast['step_time_s']:.4g} s (median after 2 warm-up steps)"
    if "forecast_step_time_s" not in forecast:
        return [measured + "; no forecast (no hardware profile)"]
    lines = [
        measured + f", forecast {forecast['forecast_step_time_s']:.4g} s "
        f"(measured / forecast {forecast['forecast_ratio']:.2f})",
        f"  MFU              {forecast['mfu']:.1%}",
    ]
    if forecast.get("forecast_note"):
        lines.append(f"  forecast         {forecast['forecast_note']}")
    return lines


def _unique_names(run_dirs: list[Path]) -> list[str]:
    names = [d.name if d.is_dir() else d.parent.name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    # same leaf name in different places: add the parent folder
    return [
        f"{d.parent.name}/{d.name}" if d.is_dir() else f"{d.parent.parent.name}/{d.parent.name}"
        for d in run_dirs
    ]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for record in records:
        value = _finite(record.get(key))
        if value is not None:
            steps.append(record["step"])
            values.append(value)
    return steps, values


@dataclass(frozen=True)
class PhaseComparison:
    """One phase of a run's step: the forecast's seconds term by term, and the measured median."""

    phase: str
    forecast: dict[str, float]
    measured: float


def phase_comparison(run_dir: Path, summary: dict[str, Any] | None) -> list[PhaseComparison]:
    """The forecast (RUN_DIR's plan.json) beside the measured phases (the run's summary record),
    phases the engine timed as one joined in both; [] without a forecast or timed phases."""
    from dplaunch.planning.forecast import join_phases
    from dplaunch.run_directory.files import read_plan_file

    measured = (summary or {}).get("phases_s")
    if not measured or not run_dir.is_dir():
        return []
    try:
        forecast = read_plan_file(run_dir).get("forecast")
    except (OSError, ValueError):
        return []
    if not forecast or "phases_s" not in forecast:
        return []
    joined = tuple((summary or {}).get("phases_joined") or ())
    if joined:
        forecast, measured = join_phases(forecast, measured, joined)
    return [
        PhaseComparison(phase, dict(forecast["phases_s"].get(phase, {})), float(seconds))
        for phase, seconds in measured.items()
    ]


def make_report(run_dirs: list[Path], out_dir: Path) -> ReportResult:
    """Plots (loss, eval, lr, throughput, memory) overlaying the runs, and summary.txt, in out_dir."""
    if not run_dirs:
        raise UserError("report", "no run directories given", "pass one or more run directories")
    runs = [
        read_metrics(Path(d), name)
        for d, name in zip(run_dirs, _unique_names([Path(d) for d in run_dirs]), strict=True)
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = _Plots(out_dir)
    plots.loss(runs)
    plots.evaluation(runs)
    plots.simple(runs, "lr.png", "lr", "learning rate", "lr")
    plots.simple(runs, "throughput.png", "tokens_per_s", "throughput (all ranks)", "tokens / s")
    plots.simple(runs, "memory.png", "memory_gb", "peak memory of rank 0", "GB")
    plots.phases([(run.name, phase_comparison(run.path.parent, run.summary)) for run in runs])
    summaries = [summarize(run) for run in runs]
    summary_path = out_dir / REPORT_SUMMARY_FILE
    summary_path.write_text(format_summary(summaries))
    return ReportResult(
        out_dir=out_dir, plots=plots.written, summary_path=summary_path, runs=summaries
    )


class _Plots:
    """The report's PNG files in OUT_DIR, each overlaying the runs (matplotlib, no display)."""

    def __init__(self, out_dir: Path):
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot as plt

        self.plt, self.out_dir = plt, out_dir
        self.written: list[Path] = []

    def _save(self, fig: Any, name: str) -> None:
        path = self.out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        self.plt.close(fig)
        self.written.append(path)

    def loss(self, runs: list[Any]) -> None:
        """Training loss per run, with its eval loss as markers in the same colour."""
        fig, ax = self.plt.subplots(figsize=(7, 4.2))
        for run in runs:
            steps, values = _series(run.train, "loss")
            (line,) = ax.plot(steps, values, label=f"{run.name} train")
            eval_steps, eval_values = _series(run.eval, "eval_loss")
            if eval_steps:
                ax.plot(
                    eval_steps, eval_values, "o--", color=line.get_color(), label=f"{run.name} eval"
                )
        ax.set(title="loss", xlabel="optimizer step", ylabel="loss")
        ax.grid(alpha=0.3)
        ax.legend()
        self._save(fig, "loss.png")

    def evaluation(self, runs: list[Any]) -> None:
        """One panel per evaluation metric the runs logged (eval.png), none without any."""
        keys = sorted(
            {
                k
                for run in runs
                for r in run.eval
                for k in r
                if k.startswith("eval_") and _finite(r[k]) is not None
            }
        )
        if not keys:
            return
        fig, axes = self.plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            for run in runs:
                steps, values = _series(run.eval, key)
                if steps:
                    ax.plot(steps, values, "o-", label=run.name)
            ax.set(title=key.replace("_", " "), xlabel="optimizer step")
            ax.grid(alpha=0.3)
            ax.legend()
        self._save(fig, "eval.png")

    def phases(self, runs: list[tuple[str, list[PhaseComparison]]]) -> None:
        """forecast.png: each run's step phase by phase, the forecast's terms stacked beside the
        measured median (nothing when no run had a forecast and timed phases)."""
        runs = [(name, phases) for name, phases in runs if phases]
        if not runs:
            return
        fig, axes = self.plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.2), squeeze=False)
        terms = sorted({term for _, phases in runs for p in phases for term in p.forecast})
        colours = {term: f"C{i + 1}" for i, term in enumerate(terms)}
        for ax, (name, phases) in zip(axes[0], runs, strict=True):
            for x, phase in enumerate(phases):
                bottom = 0.0
                for term in terms:
                    seconds = phase.forecast.get(term, 0.0)
                    if seconds > 0:
                        label = f"forecast: {term}" if x == 0 else None
                        ax.bar(x - 0.2, seconds, 0.4, bottom=bottom, color=colours[term], label=label)  # fmt: skip
                        bottom += seconds
                ax.bar(x + 0.2, phase.measured, 0.4, color="C0", label="measured" if x == 0 else None)  # fmt: skip
            ax.set_xticks(range(len(phases)), [p.phase for p in phases])
            ax.set(title=f"{name}: forecast | measured", ylabel="seconds a step")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
        self._save(fig, "forecast.png")

    def simple(self, runs: list[Any], name: str, key: str, title: str, ylabel: str) -> None:
        """KEY of the training records over the steps (nothing when no run logged it)."""
        if not any(_series(run.train, key)[0] for run in runs):
            return
        fig, ax = self.plt.subplots(figsize=(7, 4.2))
        for run in runs:
            steps, values = _series(run.train, key)
            if steps:
                ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=run.name)
        ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        self._save(fig, name)
