"""`dplaunch train`, `config` and `launch`: prepare → (print | write) → start and supervise."""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dplaunch.commands.options import command
from dplaunch.config.flags import Framework, RunFlags
from dplaunch.errors import UserError
from dplaunch.run_directory.layout import (
    ACCELERATE_FILE,
    CHECKPOINTS_DIR,
    DEEPSPEED_FILE,
    ERRORS_DIR,
    LAUNCH_SCRIPT,
    RESUME_FILE,
    RUN_FILE,
    step_dir,
)
from dplaunch.stop_signals import EXIT_CHECKPOINTED, EXIT_NONFINITE, StopSignals

# `dplaunch launch` runs Python scripts; a run file given to it is meant for `dplaunch train`
RUN_FILE_SUFFIXES = (".yaml", ".yml", ".json")

if TYPE_CHECKING:
    from dplaunch.launching import restarts
    from dplaunch.launching.prepare import PreparedRun
    from dplaunch.launching.process import RankWatch
    from dplaunch.launching.resume import ResumeChoice, ResumePoint
    from dplaunch.run_directory.checkpoints import DamagedCheckpoint


@command()
def train_command(
    flags: RunFlags,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print the plan, rendered files and launch command; start nothing."
        ),
    ] = False,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume", help="'auto' (newest checkpoint that verifies) or a checkpoint path."
        ),
    ] = None,
    start_over: Annotated[
        bool,
        typer.Option(
            "--start-over",
            help="With --resume auto: train from step 0 when no checkpoint of the run "
            "directory verifies (they are kept, renamed damaged-step-N).",
        ),
    ] = False,
) -> int:
    """Train a Hugging Face model with the planned parallel layout."""
    return run_train(flags, dry_run=dry_run, resume=resume, start_over=start_over)


@command()
def config_command(
    flags: RunFlags,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help=f"Directory to write {ACCELERATE_FILE}, {DEEPSPEED_FILE}, {RUN_FILE}, "
            f"{LAUNCH_SCRIPT} into (or -o DIR: the run directory {LAUNCH_SCRIPT} then trains in).",
        ),
    ] = None,
) -> int:
    """Render the run's Accelerate/DeepSpeed files for the target the flags describe (GPUs need not be here)."""
    return run_config(flags, out)


@command(config_option=True)
def launch_command(
    flags: RunFlags,
    script: Annotated[
        Path,
        typer.Argument(help="Your Accelerate, torchrun-style or TensorFlow Python script."),
    ],
    script_args: Annotated[
        list[str] | None, typer.Argument(help="Arguments for the script (after --).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan and launch command; start nothing.")
    ] = False,
    framework: Annotated[
        Framework,
        typer.Option(
            "--framework",
            help="auto: what the script imports (TensorFlow/Keras: workers with TF_CONFIG).",
        ),
    ] = "auto",
) -> int:
    """Launch any Accelerate, PyTorch DDP or TensorFlow script with the same plan: dplaunch launch SCRIPT [flags] -- ARGS."""
    argv = [str(script), *(script_args or [])]
    return run_launch(flags, argv, dry_run=dry_run, framework=framework)


def run_train(
    flags: RunFlags, *, dry_run: bool, resume: str | None, start_over: bool = False
) -> int:
    """Plan, write the run directory and start the ranks; return their exit status.

    75 (EXIT_CHECKPOINTED) means the ranks checkpointed on SIGUSR1/SIGTERM: continue with --resume auto.
    START_OVER: with --resume auto, train from step 0 when no checkpoint of the run verifies.
    """
    from dplaunch.launching.prepare import prepare_training_run
    from dplaunch.requirements import check_installed_versions

    if start_over and resume != "auto":
        raise UserError(
            "--start-over",
            "it trains from step 0 when no checkpoint of the run directory verifies, which only "
            "--resume auto looks for",
            "add --resume auto",
        )
    check_installed_versions()
    prepared = prepare_training_run(flags)
    with _run_dir_held(prepared, dry_run=dry_run):
        return _train_prepared(
            flags, prepared, dry_run=dry_run, resume=resume, start_over=start_over
        )


