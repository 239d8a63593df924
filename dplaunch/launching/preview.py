"""What a prepared launch prints: the plan, the rendered files (--dry-run) and the launch command.

`dplaunch train`, `launch`, `config`, `verify` and the srun relaunch of `train` in a SLURM job
print the same lines before they start (or instead of starting) anything.
"""

from __future__ import annotations

import shlex

import typer

from dplaunch.launching.prepare import PreparedRun
from dplaunch.run_directory.layout import LAUNCH_SCRIPT


def print_prepared(prepared: PreparedRun, *, show_files: bool) -> None:
    """The plan (and with show_files the rendered files) and the exact launch command; first,
    where a scheduler's job decided the launch section."""
    cluster = prepared.cluster_note
    if cluster is not None:
        typer.echo(cluster)
    for line in prepared.plan.summary_lines():
        if line != f"note: {cluster}":
            typer.echo(line)
    if show_files:
        for name, text in prepared.files.items():
            if name == LAUNCH_SCRIPT:
                continue
            typer.echo(f"\n--- {prepared.run_dir / name}")
            typer.echo(text.rstrip())
        typer.echo("")
    typer.echo("launch: " + " ".join(shlex.quote(part) for part in prepared.argv))
