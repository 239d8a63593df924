"""Start this node's ranks, forward signals to all of them, leave no orphans, name the first failure.

`accelerate launch` runs torchrun, and torchrun starts every rank in a session of its own, so one
process group does not cover the job. The supervisor therefore keeps track of every descendant:
it is the children's subreaper (orphaned ranks come back to it), it snapshots the process tree
while the job runs, and when the launcher exits it stops whatever of the tree is left.

With a `RankWatch`, the children's output goes through the supervisor: torchrun's elastic
shutdown noise (its ChildFailedError report and "closing signal" lines) is dropped, the ranks'
one-line errors are held back, and at the end the first failure is printed once, last.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from dplaunch.run_directory.environment import SUPERVISOR_PID_ENV
from dplaunch.run_directory.layout import (
    STACKS_REQUEST_FILE,
    rank_error_file,
    rank_of,
    rank_stacks_file,
)
from dplaunch.stop_signals import STACK_DUMP_SIGNAL, TIMEOUT_RE, exit_handle

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# signals the launcher in between (accelerate → torchrun) handles itself by stopping the ranks
LAUNCHER_HANDLED = (signal.SIGINT, signal.SIGTERM)
GRACE_SECONDS = 20
POLL_SECONDS = 0.25
# the tree is walked every second; orphans come back to us anyway (subreaper) on Linux
REFRESH_EVERY_POLLS = 4
READER_JOIN_SECONDS = 5

# hang dumps: on a collective timeout every rank writes its Python stack (faulthandler, armed by
# dplaunch.train.rank_process) to RUN/errors/stacks-rank-N.txt; the ranks find the folder in
# ERRORS_DIR_ENV
# written by the supervisor that saw the timeout; the other nodes' supervisors watch for it
# the ranks dplaunch starts run one of these modules (any launcher: accelerate, DeepSpeed's runner)
RANK_MODULES = ("dplaunch.train", "dplaunch.train.script")

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def run_supervised(
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str | None = None,
    *,
    watch: RankWatch | None = None,
) -> int:
    """Run argv as the job's launcher; signals go to the launcher and the ranks; return its status.

    Without ``watch`` the children write straight to our terminal.
    """
    libc = _libc()
    if libc is not None:
        # ranks whose launcher died are re-parented to us instead of init, so we can still stop them
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    parent = os.getpid()
    piped = subprocess.PIPE if watch is not None else None
    process = subprocess.Popen(
        list(argv),
        env={**env, SUPERVISOR_PID_ENV: str(parent)},
        cwd=cwd,
        start_new_session=True,
        preexec_fn=lambda: _prepare_launcher(libc, parent),
        stdout=piped,
        stderr=piped,
    )
    tree = ProcessTree(process.pid)
    readers = []
    if watch is not None:
        watch.on_timeout = lambda: tree.signal_dplaunch_ranks(STACK_DUMP_SIGNAL)
        for source, target in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
            reader = threading.Thread(target=watch.pump, args=(source, target), daemon=True)
            reader.start()
            readers.append(reader)

    def forward(signum: int, _frame: object) -> None:
        if watch is not None and signum in LAUNCHER_HANDLED:
            watch.note_signal(signum)
        tree.refresh()
        if signum in LAUNCHER_HANDLED:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)
        else:
            # SIGUSR1 (checkpoint and stop) is for the ranks; the launcher would die of SIGUSR2
            tree.signal_ranks(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    exited = exit_handle(process.pid)
    try:
        polls = 0
        while process.poll() is None:
            if polls % REFRESH_EVERY_POLLS == 0:
                tree.refresh()
                if watch is not None:
                    watch.check_stacks_request()
            polls += 1
            _wait_a_little(exited)
    finally:
        if exited is not None:
            os.close(exited)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if process.poll() is None:  # we are unwinding (an error in dplaunch): stop the job
            _stop_launcher(process)
        leftovers = tree.stop_all(GRACE_SECONDS)
        process.wait()
        for reader in readers:
            reader.join(READER_JOIN_SECONDS)
        if leftovers and watch is not None:
            watch.leftovers = leftovers
        if watch is not None:
            watch.drop_empty_stacks_files()
    code = process.returncode
    return code if code >= 0 else 128 - code


def _wait_a_little(exited: int | None) -> None:
    # POLL_SECONDS, or less when the launcher exits first: dplaunch returns as soon as the job ends
    # (a signal runs its handler and the wait goes on, PEP 475)
    if exited is None:
        time.sleep(POLL_SECONDS)
    else:
        select.select([exited], [], [], POLL_SECONDS)


def _stop_launcher(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


class ProcessTree:
    """Every process the launcher started, directly or not, remembered by (pid, start time)."""

    def __init__(self, root: int):
        import psutil  # accelerate requires it; light (no torch)

        self._psutil = psutil
        self.root = root
        self.known: dict[int, Any] = {}

    def refresh(self) -> None:
        """Remember the descendants alive now (ranks, their workers)."""
        psutil = self._psutil
        sources = [os.getpid(), self.root]
        for pid in sources:
            try:
                children = psutil.Process(pid).children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                self.known.setdefault(child.pid, child)

    def signal_ranks(self, signum: int) -> None:
        """Send a signal to the ranks: the processes the launcher (torchrun) started."""
        try:
            ranks = self._psutil.Process(self.root).children()
        except self._psutil.Error:
            return
        for rank in ranks:
            with contextlib.suppress(self._psutil.Error):
                rank.send_signal(signum)

    def signal_dplaunch_ranks(self, signum: int) -> None:
        """Send a signal to every rank dplaunch started below the launcher, however deep."""
        self.refresh()
        for pid, child in list(self.known.items()):  # the main thread refreshes it meanwhile
            if pid == self.root:
                continue
            with contextlib.suppress(self._psutil.Error):
                argv = child.cmdline()
                if any(
                    argv[i] == "-m" and argv[i + 1] in RANK_MODULES for i in range(len(argv) - 1)
                ):
                    child.send_signal(signum)

    def stop_all(self, grace: float) -> int:
        """SIGTERM what is left of the tree, SIGKILL it after ``grace`` seconds; how many were left."""
        psutil = self._psutil
        self.refresh()
        alive = [c for pid, c in self.known.items() if pid != self.root and _running(c, psutil)]
        if not alive:
            self._reap_zombies()
            return 0
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.terminate()
        _, still = psutil.wait_procs(alive, timeout=grace)
        for child in still:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(still, timeout=5)
        self._reap_zombies()
        return len(alive)

    def _reap_zombies(self) -> None:
        # as subreaper we inherit orphaned ranks; collect their exit status so none stays a zombie
        for pid in list(self.known):
            if pid == self.root:
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def _running(child: Any, psutil: Any) -> bool:
    try:
        return child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --- output of the job: stream it, drop torchrun's shutdown noise, find the first failure -------

# the line a failing dplaunch rank prints (dplaunch.train.__main__): "[rank 3] Type: msg (traceback: PATH)"
RANK_ERROR_RE = re.compile(r"^\[rank (\d+)\] (.+) \(traceback: (.+)\)$")
# torch's excepthook prefixes a rank's uncaught traceback with "[rankN]: "
EXCEPTHOOK_RE = re.compile(r"^\[rank(\d+)\]: (.*)$")
ELASTIC_LOG_RE = re.compile(
    r"^[IWE]\d{4} \S+ \d+ \S*torch/distributed/elastic/multiprocessing/\S+\] "
)
ELASTIC_AGENT_LOG_RE = re.compile(r"^[IWE]\d{4} \S+ \d+ \S*torch/distributed/elastic/\S+\] ")
ELASTIC_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
LAUNCHER_EXCEPTION_RE = re.compile(
    r"^torch\.distributed\.elastic\.\S*(ChildFailedError|SignalException)\b"
)
# Accelerate runs a single rank without torchrun and raises this when it fails: its traceback only
# repeats that the rank failed, which the rank said itself
ONE_RANK_FAILED_RE = re.compile(
    r"^subprocess\.CalledProcessError: Command .* "
    r"(?:returned non-zero exit status (\d+)|died with <Signals\.\w+: (\d+)>)\.$"
)
ONE_RANK_LAUNCHER = "in simple_launcher"
# after dplaunch was asked to stop (Ctrl-C), what ranks and launchers still starting print:
# their KeyboardInterrupt tracebacks, interleaved
INTERRUPTED_TRACEBACK = (
    "Traceback (most recent call last):",
    "KeyboardInterrupt",
    "During handling of the above exception",
    "The above exception was the direct cause",
)
# a process that gets the signal while Python itself starts (importing `site`, before any program
# runs) ends with the interpreter's own report before that traceback: "Fatal Python error:
# init_import_site: Failed to import the site module", "Python runtime state: initialized". C
# writes it in pieces, so two ranks' reports interleave inside a line
INTERRUPTED_START_RE = re.compile(r"Fatal Python error: |^Python runtime state: |^init_\w+: ")
# every rank's DeepSpeed says it "built" the op it only loaded: the launcher built it and said so
DEEPSPEED_OP_LOADED_RE = re.compile(r"^DeepSpeed deepspeed\.ops\.\S+ built successfully$")
WATCHDOG_TIMEOUT = "Watchdog caught collective operation timeout"
MAX_BUFFERED_LINES = 400


@dataclass
class TorchrunFailure:
    """One entry of torchrun's failure report."""

    rank: int
    exitcode: int
    time: float | None = None
    root: bool = False