def _run_dir_held(prepared: PreparedRun, *, dry_run: bool) -> contextlib.AbstractContextManager:
    """The run directory's lock for this job while it is written (a dry run writes nothing)."""
    from dplaunch.launching.rundir import job_identity, run_dir_lock

    if dry_run:
        return contextlib.nullcontext()
    say = functools.partial(typer.echo, err=True)
    return run_dir_lock(prepared.run_dir, job_identity(prepared.plan), say=say)


def _train_prepared(
    flags: RunFlags, prepared: PreparedRun, *, dry_run: bool, resume: str | None, start_over: bool
) -> int:
    """run_train from the prepared run on: resume, (print | write), start and supervise."""
    from dplaunch.launching.preview import print_prepared
    from dplaunch.launching.resume import plan_resume, resume_file_text
    from dplaunch.launching.rundir import check_run_dir
    from dplaunch.run_directory.files import clear_stop_record, read_stop_record

    disk_line = check_run_dir(prepared.run_dir, resuming=resume is not None)
    relaunch = _srun_relaunch(prepared)
    if relaunch is not None:  # a SLURM job outside an srun step: one launcher per node
        from dplaunch.commands.slurm import run_under_srun

        return run_under_srun(prepared, relaunch, dry_run=dry_run)
    choice = (
        plan_resume(prepared.run_dir, resume, prepared.config, prepared.plan, start_over=start_over)
        if resume is not None
        else None
    )
    point = choice.point if choice is not None else None
    # always written: a stale resume.json of an earlier launch must not be read by these ranks
    prepared.files[RESUME_FILE] = resume_file_text(point)
    if dry_run:
        print_prepared(prepared, show_files=True)
        _print_resume(choice, resume, set_aside=False)
        return 0
    print_prepared(prepared, show_files=False)
    typer.echo(f"run directory: {prepared.run_dir} ({disk_line})")
    _print_resume(choice, resume, set_aside=prepared.plan.node_rank == 0)
    if point is not None and point.convert:
        interrupted = _reshard(prepared, point)
        if interrupted is not None:
            typer.echo(
                f"dplaunch: {interrupted} (the time-limit warning) came while {point.checkpoint.name} "
                f"was converted, so no rank was started; the converted checkpoint {point.load_dir} "
                f"is kept for the next launch: continue with --resume auto "
                f"(exit status {EXIT_CHECKPOINTED})",
                err=True,
            )
            return EXIT_CHECKPOINTED
    if prepared.config.launch.preflight and _preflight_failed(flags, prepared):
        return 1
    clear_stop_record(prepared.run_dir)
    code = _train_with_restarts(prepared, point)
    stop = read_stop_record(prepared.run_dir)
    if code == 0 and stop is None and prepared.plan.node_rank == 0:
        typer.echo(result_line(prepared.run_dir))
    if stop is not None:
        code = int(stop["exit_status"])
        if code == EXIT_NONFINITE:
            typer.echo(
                f"dplaunch: stopped at {stop['reason']}; the last good checkpoint is "
                f"{stop['checkpoint']} (exit status {code})",
                err=True,
            )
            return code
        _refuse_a_requeue_without_progress(stop, point)
        typer.echo(
            f"dplaunch: stopped at step {stop['step']} ({stop['reason']}), checkpoint {stop['checkpoint']}; "
            f"continue with --resume auto (exit status {code})",
            err=True,
        )
    return code


def result_line(run_dir: Path) -> str:
    """The last line of a finished run: steps, time, the final metrics, where the model is."""
    from dplaunch.run_directory.files import newest_results
    from dplaunch.run_directory.layout import ADAPTER_DIR, EXPORT_DIR

    found = newest_results(run_dir)
    summary = found.get("summary", {})
    line = f"dplaunch: done: {summary.get('step', '?')} steps in {summary.get('wall_s', 0):.1f} s"
    evaluation, last = found.get("eval"), found.get("train")
    if evaluation is not None:
        metrics = [
            f"{k} {v:.4f}"
            for k, v in evaluation.items()
            if k.startswith("eval_") and isinstance(v, (int, float))
        ]
        line += f"; {', '.join(metrics)} at step {evaluation['step']}"
    elif last is not None:
        line += f"; loss {last['loss']:.4f} at step {last['step']}"
    exported = [name for name in (EXPORT_DIR, ADAPTER_DIR) if (run_dir / name).is_dir()]
    if exported:
        line += "; the model: " + " and ".join(str(run_dir / name) for name in exported)
    return line


