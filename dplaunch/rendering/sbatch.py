"""SbatchSpec → a batch script that runs one `dplaunch` launcher per node under srun.

Pure: returns text. Two quoting worlds meet in a batch script:
- `#SBATCH` lines are comments to bash and are parsed by sbatch itself, which splits on
  blanks, toggles on double quotes, takes backslash as escape and `#` as the start of a
  comment. Nothing there is ever executed, so `$(...)` is harmless; we quote for sbatch.
- every other line is bash: values go through `shlex.quote`, so they are single-quoted words.
Values that contain a newline (or NUL) could start a new line of either kind: refused with
ValueError, which the caller reports as a UserError naming the field.

Requeue: a launcher that exits with REQUEUE_EXIT_STATUS (75) says "the ranks saved a checkpoint
on SLURM's time-limit signal". The script then runs `scontrol requeue`, and the requeued job
runs the same command again, which resumes (`--resume auto`).
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field

from dplaunch.run_directory.environment import REQUEUE_MARK_ENV
from dplaunch.run_directory.layout import REQUEUE_MARK_PREFIX

# SLURM time limits: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (or "infinite"/"UNLIMITED")
_TIME_RE = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|infinite|unlimited)$", re.I)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE_RE = re.compile(r"^[\w./+@:=,-]+$")

# EX_TEMPFAIL: what dplaunch train returns after checkpointing on SIGUSR1/SIGTERM
REQUEUE_EXIT_STATUS = 75
# what SLURM's --signal=SIG@SECONDS accepts
MAX_SIGNAL_SECONDS = 65535
# run on every node by srun when requeue is on: turns 75 into a marker file and exit 0, because
# `srun --kill-on-bad-exit=1` takes any other status for a failure and kills the other nodes
# (srun then returns 143, not 75: measured on SLURM 22.05). Bash ignores USR1, which SLURM sends
# to every process of the step: the ranks handle it, the launcher passes it on, bash would die.
NODE_LAUNCHER = (
    'trap "" USR1; "$@"; status=$?; '
    f'if [ "$status" -eq {REQUEUE_EXIT_STATUS} ]; then touch "${REQUEUE_MARK_ENV}"; exit 0; fi; '
    'exit "$status"'
)


@dataclass(frozen=True)
class SbatchSpec:
    """Everything the batch script needs; one field per SLURM option or script part."""

    job_name: str
    # argv of the launcher run on every node after `srun`, e.g. ["dplaunch", "train", "run.yaml"]
    command: list[str]
    nodes: int = 1
    # GPUs per node (`--gres=gpu:N`); ignored when `cpu` is True
    gpus_per_node: int = 1
    # CPUs for the one launcher task per node (it and its ranks share them)
    cpus_per_task: int = 1
    # wall time in a SLURM format: "20:00:00", "1-00:00:00", "30" (minutes)
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None  # e.g. "abc@h100" on Jean-Zay
    qos: str | None = None
    constraint: str | None = None  # e.g. "h100"
    # `module load` these after `module purge` (nothing module-related when empty)
    modules: list[str] = field(default_factory=list)
    # raw shell lines the user asked for (conda activate, exports), run before srun as written
    setup_lines: list[str] = field(default_factory=list)
    # directory for %x-%j.out / %x-%j.err; sbatch does not create it, the caller must
    log_dir: str = "slurm-logs"
    requeue: bool = False
    # seconds before the time limit at which every process of the srun step gets SIGUSR1
    signal_seconds: int | None = None
    # CPU-only job: no --gres line
    cpu: bool = False
    # exported before srun (srun passes the whole environment to the step)
    env: dict[str, str] = field(default_factory=dict)
    # --hint=nomultithread: one task thread per physical core (IDRIS recommendation)
    nomultithread: bool = True
    # the job's working directory (`--chdir`); None = where sbatch is run
    workdir: str | None = None
    # comment lines at the top (what generated the script, the plan); never parsed
    comments: list[str] = field(default_factory=list)


def render_sbatch(spec: SbatchSpec) -> str:
    """Render the batch script for `spec`; ValueError names the first unusable field."""
    _validate(spec)
    lines = ["#!/bin/bash"]
    lines += [f"# {comment}" if comment else "#" for comment in spec.comments]
    lines += [sbatch_directive(option, value) for option, value in _directives(spec)]
    lines += ["", "set -euo pipefail", ""]
    lines += _setup_lines(spec)
    srun = _srun_words(spec)
    if not spec.requeue:
        lines.append(" ".join(srun) + " " + shlex.join(spec.command))
        return "\n".join(lines) + "\n"
    return "\n".join([*lines, *_requeue_lines(spec, srun)]) + "\n"


def _log_dir(spec: SbatchSpec) -> str:
    return spec.log_dir.rstrip("/") or "/"


def _directives(spec: SbatchSpec) -> list[tuple[str, str | None]]:
    """The #SBATCH options of the job, in the script's order."""
    directives: list[tuple[str, str | None]] = [
        ("job-name", spec.job_name),
        ("nodes", str(spec.nodes)),
        # one launcher per node; it spawns one rank per GPU itself
        ("ntasks-per-node", "1"),
    ]
    if not spec.cpu:
        directives.append(("gres", f"gpu:{spec.gpus_per_node}"))
    directives.append(("cpus-per-task", str(spec.cpus_per_task)))
    if spec.nomultithread:
        directives.append(("hint", "nomultithread"))
    directives.append(("time", spec.time))
    for option in ("account", "partition", "qos", "constraint"):
        value = getattr(spec, option)
        if value:
            directives.append((option, value))
    # '%' starts a filename pattern in --output; '%%' is a literal percent
    log_prefix = f"{_log_dir(spec).replace('%', '%%')}/%x-%j"
    directives.append(("output", f"{log_prefix}.out"))
    directives.append(("error", f"{log_prefix}.err"))
    if spec.signal_seconds is not None:
        # no "B:" prefix: SLURM then signals every process of the srun step (the launcher on
        # each node and the training ranks below it, via proctrack), and not the batch shell.
        # With "B:USR1" only this bash script would get it, and bash runs a trap only after
        # the foreground srun returns, i.e. too late. The launcher must ignore/handle USR1
        # (its default action is to terminate) and the ranks checkpoint on it.
        # SLURM checks time limits about every 30 s, so the signal can come that much later.
        directives.append(("signal", f"USR1@{spec.signal_seconds}"))
    if spec.requeue:
        directives.append(("requeue", None))
        # a requeued job writes to the same log files: append, or its first run's log is lost
        directives.append(("open-mode", "append"))
    if spec.workdir:
        directives.append(("chdir", spec.workdir))
    return directives


