"""This node's workers of a TensorFlow (or other non-torchrun) job: `python -m dplaunch.launching.workers SPEC`.

What torchrun is for PyTorch ranks, in a few lines: start every worker of the spec (its argv
with its own variables, e.g. TF_CONFIG), wait, and when one fails stop the others and exit with
the first failure's status. dplaunch's supervisor (launching.process.run_supervised) runs this
as the job's launcher, so signals, orphans and the one-line failure summary work as for ranks.

A worker that raises prints its traceback prefixed with "[rankN]: " (dplaunch.train.script), as
torch's ranks do; one that dies without a word (a signal, a bare exit status) gets a line in
RUN/errors/rank-N.txt from here: the supervisor names it from either.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dplaunch.launching.process import GRACE_SECONDS, POLL_SECONDS, killed_line
from dplaunch.run_directory.environment import TRACEBACK_PREFIX_ENV
from dplaunch.run_directory.layout import rank_error_file


@dataclass
class Worker:
    """One process of this node: its global index, argv and the variables it gets on top."""

    rank: int
    argv: list[str]
    env: dict[str, str]


def render_workers_spec(workers: list[Worker], errors_dir: Path) -> str:
    """The spec file this launcher reads (workers.json in the run directory)."""
    spec = {
        "errors_dir": str(errors_dir),
        "workers": [{"rank": w.rank, "argv": w.argv, "env": w.env} for w in workers],
    }
    return json.dumps(spec, indent=2) + "\n"


def read_workers_spec(path: Path) -> tuple[list[Worker], Path]:
    """The workers and the errors directory of a spec file."""
    spec = json.loads(path.read_text())
    workers = [Worker(int(w["rank"]), list(w["argv"]), dict(w["env"])) for w in spec["workers"]]
    return workers, Path(spec["errors_dir"])


def run_workers(workers: list[Worker], errors_dir: Path) -> int:
    """Start the workers, wait; on the first failure stop the rest. The job's exit status."""
    stopping: list[int] = []
    running: dict[int, subprocess.Popen] = {}

    def stop(signum: int, _frame: object) -> None:
        # SIGTERM/SIGINT from dplaunch (or our parent-death signal): pass it on, then wait
        stopping.append(signum)
        for process in list(running.values()):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    for worker in workers:
        env = {**os.environ, **worker.env, TRACEBACK_PREFIX_ENV: "1"}
        running[worker.rank] = subprocess.Popen(worker.argv, env=env)
    first: tuple[int, int] | None = None  # (rank, status)
    while running:
        for rank, process in list(running.items()):
            code = process.poll()
            if code is None:
                continue
            del running[rank]
            if code != 0 and first is None and not stopping:
                first = (rank, code)
                _note_silent_failure(errors_dir, rank, code)
                _stop(running)
        if running:
            time.sleep(POLL_SECONDS)
    if first is not None:
        return _status(first[1])
    if stopping:
        return 128 + stopping[0]
    return 0


def _stop(running: dict[int, subprocess.Popen]) -> None:
    # the peers of a failed worker would wait in their next collective until its timeout
    for process in running.values():
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
    deadline = time.monotonic() + GRACE_SECONDS
    for process in running.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()


def _note_silent_failure(errors_dir: Path, rank: int, code: int) -> None:
    # a worker that raised said so itself ("[rankN]: Traceback …"); this line is what the
    # supervisor shows when it did not (killed, or an exit status without a traceback)
    if code < 0:
        why = killed_line(rank, -code).split("] ", 1)[1]  # the supervisor adds "[rank N] "
    else:
        why = f"exited with status {code} (its output is above)"
    errors_dir.mkdir(parents=True, exist_ok=True)
    (errors_dir / rank_error_file(rank)).write_text(why + "\n")


def _status(code: int) -> int:
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m dplaunch.launching.workers SPEC.json", file=sys.stderr)
        return 2
    workers, errors_dir = read_workers_spec(Path(argv[0]))
    return run_workers(workers, errors_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