def _train_with_restarts(prepared: PreparedRun, point: ResumePoint | None) -> int:
    """Run the ranks; after a failure start them again from the newest complete checkpoint, up
    to launch.max_restarts times (dplaunch.launching.restarts decides; nodes agree there)."""
    from dplaunch.launching import restarts
    from dplaunch.launching.resume import ResumeChoice, plan_resume, resume_file_text
    from dplaunch.run_directory.environment import RESTARTS_ENV

    run_dir, plan = prepared.run_dir, prepared.plan
    max_restarts = prepared.config.launch.max_restarts
    agreement = None
    if max_restarts and plan.num_nodes > 1 and not prepared.config.launch.hostfile:
        agreement = restarts.NodeAgreement(
            run_dir, plan.node_rank, plan.num_nodes, plan.timeout_minutes
        )
        agreement.begin()
    done, previous = 0, None
    while True:
        prepared.env[RESTARTS_ENV] = str(done)
        began = restarts.metrics_size(run_dir)
        code, watch = supervise(prepared)
        hints = _failure_hints(run_dir) if code != 0 else None
        if hints is None:  # finished, or stopped on purpose (a stop record): no failure report
            if code == 0 and done:
                typer.echo(f"dplaunch: finished after {done} automatic restart(s)")
            return code
        if not max_restarts:
            _report_failure(watch, code, run_dir, hints)
            return code
        failure = _failure_of(watch, code, run_dir, began)

        verdict_for = functools.partial(
            restarts.restart_verdict,
            previous=previous,
            restarts_done=done,
            max_restarts=max_restarts,
            checkpoint_step=_restart_step(run_dir, point, plan.node_rank),
        )
        if agreement is not None:
            verdict = agreement.decide(done + 1, failure, verdict_for, say=typer.echo)
        else:
            verdict = verdict_for(failure)
        if not verdict.restart:
            # a stop on purpose is its own one line (the watch's), no failure left unrestarted
            if not watch.stopped_on_purpose():
                hints = [*hints, f"dplaunch: not restarted: {verdict.reason}"]
            _report_failure(watch, code, run_dir, hints)
            return code
        done += 1
        wait_s = restarts.backoff_seconds(done)
        _report_failure(watch, code, run_dir, [])
        where = (
            f"checkpoint step {verdict.checkpoint_step}"
            if verdict.checkpoint_step is not None
            else (f"{point.checkpoint.path}" if point is not None else "step 0 (no checkpoint yet)")
        )
        typer.echo(
            f"dplaunch: restart {done} of {max_restarts} (launch.max_restarts) in {wait_s:g} s, "
            f"from {where}; cause: {verdict.cause}",
            err=True,
        )
        if plan.node_rank == 0:
            restarts.record_restart(run_dir, done, verdict, wait_s)
        interrupted = _back_off(wait_s)
        if interrupted is not None:
            typer.echo(
                f"dplaunch: {interrupted} during the wait before restart {done}: not restarted; "
                f"continue with --resume auto (exit status {EXIT_CHECKPOINTED})",
                err=True,
            )
            return EXIT_CHECKPOINTED
        if verdict.checkpoint_step is not None:
            checkpoint = run_dir / CHECKPOINTS_DIR / step_dir(verdict.checkpoint_step)
            point = plan_resume(run_dir, str(checkpoint), prepared.config, plan).point
        prepared.files[RESUME_FILE] = resume_file_text(point)
        _print_resume(ResumeChoice(point), "auto", set_aside=False)
        previous = failure


def _restart_step(run_dir: Path, point: ResumePoint | None, node_rank: int) -> int | None:
    """The step of this run's newest checkpoint that verifies, the one a restart continues from
    (newer damaged ones are named and set aside); None: none newer than where this launch
    started (it starts there again)."""
    from dplaunch.run_directory.checkpoints import newest_intact_checkpoint

    found = newest_intact_checkpoint(run_dir / CHECKPOINTS_DIR)
    _say_damaged(found.damaged, set_aside=node_rank == 0)
    newest = found.info
    if newest is None or (point is not None and newest.step < point.checkpoint.step):
        return None
    return newest.step


