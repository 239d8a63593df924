"""`dplaunch env`: versions, GPUs, SLURM allocation, rendezvous port and DeepSpeed ops, as text or JSON."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from dplaunch.commands.options import command


@command()
def env_command(
    all_ops: Annotated[
        bool, typer.Option("--all-ops", help="Every DeepSpeed op, not only those plans use.")
    ] = False,
    no_ops: Annotated[
        bool, typer.Option("--no-ops", help="Skip the DeepSpeed op probe (no torch import).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> int:
    """Versions, GPUs, SLURM allocation, rendezvous port and DeepSpeed ops: paste it into a bug report."""
    return run_env(probe_ops=not no_ops, all_ops=all_ops, as_json=as_json)


def run_env(*, probe_ops: bool = True, all_ops: bool = False, as_json: bool = False) -> int:
    """Print this machine's report (paste it into a bug report)."""
    from dplaunch.environment_report import collect_environment, format_environment

    report = collect_environment(probe_ops=probe_ops, all_ops=all_ops)
    typer.echo(json.dumps(report, indent=2) if as_json else format_environment(report))
    return 0