@dataclass
class RankError:
    """A failure a rank reported itself, and when it was seen."""

    rank: int
    line: str
    when: float


@dataclass
class RankWatch:
    """Filters the job's output while it runs; afterwards, says which rank failed first."""

    errors_dir: Path
    timeout_minutes: float | None = None
    started: float = field(default_factory=time.time)
    signal_received: int = 0
    signal_at: float = 0.0
    leftovers: int = 0
    reported: dict[int, RankError] = field(default_factory=dict)
    raised: dict[int, RankError] = field(default_factory=dict)
    failures: list[TorchrunFailure] = field(default_factory=list)
    timeout_seen: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _traceback: list[str] | None = None
    _in_report: int = 0
    _report_entry: TorchrunFailure | None = None
    _report_root: bool = False
    _report_started: bool = False
    _in_rank_traceback: set[int] = field(default_factory=set)
    # called once when a rank reports a collective timeout: the ranks dump their stacks
    on_timeout: Callable[[], None] | None = None
    # the ranks this supervisor starts (None: all); other nodes' files in a shared errors folder
    # are theirs to clean
    local_ranks: range | None = None
    stacks_requested: bool = False

    def pump(self, source: IO[bytes], target: IO[str]) -> None:
        """Copy one of the job's streams to ours, line by line, through the filter."""
        for raw in iter(source.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            with self._lock:
                shown = self.filter(line, is_stderr=target is sys.stderr)
            if shown:
                _write(target, "\n".join(shown) + "\n")
        with self._lock:
            pending, self._traceback = self._traceback or [], None
        if pending:
            _write(target, "\n".join(pending) + "\n")

    def filter(self, line: str, *, is_stderr: bool = True) -> list[str]:
        """The lines to show for one line of the job's output (often itself, sometimes nothing)."""
        now = time.time()
        if WATCHDOG_TIMEOUT in line:
            self.timeout_seen = True
            self._request_stacks()
        if self._in_report:
            self._read_report_line(line)
            return []
        if self.signal_received and ELASTIC_AGENT_LOG_RE.match(line):
            return []  # "Received 15 death signal, shutting down workers"
        if ELASTIC_LOG_RE.match(line):
            failed = ELASTIC_FAILED_RE.search(line)
            if failed and not self.failures:
                # torchrun's first observed failure; its report block (global ranks) replaces it
                local_rank = int(failed.group(2))
                self.failures.append(TorchrunFailure(local_rank, int(failed.group(1)), root=True))
            return []
        match = RANK_ERROR_RE.match(line)
        if match and Path(match.group(3)).parent.resolve() == self.errors_dir.resolve():
            rank = int(match.group(1))
            self.reported.setdefault(rank, RankError(rank, line, now))
            if TIMEOUT_RE.search(match.group(2)):
                self._request_stacks()
            return []  # held back: the first failure is printed once, at the end
        if DEEPSPEED_OP_LOADED_RE.match(line):
            return []
        match = EXCEPTHOOK_RE.match(line)
        if match:
            self._read_rank_traceback(int(match.group(1)), match.group(2), now)
            return [line]
        if not is_stderr:
            return [line]
        if self.signal_received and (
            line.startswith(INTERRUPTED_TRACEBACK)
            or INTERRUPTED_START_RE.search(line)
            or not line.strip()
            or line[:1] in (" ", "\t")
            or LAUNCHER_EXCEPTION_RE.match(line)
        ):
            # Ctrl-C during start-up: every process still importing prints a traceback, and
            # torchrun's agent its SignalException; dplaunch says in one line who stopped the job
            self._traceback = None
            return []
        # the launcher's own traceback (ChildFailedError, SignalException) only repeats what the
        # ranks said; a rank's traceback before its process group exists looks the same until
        # its last line, so hold tracebacks until then
        if self._traceback is None and line == "Traceback (most recent call last):":
            self._traceback = [line]
            return []
        if self._traceback is not None:
            self._traceback.append(line)
            if line[:1] in (" ", "\t") and len(self._traceback) < MAX_BUFFERED_LINES:
                return []
            held, self._traceback = self._traceback, None
            if LAUNCHER_EXCEPTION_RE.match(line):
                self._in_report = 1 if line.rstrip().endswith("ChildFailedError:") else 0
                return []
            one_rank = ONE_RANK_FAILED_RE.match(line)
            if one_rank and any(ONE_RANK_LAUNCHER in each for each in held):
                status = one_rank.group(1)
                code = int(status) if status is not None else -int(one_rank.group(2))
                self.failures.append(TorchrunFailure(0, code, root=True))
                return []
            return held
        return [line]

    def _read_rank_traceback(self, rank: int, text: str, now: float) -> None:
        if text.startswith("Traceback (most recent call last)"):
            self._in_rank_traceback.add(rank)
        elif rank in self._in_rank_traceback and text and not text[:1].isspace():
            if text.startswith(("During handling", "The above exception", "[")):
                return  # chained-exception glue, or a log line of torch ("[rank0]:[W…]")
            previous = self.raised.get(rank)
            # chained exceptions: the last one printed is the one that ended the rank
            self.raised[rank] = RankError(
                rank, f"[rank {rank}] {text}", previous.when if previous else now
            )
            if TIMEOUT_RE.search(text):
                self._request_stacks()

    def _request_stacks(self) -> None:
        # every live rank of this node dumps its stack now, before torchrun stops them; the
        # request file asks the other nodes' supervisors (the run directory is shared) to do so
        if self.stacks_requested:
            return
        self.stacks_requested = True
        with contextlib.suppress(OSError):
            self.errors_dir.mkdir(parents=True, exist_ok=True)
            (self.errors_dir / STACKS_REQUEST_FILE).write_text(f"{time.time()}\n")
        if self.on_timeout is not None:
            self.on_timeout()

    def check_stacks_request(self) -> None:
        """Dump this node's stacks when another node's supervisor saw a timeout in this launch."""
        if self.stacks_requested:
            return
        with contextlib.suppress(OSError):
            if (self.errors_dir / STACKS_REQUEST_FILE).stat().st_mtime >= self.started:
                with self._lock:
                    self._request_stacks()

    def drop_empty_stacks_files(self) -> None:
        """Ranks that were killed leave their stacks file empty: remove this node's."""
        for path in self.errors_dir.glob(rank_stacks_file("*")):
            rank = rank_of(path.name, rank_stacks_file)
            if self.local_ranks is not None and (rank is None or rank not in self.local_ranks):
                continue
            with contextlib.suppress(OSError):
                if path.stat().st_size == 0:
                    path.unlink()

    def _stacks_line(self) -> str | None:
        # the ranks that timed out waited inside the collective; a rank that dumped its stack
        # without timing out itself was elsewhere: it is the one the others waited for
        dumped = {}
        for path in self.errors_dir.glob(rank_stacks_file("*")):
            rank = rank_of(path.name, rank_stacks_file)
            with contextlib.suppress(OSError):
                stat = path.stat()
                if rank is not None and stat.st_size and stat.st_mtime >= self.started - 1:
                    dumped[rank] = path
        if not dumped:
            return None
        lines = {rank: self._line_of(rank) for rank in dumped}
        for rank, path, _ in self._error_files():
            lines[rank] = lines.get(rank) or _last_line(path)
        outside = sorted(rank for rank in dumped if not TIMEOUT_RE.search(lines.get(rank, "")))
        where = f"{self.errors_dir}/{rank_stacks_file('N')}"
        if not outside:
            return f"dplaunch: every rank timed out inside the collective; their stacks: {where}"
        files = ", ".join(str(dumped[rank]) for rank in outside)
        return (
            f"dplaunch: rank(s) {_ranks_text(outside)} not inside the collective that timed out "
            f"(the others waited there for it); its stack: {files} (every rank's: {where})"
        )

    def _read_report_line(self, line: str) -> None:
        # torchrun's report: a border of '=', Failures: [i]: entries, Root Cause: [0]:, a border.
        # Read for the ranks that died without a word: torch elastic's @record error files hold
        # only Python exceptions, which every rank already writes to RUN/errors/ itself
        # (train/__main__.py); a rank killed by a signal writes none, and its rank, exit status
        # and time of death are in this report only.
        stripped = line.strip()
        if re.fullmatch(r"=+", stripped):
            self._in_report += 1
            if self._in_report > 2:
                self._in_report = 0
            return
        if stripped.startswith("Root Cause"):
            self._report_root = True
            return
        if re.fullmatch(r"\[\d+\]:", stripped):
            if not self._report_started:
                self._report_started, self.failures = True, []
            self._report_entry = TorchrunFailure(-1, 0, root=self._report_root)
            self.failures.append(self._report_entry)
            return
        entry = self._report_entry
        if entry is None:
            return
        key, _, value = (part.strip() for part in stripped.partition(":"))
        if key == "rank":
            entry.rank = int(value.split()[0])
        elif key == "exitcode":
            entry.exitcode = int(value.split()[0])
        elif key == "time":
            with contextlib.suppress(ValueError):
                entry.time = datetime.strptime(value, "%Y-%m-%d_%H:%M:%S").timestamp()

    def note_signal(self, signum: int) -> None:
        """dplaunch itself was asked to stop (Ctrl-C, scancel)."""
        if not self.signal_received:
            self.signal_received, self.signal_at = signum, time.time()

    def stopped_on_purpose(self) -> bool:
        """dplaunch itself was asked to stop (Ctrl-C, scancel) before any rank failed."""
        first = self.first_failure()
        return bool(self.signal_received) and (first is None or first[1] >= self.signal_at)

    def report(self, code: int, run_dir: Path, hints: Sequence[str] = ()) -> list[str]:
        """What to print after the job failed; the first failing rank's error is the last line.

        ``hints`` (e.g. where to resume from) come just before that line.
        """
        first = self.first_failure()
        lines = []
        if self.leftovers:
            lines.append(f"dplaunch: stopped {self.leftovers} process(es) the job left behind")
        stop_line = None
        if self.stopped_on_purpose():
            name = signal.Signals(self.signal_received).name
            stop_line = f"dplaunch: stopped by {name} (sent to dplaunch, passed on to every rank)"
            first = None
        if first is not None:
            later = sorted((set(self.reported) | set(self.raised)) - {first[0]})
            if later:
                same = all(gist(self._line_of(rank)) == gist(first[2]) for rank in later)
                how = "failed the same way" if same else f"failed after rank {first[0]}"
                where = f"tracebacks: {self.errors_dir}/" if self.reported else "output above"
                lines.append(f"dplaunch: rank(s) {_ranks_text(later)} {how} ({where})")
        timed_out = self.timeout_seen or (first is not None and TIMEOUT_RE.search(first[2]))
        if self.timeout_minutes is not None and timed_out:
            lines.append(self._timeout_line())
        if not stop_line:  # stopped on purpose before any rank failed: that one line says it all
            lines.append(f"dplaunch: the job failed with status {code} (run directory: {run_dir})")
        lines += hints
        if stop_line:
            lines.append(stop_line)
        if first is not None:
            lines.append(first[2])
        if timed_out or self.stacks_requested:
            stacks = self._stacks_line()
            if stacks is not None:
                lines.append(stacks)  # after a timeout, the rank to look at is the last line
        return lines

    def _timeout_line(self) -> str:
        line = (
            f"dplaunch: a collective timed out after launch.timeout_minutes = "
            f"{self.timeout_minutes:g} ({self.timeout_minutes * 60:g} s): a rank stopped taking "
            "part (stuck, dead or far slower than the others)"
        )
        # the ranks that waited report the timeout; the one they waited for usually does not
        spoke = set(self.reported) | set(self.raised) | {rank for rank, _, _ in self._error_files()}
        silent = sorted({f.rank for f in self.failures if f.rank >= 0} - spoke)
        if spoke and silent:
            line += f"; rank(s) {_ranks_text(silent)} did not time out themselves: look there first"
        return line + ". If a step really takes that long, raise it: --set launch.timeout_minutes=N"

    def _line_of(self, rank: int) -> str:
        error = self.reported.get(rank) or self.raised.get(rank)
        return error.line if error else ""

    def first_failure(self) -> tuple[int, float, str] | None:
        """(rank, time, line) of the failure that came first, or None when no rank failed."""
        candidates: list[tuple[float, int, int, str]] = []  # (time, preference, rank, line)
        seen = {**self.raised, **self.reported}
        for error in seen.values():
            candidates.append((error.when, 1, error.rank, error.line))
        for rank, path, when in self._error_files():
            if rank not in seen:
                candidates.append(
                    (when, 1, rank, f"[rank {rank}] {_last_line(path)} (traceback: {path})")
                )
        reported = set(seen) | {c[2] for c in candidates}
        for failure in self.failures:
            if failure.rank in reported or failure.exitcode >= 0:
                continue
            signum = -failure.exitcode
            # torchrun ends the other ranks with SIGTERM: only its first observed failure counts
            if signum == signal.SIGTERM and not failure.root:
                continue
            when = failure.time if failure.time is not None else time.time()
            candidates.append((when, 0, failure.rank, killed_line(failure.rank, signum)))
        if not candidates:
            root = next((f for f in self.failures if f.root), None) or (
                self.failures[0] if self.failures else None
            )
            if root is None:
                return None
            line = f"[rank {root.rank}] exited with status {root.exitcode} (its output is above)"
            return root.rank, time.time(), line
        when, _, rank, line = _cause(candidates)
        return rank, when, line

    def _error_files(self) -> list[tuple[int, Path, float]]:
        # ranks on other nodes write here too when the run directory is shared
        found = []
        for path in sorted(self.errors_dir.glob(rank_error_file("*"))):
            rank = rank_of(path.name, rank_error_file)
            with contextlib.suppress(OSError):
                when = path.stat().st_mtime
                if rank is not None and when >= self.started - 1:
                    found.append((rank, path, when))
        return found


# a rank's error that another rank's death causes: its collective lost the peer, or waited for it
PEER_LOST_RE = re.compile(
    r"connection (reset|closed|refused)|broken pipe|peer|socket|gloo|nccl|timed out|timeout",
    re.IGNORECASE,
)


def _cause(candidates: list[tuple[float, int, int, str]]) -> tuple[float, int, int, str]:
    """The first of CANDIDATES (time, 1 for a rank's own error or 0 for a death by a signal, rank,
    line). torchrun's times are whole seconds, taken when it noticed the death: a death counts as
    up to a second earlier, so that it wins over the errors it caused in the other ranks (a lost
    peer, a timeout). An error of a rank's own (a record that is not JSON) causes none of them:
    within that second it is the cause, and the death a consequence (torchrun's kill of the
    ranks left after a failure, which it may time to the same second)."""
    first = min(candidates, key=lambda c: (c[0] if c[1] else c[0] - 1, c[1]))
    if first[1]:
        return first
    own = [
        c
        for c in candidates
        if c[1] and c[0] < first[0] + 1 and not PEER_LOST_RE.search(gist(c[3]))
    ]
    return min(own) if own else first


def gist(line: str) -> str:
    """A rank's message without its rank and traceback path, to tell "the same error" apart."""
    match = RANK_ERROR_RE.match(line)
    text = match.group(2) if match else line
    return re.sub(r"^\[rank ?\d+\]:? ", "", text)


def killed_line(rank: int, signum: int) -> str:
    """ "[rank N] killed by signal S (NAME)": the line for a rank that a signal ended."""
    try:
        name = f" ({signal.Signals(signum).name})"
    except ValueError:
        name = ""
    hint = (
        "; if nobody killed it, the kernel's out-of-memory killer did (see `dmesg`)"
        if signum == signal.SIGKILL
        else ""
    )
    return (
        f"[rank {rank}] was killed by signal {signum}{name} before it could report an error{hint}"
    )


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()
    return "failed"


def _ranks_text(ranks: list[int]) -> str:
    spans: list[str] = []
    start = previous = None
    for rank in ranks:
        if previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            spans.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    if start is not None:
        spans.append(str(start) if start == previous else f"{start}-{previous}")
    return ", ".join(spans)


def _write(target: IO[str], text: str) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):
        target.write(text)
        target.flush()


# --- process set-up ------------------------------------------------------------------------------


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _prepare_launcher(libc: Any, parent: int) -> None:
    # SIGUSR1 asks the ranks to checkpoint and stop (SLURM's time-limit warning). The launcher
    # processes in between (accelerate, torchrun) would die of it, so they inherit it ignored;
    # the ranks install their own handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if libc is not None:
        # if dplaunch is killed (even with SIGKILL) the launcher gets SIGTERM and stops the ranks
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
