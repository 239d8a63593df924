"""`dplaunch calibrate`: measure this hardware's rates once; `dplaunch plan` forecasts with them.

Placed as `dplaunch train` places its ranks (--gpus, --nodes, a SLURM allocation: one launcher per
node, as `dplaunch doctor`), the ranks (dplaunch/train/calibrate_ranks.py) time every collective
at a few sizes inside a node and across nodes, a transformer block's matrix products and
attention at a few shapes and dtypes, how much communication hides behind computation, the
optimizer step, DeepSpeed's CPU Adam and host ↔ device copies, and run a few real steps of each
engine family (DDP, ZeRO-1/2/3, FSDP2, Ulysses) on small models, whose time beyond the FLOPs and
collectives becomes the forecast's overhead terms (planning/overhead_fit.py). They keep to a time budget
(BUDGET_S, --quick QUICK_BUDGET_S, --budget), counted once they have started: DeepSpeed's CPU Adam
op is built before (once per Python environment and CPU type; --quick times it only when it is
built already). Node 0 turns what they measured into a profile (planning/profiles.py) keyed by
the hardware and saves it in the user's cache, where `dplaunch plan` and `parallel: auto` find it
(or `--out FILE`, to ship with a run file as `--profile FILE`). The ranks' launch files and their
output (a log) stay in the cache too (with -o DIR, in DIR/calibrate/). Torch is imported only by
the ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dplaunch.commands.doctor import BACKEND_PLACEHOLDER, with_backend
from dplaunch.commands.options import command
from dplaunch.config.flags import RunFlags
from dplaunch.errors import UserError
from dplaunch.launching.devices import cpu_device_name, interconnect_seen, visible_gpus
from dplaunch.planning.profiles import (
    cache_dir,
    profile_dir,
    profile_file_name,
    profile_from_record,
    profile_text,
    summary_lines,
)
from dplaunch.run_directory.layout import (
    CALIBRATE_DIR,
    CALIBRATE_LOG_FILE,
    CALIBRATE_RESULT_FILE,
    ERRORS_DIR,
)

if TYPE_CHECKING:
    from dplaunch.launching.prepare import PreparedRun
    from dplaunch.launching.process import RankWatch

# seconds the ranks measure for, once started (the op build before does not count)
BUDGET_S = 120
QUICK_BUDGET_S = 30
# beyond the budget, what the ranks may take to start (imports, the rendezvous) and to end on a
# loaded machine before dplaunch stops them
START_ALLOWANCE_S = 180
RANKS_SCRIPT = Path(__file__).resolve().parent.parent / "train" / "calibrate_ranks.py"
# the DeepSpeed op whose optimizer step the profile holds (ZeRO-Offload's)
CPU_ADAM_OP = "cpu_adam"


class CalibrationTimeout(Exception):
    """The deadline passed while the ranks measured."""


@dataclass
class CalibrateOptions:
    """`dplaunch calibrate`'s own options."""

    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Write the profile to this file (to ship with a run file: --profile FILE) "
            "instead of the user's cache.",
        ),
    ] = None
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help=f"Few shapes and sizes, at most {QUICK_BUDGET_S} s of measuring, and no build of "
            "DeepSpeed's CPU Adam op (timed only when built already): a smoke test.",
        ),
    ] = False
    budget: Annotated[
        float | None,
        typer.Option(
            "--budget",
            min=1,
            metavar="SECONDS",
            help=f"Measure for at most this long once the ranks have started (default "
            f"{BUDGET_S}, --quick {QUICK_BUDGET_S}); what does not fit is left out and named in "
            "the profile's notes.",
        ),
    ] = None


@command(config_option=True)
def calibrate_command(flags: RunFlags, options: CalibrateOptions) -> int:
    """Measure this hardware's compute, collective and copy rates and its engines' overheads (short real steps of DDP, ZeRO-1/2/3, FSDP2, Ulysses) — at most 2 minutes of measuring after a one-time op build; --quick 30 s: the profile `dplaunch plan` forecasts step times with."""
    return run_calibrate(flags, options)


def run_calibrate(flags: RunFlags, options: CalibrateOptions) -> int:
    """Measure, write the profile (node 0), print it; 0 when done, 1 when the ranks failed."""
    started = time.monotonic()
    check_out(options.out)
    budget = options.budget or (QUICK_BUDGET_S if options.quick else BUDGET_S)
    prepared, extensions = _prepare(flags, options.quick, budget)
    from dplaunch.commands.slurm import run_under_srun, srun_relaunch_argv

    relaunch = srun_relaunch_argv(prepared)
    if relaunch is not None:  # a SLURM job outside an srun step: one launcher per node
        return run_under_srun(prepared, relaunch, dry_run=False)
    plan = prepared.plan
    gpus = visible_gpus() if plan.target == "gpu" else []
    device = gpus[0].name if gpus else cpu_device_name()
    typer.echo(
        f"calibrate: {plan.num_nodes} node(s) × {plan.processes_per_node} {device}, backend "
        f"{plan.backend}: the ranks measure for at most {budget:g} s once started"
        f"{' (--quick)' if options.quick else ''}"
    )
    from dplaunch.launching.rundir import write_run_files

    write_run_files(prepared.run_dir, prepared.files)
    result_file = prepared.run_dir / CALIBRATE_RESULT_FILE
    result_file.unlink(missing_ok=True)
    env = {**os.environ, **prepared.env, "TORCH_EXTENSIONS_DIR": str(extensions)}
    if not options.quick:  # ZeRO-Offload's optimizer: built once (minutes on a small machine)
        from dplaunch.launching.op_build import build_missing

        accelerator = "cuda" if plan.target == "gpu" else "cpu"
        errors = prepared.run_dir / ERRORS_DIR
        build_missing({CPU_ADAM_OP: "dplaunch calibrate"}, accelerator, env, errors, typer.echo)
    failure = _run_ranks(prepared, env, budget + START_ALLOWANCE_S)
    if failure:
        typer.echo(f"calibrate: FAIL: {failure}", err=True)
        return 1
    if plan.node_rank != 0:
        typer.echo(f"node {plan.node_rank}: ranks finished; node 0 writes the profile")
        return 0
    return _write_profile(json.loads(result_file.read_text()), prepared, gpus, options, started)


