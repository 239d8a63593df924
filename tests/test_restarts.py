"""Automatic restarts (launch.max_restarts): a killed or frozen rank costs a restart from the
newest checkpoint, not the night; a failure that repeats itself, a user error, or a failure after
the restarts are used up ends the job with the reason.

Ranks are killed and frozen for real (kill -9 while a checkpoint is being written, the window
the test checkpoint hook opens; SIGSTOP in a step, which the others' collective timeout ends); a
deterministic failure is a disk that is full at the same save every time (the same hook's
file-size limit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dplaunch.launching import restarts
from dplaunch.launching.restarts import Failure, NodeAgreement, restart_verdict
from dplaunch.run_directory.layout import ERRORS_DIR, RUN_LOCK_FILE, rank_stacks_file
from tests.helpers import (
    DDP,
    FAULT,
    REPO,
    child_environment,
    finish_train,
    free_port,
    latest,
    loopback_node_argv,
    losses_by_step,
    rank_pids,
    read_metrics,
    refusal_line,
    run_cli,
    start_train,
    train,
    wait_while_running,
)

EVERY_2 = ("--set", "train.checkpoint_every=2")
ZERO_2 = ("--cpu", "--gpus", "2", "--zero", "2")
KILLED = "was killed by signal 9 (SIGKILL)"


def kill_rank_during_save(run: Path, rank: int, process, after: float = 0.0, step: int = 4) -> None:
    """kill -9 of ``rank`` while checkpoint STEP is being written (the hook sleeps there)."""
    marker = run / "checkpoints" / f".tmp-step-{step}" / "random_states_1.pkl"

    def saving() -> bool:
        try:
            return marker.stat().st_mtime > after and rank in rank_pids(run)
        except OSError:
            return False

    wait_while_running(saving, f"the step-{step} save", process, timeout=400)
    os.kill(rank_pids(run)[rank], signal.SIGKILL)


def restart_records(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if r["type"] == "restart"]


# --- the decision, without processes ------------------------------------------------------------


def failure(cause: str = "[rank 1] was killed by signal 9 (SIGKILL)", step=5, **kw) -> Failure:
    return Failure(**{"status": 1, **kw}, cause=cause, step=step, when=0.0)


def test_a_failure_is_restarted_until_the_restarts_are_used_up_or_it_repeats_itself():
    first = failure()
    assert restart_verdict(first, None, 0, 2, checkpoint_step=4).restart
    # the same error at the same step again (another rank, another traceback path): deterministic
    again = failure("[rank 0] was killed by signal 9 (SIGKILL)")
    verdict = restart_verdict(again, first, 1, 2, checkpoint_step=4)
    assert not verdict.restart and "failed again at step 5 with the same error" in verdict.reason
    # the same error further on is progress; another error at the same step is another failure
    assert restart_verdict(failure(step=7), first, 1, 2, checkpoint_step=6).restart
    assert restart_verdict(failure("[rank 1] OSError: x (traceback: t)"), first, 1, 2, 4).restart
    used = restart_verdict(failure(step=9), first, 2, 2, checkpoint_step=8)
    assert not used.restart and "used up (2 of launch.max_restarts 2)" in used.reason
    for never in (failure(status=2), failure(user_error=True), failure(stopped=True)):
        assert not restart_verdict(never, None, 0, 5, checkpoint_step=4).restart
    assert [restarts.backoff_seconds(n) for n in (1, 2, 3)] == [2, 4, 8]


def test_node_0_decides_for_every_node_from_the_first_failure(tmp_path):
    nodes = [NodeAgreement(tmp_path, rank, 2, timeout_minutes=1) for rank in (0, 1)]
    nodes[0].begin()
    killed = Failure(1, "[rank 1] was killed by signal 9 (SIGKILL)", step=5, when=10.0)
    after = Failure(1, "[rank 0] RuntimeError: Connection closed by peer", step=5, when=11.0)
    follower: list = []
    thread = threading.Thread(
        target=lambda: follower.append(nodes[1].decide(1, killed, None, say=print))
    )
    thread.start()
    verdict = nodes[0].decide(
        1, after, lambda f: restart_verdict(f, None, 0, 1, checkpoint_step=4), say=print
    )
    thread.join(30)
    assert verdict.restart and verdict.cause == killed.cause and verdict.checkpoint_step == 4
    assert follower == [verdict]


# --- real ranks ---------------------------------------------------------------------------------


def records_after(run: Path, kind: str, since: int) -> list[dict]:
    """RUN's metrics records of KIND written after its SINCE-th restart record."""
    found, restarts_seen = [], 0
    for record in read_metrics(run):
        restarts_seen += record["type"] == "restart"
        if record["type"] == kind and restarts_seen == since:
            found.append(record)
    return found


