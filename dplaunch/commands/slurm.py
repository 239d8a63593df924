"""`dplaunch slurm` (plan → sbatch script → optionally sbatch), and srun for `train` in a job.

The script runs one launcher per node: `srun … python -m dplaunch train CONFIG <the same flags>
--output-dir RUN --resume auto`. Inside the job, `dplaunch train` reads the allocation (nodes,
node rank, head node, port, GPUs per node) and checks it against the plan; the run directory is
pinned so that a requeued job resumes the same run.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dplaunch.commands.options import command
from dplaunch.config.flags import RUN_FLAGS, RunFlags, flag_option
from dplaunch.errors import UserError
from dplaunch.run_directory.environment import UNDER_SRUN_ENV
from dplaunch.run_directory.layout import LOGS_DIR, REQUEUE_MARK_PREFIX, SBATCH_SCRIPT

if TYPE_CHECKING:
    from dplaunch.config.schema import LaunchConfig
    from dplaunch.launching.prepare import PreparedRun
    from dplaunch.planning.plan import Plan

# SLURM sends USR1 this many seconds before the time limit: time for a step and a checkpoint
SIGNAL_SECONDS = 120
# when neither the flags nor sinfo say: Jean-Zay's V100/H100 nodes have 4 GPUs
FALLBACK_GPUS_PER_NODE = 4
# ... and 10 cores per GPU (a V100 node: 40 cores, 4 GPUs)
FALLBACK_CPUS_PER_GPU = 10
# run flags that SLURM decides inside the job, so the script does not repeat them
DECIDED_IN_JOB = ("nodes", "node_rank", "master_addr", "master_port", "hostfile", "output_dir")
# SbatchSpec fields → the flag a user would change
SPEC_FLAGS = {
    "job_name": "--job-name",
    "time": "--time",
    "partition": "--partition",
    "account": "--account",
    "qos": "--qos",
    "constraint": "--constraint",
    "modules": "--module",
    "setup_lines": "--setup",
    "log_dir": "--output-dir",
    "signal_seconds": "--signal-seconds",
    "workdir": "the working directory",
    "command": "CONFIG / flags",
    "comments": "CONFIG / flags",
}


_JOB = "SLURM job"


@dataclass
class SlurmOptions:
    """The `dplaunch slurm` options that are not run flags, each one typer option."""

    cpus_per_gpu: Annotated[
        int | None,
        typer.Option(
            "--cpus-per-gpu",
            help="CPU cores per GPU (default: the node's cores / GPUs from sinfo, else 10).",
            rich_help_panel=_JOB,
        ),
    ] = None
    time: Annotated[
        str | None,
        typer.Option(
            "--time",
            help="Time limit, HH:MM:SS or D-HH:MM:SS (default: the job's forecast × 1.2 and the "
            "signal's lead, where launch.profile or --gpu-type gives one; else 01:00:00).",
            rich_help_panel=_JOB,
        ),
    ] = None
    gpu_type: Annotated[
        str | None,
        typer.Option(
            "--gpu-type",
            help="The job's GPUs (a datasheet: H100, A100, …), whose forecast sets --time "
            "(this login node has none to calibrate); launch.profile: a calibrated profile.",
            rich_help_panel=_JOB,
        ),
    ] = None
    # None: SIGNAL_SECONDS
    signal_seconds: Annotated[
        int | None,
        typer.Option(
            "--signal-seconds",
            help="Seconds before the time limit at which the ranks checkpoint and stop "
            "(SIGUSR1; default 120).",
            rich_help_panel=_JOB,
        ),
    ] = None
    partition: Annotated[
        str | None, typer.Option("--partition", help="SLURM partition.", rich_help_panel=_JOB)
    ] = None
    account: Annotated[
        str | None,
        typer.Option("--account", help="SLURM account, e.g. abc@h100.", rich_help_panel=_JOB),
    ] = None
    qos: Annotated[str | None, typer.Option("--qos", help="QoS.", rich_help_panel=_JOB)] = None
    constraint: Annotated[
        str | None,
        typer.Option("--constraint", help="Node feature, e.g. h100.", rich_help_panel=_JOB),
    ] = None
    job_name: Annotated[
        str | None,
        typer.Option(
            "--job-name", help="Job name (default: the run's name).", rich_help_panel=_JOB
        ),
    ] = None
    modules: Annotated[
        list[str],
        typer.Option(
            "--module", help="`module load` this first (repeatable).", rich_help_panel=_JOB
        ),
    ] = field(default_factory=list)
    setup: Annotated[
        list[str],
        typer.Option(
            "--setup",
            help="A shell line run before srun, e.g. 'source venv/bin/activate' (repeatable).",
            rich_help_panel=_JOB,
        ),
    ] = field(default_factory=list)
    out: Annotated[
        str | None,
        typer.Option(
            "--out", help=f"Where to write the script (default RUN/{SBATCH_SCRIPT}; '-' = stdout)."
        ),
    ] = None
    submit: Annotated[
        bool, typer.Option("--submit", help="Submit it with sbatch and print the job id.")
    ] = False
    # the python that runs dplaunch in the job (default: the one running this command)
    python: Annotated[
        str | None,
        typer.Option(
            "--python",
            help="Python that runs dplaunch in the job (default: this one; 'python' = the "
            "one on PATH after --module/--setup).",
            rich_help_panel=_JOB,
        ),
    ] = None
    # paths relative to the submit directory (no --chdir): a script that holds no machine's paths
    relative_paths: Annotated[
        bool,
        typer.Option(
            "--relative-paths",
            help="Name the run file, run directory and logs relative to this directory, and "
            "python as 'python' unless --python: a script to share or commit, which works when "
            "sbatch is run from the same directory.",
            rich_help_panel=_JOB,
        ),
    ] = False


@command()
def slurm_command(flags: RunFlags, options: SlurmOptions) -> int:
    """Write an sbatch script that trains with this plan on SLURM nodes (one launcher per node)."""
    return run_slurm(flags, options)


@dataclass(frozen=True)
class JobShape:
    """Nodes, GPUs (or CPU ranks) per node and CPUs per task of the job, and where they came from."""

    nodes: int
    per_node: int
    cpus_per_task: int
    notes: tuple[str, ...] = ()


def run_slurm(flags: RunFlags, options: SlurmOptions) -> int:
    """Plan the run for the job, write its sbatch script, and submit it with --submit."""
    from dplaunch.config.load import load_run_config
    from dplaunch.launching.prepare import prepare_training_run
    from dplaunch.launching.rundir import check_output_dir, check_output_file
    from dplaunch.run_directory.files import write_text_atomic

    refuse_flags_the_job_decides(flags, "SLURM", "inside the job (node list, SLURM_NODEID, job id)")
    _check_submit(options)
    signal_seconds = _signal_seconds(options)
    config = load_run_config(
        flags.config, overrides=flags.overrides(), assignments=flags.assignments
    )
    shape = job_shape(config.launch, options, query_sinfo)
    plan_flags = dataclasses.replace(
        flags, gpus=shape.nodes * shape.per_node, gpus_per_node=shape.per_node, nodes=None
    )
    # the same validation `dplaunch train` does, for the job's layout rather than this machine's
    prepared = prepare_training_run(plan_flags, render_only=True, use_allocation=False)
    limit = job_time_limit(prepared, options, shape, signal_seconds)
    options = dataclasses.replace(options, time=limit.time)
    spec, script, run_dir = _job_script(
        plan_flags, options, config, shape, prepared, signal_seconds
    )
    path = None if options.out == "-" else Path(options.out or run_dir / SBATCH_SCRIPT)
    # checked before anything is written; the log directory must exist only to submit from here
    # (a script rendered on a laptop for the cluster names the cluster's paths)
    if path is not None:
        check_output_file(path, "--out" if options.out else "output_dir", SBATCH_SCRIPT)
    if options.submit:
        check_output_dir(Path(spec.log_dir), "output_dir")
    say = _say(to_stderr=options.out == "-")
    _say_job(say, prepared, shape, options, config)
    say(limit.line)
    _make_log_dir(say, spec.log_dir)
    if path is None:
        sys.stdout.write(script)
        return 0
    write_text_atomic(path, script, 0o755)
    say(f"sbatch script: {path}")
    say(f"run directory: {run_dir} (logs: {spec.log_dir}/{spec.job_name}-JOBID.out/.err)")
    if not options.submit:
        say(f"submit with: sbatch {shlex.quote(str(path))}")
        return 0
    say(f"submitted batch job {_submit(path)}")
    return 0


# the time limit without a forecast (and before dplaunch forecast one)
DEFAULT_TIME = "01:00:00"


@dataclass(frozen=True)
class TimeLimit:
    """The job's time limit and the line that says where it comes from."""

    time: str
    line: str


