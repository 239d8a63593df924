"""`dplaunch train`, `config` and `launch`: prepare → (print | write) → start and supervise."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import typer

from dplaunch.launching.prepare import (
    PreparedRun,
    RunFlags,
    prepare_script_launch,
    prepare_training_run,
)
from dplaunch.launching.process import run_supervised
from dplaunch.launching.rundir import check_run_dir, write_run_files

RESUME_FILE = "resume.txt"


def run_train(flags: RunFlags, *, dry_run: bool, resume: str | None) -> int:
    """Plan, write the run directory and start the ranks; return their exit status."""
    prepared = prepare_training_run(flags)
    disk_line = check_run_dir(prepared.run_dir, resuming=resume is not None)
    if resume is not None:
        prepared.files[RESUME_FILE] = resume + "\n"
    if dry_run:
        print_prepared(prepared, show_files=True)
        return 0
    print_prepared(prepared, show_files=False)
    typer.echo(f"run directory: {prepared.run_dir} ({disk_line})")
    return start(prepared)


def run_config(flags: RunFlags, out: Path) -> int:
    """Render the run's files into ``out`` for the target the flags describe."""
    prepared = prepare_training_run(flags, render_only=True, out_dir=out)
    write_run_files(out, prepared.files)
    print_prepared(prepared, show_files=False)
    typer.echo(f"wrote {', '.join(sorted(prepared.files))} to {out}")
    return 0


def run_launch(flags: RunFlags, script: list[str], *, dry_run: bool) -> int:
    """Launch a user script with the same plan."""
    prepared = prepare_script_launch(flags, script)
    print_prepared(prepared, show_files=dry_run)
    if dry_run:
        return 0
    return start(prepared)


def start(prepared: PreparedRun) -> int:
    """Write the run directory and run this node's ranks under supervision."""
    write_run_files(prepared.run_dir, prepared.files)
    env = {**os.environ, **prepared.env}
    code = run_supervised(prepared.argv, env)
    if code != 0:
        typer.echo(
            f"dplaunch: training exited with status {code} (run directory: {prepared.run_dir})",
            err=True,
        )
    return code


def print_prepared(prepared: PreparedRun, *, show_files: bool) -> None:
    """The plan (and with show_files the rendered files) and the exact launch command."""
    for line in prepared.plan.summary_lines():
        typer.echo(line)
    if show_files:
        for name, text in prepared.files.items():
            if name == "launch.sh":
                continue
            typer.echo(f"\n--- {prepared.run_dir / name}")
            typer.echo(text.rstrip())
        typer.echo("")
    typer.echo("launch: " + " ".join(shlex.quote(part) for part in prepared.argv))
