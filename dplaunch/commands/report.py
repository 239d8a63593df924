"""`dplaunch report`: PNG plots and summary.txt from the metrics.jsonl of one or more runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dplaunch.commands.options import command
from dplaunch.run_directory.layout import METRICS_FILE, REPORT_DIR


@command()
def report_command(
    run_dir: Annotated[Path, typer.Argument(help=f"A run directory (with {METRICS_FILE}).")],
    compare: Annotated[
        list[Path] | None,
        typer.Option("--compare", help="Another run to overlay (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output folder (default RUN_DIR/report).")
    ] = None,
) -> int:
    """PNG plots (loss, eval, lr, tokens/s, memory) and summary.txt from runs' metrics.jsonl."""
    return run_report(run_dir, compare or [], out)


def run_report(run_dir: Path, compare: list[Path], out: Path | None) -> int:
    """Plot RUN_DIR (overlaid with the --compare runs) into OUT (default RUN_DIR/report)."""
    from dplaunch.launching.rundir import check_output_dir
    from dplaunch.report import make_report

    runs = [run_dir, *compare]
    out_dir = out or (run_dir if run_dir.is_dir() else run_dir.parent) / REPORT_DIR
    if out is not None or run_dir.exists():
        # a missing run is make_report's to report, not the default folder inside it
        check_output_dir(out_dir, "--out")
    result = make_report(runs, out_dir)
    typer.echo(result.summary_path.read_text().rstrip())
    typer.echo("")
    for plot in result.plots:
        typer.echo(f"plot: {plot}")
    typer.echo(f"summary: {result.summary_path}")
    return 0