def job_time_limit(
    prepared: PreparedRun, options: SlurmOptions, shape: JobShape, signal_seconds: int
) -> TimeLimit:
    """--time, else the forecast of the job (planning/job_time.py) with its margin, else
    DEFAULT_TIME; the line says which, and warns when --time holds fewer steps than the run."""
    from dplaunch.planning.job_time import MARGIN, steps_that_fit, time_limit
    from dplaunch.rendering.sbatch import slurm_time, time_limit_seconds

    job, why = _forecast_job(prepared, options, shape)
    if options.time is not None:
        given = time_limit_seconds(options.time)  # checked by _signal_seconds
        if job is None or given is None or given >= job.total_s + signal_seconds:
            return TimeLimit(options.time, f"time limit {options.time} (--time)")
        fit = steps_that_fit(job, given, signal_seconds)
        return TimeLimit(
            options.time,
            f"note: --time {options.time} holds about {fit:,} of the run's {job.steps:,} steps "
            f"(forecast: {slurm_time(job.total_s)} for {job.words()}): at the time-limit signal "
            "the job checkpoints and requeues itself to go on",
        )
    if job is None:
        return TimeLimit(DEFAULT_TIME, f"time limit {DEFAULT_TIME} (the default: {why})")
    seconds = time_limit(job, signal_seconds)
    return TimeLimit(
        slurm_time(seconds),
        f"time limit {slurm_time(seconds)}: the forecast {slurm_time(job.total_s)} "
        f"({job.words()}) × {1 + MARGIN:g} and the signal's {signal_seconds} s, rounded up to "
        "a minute (--time to set it)",
    )


