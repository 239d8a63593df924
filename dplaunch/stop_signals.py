"""Signals between dplaunch and its ranks: stopping early on what SLURM (or a user) sends and the
exit status that says so; the hang dump after a collective timed out; noticing a process's end.

SIGUSR1 (SLURM's time-limit warning) or SIGTERM makes the ranks checkpoint at the next step
boundary and stop; `dplaunch train` then exits 75, on which the SLURM script requeues. The
launcher notes SIGUSR1 the same way while it re-shards a checkpoint, before any rank exists.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

# "checkpointed on a signal; continue with --resume auto" (EX_TEMPFAIL): the SLURM script requeues on it
EXIT_CHECKPOINTED = 75
# `dplaunch train`'s exit status when the non-finite guard (train.on_nonfinite) stopped the run
# (2 is a user error, 75 a checkpointed stop that a requeue continues): not worth retrying as is
EXIT_NONFINITE = 3
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# after a collective timed out the supervisor sends this to every rank, which then writes its
# Python stack (faulthandler) to RUN/errors/stacks-rank-N.txt
STACK_DUMP_SIGNAL = signal.SIGUSR2
# a rank's error that says a collective timed out (torch's watchdog, gloo, NCCL)
TIMEOUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)


def exit_handle(pid: int) -> int | None:
    """A pidfd that becomes readable when ``pid`` exits; None where Linux or Python has none
    (poll instead) or when the process is already gone."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class StopSignals:
    """SIGUSR1/SIGTERM set a flag; the loop stops at the next step boundary. Repeats are harmless.

    ``starting`` (a rank before its first step): SIGTERM keeps its default action and ends the
    rank at once, even inside a collective or a C++ call where no Python handler runs: nothing
    is trained yet to save, and torchrun would kill it 30 s later anyway (SLURM after its
    KillWait). SIGUSR1, SLURM's warning minutes before the time limit, waits for the first step
    still. ``started()`` hands SIGTERM to the flag too. The launcher notes SIGUSR1 alone the same
    way while it re-shards a checkpoint (``signals``).
    """

    def __init__(
        self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS, *, starting: bool = False
    ) -> None:
        self.received: str | None = None
        self.starting = starting
        self._signals = signals
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in self._signals:
            if self.starting and sig == signal.SIGTERM:
                self._previous[sig] = signal.signal(sig, signal.SIG_DFL)
            else:
                self._previous[sig] = signal.signal(sig, self._handle)

    def started(self) -> None:
        """The first step begins: from now on SIGTERM checkpoints at a step boundary as well."""
        if self.starting:
            self.starting = False
            if signal.SIGTERM in self._signals:
                signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        # only a flag: the save in progress (if any) goes on untouched, a second signal changes nothing
        if self.received is None:
            self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
