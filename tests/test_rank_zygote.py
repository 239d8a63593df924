"""The suite's fork server for ranks (tests/rank_zygote.py): a rank it starts is the rank a started
process would have been — same numbers, same output, same end — and a rank whose libraries would
import differently starts as itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_environment, cpu_rank_environment, losses_by_step, train, wait_for
from tests.rank_zygote import LOG_NAME, REAL_START_VARIABLE, SOCKET_VARIABLE

pytestmark = pytest.mark.skipif(
    bool(os.environ.get(REAL_START_VARIABLE)), reason=f"{REAL_START_VARIABLE}: no fork server"
)


def server_log() -> Path:
    """This pytest worker's server log (conftest starts the server; its socket is in the environment)."""
    return Path(os.environ[SOCKET_VARIABLE]).with_name(LOG_NAME)


def new_lines(log: Path, offset: int) -> list[str]:
    return log.read_text()[offset:].splitlines()


def test_ranks_from_the_server_train_exactly_as_started_ranks(tmp_path):
    log = server_log()
    offset = len(log.read_text())
    served, started = tmp_path / "served", tmp_path / "started"
    train(served, "--cpu", "--gpus", "2", "--max-steps", "3")
    # a variable transformers reads while it is imported, which the server's import did not see
    verbose = child_environment(TRANSFORMERS_VERBOSITY="warning")
    train(started, "--cpu", "--gpus", "2", "--max-steps", "3", env=verbose)
    lines = new_lines(log, offset)
    assert (
        sum(line.startswith("started dplaunch.train") and str(served) in line for line in lines)
        == 2
    )
    refused = [line for line in lines if line.startswith("refused") and str(started) in line]
    assert len(refused) == 2 and all("TRANSFORMERS_VERBOSITY" in line for line in refused)
    assert len(losses_by_step(served)) == 3
    assert losses_by_step(served) == losses_by_step(started)


def test_a_served_process_prints_and_ends_as_its_rank(tmp_path):
    log = server_log()
    offset = len(log.read_text())
    command = [sys.executable, "-u", "-m", "dplaunch.train"]
    result = subprocess.run(
        command, env=cpu_rank_environment(), capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stderr) == (2, "usage: python -m dplaunch.train RUN_DIR\n")
    assert any(line.startswith("started dplaunch.train [] pid") for line in new_lines(log, offset))


def _ignore_sigusr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _served_rank_blocked(run_dir: Path, **popen) -> tuple[subprocess.Popen, int]:
    """A served rank that blocks reading its run file (a FIFO nobody writes): (waiting process, rank pid)."""
    log = server_log()
    offset = len(log.read_text())
    run_dir.mkdir()
    os.mkfifo(run_dir / "run.yaml")
    waiting = subprocess.Popen(
        [sys.executable, "-u", "-m", "dplaunch.train", str(run_dir)],
        env=cpu_rank_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **popen,
    )

    def started() -> re.Match | None:
        lines = [line for line in new_lines(log, offset) if str(run_dir) in line]
        return re.search(r"pid (\d+)$", lines[0]) if lines else None

    try:
        return waiting, int(wait_for(started, 60, f"the server to start {run_dir}").group(1))
    except AssertionError:
        waiting.kill()
        raise


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_signals_pass_both_ways(tmp_path):
    waiting = []
    try:
        # the rank killed: the waiting process ends by the same signal, as if it had been killed
        process, rank = _served_rank_blocked(tmp_path / "killed")
        waiting.append(process)
        os.kill(rank, signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
        # the waiting process asked to stop: its rank gets the signal, and both end by it; a
        # signal the waiting process started ignoring (dplaunch's SIGUSR1), its rank ignores too
        process, rank = _served_rank_blocked(tmp_path / "stopped", preexec_fn=_ignore_sigusr1)
        waiting.append(process)
        process.send_signal(signal.SIGUSR1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
        wait_for(lambda: _gone(rank), 30, "the stopped rank to end")
        # the waiting process killed outright (no handler runs): its rank does not outlive it
        process, rank = _served_rank_blocked(tmp_path / "orphaned")
        waiting.append(process)
        process.kill()
        process.wait(timeout=30)
        wait_for(lambda: _gone(rank), 30, "the orphaned rank to end")
    finally:
        for process in waiting:
            process.kill()