def _setup_lines(spec: SbatchSpec) -> list[str]:
    """The exports, then the module loads and setup lines, before srun."""
    lines = []
    # exports first, so that setup lines can use them
    for name, value in spec.env.items():
        lines.append(f"export {name}={shlex.quote(value)}")
    if spec.env:
        lines.append("")
    if spec.modules or spec.setup_lines:
        # module and conda scripts read unset variables; relax -u while they run
        lines.append("set +u")
        if spec.modules:
            lines.append("module purge")
            lines += [f"module load {shlex.quote(module)}" for module in spec.modules]
        for setup in spec.setup_lines:
            lines.extend(setup.splitlines())
        lines += ["set -u", ""]
    return lines


def _srun_words(spec: SbatchSpec) -> list[str]:
    """srun starting one launcher per node."""
    srun = [
        "srun",
        # all three: a job's SLURM_NTASKS reaches srun, which then ignores a lone
        # --ntasks-per-node=1 (measured on SLURM 22.05)
        f"--nodes={spec.nodes}",
        f"--ntasks={spec.nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        # SLURM 22.05 stopped passing the job's --cpus-per-task to srun; say it again
        f"--cpus-per-task={spec.cpus_per_task}",
    ]
    if spec.nomultithread:
        # and the hint with it: an explicit --cpus-per-task could otherwise place the launcher
        # and its ranks on both hardware threads of half the cores
        srun.append("--hint=nomultithread")
    return srun


