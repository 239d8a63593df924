"""`dplaunch report`: PNG plots and summary.txt from the metrics.jsonl of one or more runs."""

from __future__ import annotations

from pathlib import Path

import typer

REPORT_DIR = "report"


def run_report(run_dir: Path, compare: list[Path], out: Path | None) -> int:
    """Plot RUN_DIR (overlaid with the --compare runs) into OUT (default RUN_DIR/report)."""
    from dplaunch.report import make_report

    runs = [run_dir, *compare]
    out_dir = out or (run_dir if run_dir.is_dir() else run_dir.parent) / REPORT_DIR
    result = make_report(runs, out_dir)
    typer.echo(result.summary_path.read_text().rstrip())
    typer.echo("")
    for plot in result.plots:
        typer.echo(f"plot: {plot}")
    typer.echo(f"summary: {result.summary_path}")
    return 0