def _failure_of(watch: RankWatch, code: int, run_dir: Path, began: int) -> restarts.Failure:
    """What restarts.restart_verdict needs to know of a failed launch (``began``: the size of
    metrics.jsonl when it started)."""
    from dplaunch.launching import restarts

    first = watch.first_failure()
    return restarts.Failure(
        status=code,
        cause=first[2] if first is not None else f"the launcher exited with status {code}",
        step=restarts.last_step_reached(run_dir, began),
        when=first[1] if first is not None else time.time(),
        stopped=bool(watch.signal_received),
        user_error=any(f.exitcode == restarts.EXIT_USER_ERROR for f in watch.failures),
    )


def _back_off(seconds: float) -> str | None:
    """Wait before a restart; the name of a stop signal (SLURM's time limit, scancel) that came
    meanwhile, else None."""
    noted = StopSignals()
    noted.install()
    try:
        deadline = time.monotonic() + seconds
        while noted.received is None and time.monotonic() < deadline:
            time.sleep(min(0.1, seconds))
    finally:
        noted.restore()
    return noted.received


def _preflight_failed(flags: RunFlags, prepared: PreparedRun) -> bool:
    # launch.preflight: `dplaunch doctor` on this node's run directory and the run's own port
    from dataclasses import replace

    from dplaunch.commands.doctor import run_doctor

    typer.echo("preflight (launch.preflight): dplaunch doctor")
    doctor_flags = replace(
        flags, output_dir=str(prepared.run_dir), master_port=prepared.plan.master_port
    )
    if run_doctor(doctor_flags) == 0:
        return False
    typer.echo("dplaunch: the preflight check failed (above): no rank was started", err=True)
    return True


def _reshard(prepared: PreparedRun, point: ResumePoint) -> str | None:
    """Re-shard the checkpoint (node 0) or wait for it (the other nodes); the name of a SIGUSR1
    that came meanwhile, else None.

    A conversion can take minutes. SLURM's time-limit warning that comes during it must not be
    lost (the ranks that would have handled it do not exist yet): the conversion is finished and
    kept, and the launch stops there as a checkpointed one would, so a requeued job uses it."""
    from dplaunch.launching.reshard import convert_to_universal, wait_for_universal
    from dplaunch.stop_signals import StopSignals

    noted = StopSignals(signals=(signal.SIGUSR1,))
    noted.install()
    try:
        if prepared.plan.node_rank == 0:
            convert_to_universal(point, say=typer.echo)
        else:
            limit_s = max(prepared.plan.timeout_minutes, 1) * 60
            wait_for_universal(point, limit_s, say=typer.echo)
    finally:
        noted.restore()
    return noted.received


def _refuse_a_requeue_without_progress(stop: dict, point: ResumePoint | None) -> None:
    # in a SLURM script that requeues on 75: a stop before this launch's first step means the
    # time-limit signal came during start-up, and every requeue would do the same, forever
    from dplaunch.run_directory.environment import REQUEUE_MARK_ENV

    started_at = point.checkpoint.step if point is not None else 0
    if (
        os.environ.get(REQUEUE_MARK_ENV)
        and stop["exit_status"] == EXIT_CHECKPOINTED
        and stop["step"] <= started_at
    ):
        raise UserError(
            "--time",
            f"the job's time-limit signal ({stop['reason']}) came before its first step "
            f"(step {started_at + 1}): a requeued job would stop there again, so it is not requeued",
            "ask for a longer --time (start-up took longer than the time limit minus "
            "--signal-seconds)",
        )


