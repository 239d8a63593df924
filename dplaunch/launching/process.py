"""Start this node's ranks, forward signals to all of them, leave no orphans, return their status."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
GRACE_SECONDS = 20


def run_supervised(argv: Sequence[str], env: dict[str, str], cwd: str | None = None) -> int:
    """Run argv in its own process group; signals we receive go to the whole group."""
    # SIGUSR1 asks the ranks to checkpoint and stop (SLURM's time-limit warning). The launcher
    # processes in between (accelerate, torchrun) would die of it, so they inherit it ignored;
    # the ranks install their own handler.
    process = subprocess.Popen(
        list(argv), env=env, cwd=cwd, start_new_session=True, preexec_fn=_ignore_usr1
    )
    group = process.pid

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(group, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        code = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reap_group(group)
    return code if code >= 0 else 128 - code


def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def reap_group(group: int, grace: float = GRACE_SECONDS) -> None:
    """Terminate whatever is left of a process group: SIGTERM, then SIGKILL after a grace period."""
    if not _group_alive(group):
        return
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _group_alive(group):
            return
        time.sleep(0.1)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
