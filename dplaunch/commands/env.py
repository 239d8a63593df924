"""`dplaunch env`: versions, GPUs, SLURM allocation, rendezvous port and DeepSpeed ops, as text or JSON."""

from __future__ import annotations

import json

import typer


def run_env(*, probe_ops: bool = True, all_ops: bool = False, as_json: bool = False) -> int:
    """Print this machine's report (paste it into a bug report)."""
    from dplaunch.environment_report import collect_environment, format_environment

    report = collect_environment(probe_ops=probe_ops, all_ops=all_ops)
    typer.echo(json.dumps(report, indent=2) if as_json else format_environment(report))
    return 0