def _failure_hints(run_dir: Path) -> list[str] | None:
    # printed before the failing rank's error, which stays the last line; None: the ranks stopped
    # on purpose (a signal, train.stop_after_steps) and that is no failure. The checkpoints'
    # sizes are checked (no digests: a report cannot wait for terabytes to be read), so a cut
    # one is named as damaged, never offered as where to continue.
    from dplaunch.run_directory.checkpoints import newest_intact_checkpoint
    from dplaunch.run_directory.files import read_stop_record

    if read_stop_record(run_dir) is not None:
        return None
    found = newest_intact_checkpoint(run_dir / CHECKPOINTS_DIR, digests=False)
    hints = [f"dplaunch: {damage.line()}: --resume auto skips it" for damage in found.damaged]
    if found.info is not None:
        hints.append(
            f"dplaunch: the newest checkpoint whose files are whole is {found.info.path} "
            f"(step {found.info.step}): continue with --resume auto (it checks their CRC-32 "
            "first)"
        )
    elif found.damaged:
        hints.append(
            "dplaunch: no checkpoint of this run is whole: --resume auto refuses to train over "
            "them from step 0 (--start-over does)"
        )
    return hints


def _say_damaged(damaged: tuple[DamagedCheckpoint, ...], *, set_aside: bool) -> None:
    # never deleted: renamed damaged-step-N (node 0 only, once), so nothing reads, rotates or
    # replaces it again; a dry run only says so
    from dplaunch.run_directory.checkpoints import set_aside as rename_aside

    for damage in damaged:
        if set_aside and damage.path.exists():
            kept = f"set aside as {rename_aside(damage)} (kept, not read again)"
        else:
            kept = "skipped"
        typer.echo(f"resume: {damage.line()}: {kept}", err=True)


def _print_resume(choice: ResumeChoice | None, resume: str | None, *, set_aside: bool) -> None:
    if resume is None or choice is None:
        return
    _say_damaged(choice.damaged, set_aside=set_aside)
    point = choice.point
    if point is None:
        if choice.damaged:
            typer.echo("resume: no checkpoint verifies: starting from step 0 (--start-over)")
        else:
            typer.echo("resume: no complete checkpoint in this run directory: starting from step 0")
        return
    info = point.checkpoint
    # a stream's checkpoint has no epoch: its position is each lane's (data-position-N.json)
    epoch = info.meta.get("epoch")
    where = f"epoch {epoch}" if epoch is not None else "the stream's position"
    typer.echo(
        f"resume: {info.path} (step {info.step}, {where}); "
        f"training continues with step {info.step + 1}"
    )
    for note in point.notes:
        typer.echo(f"resume note: {note}")


def run_config(flags: RunFlags, out: Path | None) -> int:
    """Render the run's files into ``out`` (or -o DIR) for the target the flags describe."""
    from dplaunch.launching.prepare import prepare_training_run
    from dplaunch.launching.preview import print_prepared
    from dplaunch.launching.rundir import check_output_dir, write_run_files

    named = Path(flags.output_dir) if flags.output_dir else None
    if out is None and named is None:
        raise UserError("--out", "no directory to write the files into", "give --out DIR or -o DIR")
    if out is not None and str(out) == "-":
        raise UserError(
            "--out",
            "dplaunch config writes several files, not one to stdout",
            "give a directory (--dry-run of dplaunch train prints them all)",
        )
    if out is not None and named is not None and out.resolve() != named.resolve():
        raise UserError(
            "--out", f"{out} and --output-dir {named} name two directories", "give one of them"
        )
    field = "--out" if out is not None else "output_dir"
    out = out or named
    prepared = prepare_training_run(flags, render_only=True, out_dir=out)
    check_output_dir(out, field)
    write_run_files(out, prepared.files)
    print_prepared(prepared, show_files=False)
    typer.echo(f"wrote {', '.join(sorted(prepared.files))} to {out}")
    return 0