def launch_trained(run: Path, restarts_done: int, step: int = 0) -> bool:
    """The launch after RESTARTS_DONE restarts has logged a step past STEP."""
    with contextlib.suppress(OSError, ValueError):
        return any(r["step"] > step for r in records_after(run, "train", restarts_done))
    return False


def rank_process(run: Path, rank: int) -> int | None:
    """The process that runs RANK of RUN's live launch, served by the fork server or not: the one
    holding its stacks file open (train/rank_process.arm_stack_dump). SIGSTOP must reach it
    itself: a served rank's waiting process (rank_pids) cannot pass that signal on."""
    held = str((run / ERRORS_DIR / rank_stacks_file(rank)).absolute())
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) == held for fd in (entry / "fd").iterdir()):
                    return int(entry.name)
    return None


@pytest.mark.multiprocess
def test_one_zero2_run_survives_a_frozen_rank_and_two_kills_and_ends_with_the_straight_losses(
    tmp_path,
    run_file,
):
    """Three faults one after another in one ZeRO-2 run, each costing a restart from the newest
    checkpoint: rank 1 frozen in a step (SIGSTOP: rank 0, in DeepSpeed's data-parallel
    reduction, times out at launch.timeout_minutes instead of DeepSpeed's 30-minute default),
    kill -9 of rank 0 while the ranks start, kill -9 of rank 1 while checkpoint step 4 is
    written. The run ends with the straight run's per-step losses and weights, bit for bit; a
    second run into its directory meanwhile is refused."""
    straight = tmp_path / "straight"
    train(straight, *ZERO_2, *EVERY_2, config=run_file)
    run = tmp_path / "run"
    process = start_train(
        run_file, run, *ZERO_2, *EVERY_2, "--max-restarts", "8",
        "--set", "launch.timeout_minutes=0.1", **{FAULT: "4:sleep=2"},
    )  # fmt: skip
    # 1. rank 1 frozen in step 2
    wait_while_running(lambda: launch_trained(run, 0), "step 1", process)
    frozen = rank_process(run, 1)
    os.kill(frozen, signal.SIGSTOP)
    # a second run into the directory while this one lives: refused, in one line
    second = run_cli("train", run_file, "-o", run, *ZERO_2, "--resume", "auto")
    refusal_line(second, "output_dir", f"{run} is in use by a live run: dplaunch pid")
    timed_out = run / ERRORS_DIR / "rank-0.txt"
    wait_while_running(timed_out.exists, "rank 0's timeout", process, timeout=120)
    # thawed only now, far too late: torchrun's SIGTERM is waiting for it (else it would wait
    # 30 s more before its SIGKILL)
    os.kill(frozen, signal.SIGCONT)
    wait_while_running(lambda: restart_records(run), "restart 1", process, timeout=120)
    # 2. kill -9 of rank 0 while the ranks start (before a step: another step than the next
    # fault's, or two kills in a row would be "the same error at the same step", not restarted)
    wait_while_running(lambda: 0 in rank_pids(run), "the restarted ranks", process)
    os.kill(rank_pids(run)[0], signal.SIGKILL)
    wait_while_running(lambda: len(restart_records(run)) == 2, "restart 2", process)
    # 3. kill -9 of rank 1 while step 4 is saved
    kill_rank_during_save(run, 1, process, after=restart_records(run)[1]["time"] - 1)
    code, log = finish_train(process, run, timeout=600)
    assert code == 0, log[-4000:]
    records = restart_records(run)
    assert [(r["restart"], r["checkpoint_step"]) for r in records] == [(1, None), (2, None), (3, 2)]
    assert [r["cause"][:8] for r in records] == ["[rank 0]", "[rank 0]", "[rank 1]"], records
    assert "Timed out" in records[0]["cause"] and "launch.timeout_minutes = 0.1 (6 s)" in log
    assert all(KILLED in r["cause"] for r in records[1:]), records
    # the frozen launch's hang dump: both ranks' stacks, and the rank the others waited for.
    # Thawed, the frozen rank either times out itself (no rank was elsewhere) or, when rank 0
    # has already exited, fails on the closed connection (then it is the one named); which comes
    # first is a race inside gloo, and both reports are true
    errors = run / ERRORS_DIR
    assert all((errors / rank_stacks_file(rank)).stat().st_size for rank in (0, 1))
    assert (
        f"dplaunch: every rank timed out inside the collective; their stacks: {errors}/" in log
        or "dplaunch: rank(s) 1 not inside the collective that timed out" in log
    ), log[-4000:]
    assert "dplaunch: restart 1 of 8 (launch.max_restarts) in 2 s, from step 0" in log
    assert "finished after 3 automatic restart(s)" in log
    summary = [r for r in read_metrics(run) if r["type"] == "summary"]
    assert [s["restarts"] for s in summary] == [3]
    assert not (run / RUN_LOCK_FILE).exists()  # the lock went with the job
    assert losses_by_step(run) == losses_by_step(straight)
    restarted, uninterrupted = (
        load_file(str(d / "model" / "model.safetensors")) for d in (run, straight)
    )
    assert all(torch.equal(restarted[name], uninterrupted[name]) for name in uninterrupted)