def check_out(out: Path | None) -> None:
    """Refuse an --out that cannot take the profile, before anything is measured."""
    if out is None:
        return
    if out.is_dir():
        raise UserError(
            "--out",
            f"{out} is a directory",
            f"give the profile's file, e.g. {out / 'profile.json'}",
        )
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UserError("--out", f"{parent} is a file, not a folder", "give another path")


def _prepare(flags: RunFlags, quick: bool, budget: float) -> tuple[PreparedRun, Path]:
    """The ranks' launch (as a script's ranks: the run's parallel layout plays no part) and the
    folder DeepSpeed's ops are built in."""
    from dplaunch.launching.deepspeed_ops import prebuilt_ops, torch_extensions_dir
    from dplaunch.launching.op_build import is_built
    from dplaunch.launching.prepare import prepare_script_launch

    run_dir = (
        Path(flags.output_dir) / CALIBRATE_DIR if flags.output_dir else cache_dir() / CALIBRATE_DIR
    )
    own = replace(flags, output_dir=str(run_dir), pp=1, tp=1)
    extensions = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or torch_extensions_dir())
    # without --quick the op is built before the ranks start; --quick times it only when it is
    cpu_adam = not quick or (
        CPU_ADAM_OP in prebuilt_ops("cpu") | prebuilt_ops("cuda")
        or is_built(extensions, CPU_ADAM_OP)
    )
    deadline = budget + START_ALLOWANCE_S
    argv = [
        str(RANKS_SCRIPT),
        str((run_dir / CALIBRATE_RESULT_FILE).absolute()),
        BACKEND_PLACEHOLDER,
        str(deadline),  # how long a collective may wait
        f"{budget:g}",
        "quick" if quick else "full",
        "cpu_adam" if cpu_adam else "no_cpu_adam",
    ]
    prepared = prepare_script_launch(own, argv)
    return with_backend(prepared, prepared.plan.backend), extensions


def _run_ranks(prepared: PreparedRun, env: dict[str, str], deadline_s: float) -> str | None:
    """Start the ranks, their output to the log; why they failed in one line, or None."""
    from dplaunch.launching.process import RankWatch, run_supervised

    log = prepared.run_dir / CALIBRATE_LOG_FILE
    watch = RankWatch(prepared.run_dir / ERRORS_DIR)

    def too_late(_signum: int, _frame: Any) -> None:
        raise CalibrationTimeout

    previous = signal.signal(signal.SIGALRM, too_late)
    signal.alarm(max(1, int(deadline_s)))
    try:
        # the watch's readers write what the ranks print to sys.stdout / sys.stderr: the log
        log.write_text("")
        with open(log, "a", buffering=1) as out, open(log, "a", buffering=1) as err:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = run_supervised(prepared.argv, env, watch=watch)
    except CalibrationTimeout:
        nodes = prepared.plan.num_nodes
        where = "; `dplaunch doctor` checks that the nodes reach each other" if nodes > 1 else ""
        return (
            f"the ranks did not finish within {deadline_s:g} s (their start, and at most "
            f"{deadline_s - START_ALLOWANCE_S:g} s of measuring): a rank is stuck or far slower "
            f"than the others{where}; their output: {log}"
        )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if code != 0:
        why = _failure_line(watch, log, code)
        return f"the ranks failed (exit status {code}): {why}; their output: {log}"
    return None


def _failure_line(watch: RankWatch, log: Path, code: int) -> str:
    """The first failing rank's error, else the last error line of LOG, else the signal that
    ended the launcher (status CODE)."""
    if watch.signal_received:
        return f"stopped by {signal.Signals(watch.signal_received).name}"
    first = watch.first_failure()
    if first is not None:
        return first[2]
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [
        line.strip() for line in lines if re.match(r"(\[rank\d+\]: )?\w*(Error|Exception)\b", line)
    ]
    if errors:
        return errors[-1]
    if code > 128:
        return f"the launcher was killed by signal {code - 128}"
    return "no error printed"


def _write_profile(
    record: dict[str, Any],
    prepared: PreparedRun,
    gpus: list[Any],
    options: CalibrateOptions,
    started: float,
) -> int:
    """Turn the ranks' RECORD into a profile, write it (--out, else the cache), print it."""
    plan = prepared.plan
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    device = gpus[0].name if gpus else cpu_device_name()
    profile = profile_from_record(
        record,
        device,
        interconnect_seen(plan.num_nodes, gpus),
        measured_at,
        intra=interconnect_seen(1, gpus),
    )
    from dplaunch.planning.overhead_fit import fitted_profile

    # the engines' own time besides FLOPs and collectives, fitted to their timed steps
    profile = fitted_profile(profile, record.get("engine_steps"))
    path = options.out or profile_dir() / profile_file_name(profile.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile_text(profile))
    typer.echo(
        f"profile of {profile.label}, measured in {record['seconds']:.0f} s (the ranks started "
        f"in {record.get('start_s', 0):.0f} s):"
    )
    for line in summary_lines(profile):
        typer.echo(line)
    where = (
        "--profile FILE" if options.out else "this hardware's `dplaunch plan` and parallel: auto"
    )
    typer.echo(f"wrote {path} ({where} use it) in {time.monotonic() - started:.0f} s")
    return 0