def _forecast_job(prepared: PreparedRun, options: SlurmOptions, shape: JobShape) -> tuple[Any, str]:
    """(the job's JobTime on its GPUs' profile, None without one; why there is none)."""
    from dplaunch.launching.prepare import model_facts
    from dplaunch.planning.auto import layout_forecast, plan_workload
    from dplaunch.planning.job_time import JobSetting, run_schedule
    from dplaunch.planning.profiles import choose_profile

    config, plan = prepared.config, prepared.plan
    launch = config.launch
    if options.gpu_type is None and not launch.profile:
        return None, "give --gpu-type (the job's GPUs) or launch.profile for a forecast"
    schedule = run_schedule(config, shape.nodes)
    if schedule is None:
        return None, "train.max_steps is unset: the job's steps are counted by its ranks"
    path = Path(launch.profile) if launch.profile else None
    profile = choose_profile(
        options.gpu_type, shape.per_node, shape.nodes, path=path, field_name="--gpu-type"
    )
    if profile is None:
        return None, f"no datasheet or profile of {options.gpu_type}"
    facts = model_facts(config.model)
    workload = plan_workload(config, plan)
    forecast = layout_forecast(config, facts, plan, profile)
    return JobSetting.of(schedule, facts, workload).time(forecast), ""


def _check_submit(options: SlurmOptions) -> None:
    # --submit needs a script file and sbatch
    if options.submit and options.out == "-":
        raise UserError("--submit", "cannot submit a script printed to stdout", "give --out FILE")
    if options.submit and shutil.which("sbatch") is None:
        raise UserError(
            "--submit",
            "sbatch is not on PATH here",
            "run this on a login node of the cluster, or drop --submit and sbatch the script there",
        )


