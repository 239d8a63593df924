"""DeepSpeed's ops are built once, by the launcher, and a build killed halfway hangs nothing.

torch builds an op under a lock file that records no owner; a build killed by kill -9 (the OOM
killer, a time limit, an automatic restart) left it, and every later DeepSpeed run waited on it
forever, in silence. The launcher now finds who holds a lock (a process of this node that has it
open), removes a stale one with a line, waits for a live one saying so, and builds what the plan
needs before any rank starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dplaunch.launching import deepspeed_ops, op_build
from dplaunch.launching.op_build import BuildLock, clear_stale_lock, find_lock
from tests.helpers import TINY_LLAMA, child_environment, run_dplaunch

OP = "deepspeed_shm_comm"


def _hold_open(lock: Path) -> subprocess.Popen:
    """A process that takes LOCK as torch's FileBaton does (O_CREAT | O_EXCL) and keeps it open."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
            "print('held', flush=True); time.sleep(600)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def _killed_build(op_dir: Path) -> Path:
    """The lock a build killed by SIGKILL leaves behind."""
    op_dir.mkdir(parents=True, exist_ok=True)
    holder = _hold_open(op_dir / op_build.LOCK_FILE)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = op_dir / op_build.LOCK_FILE
    past = time.time() - 10  # the restart comes seconds after the kill
    os.utime(lock, (past, past))
    return lock


def _guarded(function, *args, timeout: float = 60, **kwargs):
    """Run FUNCTION in a thread; fail (instead of hanging the suite) when it does not return."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(function(*args, **kwargs)), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{function.__name__} still waits after {timeout} s"
    return result[0]


def test_a_lock_left_by_a_killed_build_is_removed_with_a_line(tmp_path):
    lock = _killed_build(tmp_path / OP)
    found = find_lock(lock)
    assert found is not None and found.holders == () and found.stale
    said: list[str] = []
    assert _guarded(clear_stale_lock, tmp_path / OP, said.append) is True
    assert not lock.exists()
    assert len(said) == 1 and "stale DeepSpeed build lock" in said[0] and str(lock) in said[0]


def test_a_lock_a_live_process_holds_is_waited_for_and_the_wait_is_said(tmp_path):
    (tmp_path / OP).mkdir()
    lock = tmp_path / OP / op_build.LOCK_FILE
    holder = _hold_open(lock)
    try:
        found = find_lock(lock)
        assert found is not None and found.holders == (holder.pid,) and not found.stale
        said: list[str] = []

        def release_soon() -> None:
            time.sleep(1.5)
            lock.unlink()  # what torch's FileBaton.release does after its build
            holder.kill()

        threading.Thread(target=release_soon, daemon=True).start()
        removed = _guarded(clear_stale_lock, tmp_path / OP, said.append, note_every=0.5)
        assert removed is False
        assert said and all(f"process {holder.pid}" in line for line in said), said
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_on_a_shared_filesystem_is_stale_only_once_nobody_touched_it_for_a_while():
    # a builder on another node is invisible here: dplaunch's builds touch their lock meanwhile
    young = BuildLock(Path("lock"), holders=(), age_s=20, shared=True)
    old = BuildLock(Path("lock"), holders=(), age_s=op_build.SHARED_STALE_SECONDS + 1, shared=True)
    held = BuildLock(Path("lock"), holders=(123,), age_s=3600, shared=False)
    unknown = BuildLock(Path("lock"), holders=None, age_s=5, shared=False)
    assert not young.stale and old.stale and not held.stale and not unknown.stale


def test_sequence_parallel_ranks_build_their_op_in_the_keyed_folder(monkeypatch, tmp_path):
    # Ulysses' collectives run through deepspeed.comm, which builds the op too: before, --sp runs
    # built it in torch's shared ~/.cache/torch_extensions
    from dplaunch.launching.prepare import rank_environment
    from tests.helpers import LLAMA, plan_for

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    plan = plan_for(gpus=2, cpu=True, sp=2, model=LLAMA)
    assert plan.sequence_parallel_size == 2 and not plan.uses_deepspeed
    assert rank_environment(plan, tmp_path)["TORCH_EXTENSIONS_DIR"] == str(
        deepspeed_ops.torch_extensions_dir()
    )
    assert OP in deepspeed_ops.needed_ops(plan)


def test_doctor_names_a_stale_build_lock(tmp_path):
    from dplaunch.commands.doctor import build_lock_warnings

    lock = _killed_build(tmp_path / "some-key" / OP)
    warnings = build_lock_warnings([tmp_path])
    assert len(warnings) == 1 and str(lock) in warnings[0] and "stale" in warnings[0]
    assert lock.exists()  # the doctor only looks


@pytest.mark.multiprocess
def test_a_deepspeed_run_after_a_killed_build_starts_instead_of_waiting_forever(tmp_path):
    # the op built once where the suite builds it, then copied: the lock is this test's own
    shared = deepspeed_ops.torch_extensions_dir()
    env = child_environment()
    if not op_build.is_built(shared, OP):
        op_build.build_op(OP, shared, env, tmp_path / "build.txt", "parallel", print)
    folder = tmp_path / "extensions"
    shutil.copytree(shared / OP, folder / OP, ignore=shutil.ignore_patterns("lock"))
    lock = _killed_build(folder / OP)
    env["TORCH_EXTENSIONS_DIR"] = str(folder)
    flags = ("--cpu", "--gpus", "2", "--zero", "2", "--max-steps", "1")
    # before: every rank waited in torch's FileBaton.wait, forever and without a word
    result = run_dplaunch("train", TINY_LLAMA, *flags, "-o", tmp_path / "run", env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"removed a stale DeepSpeed build lock {lock}" in result.stdout
    assert not lock.exists()


def test_a_build_that_fails_is_one_line_naming_its_log_and_a_long_one_is_said(tmp_path):
    said: list[str] = []
    log = tmp_path / "errors" / "build-nonexistent_op.txt"
    with pytest.raises(op_build.UserError) as refused:
        op_build.build_op(
            "nonexistent_op", tmp_path, child_environment(), log, "parallel", said.append,
            note_every=0.5,
        )  # fmt: skip
    assert "DeepSpeed's nonexistent_op op did not build: KeyError" in refused.value.line()
    assert str(log) in refused.value.line() and log.is_file()
    assert said[0].startswith("dplaunch: building DeepSpeed's nonexistent_op op in")
    # the measured build times (the first ZeRO run's shm op took 115 s where it said "about a
    # minute"), and the progress lines that follow
    assert f"{op_build.BUILD_TIME}; a line every 0.5 s until it is built)" in said[0]
    assert any(line.startswith("dplaunch: still building nonexistent_op (") for line in said)
