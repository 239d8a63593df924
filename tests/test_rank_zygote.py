"""The suite's fork servers (tests/rank_zygote.py): a process they start is the process a real start
would have been — same numbers, same output, same signals, same end, its children where dplaunch
and the tests look for them — and one whose libraries would import differently starts as itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    TINY_LLAMA,
    child_environment,
    cpu_rank_environment,
    losses_by_step,
    run_dplaunch,
    run_processes,
    train,
    wait_for,
)
from tests.rank_zygote import HOLD_VARIABLE, LOG_NAME, REAL_START_VARIABLE, SOCKET_VARIABLE

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
    # the command line, the launcher and its 2 ranks, each time
    served_lines = [line.split(" [")[0] for line in lines if str(served) in line]
    assert sorted(served_lines) == [
        "started accelerate.commands.launch",
        "started dplaunch",
        "started dplaunch.train",
        "started dplaunch.train",
    ]
    refused = [line for line in lines if line.startswith("refused") and str(started) in line]
    assert len(refused) == 4 and all("TRANSFORMERS_VERBOSITY" in line for line in refused)
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


def _served_rank_blocked(
    run_dir: Path, *, preexec_fn=None, **variables: str
) -> tuple[subprocess.Popen, int]:
    """A served rank that blocks reading its run file (a FIFO nobody writes): (waiting process, rank pid)."""
    log = server_log()
    offset = len(log.read_text())
    run_dir.mkdir()
    os.mkfifo(run_dir / "run.yaml")
    waiting = subprocess.Popen(
        [sys.executable, "-u", "-m", "dplaunch.train", str(run_dir)],
        env=cpu_rank_environment(**variables),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=preexec_fn,
    )

    def started() -> re.Match | None:
        lines = [line for line in new_lines(log, offset) if str(run_dir) in line]
        return re.search(r"pid (\d+)$", lines[0]) if lines else None

    try:
        return waiting, int(wait_for(started, 60, f"the server to start {run_dir}").group(1))
    except AssertionError:
        waiting.kill()
        raise


def _signals(pid: int, field: str) -> int:
    """A process's set of signals from /proc (SigCgt: caught, ShdPnd: pending), as a bit mask."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _bit(number: int) -> int:
    return 1 << (number - 1)


def _start_in_its_own_session(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """ARGV in a session of its own, as dplaunch starts a launcher, its output discarded."""
    return subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def test_signals_pass_both_ways(tmp_path):
    import psutil

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
        wait_for(lambda: not psutil.pid_exists(rank), 30, "the stopped rank to end")
        # the same signal while the rank is just forked, before it took over those dispositions
        # (HOLD_VARIABLE keeps it there): held, then ignored, not the server's default action (a
        # fresh-clone failure: a checkpoint conversion killed by SIGUSR1)
        process, rank = _served_rank_blocked(
            tmp_path / "just-forked", preexec_fn=_ignore_sigusr1, **{HOLD_VARIABLE: "3"}
        )
        waiting.append(process)
        # once the waiting process relays it (its handler is in place), not before: it ignores it
        wait_for(lambda: _signals(process.pid, "SigCgt") & _bit(signal.SIGUSR1), 30, "the relay")
        process.send_signal(signal.SIGUSR1)
        wait_for(
            lambda: process.poll() is not None or _signals(rank, "ShdPnd") & _bit(signal.SIGUSR1),
            30,
            "SIGUSR1 to reach the held rank",
        )
        assert process.poll() is None and psutil.pid_exists(rank)  # held there, not its death
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
        # the waiting process killed outright (no handler runs): its rank does not outlive it
        process, rank = _served_rank_blocked(tmp_path / "orphaned")
        waiting.append(process)
        process.kill()
        process.wait(timeout=30)
        wait_for(lambda: not psutil.pid_exists(rank), 30, "the orphaned rank to end")
    finally:
        for process in waiting:
            process.kill()


def test_a_served_launchers_ranks_have_stand_ins_where_dplaunch_looks_for_them(tmp_path):
    """dplaunch signals the ranks it finds as its launcher's children (ProcessTree): a served
    launcher's waiting process has one stand-in per rank there, with the rank's command line and
    its own session (as torchrun starts ranks), and a stand-in killed takes its rank along."""
    import psutil

    run = tmp_path / "run"
    assert run_dplaunch("config", TINY_LLAMA, "--cpu", "--gpus", "2", "-o", run).returncode == 0
    (run / "run.yaml").unlink()
    os.mkfifo(run / "run.yaml")  # the ranks block reading it
    log = server_log()
    offset = len(log.read_text())
    # the launch command and environment dplaunch rendered for the run (its launch.sh execs the
    # launcher: same process)
    launcher = _start_in_its_own_session(["bash", str(run / "launch.sh")], child_environment())
    try:
        stand_ins = wait_for(
            lambda: len(children := psutil.Process(launcher.pid).children()) == 2 and children,
            60,
            "two stand-ins under the launcher",
        )
        for stand_in in stand_ins:
            assert stand_in.cmdline()[-3:] == ["-m", "dplaunch.train", str(run)]
            assert os.getsid(stand_in.pid) == stand_in.pid
        served = lambda: [  # noqa: E731
            line for line in new_lines(log, offset) if str(run) in line and "started" in line
        ]
        lines = wait_for(lambda: len(served()) == 3 and served(), 60, "the launcher and 2 ranks")
        ranks = [int(line.rsplit(" ", 1)[1]) for line in lines if "started dplaunch.train" in line]
        assert len(ranks) == 2 and "started accelerate.commands.launch" in lines[0]
        stand_ins[0].kill()
        assert launcher.wait(timeout=120) != 0  # torchrun saw a rank die and stopped the other
        for rank in ranks:
            wait_for(lambda rank=rank: not psutil.pid_exists(rank), 60, f"rank {rank} to end")
        assert not psutil.pid_exists(stand_ins[1].pid)
    finally:
        launcher.kill()


def test_a_served_command_lines_launcher_has_a_stand_in_in_its_own_session(tmp_path):
    """Tests look for dplaunch's children and signal its process group: the served command line's
    waiting process has a stand-in for its launcher (a session leader, as dplaunch starts it),
    and dplaunch stopped by SIGTERM stops everything, stand-ins included."""
    import psutil

    script = tmp_path / "wait.py"
    script.write_text("import time\ntime.sleep(600)\n")
    log = server_log()
    offset = len(log.read_text())
    run = tmp_path / "run"
    command = [sys.executable, "-m", "dplaunch", "launch", str(script), "--cpu", "--gpus", "2"]
    process = _start_in_its_own_session([*command, "-o", str(run)], child_environment())
    try:
        launcher = wait_for(
            lambda: next(iter(psutil.Process(process.pid).children()), None),
            60,
            "a stand-in for the launcher under dplaunch",
        )
        assert "accelerate.commands.launch" in launcher.cmdline()
        assert os.getsid(launcher.pid) == launcher.pid
        wait_for(
            lambda: sum("started dplaunch.train.script" in x for x in new_lines(log, offset)) == 2,
            60,
            "the 2 ranks",
        )
        assert any(line.startswith("started dplaunch [") for line in new_lines(log, offset))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) != 0
        wait_for(lambda: not run_processes(str(tmp_path)), 60, "every process of the run to end")
    finally:
        process.kill()