def _job_script(
    plan_flags: RunFlags,
    options: SlurmOptions,
    config: Any,
    shape: JobShape,
    prepared: PreparedRun,
    signal_seconds: int,
) -> tuple[Any, str, Path]:
    """The job's SbatchSpec, its script and its run directory (as the job names it); UserError
    naming the flag of a value sbatch refuses."""
    from dplaunch.rendering.sbatch import SbatchSpec, render_sbatch

    submit_dir = Path.cwd()
    # relative: paths as seen from the directory sbatch is run in (the job starts there)
    where = submit_dir if options.relative_paths else None
    run_dir = job_path(prepared.run_dir, where)
    plan_flags = dataclasses.replace(plan_flags, output_dir=str(run_dir))
    python = options.python
    if python is None and options.relative_paths:
        python = "python"  # the path of this one would be this machine's
    spec = SbatchSpec(
        job_name=options.job_name or config.name or "dplaunch",
        command=train_command(plan_flags, python=python, relative_to=where),
        nodes=shape.nodes,
        gpus_per_node=shape.per_node,
        cpus_per_task=shape.cpus_per_task,
        time=options.time,
        partition=options.partition,
        account=options.account,
        qos=options.qos,
        constraint=options.constraint,
        modules=list(options.modules),
        setup_lines=list(options.setup),
        log_dir=str(run_dir / LOGS_DIR),
        requeue=True,
        signal_seconds=signal_seconds,
        cpu=prepared.plan.target == "cpu",
        # dplaunch's own lines reach the log in order with the ranks' output
        env={"PYTHONUNBUFFERED": "1"},
        workdir=None if options.relative_paths else str(submit_dir),
        comments=[
            "generated by dplaunch; regenerate it rather than edit it:",
            "  dplaunch " + comment_join(sys.argv[1:]),
            *(f"  {line}" for line in job_summary_lines(prepared.plan)),
        ],
    )
    try:
        return spec, render_sbatch(spec), run_dir
    except ValueError as error:
        name, _, problem = str(error).partition(": ")
        flag = SPEC_FLAGS.get(name.split("[")[0].split(".")[0], name)
        raise UserError(flag, problem or str(error), "change that value") from None


def _say_job(
    say: Any, prepared: PreparedRun, shape: JobShape, options: SlurmOptions, config: Any
) -> None:
    # the job's plan and what the user should know before submitting it
    for line in job_summary_lines(prepared.plan):
        say(line)
    for note in shape.notes:
        say(f"note: {note}")
    if options.relative_paths:
        say(
            f"note: --relative-paths: run sbatch from {Path.cwd()} (or the same place in your "
            "copy): the script's paths are relative to the directory it is submitted from"
            + ("; python is the one on PATH in the job" if options.python is None else "")
        )
    if not config.train.checkpoint_every:
        say(
            "note: train.checkpoint_every is not set: only the time-limit signal saves a "
            "checkpoint, so a job that fails or is requeued after a node failure starts again "
            "from step 0 (--set train.checkpoint_every=N)"
        )


def _make_log_dir(say: Any, log_dir: str) -> None:
    # sbatch does not create the directory of --output/--error: a job whose log directory is
    # missing fails at once and writes nothing, so it exists before the script can be submitted
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        say(
            f"note: cannot create the log directory {log_dir} here ({error.strerror}): "
            f"create it where the job is submitted (mkdir -p {shlex.quote(log_dir)}); "
            "sbatch does not, and a job without it fails writing nothing"
        )


def _submit(path: Path) -> str:
    """sbatch the script; its job id, or UserError with sbatch's reason."""
    result = subprocess.run(
        ["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise UserError(
            "--submit",
            f"sbatch refused the job: {_first_error_line(result)}",
            "fix what it names and run this command again, or submit the script (it is "
            f"written) yourself: sbatch {shlex.quote(str(path))}",
        )
    return result.stdout.strip().split(";")[0]


def _first_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [f"exit status {result.returncode}"])[0]


def comment_join(argv: list[str]) -> str:
    """shlex.join, with control characters as bash $'…' escapes: the command stays one line."""
    return " ".join(_quote_word(word) for word in argv)


# bash $'…' escapes for the characters that would end a comment line or hide in it
_ANSI_C_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _quote_word(word: str) -> str:
    if not any(_is_control(char) for char in word):
        return shlex.quote(word)
    escaped = "".join(
        _ANSI_C_ESCAPES.get(char) or (f"\\x{ord(char):02x}" if _is_control(char) else char)
        for char in word
    )
    return f"$'{escaped}'"


def _is_control(char: str) -> bool:
    return ord(char) < 32 or ord(char) == 127


def _signal_seconds(options: SlurmOptions) -> int:
    """The checkpoint signal's lead on the time limit; it must come after the job starts."""
    from dplaunch.rendering.sbatch import MAX_SIGNAL_SECONDS, time_limit_seconds

    seconds = SIGNAL_SECONDS if options.signal_seconds is None else options.signal_seconds
    if not 1 <= seconds <= MAX_SIGNAL_SECONDS:
        raise UserError(
            "--signal-seconds",
            f"{seconds} is not in 1..{MAX_SIGNAL_SECONDS}",
            "give the seconds before the time limit at which the ranks checkpoint, e.g. 300",
        )
    if options.time is None:  # the forecast's limit leaves the signal its lead (job_time_limit)
        return seconds
    try:
        limit = time_limit_seconds(options.time)
    except ValueError:
        raise UserError(
            "--time",
            f"{options.time!r} is not a SLURM time limit",
            "use HH:MM:SS, D-HH:MM:SS or minutes, e.g. 20:00:00",
        ) from None
    if limit is not None and limit <= seconds:
        raise UserError(
            "--time",
            f"{options.time} is not longer than the {seconds} s before the limit "
            "at which SLURM tells the ranks to checkpoint and stop",
            "ask for more time, or a smaller --signal-seconds",
        )
    return seconds


