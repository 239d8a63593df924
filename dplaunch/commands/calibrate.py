"""`dplaunch calibrate`: measure this hardware's rates once; `dplaunch plan` forecasts with them.

Placed as `dplaunch train` places its ranks (--gpus, --nodes, a SLURM allocation: one launcher per
node, as `dplaunch doctor`), the ranks (dplaunch/train/calibrate_ranks.py) time a transformer
block's matrix products and attention at a few shapes and dtypes, every collective at a few sizes
inside a node and across nodes, how much communication hides behind computation, the optimizer
step, DeepSpeed's CPU Adam and host ↔ device copies. Node 0 turns that into a profile
(planning/profiles.py) keyed by the hardware and saves it in the user's cache, where `dplaunch
plan` and `parallel: auto` find it (or `--out FILE`, to ship with a run file as `--profile FILE`).
Torch is imported only by the ranks.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer

from dplaunch.commands.doctor import BACKEND_PLACEHOLDER, with_backend
from dplaunch.commands.options import command
from dplaunch.config.flags import RunFlags
from dplaunch.launching.devices import cpu_device_name, interconnect_seen, visible_gpus
from dplaunch.planning.profiles import (
    profile_dir,
    profile_file_name,
    profile_from_record,
    profile_text,
    summary_lines,
)
from dplaunch.run_directory.layout import (
    CALIBRATE_DIR,
    CALIBRATE_RESULT_FILE,
    DEFAULT_RUNS_DIR,
    ERRORS_DIR,
)

# the ranks' own files in the run directory, and how long they may take
DEADLINE_S = 300
RANKS_SCRIPT = Path(__file__).resolve().parent.parent / "train" / "calibrate_ranks.py"


class CalibrationTimeout(Exception):
    """The deadline passed while the ranks measured."""


@dataclass
class CalibrateOptions:
    """`dplaunch calibrate`'s own options."""

    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Write the profile here (to ship with a run file: --profile FILE) instead of "
            "the user's cache.",
        ),
    ] = None
    quick: Annotated[
        bool, typer.Option("--quick", help="Few shapes and sizes (seconds): a smoke test.")
    ] = False


@command(config_option=True)
def calibrate_command(flags: RunFlags, options: CalibrateOptions) -> int:
    """Measure this hardware's compute, collective and copy rates (about a minute): the profile `dplaunch plan` forecasts step times with."""
    return run_calibrate(flags, options.out, options.quick)


def run_calibrate(flags: RunFlags, out: Path | None = None, quick: bool = False) -> int:
    """Measure, write the profile (node 0), print it; 0 when done, 1 when the ranks failed."""
    from dplaunch.launching.prepare import prepare_script_launch
    from dplaunch.launching.rundir import write_run_files

    started = time.monotonic()
    run_dir = Path(flags.output_dir or Path(DEFAULT_RUNS_DIR) / CALIBRATE_DIR)
    # launched as a script's ranks are; the run's parallel layout plays no part
    own = replace(flags, output_dir=str(run_dir / CALIBRATE_DIR), pp=1, tp=1)
    result_file = (run_dir / CALIBRATE_DIR / CALIBRATE_RESULT_FILE).absolute()
    argv = [str(RANKS_SCRIPT), str(result_file), BACKEND_PLACEHOLDER, str(DEADLINE_S)]
    prepared = prepare_script_launch(own, [*argv, "quick" if quick else "full"])
    prepared = with_backend(prepared, prepared.plan.backend)
    plan = prepared.plan
    from dplaunch.commands.slurm import run_under_srun, srun_relaunch_argv

    relaunch = srun_relaunch_argv(prepared)
    if relaunch is not None:  # a SLURM job outside an srun step: one launcher per node
        return run_under_srun(prepared, relaunch, dry_run=False)
    gpus = visible_gpus() if plan.target == "gpu" else []
    device = gpus[0].name if gpus else cpu_device_name()
    typer.echo(
        f"calibrate: {plan.num_nodes} node(s) × {plan.processes_per_node} {device}, "
        f"backend {plan.backend}{' (quick)' if quick else ''}: about a minute"
    )
    write_run_files(prepared.run_dir, prepared.files)
    result_file.unlink(missing_ok=True)
    env = {**os.environ, **prepared.env}
    # offload steps DeepSpeed's CPU Adam on the host: built once (about a minute), then timed
    from dplaunch.launching.op_build import build_missing

    log_dir = prepared.run_dir / ERRORS_DIR
    accelerator = "cuda" if plan.target == "gpu" else "cpu"
    build_missing({"cpu_adam": "dplaunch calibrate"}, accelerator, env, log_dir, typer.echo)
    failure = _run_ranks(prepared.argv, env)
    if failure:
        typer.echo(f"calibrate: FAIL: {failure}", err=True)
        return 1
    if plan.node_rank != 0:
        typer.echo(f"node {plan.node_rank}: ranks finished; node 0 writes the profile")
        return 0
    record = json.loads(result_file.read_text())
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    profile = profile_from_record(
        record, device, interconnect_seen(plan.num_nodes, gpus), measured_at
    )
    path = out or profile_dir() / profile_file_name(profile.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile_text(profile))
    typer.echo(f"profile of {profile.label}, measured in {record['seconds']:.0f} s:")
    for line in summary_lines(profile):
        typer.echo(line)
    where = "--profile FILE" if out else "this hardware's `dplaunch plan` and parallel: auto"
    typer.echo(f"wrote {path} ({where} use it) in {time.monotonic() - started:.0f} s")
    return 0


def _run_ranks(argv: list[str], env: dict[str, str]) -> str | None:
    """Start the ranks; why they failed, or None."""
    from dplaunch.launching.process import run_supervised

    def too_late(_signum: int, _frame: Any) -> None:
        raise CalibrationTimeout

    previous = signal.signal(signal.SIGALRM, too_late)
    signal.alarm(DEADLINE_S)
    try:
        code = run_supervised(argv, env)
    except CalibrationTimeout:
        return f"the ranks did not finish within {DEADLINE_S} s (run `dplaunch doctor`)"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if code != 0:
        return f"the ranks failed (exit status {code}): see their errors above"
    return None