def _requeue_lines(spec: SbatchSpec, srun: list[str]) -> list[str]:
    """srun through NODE_LAUNCHER, and the requeue when the ranks checkpointed on the signal."""
    mark = shlex.quote(f"{_log_dir(spec)}/{REQUEUE_MARK_PREFIX}") + '"$SLURM_JOB_ID"'
    return [
        f"# {REQUEUE_EXIT_STATUS} from a node's launcher: the ranks saved a checkpoint on SLURM's "
        "time-limit signal;",
        "# the job is then requeued and the same command resumes from that checkpoint.",
        f"export {REQUEUE_MARK_ENV}={mark}",
        f'rm -f "${REQUEUE_MARK_ENV}"',
        f"node_launcher={shlex.quote(NODE_LAUNCHER)}",
        "status=0",
        " ".join(srun)
        + ' bash -c "$node_launcher" dplaunch-node '
        + shlex.join(spec.command)
        + " || status=$?",
        f'if [ "$status" -eq 0 ] && [ -e "${REQUEUE_MARK_ENV}" ]; then',
        f'    rm -f "${REQUEUE_MARK_ENV}"',
        '    echo "dplaunch: checkpoint saved before the time limit: requeueing job $SLURM_JOB_ID" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]


def time_limit_seconds(text: str) -> int | None:
    """Seconds in a SLURM time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None when unlimited."""
    text = text.strip().lower()
    if not _TIME_RE.match(text):
        raise ValueError(f"time: {text!r} is not a SLURM time (e.g. 20:00:00, 1-00:00:00, 30)")
    if text in ("infinite", "unlimited"):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(part) for part in clock.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # H:M:S
        hours, minutes, seconds = parts
    else:  # M, M:S
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def slurm_time(seconds: float) -> str:
    """SECONDS as a SLURM time limit, HH:MM:SS or D-HH:MM:SS (whole seconds, rounded up)."""
    total = math.ceil(seconds)
    days, rest = divmod(total, 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def sbatch_directive(option: str, value: str | None) -> str:
    """One `#SBATCH --option=value` line, quoted the way sbatch (not bash) parses it."""
    if value is None:
        return f"#SBATCH --{option}"
    return f"#SBATCH --{option}={quote_for_sbatch(value)}"


def quote_for_sbatch(value: str) -> str:
    """Quote a value for an #SBATCH line: escape \\ \" ' # and wrap in double quotes if needed."""
    _refuse_line_breaks("value", value)
    # sbatch takes ' as a quote too (an unmatched one is fatal); escaped, it is a plain character
    escaped = re.sub(r"""([\\"'#])""", r"\\\1", value)
    if escaped == value and value and not re.search(r"\s", value):
        return value
    return f'"{escaped}"'


def _validate(spec: SbatchSpec) -> None:
    if not spec.job_name:
        raise ValueError("job_name: empty")
    if "/" in spec.job_name:
        raise ValueError(f"job_name: {spec.job_name!r} contains '/', but it names the log files")
    for index, comment in enumerate(spec.comments):
        _refuse_line_breaks(f"comments[{index}]", comment)
    for name in (
        "job_name",
        "time",
        "partition",
        "account",
        "qos",
        "constraint",
        "log_dir",
        "workdir",
    ):
        value = getattr(spec, name)
        if value is not None:
            _refuse_line_breaks(name, value)
    for name in ("nodes", "cpus_per_task") + (() if spec.cpu else ("gpus_per_node",)):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {value!r} is not a positive integer")
    time_limit_seconds(spec.time)  # ValueError naming time
    if spec.signal_seconds is not None and (
        not isinstance(spec.signal_seconds, int)
        or not 0 < spec.signal_seconds <= MAX_SIGNAL_SECONDS
    ):
        raise ValueError(
            f"signal_seconds: {spec.signal_seconds!r} is not in 1..{MAX_SIGNAL_SECONDS}"
        )
    if not spec.command:
        raise ValueError("command: empty")
    for index, arg in enumerate(spec.command):
        _refuse_line_breaks(f"command[{index}]", arg)
    for module in spec.modules:
        if not _MODULE_RE.match(module):
            raise ValueError(f"modules: {module!r} is not a module name")
    for name, value in spec.env.items():
        if not _ENV_NAME_RE.match(name):
            raise ValueError(f"env: {name!r} is not a shell variable name")
        _refuse_line_breaks(f"env.{name}", value)
    for index, line in enumerate(spec.setup_lines):
        if "\0" in line:
            raise ValueError(f"setup_lines[{index}]: contains a NUL byte")


def _refuse_line_breaks(name: str, value: str) -> None:
    if any(char in value for char in "\n\r\0"):
        raise ValueError(f"{name}: {value!r} contains a line break")