def job_shape(launch: LaunchConfig, options: SlurmOptions, sinfo) -> JobShape:
    """Nodes × per node and CPUs per task: the flags and run file first, then sinfo, then defaults.

    ``launch`` is the run file's launch section with the flags applied;
    ``sinfo(partition, constraint)`` answers (GPUs per node, cores per node, source) or Nones.
    """
    notes: list[str] = []
    total = launch.gpus
    if total is None:
        raise UserError("--gpus", "dplaunch slurm needs the total GPU count", "pass --gpus N")
    per_node = launch.gpus_per_node
    if per_node is None and launch.nodes > 1:
        if total % launch.nodes:
            raise UserError(
                "--nodes",
                f"{total} GPUs cannot be spread evenly over {launch.nodes} nodes",
                f"use a GPU count that is a multiple of {launch.nodes}",
            )
        per_node = total // launch.nodes
    if per_node is None and launch.cpu:
        per_node = total  # CPU ranks: one node unless told otherwise
    shape_gpus = shape_cores = None
    if per_node is None or options.cpus_per_gpu is None:
        shape_gpus, shape_cores, source = sinfo(options.partition, options.constraint)
        if per_node is None and shape_gpus:
            per_node = min(shape_gpus, total)
            notes.append(f"{shape_gpus} GPUs per node ({source})")
        elif per_node is None:
            per_node = min(FALLBACK_GPUS_PER_NODE, total)
            notes.append(
                f"GPUs per node unknown ({source}): assuming {FALLBACK_GPUS_PER_NODE}; "
                "pass --gpus-per-node G if the nodes have another count"
            )
    if total % per_node:
        below, above = (total // per_node) * per_node, (total // per_node + 1) * per_node
        options_text = f"{below} or {above}" if below else str(above)
        raise UserError(
            "--gpus",
            f"{total} GPUs do not fill whole nodes of {per_node}",
            f"use --gpus {options_text}, or set --gpus-per-node",
        )
    if options.cpus_per_gpu is not None:
        if options.cpus_per_gpu < 1:
            raise UserError("--cpus-per-gpu", f"{options.cpus_per_gpu} is below 1", "use 1 or more")
        per_rank = options.cpus_per_gpu
    elif launch.cpu:
        # CPU ranks share the node's cores
        per_rank = max(1, shape_cores // per_node) if shape_cores else 1
    elif shape_cores and shape_gpus:
        per_rank = max(1, shape_cores // shape_gpus)
        notes.append(f"{per_rank} CPU cores per GPU ({shape_cores} cores / {shape_gpus} GPUs)")
    else:
        per_rank = FALLBACK_CPUS_PER_GPU
        notes.append(
            f"CPU cores per GPU unknown: asking {FALLBACK_CPUS_PER_GPU}; pass --cpus-per-gpu C"
        )
    return JobShape(total // per_node, per_node, per_rank * per_node, tuple(notes))


def job_summary_lines(plan: Plan) -> list[str]:
    """The plan as the job will run it: the rendezvous is decided there, not here."""
    lines = [
        line
        for line in plan.summary_lines()
        if not line.startswith("node rank ") and "rendezvous at 127.0.0.1" not in line
    ]
    if plan.num_nodes > 1:
        lines.append(
            "rendezvous: the job's first node, on a port derived from the job id "
            "(two jobs sharing a node do not clash)"
        )
    return lines


def query_sinfo(
    partition: str | None, constraint: str | None
) -> tuple[int | None, int | None, str]:
    """(GPUs per node, cores per node, source) of the nodes a job would get, as sinfo says."""
    from dplaunch.cluster.slurm import SINFO_FORMAT, node_shape, parse_sinfo_nodes

    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None, None, "no sinfo here"
    try:
        result = subprocess.run(
            [sinfo, "-h", "-o", SINFO_FORMAT], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return None, None, "sinfo did not answer"
    if result.returncode != 0:
        return None, None, "sinfo did not answer"
    return node_shape(parse_sinfo_nodes(result.stdout), partition, constraint)


def job_path(path: Path, relative_to: Path | None) -> Path:
    """A path as the job names it: absolute, or relative to the submit directory when given."""
    if relative_to is None:
        return path.absolute()
    return Path(os.path.relpath(path.absolute(), relative_to))


def train_command(
    flags: RunFlags, *, python: str | None = None, relative_to: Path | None = None
) -> list[str]:
    """`python -m dplaunch train CONFIG <flags> --output-dir RUN --resume auto`, with absolute
    paths, or paths relative to ``relative_to`` (the submit directory)."""
    command = [python or sys.executable, "-m", "dplaunch", "train"]
    if flags.config is not None:
        command.append(str(job_path(Path(flags.config), relative_to)))
    for name in RUN_FLAGS:
        value = getattr(flags, name)
        if name in DECIDED_IN_JOB or value is None or value is False:
            continue
        option = flag_option(name)
        command += [option] if value is True else [option, str(value)]
    for assignment in flags.assignments:
        command += ["--set", assignment]
    return [*command, "--output-dir", str(flags.output_dir), "--resume", "auto"]


def refuse_flags_the_job_decides(flags: RunFlags, who: str, how: str) -> None:
    """A node rank, rendezvous or hostfile given to a command whose scheduler decides them:
    one UserError saying WHO does, and HOW."""
    for name in ("node_rank", "master_addr", "master_port", "hostfile"):
        if getattr(flags, name) is not None:
            option = flag_option(name)
            raise UserError(option, f"{who} decides it {how}", f"drop {option}")


def _say(*, to_stderr: bool):
    def say(line: str) -> None:
        typer.echo(line, err=to_stderr)

    return say


# --- `dplaunch train` in a SLURM job but outside an srun step ----------------------------------


def srun_relaunch_argv(prepared: PreparedRun) -> list[str] | None:
    """The srun line that reruns this command once per node, or None when none is needed.

    In the batch script or an salloc shell (a job, no step) the ranks would start on the one
    node running the script (with salloc: the login node), and SLURM's time-limit signal
    (`--signal` without B:) reaches only steps. So dplaunch starts the step itself.
    """
    from dplaunch.cluster.slurm import srun_argv
    from dplaunch.launching.prepare import current_allocation
    from dplaunch.rendering.sbatch import NODE_LAUNCHER

    allocation = current_allocation()
    if allocation is None or allocation.inside_step or os.environ.get(UNDER_SRUN_ENV):
        return None
    again = [sys.executable, "-m", "dplaunch", *sys.argv[1:]]
    # the run directory is pinned: a default one is named by the time each node starts
    again += ["--output-dir", str(prepared.run_dir.absolute())]
    return srun_argv(allocation, ["bash", "-c", NODE_LAUNCHER, "dplaunch-node", *again])


def run_under_srun(prepared: PreparedRun, argv: list[str], *, dry_run: bool) -> int:
    """Start one launcher per node with srun; 75 when the ranks checkpointed to be requeued."""
    from dplaunch.launching.prepare import current_allocation
    from dplaunch.launching.preview import print_prepared
    from dplaunch.launching.process import run_supervised
    from dplaunch.rendering.sbatch import REQUEUE_EXIT_STATUS
    from dplaunch.run_directory.environment import REQUEUE_MARK_ENV

    allocation = current_allocation()
    job = allocation.job_id if allocation else "?"
    print_prepared(prepared, show_files=dry_run)
    typer.echo(f"SLURM job {job}, not in an srun step: starting one launcher per node with")
    typer.echo("  " + shlex.join(argv))
    if dry_run:
        return 0
    if shutil.which("srun") is None:
        raise UserError(
            "SLURM",
            f"SLURM job {job} but no srun on PATH",
            "load the SLURM module, or unset SLURM_JOB_ID to run on this machine only",
        )
    mark = prepared.run_dir.absolute() / f"{REQUEUE_MARK_PREFIX}{job}"
    mark.unlink(missing_ok=True)
    prepared.run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, UNDER_SRUN_ENV: "1", REQUEUE_MARK_ENV: str(mark)}
    code = run_supervised(argv, env)
    if code == 0 and mark.exists():
        mark.unlink(missing_ok=True)
        return REQUEUE_EXIT_STATUS
    return code