def run_launch(
    flags: RunFlags, script: list[str], *, dry_run: bool, framework: Framework = "auto"
) -> int:
    """Launch a user script with the same plan (TensorFlow scripts: workers with TF_CONFIG)."""
    from dplaunch.launching.preview import print_prepared
    from dplaunch.launching.rundir import check_run_dir
    from dplaunch.requirements import check_installed_versions

    _check_script(Path(script[0]))
    check_installed_versions()
    prepared = _prepare_launch(flags, script, framework)
    if prepared.config.launch.max_restarts:
        raise UserError(
            "launch.max_restarts",
            "automatic restarts continue dplaunch's own training loop from its checkpoints; "
            "dplaunch launch cannot know where a script of its own resumes",
            "drop it here (it works with `dplaunch train`)",
        )
    with _run_dir_held(prepared, dry_run=dry_run):
        # a script's run directory holds only dplaunch's files: launching into it again is fine
        disk_line = check_run_dir(prepared.run_dir, resuming=True)
        relaunch = _srun_relaunch(prepared)
        if relaunch is not None:
            from dplaunch.commands.slurm import run_under_srun

            return run_under_srun(prepared, relaunch, dry_run=dry_run)
        print_prepared(prepared, show_files=dry_run)
        if dry_run:
            return 0
        typer.echo(f"run directory: {prepared.run_dir} ({disk_line})")
        return start(prepared)


def _prepare_launch(flags: RunFlags, script: list[str], framework: Framework) -> PreparedRun:
    from dplaunch.launching import frameworks
    from dplaunch.launching.prepare import prepare_script_launch

    chosen = frameworks.resolve_framework(framework, Path(script[0]))
    if chosen == "tensorflow":
        return frameworks.prepare_tensorflow_launch(flags, script)
    if chosen == "horovod":
        frameworks.check_horovod()
    return prepare_script_launch(flags, script)


def _check_script(script: Path) -> None:
    # a missing script is reported by prepare_script_launch, after the run file's checks
    if script.is_dir():
        raise UserError(
            "SCRIPT", f"{script} is a directory", "give the path of a Python script (a .py file)"
        )
    if script.suffix.lower() in RUN_FILE_SUFFIXES and script.is_file():
        raise UserError(
            "SCRIPT",
            f"{script} is a run file, not a Python script",
            f"train with a run file: dplaunch train {shlex.quote(str(script))} [flags]",
        )


def _srun_relaunch(prepared: PreparedRun) -> list[str] | None:
    from dplaunch.commands.slurm import srun_relaunch_argv

    return srun_relaunch_argv(prepared)


def start(
    prepared: PreparedRun,
    *,
    after_failure: Callable[[int], list[str] | None] | None = None,
) -> int:
    """Write the run directory and run this node's ranks under supervision.

    When the job fails, the first failing rank's error is printed once, as the last line.
    ``after_failure(status)`` gives lines to print before it, or None when the ranks stopped on
    purpose (then there is no failure report).
    """
    code, watch = supervise(prepared)
    if code != 0:
        hints = after_failure(code) if after_failure is not None else []
        if hints is not None:
            _report_failure(watch, code, prepared.run_dir, hints)
    return code


def supervise(prepared: PreparedRun) -> tuple[int, RankWatch]:
    """Write the run directory, run this node's ranks; their status and what the watch saw."""
    from dplaunch.launching.op_build import prepare_ops
    from dplaunch.launching.process import RankWatch, run_supervised
    from dplaunch.launching.rundir import write_run_files
    from dplaunch.run_directory.environment import PROGRESS_ENV

    write_run_files(prepared.run_dir, prepared.files)
    env = {**os.environ, **prepared.env}
    # DeepSpeed's ops built (and a killed build's lock cleared) here, once, not in every rank
    prepare_ops(prepared.plan, env, prepared.run_dir / ERRORS_DIR, say=typer.echo)
    if sys.stdout.isatty():  # rank 0 draws a live progress bar instead of a line per logged step
        env.setdefault(PROGRESS_ENV, str(shutil.get_terminal_size().columns))
    plan = prepared.plan
    watch = RankWatch(prepared.run_dir / ERRORS_DIR, timeout_minutes=plan.timeout_minutes)
    if plan.num_nodes > 1 and not prepared.config.launch.hostfile:  # one launcher per node
        first = plan.node_rank * plan.processes_per_node
        watch.local_ranks = range(first, first + plan.processes_per_node)
    return run_supervised(prepared.argv, env, watch=watch), watch


def _report_failure(watch: RankWatch, code: int, run_dir: Path, hints: list[str]) -> None:
    for line in watch.report(code, run_dir, hints):
        typer.echo(line, err=True)