@pytest.mark.multiprocess
def test_a_failure_that_repeats_at_the_same_step_is_restarted_once_then_stops_with_the_reason(
    tmp_path,
    run_file,
):
    run = tmp_path / "run"
    # the disk is full at every save of step 4 (RLIMIT_FSIZE): a deterministic failure
    process = start_train(
        run_file, run, *DDP, *EVERY_2, "--max-restarts", "3", **{FAULT: "4:max_file_bytes=100000"}
    )
    code, log = finish_train(process, run, timeout=600)
    assert code == 1, log[-4000:]
    assert log.count("dplaunch: restart ") == 1, log[-4000:]
    assert [r["checkpoint_step"] for r in restart_records(run)] == [2]
    lines = log.strip().splitlines()
    assert "could not write checkpoint step 4" in lines[-1], lines[-3:]
    assert lines[-2].startswith(
        "dplaunch: not restarted: the job failed again at step 4 with the same error"
    ), lines[-3:]
    assert latest(run) == "step-2"


@pytest.mark.multiprocess
def test_two_nodes_restart_together_and_a_kill_after_the_restarts_are_used_up_ends_the_job(
    tmp_path,
    run_file,
):
    run = tmp_path / "shared-run"  # both nodes' run directory, as a cluster's shared disk
    port = free_port()
    nodes = []
    for rank in (0, 1):
        log = open(tmp_path / f"node-{rank}.log", "w")  # noqa: SIM115 — closed with the process
        nodes.append(
            subprocess.Popen(
                loopback_node_argv(run_file, rank, port, run, *EVERY_2, "--max-restarts", 1),
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=REPO,
                env=child_environment(**{FAULT: "4:sleep=4"}),
            )
        )
    # rank 1 runs on node 1: killing it fails both nodes' launches
    kill_rank_during_save(run, 1, nodes[1])
    wait_while_running(lambda: restart_records(run), "the restart", nodes[0], timeout=300)
    restarted_at = time.time()
    kill_rank_during_save(run, 1, nodes[1], after=restarted_at)
    codes = [node.wait(timeout=300) for node in nodes]
    logs = [(tmp_path / f"node-{rank}.log").read_text() for rank in (0, 1)]
    assert codes[0] != 0 and codes[1] != 0, logs
    for log in logs:  # both nodes restarted, once, from the same checkpoint
        assert log.count("restart 1 of 1 (launch.max_restarts) in 2 s, from checkpoint step 2") == 1
    assert "waiting for node 0's restart decision" in logs[1]
    (record,) = restart_records(run)
    assert KILLED in record["cause"] and record["checkpoint_step"] == 2
    # the second kill ends the job as without restarts: the newest checkpoint, the killed rank
    # last on its node
    for log in logs:
        assert "not restarted: the automatic restarts are used up (1 of launch.max_restarts 1)" in (
            log
        )
        assert "continue with --resume auto" in log
    node_1 = logs[1].strip().splitlines()
    assert KILLED in node_1[-1] and node_1[-1].startswith("[rank 1]"), node_1[-5:]
    assert latest(run) == "step-2"


def test_dplaunch_launch_refuses_restarts_it_cannot_resume(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("print('hi')\n")
    result = subprocess.run(
        [sys.executable, "-m", "dplaunch", "launch", str(script), "--cpu", "--gpus", "1",
         "--max-restarts", "1", "-o", str(tmp_path / "run")],
        capture_output=True, text=True, env=child_environment(), cwd=REPO, check=False,
    )  # fmt: skip
    refusal_line(result, "launch.max_restarts", "dplaunch train")
    assert not (tmp_path / "run").exists()
