"""Interleaved contenders: all of them started, then trained by turns while the others are frozen.

Separate runs a minute apart compare under different machine speeds: on this project's 2-vCPU VMs
the same loop's median step drifted by 30 % over tens of minutes, and stretches of a few steps ran
20-60 % slower than the rest. Here each contender starts alone, takes its first WARMUP steps and is
frozen (SIGSTOP to its whole process tree: launcher and ranks). Then, round after round, each one
in turn is thawed for a few steps and frozen again, so a round compares the contenders within
seconds of each other, and many short rounds replace a few long runs. A step counts only when it
began and ended inside one turn: the first step of a turn straddles the freeze and is dropped. A
frozen contender uses no CPU, only its memory.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    RUN_LIMIT_S,
    RunFailed,
    failure_note,
    median,
    process_tree,
    stop_tree,
)

# how often the harness looks at the step clocks: often enough to freeze a contender early in
# the step after its turn, rarely enough that the harness itself takes no visible CPU
POLL_S = 0.02
# a turn of a few steps that takes longer than this hangs
TURN_LIMIT_S = 120.0
# a finished contender's remaining steps (run by all at once) and its exit
FINISH_LIMIT_S = 300.0


@dataclass
class Contender:
    """One command and the file in which it timestamps its optimizer steps."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    clock: Path
    # one JSON line of the clock → (step, seconds), or None for lines that are not a step
    read_step: Callable[[dict[str, Any]], tuple[int, float] | None]


@dataclass
class Interleaved:
    """What an interleaved session measured."""

    # contender → the median clean step duration of each round (seconds)
    step_s: dict[str, list[float]]
    # contender → seconds from its command to its first step (started alone, the others frozen)
    to_first_step: dict[str, float]


class _Running:
    """A started contender: its process tree, and the steps its clock has shown so far."""

    def __init__(self, contender: Contender):
        self.contender = contender
        self.steps: dict[int, float] = {}
        self._read = 0
        self._partial = ""
        # when the harness first saw step 1 (within POLL_S of it)
        self.first_seen: float | None = None
        contender.clock.unlink(missing_ok=True)
        self.started = time.perf_counter()
        with contender.log.open("w") as out:
            self.process = subprocess.Popen(
                contender.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=contender.env,
                cwd=REPO,
            )

    def last_step(self) -> int:
        """The newest step on the clock (0 before the first), reading only what was appended."""
        try:
            with self.contender.clock.open() as clock:
                clock.seek(self._read)
                text = clock.read()
                self._read = clock.tell()
        except FileNotFoundError:
            return 0
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # a line still being written
        for line in lines:
            with contextlib.suppress(ValueError):
                entry = self.contender.read_step(json.loads(line))
                if entry is not None:
                    self.steps[entry[0]] = entry[1]
        if self.first_seen is None and self.steps:
            self.first_seen = time.perf_counter()
        return max(self.steps, default=0)

    def check(self, deadline: float, step: int) -> None:
        """Fail if it exited, or if the deadline passed before its clock showed STEP."""
        code = self.process.poll()
        if code is not None:
            self._fail(f"exited with {code} before step {step}")
        if time.perf_counter() > deadline:
            self._fail(f"no step {step} in time")

    def send(self, signum: int) -> None:
        import psutil

        for member in process_tree(self.process.pid):
            with contextlib.suppress(psutil.Error):
                member.send_signal(signum)

    def finish(self) -> None:
        """Wait for it (thawed) to run its last steps and exit; it must succeed like any run."""
        try:
            code = self.process.wait(timeout=FINISH_LIMIT_S)
        except subprocess.TimeoutExpired:
            self._fail(f"did not exit within {FINISH_LIMIT_S:.0f} s of its last turn")
        if code != 0:
            self._fail(f"exited with {code}")

    def _fail(self, reason: str) -> None:
        tail = self.contender.log.read_text(errors="replace").splitlines()[-30:]
        raise RunFailed(
            f"{self.contender.name} ({' '.join(self.contender.argv[:6])} …) {reason}; last output:\n"
            + "\n".join(tail)
        )


def interleave(
    turns: dict[str, list[Contender]],
    *,
    warmup: int,
    rounds: int,
    turn_steps: int,
    say: Callable[[str], None] = print,
) -> Interleaved:
    """Start the contenders of each turn together and run them to step WARMUP, then ROUNDS rounds
    in which each turn's contenders train TURN_STEPS steps together while all others are frozen
    (who goes first rotates; a contender that is done waits frozen for the others of its turn);
    every contender must then finish its run and succeed. The runs must have at least
    warmup + (rounds + 1) × turn_steps steps."""
    if turn_steps < 2:
        raise ValueError("a turn needs at least 2 steps: its first one straddles the freeze")
    groups: list[list[_Running]] = []
    step_s: dict[str, list[float]] = {c.name: [] for group in turns.values() for c in group}
    try:
        for contenders in turns.values():
            groups.append([_Running(contender) for contender in contenders])
            _train_together(
                groups[-1], {run.contender.name: warmup for run in groups[-1]}, RUN_LIMIT_S
            )
        every = [run for group in groups for run in group]
        to_first = {run.contender.name: run.first_seen - run.started for run in every}
        for number in range(rounds):
            shift = number % len(groups)
            for group in groups[shift:] + groups[:shift]:
                before = {run.contender.name: run.last_step() for run in group}
                _train_together(group, {name: step + turn_steps for name, step in before.items()})
                for run in group:
                    # a step that ended between the last look and the freeze belongs to this turn
                    after, at = run.last_step(), run.steps
                    start = before[run.contender.name] + 2
                    clean = [at[s] - at[s - 1] for s in range(start, after + 1)]
                    step_s[run.contender.name].append(median(clean))
            say(
                f"  round {number + 1}/{rounds}  "
                + "  ".join(f"{name} {values[-1] * 1e3:.0f} ms" for name, values in step_s.items())
            )
        # the steps left (one turn's worth at most) run by all at once
        for run in every:
            run.send(signal.SIGCONT)
        for run in every:
            run.finish()
    finally:
        for group in groups:
            for run in group:
                if run.process.poll() is None:
                    stop_tree(run.process)
    return Interleaved(step_s, to_first)


def _train_together(
    group: list[_Running], targets: dict[str, int], limit_s: float = TURN_LIMIT_S
) -> None:
    """Thaw the group and freeze each of its contenders once its clock shows its target step."""
    deadline = time.perf_counter() + limit_s
    for run in group:
        run.send(signal.SIGCONT)
    waiting = list(group)
    while waiting:
        for run in list(waiting):
            target = targets[run.contender.name]
            if run.last_step() >= target:
                run.send(signal.SIGSTOP)
                waiting.remove(run)
            else:
                run.check(deadline, target)
        if waiting:
            time.sleep(POLL_S)


def interleave_retrying(
    make_turns: Callable[[], dict[str, list[Contender]]],
    label: str,
    retried: list[str],
    **settings: Any,
) -> Interleaved:
    """interleave(make_turns(), **settings), run once more with fresh runs when a contender fails
    (on a shared machine runs have failed for reasons of their own); the failure is noted in
    RETRIED."""
    try:
        return interleave(make_turns(), **settings)
    except RunFailed as error:
        note = f"{label}: {failure_note(error)}"
        print(f"  {label}: failed, running it again ({note})")
        retried.append(note)
        return interleave(make_turns(), **settings)
