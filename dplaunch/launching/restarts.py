"""Automatic restarts (launch.max_restarts): when to start the ranks again, and how nodes agree.

A failed launch is started again from the newest complete checkpoint, after a short backoff,
unless it was a user error (exit 2), dplaunch itself was stopped (Ctrl-C, scancel), the restarts
are used up, or the failure is the one before again: the same error at the same step. The
decision is pure (``restart_verdict``); the edges are the run directory's files.

Nodes of a multi-node job started one command per node (`--nodes`/`--node-rank`, and SLURM,
which starts one dplaunch per node) have a supervisor each. They agree through the run directory,
which they share (a resume needs it: every rank reads the checkpoint there): after its launch
failed, every node writes ``RUN/restarts/attempt-K/node-R.json`` (its first failure); node 0
waits for all of them (or AGREE_SECONDS), decides for the job and writes ``decision.json``; the
other nodes wait for that and follow it. A hostfile job has one supervisor (DeepSpeed's runner
starts every host from node 0), which restarts all hosts by starting the runner again.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dplaunch.launching.process import gist
from dplaunch.run_directory.files import write_text_atomic
from dplaunch.run_directory.layout import (
    METRICS_FILE,
    RESTART_DECISION_FILE,
    RESTARTS_DIR,
    node_failure_file,
    restart_attempt_dir,
)

# backoff before restart K: BACKOFF_SECONDS × 2^(K-1), at most BACKOFF_MAX_SECONDS
BACKOFF_SECONDS = 2.0
BACKOFF_MAX_SECONDS = 60.0
# how long node 0 waits for the other nodes' failures before it decides with what it has
AGREE_SECONDS = 60.0
# how long another node waits for node 0's decision beyond the collective timeout (node 0's
# ranks may wait that long before they fail, then node 0 waits up to AGREE_SECONDS)
FOLLOW_MARGIN_SECONDS = AGREE_SECONDS + 120.0
POLL_SECONDS = 0.2
EXIT_USER_ERROR = 2


@dataclass(frozen=True)
class Failure:
    """How one launch ended: its status, the first failure's line, the step it had reached."""

    status: int
    cause: str
    # the last step the launch logged or checkpointed (None: none before it failed)
    step: int | None
    when: float
    # dplaunch was stopped (a signal to dplaunch itself): never restarted
    stopped: bool = False
    user_error: bool = False

    def same_as(self, other: Failure | None) -> bool:
        """The same error at the same step: a deterministic failure, not worth another restart."""
        return (
            other is not None and other.step == self.step and gist(other.cause) == gist(self.cause)
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Failure:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Verdict:
    """Restart or not, and why (the line the user reads)."""

    restart: bool
    reason: str
    cause: str
    checkpoint_step: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Verdict:
        return cls(**json.loads(text))


def restart_verdict(
    failure: Failure,
    previous: Failure | None,
    restarts_done: int,
    max_restarts: int,
    checkpoint_step: int | None,
) -> Verdict:
    """Whether the job starts again after ``failure`` (``previous``: the failure before it)."""
    cause = failure.cause

    def stop(reason: str) -> Verdict:
        return Verdict(False, reason, cause, checkpoint_step)

    if failure.stopped:
        return stop("dplaunch itself was stopped: no automatic restart")
    if failure.user_error or failure.status == EXIT_USER_ERROR:
        return stop("a user error (exit status 2) is never restarted: fix it and launch again")
    if restarts_done >= max_restarts:
        return stop(
            f"the automatic restarts are used up ({restarts_done} of launch.max_restarts "
            f"{max_restarts})"
        )
    if failure.same_as(previous):
        at = f"step {failure.step}" if failure.step is not None else "the start"
        return stop(
            f"the job failed again at {at} with the same error as before the last restart: a "
            "deterministic failure (a bad data row, a bug, a real out-of-memory) is not restarted"
        )
    return Verdict(True, "", cause, checkpoint_step)


def backoff_seconds(restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, …)."""
    return min(BACKOFF_SECONDS * 2 ** (restart - 1), BACKOFF_MAX_SECONDS)


def metrics_size(run_dir: Path) -> int:
    """Bytes in RUN/metrics.jsonl now: what a launch about to start has not written."""
    try:
        return (run_dir / METRICS_FILE).stat().st_size
    except OSError:
        return 0


def last_step_reached(run_dir: Path, since: int = 0) -> int | None:
    """The last step a launch logged in RUN/metrics.jsonl after byte ``since`` (where it began);
    None when it logged none (it failed before its first step)."""
    step = None
    with contextlib.suppress(OSError), (run_dir / METRICS_FILE).open("rb") as metrics:
        metrics.seek(since)
        for line in metrics.read().decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed rank
            if isinstance(record, dict) and record.get("type") in ("header", "train", "eval"):
                step = record.get("resumed_from_step", record.get("step")) or step
    return step


def record_restart(run_dir: Path, number: int, verdict: Verdict, backoff_s: float) -> None:
    """One `restart` line in RUN/metrics.jsonl (no rank runs now: nothing else writes it)."""
    record = {
        "type": "restart",
        "restart": number,
        "time": round(time.time(), 3),
        "cause": verdict.cause,
        "checkpoint_step": verdict.checkpoint_step,
        "backoff_s": backoff_s,
    }
    with (run_dir / METRICS_FILE).open("a") as metrics:
        metrics.write(json.dumps(record) + "\n")


# --- nodes agree through the shared run directory ------------------------------------------


class NodeAgreement:
    """Node 0 decides whether the whole job restarts; the other nodes follow (see the module doc)."""

    def __init__(self, run_dir: Path, node_rank: int, num_nodes: int, timeout_minutes: float):
        self.folder = run_dir / RESTARTS_DIR
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.follow_s = timeout_minutes * 60 + FOLLOW_MARGIN_SECONDS

    def begin(self) -> None:
        """Node 0, before its first launch: forget the decisions of an earlier dplaunch."""
        if self.node_rank == 0:
            shutil.rmtree(self.folder, ignore_errors=True)

    def decide(
        self,
        attempt: int,
        failure: Failure,
        verdict_for: Callable[[Failure], Verdict],
        say: Callable[[str], None],
    ) -> Verdict:
        """This node's failure in, the job's verdict out (node 0 writes it, the others read it)."""
        folder = self.folder / restart_attempt_dir(attempt)
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / node_failure_file(self.node_rank), failure.to_json())
        decision = folder / RESTART_DECISION_FILE
        if self.node_rank != 0:
            say(f"dplaunch: node {self.node_rank} failed; waiting for node 0's restart decision")
            text = _wait_for_file(decision, self.follow_s)
            if text is None:
                return Verdict(
                    False,
                    f"node 0 gave no restart decision within {self.follow_s:g} s ({decision})",
                    failure.cause,
                )
            return Verdict.from_json(text)
        failures = self._wait_for_nodes(folder)
        # the first failure of the job is its cause (a killed rank on one node makes the ranks
        # of the others fail after it, with connection errors)
        first = min(failures, key=lambda f: f.when)
        verdict = verdict_for(
            Failure(
                status=failure.status,
                cause=first.cause,
                step=max((f.step for f in failures if f.step is not None), default=None),
                when=first.when,
                stopped=any(f.stopped for f in failures),
                user_error=any(f.user_error for f in failures),
            )
        )
        missing = self.num_nodes - len(failures)
        if missing and verdict.restart:
            verdict = Verdict(
                False,
                f"{missing} node(s) did not report within {AGREE_SECONDS:g} s: not restarted",
                verdict.cause,
                verdict.checkpoint_step,
            )
        _write_atomic(decision, verdict.to_json())
        return verdict

    def _wait_for_nodes(self, folder: Path) -> list[Failure]:
        deadline = time.monotonic() + AGREE_SECONDS
        while True:
            found = []
            for rank in range(self.num_nodes):
                with contextlib.suppress(OSError, ValueError, TypeError):
                    found.append(Failure.from_json((folder / node_failure_file(rank)).read_text()))
            if len(found) == self.num_nodes or time.monotonic() > deadline:
                return found
            time.sleep(POLL_SECONDS)


def _wait_for_file(path: Path, limit_s: float) -> str | None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            return path.read_text()
        time.sleep(POLL_SECONDS)
    return None


def _write_atomic(path: Path, text: str) -> None:
    write_text_atomic(path, text + "\n")
