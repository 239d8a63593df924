"""Reliability and security with real processes: a dying rank ends the job with its own error as
the last line, a stuck rank becomes a timeout error, no process outlives the job, busy ports are
avoided, launch.sh quotes every value, secrets stay out of the run, the umask is respected.

Faults are injected from outside, as they happen for real: user scripts that raise, kill or
stop themselves (run through `dplaunch launch`, the same launcher), a data mistake that breaks
only one rank, and signals sent to a rank, to the launcher or to dplaunch found in the process tree.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.helpers import (
    REPO,
    TINY_LLAMA,
    child_environment,
    free_port,
    last_line,
    output,
    run_dplaunch,
    run_processes,
    start_dplaunch,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.multiprocess

# every rank of these scripts builds its process group the way dplaunch's loop does: gloo, with
# launch.timeout_minutes, which dplaunch passes to the ranks as DPLAUNCH_TIMEOUT_MINUTES
PRELUDE = """
import os, signal, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
minutes = float(os.environ["DPLAUNCH_TIMEOUT_MINUTES"])
dist.init_process_group("gloo", timeout=timedelta(minutes=minutes))
rank = dist.get_rank()
def say(text):  # one write per line: print() writes the newline separately, ranks interleave
    sys.stdout.write(text + "\\n")
    sys.stdout.flush()
say(f"rank {rank} ready")
"""
RANK_1_RAISES = """
if rank == 1:
    time.sleep(1)  # rank 0 is waiting (in its all-reduce or its sleep) by then
    open(sys.argv[1], "w").write(str(time.time()))
    raise ValueError("rank one broke on purpose")
"""
# rank 0 waits for rank 1 inside an all-reduce and gets a connection error when rank 1 dies
RAISES_ON_RANK_1 = (
    RANK_1_RAISES
    + """
# torchrun SIGTERMs rank 0 within its 0.1 s poll of rank 1's exit; a plain script would die of it
# before its connection error prints whenever that error is slower (a cold machine): rank 0 defers
# SIGTERM as dplaunch's loop does, so it always gets to report (the plain case is the next test)
signal.signal(signal.SIGTERM, lambda signum, frame: None)
dist.all_reduce(torch.ones(1))
"""
)
# rank 0 is nowhere near a collective when rank 1 raises: torchrun's SIGTERM ends it, silently
RAISES_WHILE_RANK_0_SLEEPS = RANK_1_RAISES + "time.sleep(120)\n"
KILLS_ITSELF_ON_RANK_1 = """
if rank == 1:
    time.sleep(1)
    open(sys.argv[1], "w").write(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(torch.ones(1))
"""
SLEEPS_ON_RANK_1 = """
if rank == 1:
    time.sleep(300)  # stuck: far longer than the 6 s collective timeout
dist.all_reduce(torch.ones(1))
"""
WAITS_FOR_SIGNALS = """
def on_signal(signum, frame):
    say(f"rank {rank} got {signal.Signals(signum).name[3:]}")
signal.signal(signal.SIGUSR1, on_signal)
signal.signal(signal.SIGUSR2, on_signal)
while True:
    time.sleep(0.2)
"""
REPORTS = """
total = torch.ones(1)
dist.all_reduce(total)
say("REPORT " + json.dumps({"rank": rank, "port": os.environ["MASTER_PORT"],
    "sum": int(total.item()), "args": sys.argv[1:]}))
dist.destroy_process_group()  # without it gloo may abort at exit ("terminate called…", SIGABRT)
"""
TEARDOWN_LIMIT_S = 30
SECRETS = {
    "HF_TOKEN": "hf_secretvalue123",
    "HUGGING_FACE_HUB_TOKEN": "hf_hubsecret456",
    "WANDB_API_KEY": "wandbkey789abc",
    "MY_SERVICE_SECRET": "s3cr3t-service",
    "DB_PASSWORD": "pa55word-db",
    "AWS_SECRET_ACCESS_KEY": "awsKEYabc/def+ghi",
}
# a value that runs a command if anything ever evaluates it unquoted
EVIL = 'it\'s a "q" $(touch pwned) `touch pwned2`; touch pwned3 &'


def write_script(tmp: Path, name: str, body: str) -> Path:
    path = tmp / name
    path.write_text(PRELUDE + body)
    return path


def assert_no_launcher_noise(text: str) -> None:
    # torchrun's own report and shutdown chatter bury the one line that matters
    for noise in ("ChildFailedError", "Root Cause", "closing signal", "elastic/multiprocessing"):
        assert noise not in text, f"{noise!r} in the output:\n{text[-3000:]}"


def rank_pid(dplaunch: subprocess.Popen, rank: int) -> int:
    """The pid of a training rank, found in dplaunch's process tree."""

    def find():
        for child in psutil.Process(dplaunch.pid).children(recursive=True):
            try:
                if "dplaunch.train" in child.cmdline() and child.environ().get("RANK") == str(rank):
                    return child.pid
            except psutil.Error:
                continue
        return None

    return wait_for(find, 60, f"rank {rank}")


def training_started(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and '"type": "train"' in metrics.read_text()


def long_training_run(tmp: Path, *extra) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp / "run"
    dplaunch = start_dplaunch(
        tmp,
        "train",
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "2",
        "--max-steps",
        "5000",
        "-o",
        run_dir,
        *extra,
    )
    wait_for(lambda: training_started(run_dir) or dplaunch.poll() is not None, 300, "step 1")
    assert dplaunch.poll() is None, output(tmp)
    return dplaunch, run_dir


# --- a dying rank ends the job --------------------------------------------------------------------


def test_a_rank_that_raises_ends_the_job_and_its_error_is_printed_once_last(tmp_path):
    script = write_script(tmp_path, "raises.py", RAISES_ON_RANK_1)
    stamp = tmp_path / "raised-at"
    dplaunch = start_dplaunch(
        tmp_path, "launch", script, "--cpu", "--gpus", "2", "-o", tmp_path / "run", "--", stamp
    )
    wait_for(lambda: len(run_processes(str(script))) >= 2, 60, "the ranks")
    code = dplaunch.wait(timeout=120)
    ended = time.time()
    stdout, stderr = output(tmp_path)
    assert code != 0
    assert last_line(stderr) == "[rank 1] ValueError: rank one broke on purpose"
    # the rank's own traceback went by above ("[rank1]: ...", torch's prefix); the summary once
    assert stderr.count("[rank 1] ValueError") == 1
    assert "rank(s) 0 failed after rank 1" in stderr  # rank 0's connection error came second
    assert_no_launcher_noise(stdout + stderr)
    teardown = ended - float(stamp.read_text())
    print(f"teardown after a raise: {teardown:.1f} s")
    assert teardown < TEARDOWN_LIMIT_S
    assert run_processes(str(script)) == []


def test_a_rank_the_launcher_stopped_is_not_reported_as_failed(tmp_path):
    script = write_script(tmp_path, "raises.py", RAISES_WHILE_RANK_0_SLEEPS)
    result = run_dplaunch(
        "launch", script, "--cpu", "--gpus", "2", "-o", tmp_path / "run",
        "--", tmp_path / "raised-at", timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert last_line(result.stderr) == "[rank 1] ValueError: rank one broke on purpose"
    assert "rank 0" not in result.stderr  # no failure line for it ("rank 0 ready" is on stdout)
    assert "rank(s)" not in result.stderr
    assert_no_launcher_noise(result.stdout + result.stderr)
    assert run_processes(str(script)) == []


def test_a_single_failing_rank_is_its_own_error_not_accelerates_traceback(tmp_path):
    # one rank: Accelerate runs it without torchrun and raised CalledProcessError at us
    script = tmp_path / "fails.py"
    script.write_text('raise ValueError("the one rank broke")\n')
    result = run_dplaunch("launch", script, "--cpu", "--gpus", "1", "-o", tmp_path / "run")
    assert result.returncode == 1
    assert "CalledProcessError" not in result.stderr and "simple_launcher" not in result.stderr
    assert "ValueError: the one rank broke" in result.stderr  # the script's own traceback
    assert last_line(result.stderr) == "[rank 0] exited with status 1 (its output is above)"


def test_ctrl_c_while_the_ranks_start_is_one_line_without_tracebacks(tmp_path):
    # with automatic restarts too: a stop on purpose is never restarted, and needs no word of it
    dplaunch = start_dplaunch(
        tmp_path, "train", TINY_LLAMA, "--cpu", "--gpus", "2", "--max-restarts", "1",
        "-o", tmp_path / "run",
    )  # fmt: skip
    # the launcher and the ranks are importing torch: each would print a KeyboardInterrupt
    wait_for(lambda: len(run_processes(str(tmp_path / "run"))) >= 3, 60, "the ranks")
    assert_ctrl_c_is_one_line(dplaunch, tmp_path)


# imported by `site` while Python starts, before any program (or its handlers) exists
HOLD_RANKS_IN_SITE = """import os, time
if "LOCAL_RANK" in os.environ:  # torchrun's ranks, not the launcher
    open(os.path.join(os.path.dirname(__file__), f"held-{os.getpid()}"), "w").close()
    time.sleep(120)
"""


def test_ctrl_c_while_python_itself_starts_in_the_ranks_is_one_line(tmp_path):
    # a rank interrupted inside `site` ends with "Fatal Python error: init_import_site" and a
    # traceback (seen once as a rare race of the test above); here the ranks are held there
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD_RANKS_IN_SITE)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    dplaunch = start_dplaunch(
        tmp_path, "train", TINY_LLAMA, "--cpu", "--gpus", "2", "-o", tmp_path / "run",
        env=child_environment(PYTHONPATH=path),
    )  # fmt: skip
    wait_for(lambda: len(list(site.glob("held-*"))) == 2, 60, "the ranks in site")
    assert_ctrl_c_is_one_line(dplaunch, tmp_path)


def test_two_ranks_reports_of_python_interrupted_while_starting_are_dropped_even_interleaved(
    tmp_path,
):
    # C writes "Fatal Python error: ", then the function, then the message: the test above saw
    # the two ranks' pieces in one line
    from dplaunch.launching.process import RankWatch

    report = [
        "Fatal Python error: Fatal Python error: init_import_site: Failed to import the site module",
        "init_import_site: Failed to import the site module",
        "Python runtime state: initialized",
        "Python runtime state: initialized",
        "Traceback (most recent call last):",
        '  File "<frozen site>", line 548, in execsitecustomize',
        "KeyboardInterrupt",
    ]
    watch = RankWatch(tmp_path / "errors")
    assert [watch.filter(line) for line in report[:4]] == [[line] for line in report[:4]]
    watch.note_signal(signal.SIGINT)  # only once dplaunch was asked to stop
    assert [watch.filter(line) for line in report] == [[]] * len(report)
    assert watch.filter("[dplaunch] a line after the stop") == ["[dplaunch] a line after the stop"]


def assert_stopped_in_one_line(stderr: str, name: str) -> None:
    # the stop is the report, in one line: no "the job failed with status 130" before it
    stopped = f"dplaunch: stopped by {name} (sent to dplaunch, passed on to every rank)"
    said = [line for line in stderr.splitlines() if line.startswith("dplaunch: ")]
    assert said == [stopped] and last_line(stderr) == stopped, stderr


def assert_ctrl_c_is_one_line(dplaunch: subprocess.Popen, tmp_path: Path) -> None:
    dplaunch.send_signal(signal.SIGINT)
    code = dplaunch.wait(timeout=120)
    stdout, stderr = output(tmp_path)
    assert code != 0
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "Fatal Python error" not in stderr and "Python runtime state" not in stderr, stderr
    assert_stopped_in_one_line(stderr, "SIGINT")
    assert run_processes(str(tmp_path / "run")) == []


def test_sigterm_while_the_ranks_load_stops_them_at_once_not_after_torchruns_30_s(tmp_path):
    # the ranks sit in start-up with their signal handlers installed (as while a large model
    # loads): before, they kept SIGTERM for a first step that never came, and torchrun killed
    # them after 30 s
    env = child_environment(DPLAUNCH_TEST_CHECKPOINT_FAULT="0:start_sleep=300")
    run_dir = tmp_path / "run"
    dplaunch = start_dplaunch(
        tmp_path, "train", TINY_LLAMA, "--cpu", "--gpus", "2", "-o", run_dir, env=env
    )
    # rank 0 says it started (its process group exists), then sleeps in start-up
    wait_for(lambda: "[dplaunch] 2 rank(s)" in output(tmp_path)[0], 120, "the ranks' start")
    dplaunch.send_signal(signal.SIGTERM)
    code = dplaunch.wait(timeout=25)  # torchrun's own kill comes at 30 s
    stdout, stderr = output(tmp_path)
    assert code != 0
    assert_stopped_in_one_line(stderr, "SIGTERM")
    assert "Traceback" not in stderr and not list(run_dir.glob("errors/rank-*.txt")), stderr
    assert run_processes(str(run_dir)) == []


def test_a_rank_killed_with_sigkill_in_training_ends_the_job_within_30_s(tmp_path):
    dplaunch, run_dir = long_training_run(tmp_path)
    seen = run_processes(str(run_dir))
    assert len(seen) >= 3, seen  # accelerate launch + 2 ranks: the check below can see them
    victim = rank_pid(dplaunch, 1)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    code = dplaunch.wait(timeout=120)
    teardown = time.time() - killed_at
    stdout, stderr = output(tmp_path)
    print(f"teardown after kill -9 of a training rank: {teardown:.1f} s")
    assert code != 0
    assert last_line(stderr).startswith("[rank 1] was killed by signal 9 (SIGKILL)"), stderr
    # rank 0 failed too (its peer vanished), but it does not get the last word
    assert "rank(s) 0 failed after rank 1" in stderr
    assert_no_launcher_noise(stdout + stderr)
    assert teardown < TEARDOWN_LIMIT_S
    assert run_processes(str(run_dir)) == []


def test_a_data_mistake_that_breaks_one_rank_is_reported_by_that_rank(tmp_path):
    """Labels outside num_labels in exactly the samples rank 1 gets at step 1: only rank 1 raises.

    The launch check would refuse such labels; it is told to read each file's first record only
    (DPLAUNCH_DATA_CHECK_MB=0, as past its budget in a large corpus), so they reach the ranks."""
    from dplaunch.train.data import Batcher, Sharding

    rows, seed = 16, 3
    order = Batcher(
        list(range(rows)), Sharding(1, 2, 4, 1), pad_id=0, task="sequence-classification", seed=seed
    ).epoch_order(0)
    rank1_samples = set(order[4:8])  # global batch 8 = micro 4 × dp 2: rank 1 takes the second half
    assert 0 not in rank1_samples  # the first record, which the check reads, is a good one
    with (tmp_path / "reviews.jsonl").open("w") as out:
        for i in range(rows):
            label = 7 if i in rank1_samples else i % 2
            out.write(json.dumps({"text": f"review {i}: fine", "label": label}) + "\n")
    config = tmp_path / "bad-labels.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "bad-labels",
                "model": {
                    "config": {
                        "model_type": "bert",
                        "hidden_size": 32,
                        "num_hidden_layers": 2,
                        "num_attention_heads": 2,
                        "intermediate_size": 64,
                        "vocab_size": 259,
                        "max_position_embeddings": 64,
                    },
                    "tokenizer": "byte-level",
                    "task": "sequence-classification",
                    "num_labels": 2,
                },
                "data": {"dataset": "reviews.jsonl", "max_length": 32},
                "train": {
                    "global_batch_size": 8,
                    "micro_batch_size": 4,
                    "max_steps": 4,
                    "seed": seed,
                },
            }
        )
    )
    run_dir = tmp_path / "run"
    # umask 022: everything the launcher and the ranks create is readable, and writable only by us
    dplaunch = start_dplaunch(
        tmp_path,
        "train",
        config,
        "--cpu",
        "--gpus",
        "2",
        "-o",
        run_dir,
        umask=0o022,
        env=child_environment(DPLAUNCH_DATA_CHECK_MB="0"),
    )
    code = dplaunch.wait(timeout=600)
    stdout, stderr = output(tmp_path)
    assert code != 0, stdout + stderr
    report = run_dir / "errors" / "rank-1.txt"
    assert (
        last_line(stderr)
        == f"[rank 1] IndexError: Target 7 is out of bounds. (traceback: {report})"
    )
    assert stderr.count("Target 7 is out of bounds") == 1
    assert "Traceback (most recent call last)" in report.read_text()
    assert "rank(s) 0 failed after rank 1" in stderr
    assert_no_launcher_noise(stdout + stderr)
    assert run_processes(str(run_dir)) == []
    assert_modes(run_dir, umask=0o022)


def test_a_rank_that_kills_itself_is_named_even_without_an_error_report(tmp_path):
    script = write_script(tmp_path, "dies.py", KILLS_ITSELF_ON_RANK_1)
    stamp = tmp_path / "died-at"
    result = run_dplaunch(
        "launch", script, "--cpu", "--gpus", "2", "-o", tmp_path / "run", "--", stamp, timeout=120
    )
    ended = time.time()
    assert result.returncode != 0
    assert last_line(result.stderr).startswith("[rank 1] was killed by signal 9 (SIGKILL)"), (
        result.stderr
    )
    assert_no_launcher_noise(result.stdout + result.stderr)
    print(f"teardown after a rank's own SIGKILL: {ended - float(stamp.read_text()):.1f} s")
    assert run_processes(str(script)) == []


# --- hangs become errors --------------------------------------------------------------------------


def test_a_rank_stuck_before_an_all_reduce_fails_the_job_at_the_collective_timeout(tmp_path):
    script = write_script(tmp_path, "stuck.py", SLEEPS_ON_RANK_1)
    started = time.monotonic()
    result = run_dplaunch(
        "launch", script, "--cpu", "--gpus", "2", "-o", tmp_path / "run",
        "--set", "launch.timeout_minutes=0.1", timeout=280,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    # rank 1 sleeps 300 s: ending long before that means the timeout, not the sleep, ended it
    assert elapsed < 200, elapsed
    assert "launch.timeout_minutes = 0.1 (6 s)" in result.stderr
    assert "--set launch.timeout_minutes=N" in result.stderr
    assert "rank(s) 1 did not time out themselves" in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert re.match(r"\[rank 0\] RuntimeError: .*Timed out waiting 6000ms", lines[-2]), lines[-3:]
    # hang dump: every rank's Python stack; the last line names the rank the others waited for
    errors = tmp_path / "run" / "errors"
    stuck, waiting = (errors / f"stacks-rank-{rank}.txt" for rank in (1, 0))
    assert f'File "{script}", line' in stuck.read_text()  # rank 1 is in the script's sleep
    assert "in all_reduce" in waiting.read_text()  # rank 0 waited inside the collective
    assert lines[-1] == (
        "dplaunch: rank(s) 1 not inside the collective that timed out (the others waited there "
        f"for it); its stack: {stuck} (every rank's: {errors}/stacks-rank-N.txt)"
    )
    assert_no_launcher_noise(result.stdout + result.stderr)
    assert run_processes(str(script)) == []


# --- one job at a time in a run directory ---------------------------------------------------------


def write_lock(
    run_dir: Path, job: str, pid: int, host: str, since: float, namespace: str | None = None
) -> Path:
    """RUN/dplaunch.lock as the dplaunch process PID wrote it (in this pid namespace, unless
    NAMESPACE is another)."""
    from dplaunch.run_directory.layout import RUN_LOCK_FILE

    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / RUN_LOCK_FILE
    namespace = os.readlink("/proc/self/ns/pid") if namespace is None else namespace
    holder = {"job": job, "pid": pid, "host": host, "since": since, "pid_namespace": namespace}
    lock.write_text(json.dumps(holder))
    return lock


def test_a_live_runs_directory_is_refused_to_another_job_and_shared_with_its_own(tmp_path):
    """Two runs into one directory at once mixed two runs' lines in one metrics.jsonl. The lock
    is the job's: its other nodes and its restarts come in, another job does not (in one line,
    naming the owner), and it goes with the job, as does the directory when it made it."""
    from dplaunch.errors import UserError
    from dplaunch.launching.rundir import run_dir_lock
    from dplaunch.run_directory.layout import RUN_LOCK_FILE

    run_dir, notes = tmp_path / "run", []
    with run_dir_lock(run_dir, "SLURM job 41", say=notes.append):
        with pytest.raises(UserError) as refused:
            with run_dir_lock(run_dir, "SLURM job 42", say=notes.append):
                pass
        assert refused.value.field == "output_dir"
        assert (
            f"{run_dir} is in use by a live run: SLURM job 41 (dplaunch pid {os.getpid()} on "
            f"{socket.gethostname()}), since "
        ) in refused.value.problem
        with run_dir_lock(run_dir, "SLURM job 41", say=notes.append):  # node 1 of the same job
            pass
        assert (run_dir / RUN_LOCK_FILE).exists()  # still the first process's
    assert not run_dir.exists() and notes == []


def test_a_lock_left_by_a_run_that_is_gone_is_taken_over_with_a_note(tmp_path):
    from dplaunch.errors import UserError
    from dplaunch.launching.rundir import LOCK_STALE_SECONDS, run_dir_lock

    ended = subprocess.Popen(["true"])
    ended.wait()
    host, now = socket.gethostname(), time.time()
    gone = [
        ("a pid that has ended", ended.pid, host, now - 60),
        # a live pid that started after the lock was written: not the process that wrote it
        ("a pid used again", os.getpid(), host, psutil.Process().create_time() - 60),
    ]
    for case, pid, where, since in gone:
        run_dir, notes = tmp_path / case, []
        lock = write_lock(run_dir, "job A", pid, where, since)
        with run_dir_lock(run_dir, "job B", say=notes.append):
            assert json.loads(lock.read_text())["pid"] == os.getpid(), case
        assert len(notes) == 1 and notes[0].startswith(
            f"dplaunch: took over {lock} from a run that is gone: job A (dplaunch pid {pid} on"
        ), (case, notes)
        assert not lock.exists()
    # another host's lock, or another container's on this host (its pids are not ours): alive
    # while its owner touches it, gone when nobody has for long
    for name, where, namespace in (("host", "node-elsewhere", None), ("pod", host, "pid:[1]")):
        lock = write_lock(tmp_path / name, "job A", ended.pid, where, now, namespace)
        with pytest.raises(UserError, match="in use by a live run: job A"):
            with run_dir_lock(tmp_path / name, "job B", say=print):
                pass
        os.utime(lock, (now - LOCK_STALE_SECONDS - 60,) * 2)
        notes = []
        with run_dir_lock(tmp_path / name, "job B", say=notes.append):
            pass
        assert len(notes) == 1 and f"pid {ended.pid} on {where}" in notes[0], (name, notes)
    # the same job, requeued after its dplaunch died: it takes its own lock back, silently
    lock = write_lock(tmp_path / "requeued", "SLURM job 7", ended.pid, host, now - 60)
    notes = []
    with run_dir_lock(tmp_path / "requeued", "SLURM job 7", say=notes.append):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert notes == []


def test_the_lock_is_keyed_to_the_job_that_every_launcher_names_the_same_way():
    """SLURM's nodes and requeues, a torchrun or Kubernetes job's pods, a launcher's own job id
    (DPLAUNCH_JOB_ID, set by dplaunch's Ray and Kubernetes launchers) share the key; nodes
    started by hand share their rendezvous; a single-node run is its dplaunch process."""
    from dplaunch.launching.rundir import job_identity
    from tests.helpers import plan_for

    one, two = (
        plan_for(gpus=2, render_only=True),
        plan_for(gpus=16, render_only=True, nodes=2, master_addr="10.0.0.1", master_port=29400),
    )
    assert job_identity(one, {"DPLAUNCH_JOB_ID": "ray-7", "SLURM_JOB_ID": "5"}) == "job ray-7"
    assert job_identity(two, {"SLURM_JOB_ID": "5", "TORCHELASTIC_RUN_ID": "r"}) == "SLURM job 5"
    assert job_identity(two, {"TORCHELASTIC_RUN_ID": "r"}) == "torchrun job r"
    # torchrun's --rdzv-id when none was given names no job
    assert job_identity(two, {"TORCHELASTIC_RUN_ID": "none"}) == (
        "the job of rendezvous 10.0.0.1:29400"
    )
    assert job_identity(one, {}) == f"dplaunch pid {os.getpid()} on {socket.gethostname()}"


# --- no orphans, whatever dies ---------------------------------------------------------------------


def _waiting_job(tmp: Path):
    script = write_script(tmp, "waits.py", WAITS_FOR_SIGNALS)
    dplaunch = start_dplaunch(tmp, "launch", script, "--cpu", "--gpus", "2", "-o", tmp / "run")
    wait_for(lambda: output(tmp)[0].count("ready") == 2, 120, "both ranks ready")
    return dplaunch, script


def test_killing_dplaunch_itself_stops_every_rank(tmp_path):
    dplaunch, script = _waiting_job(tmp_path)
    assert len(run_processes(str(script))) >= 3
    killed_at = time.time()
    dplaunch.kill()  # SIGKILL: dplaunch gets no chance to clean up
    dplaunch.wait()
    try:
        wait_for(
            lambda: run_processes(str(script)) == [], TEARDOWN_LIMIT_S, "no process of the job left"
        )
    except AssertionError:
        # seen once in a full run: say which process outlived the limit, and in what state
        left = []
        for process in run_processes(str(script)):
            with contextlib.suppress(psutil.Error):
                left.append((process.pid, process.status(), " ".join(process.cmdline())[:200]))
        raise AssertionError(f"processes left {TEARDOWN_LIMIT_S} s after kill -9: {left}") from None
    print(f"teardown after kill -9 of dplaunch: {time.time() - killed_at:.1f} s")


def test_ranks_stop_with_dplaunch_even_when_the_launcher_passes_nothing_on(tmp_path):
    # the launcher in between turns its parent-death SIGTERM into a Python exception, which a
    # finalizer running at that moment can swallow; the ranks must not depend on it
    dplaunch, script = _waiting_job(tmp_path)
    launcher = _launcher_of(dplaunch)
    ranks = [p for p in run_processes(str(script)) if p.pid not in (launcher.pid, dplaunch.pid)]
    assert len(ranks) == 2
    launcher.suspend()  # SIGSTOP: it gets the parent-death signal but cannot act on it
    try:
        dplaunch.kill()
        dplaunch.wait()
        wait_for(
            lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks),
            TEARDOWN_LIMIT_S,
            "both ranks gone while their launcher is stopped",
        )
        assert launcher.status() == psutil.STATUS_STOPPED
    finally:
        with contextlib.suppress(psutil.Error):
            launcher.kill()


def _launcher_of(dplaunch: subprocess.Popen) -> psutil.Process:
    return next(
        p
        for p in psutil.Process(dplaunch.pid).children()
        if "accelerate.commands.launch" in " ".join(p.cmdline())
    )


def test_killing_the_launcher_between_dplaunch_and_the_ranks_leaves_no_orphan(tmp_path):
    dplaunch, script = _waiting_job(tmp_path)
    launcher = _launcher_of(dplaunch)
    launcher.kill()  # torchrun dies without stopping its ranks: they are orphans now
    code = dplaunch.wait(timeout=120)
    assert code != 0
    assert run_processes(str(script)) == []
    assert "stopped 2 process(es) the job left behind" in output(tmp_path)[1]


def test_usr1_and_usr2_reach_the_ranks_and_sigterm_stops_the_job(tmp_path):
    dplaunch, script = _waiting_job(tmp_path)
    dplaunch.send_signal(signal.SIGUSR1)  # SLURM's "time is nearly up"; the ranks handle it
    wait_for(lambda: output(tmp_path)[0].count("got USR1") == 2, 30, "USR1 in both ranks")
    dplaunch.send_signal(signal.SIGUSR2)  # for the ranks too; it would kill the launcher
    wait_for(lambda: output(tmp_path)[0].count("got USR2") == 2, 30, "USR2 in both ranks")
    assert dplaunch.poll() is None and len(run_processes(str(script))) >= 3
    dplaunch.send_signal(signal.SIGTERM)  # scancel
    code = dplaunch.wait(timeout=120)
    stdout, stderr = output(tmp_path)
    assert code != 0
    assert (
        last_line(stderr)
        == "dplaunch: stopped by SIGTERM (sent to dplaunch, passed on to every rank)"
    )
    assert_no_launcher_noise(stdout + stderr)
    assert run_processes(str(script)) == []


# --- ports ----------------------------------------------------------------------------------------


def test_a_busy_default_port_is_replaced_by_a_free_one_and_the_run_works(tmp_path):
    script = write_script(tmp_path, "report.py", "import json\n" + REPORTS)
    with socket.socket() as squatter:
        # SO_REUSEADDR: a connection of an earlier run in TIME_WAIT must not make us think it is busy
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            squatter.bind(("127.0.0.1", 29500))
            squatter.listen(1)
        except OSError:
            pass  # someone else listens on it: busy either way
        result = run_dplaunch(
            "launch", script, "--cpu", "--gpus", "2", "-o", tmp_path / "run", timeout=120
        )
    assert result.returncode == 0, result.stderr
    chosen = re.search(r"port 29500 \(default\) is busy: using free port (\d+)", result.stdout)
    assert chosen, result.stdout
    reports = [
        json.loads(line[7:]) for line in result.stdout.splitlines() if line.startswith("REPORT ")
    ]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert {r["port"] for r in reports} == {chosen.group(1)} and {r["sum"] for r in reports} == {2}


def test_two_runs_started_together_on_one_machine_get_different_ports(tmp_path):
    # between dplaunch's check of 29500 and the rendezvous store binding it, the launcher starts
    # (seconds). Without a claim on the port both runs plan 29500; Accelerate then moves the second
    # to a random port behind dplaunch's back (a warning), and its run directory names the wrong one
    script = write_script(tmp_path, "report.py", "import json\n" + REPORTS)
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        run.mkdir()
    started = [
        start_dplaunch(run, "launch", script, "--cpu", "--gpus", "2", "-o", run / "run")
        for run in runs
    ]
    ports = []
    for run, dplaunch in zip(runs, started, strict=True):
        code = dplaunch.wait(timeout=180)
        stdout, stderr = output(run)
        assert code == 0, stdout + stderr
        reports = [
            json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("REPORT ")
        ]
        assert sorted(r["rank"] for r in reports) == [0, 1] and {r["sum"] for r in reports} == {2}
        ports.append({r["port"] for r in reports})
        planned = yaml.safe_load((run / "run" / "accelerate.yaml").read_text())["main_process_port"]
        assert ports[-1] == {str(planned)}, (ports[-1], planned)  # launch.sh reruns the same
        assert "already in use" not in stderr
    assert all(len(p) == 1 for p in ports) and ports[0] != ports[1], ports


# --- security -------------------------------------------------------------------------------------


def test_launch_sh_quotes_every_value_and_reruns_the_same_command(tmp_path):
    script = write_script(tmp_path, "report.py", "import json\n" + REPORTS)
    run_dir = tmp_path / EVIL
    args = [EVIL, "two words", "$HOME"]
    # launch.sh repeats the first run's port: not the default 29500, which the suite's other
    # launches take and leave between the two runs (EADDRINUSE in CI)
    port = f"launch.master_port={free_port()}"
    result = run_dplaunch(
        "launch", script, "--cpu", "--gpus", "2", "--set", f"output_dir={run_dir}", "--set", port,
        "--", *args, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    launch_sh = run_dir / "launch.sh"
    assert subprocess.run(["bash", "-n", launch_sh], check=False).returncode == 0
    # run the script for real: the ranks get exactly the same arguments again
    rerun = subprocess.run(
        ["bash", launch_sh],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=child_environment(),
    )
    assert rerun.returncode == 0, rerun.stderr
    for out in (result.stdout, rerun.stdout):
        reports = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("REPORT ")]
        assert len(reports) == 2 and all(r["args"] == args for r in reports), out
    # another job now listens on the port: one line naming the key and the fix, exit 2, no rank
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", int(port.split("=")[1])))
        holder.listen()
        held = subprocess.run(
            ["bash", launch_sh], capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env=child_environment(),
        )  # fmt: skip
    assert held.returncode == 2, held.stderr
    assert (
        held.stderr.startswith("launch.sh: launch.master_port: port ")
        and len(held.stderr.splitlines()) == 1
    ), held.stderr
    assert "--set launch.master_port=" in held.stderr and "REPORT" not in held.stdout
    assert_nothing_ran(tmp_path)


def test_train_run_keeps_secrets_out_respects_umask_077_and_quotes_launch_sh(tmp_path):
    """A real training run with tokens in the environment, umask 077 and a run name made to break
    a shell: no secret anywhere in the run directory or the output, nothing readable by others,
    launch.sh parses and gives back the exact command, and nothing was executed by accident."""
    env = child_environment(**SECRETS)
    dplaunch = start_dplaunch(
        tmp_path, "train", TINY_LLAMA, "--cpu", "--gpus", "2", "--max-steps", "2",
        "--set", "train.checkpoint_every=2",  # checkpoints carry the umask too
        "--set", f"name={EVIL}", env=env, cwd=tmp_path, umask=0o077,
    )  # fmt: skip
    code = dplaunch.wait(timeout=600)
    stdout, stderr = output(tmp_path)
    assert code == 0, stdout + stderr
    (run_dir,) = (tmp_path / "runs").iterdir()  # the default runs/<name>-<timestamp>
    assert run_dir.name.startswith(EVIL)
    assert re.search(
        r"run directory: .* \(\d+\.\d GB free on the output directory's disk\)", stdout
    )
    assert (run_dir / "model").is_dir() and (run_dir / "checkpoints").is_dir()

    texts = {"stdout": stdout, "stderr": stderr}
    texts.update(
        {str(p): p.read_bytes().decode("latin-1") for p in run_dir.rglob("*") if p.is_file()}
    )
    for name, value in SECRETS.items():
        leaks = [where for where, text in texts.items() if value in text]
        assert not leaks, f"{name} leaked into {leaks}"
    assert yaml.safe_load((run_dir / "run.yaml").read_text())["model"]["trust_remote_code"] is False

    launch_sh = (run_dir / "launch.sh").read_text()
    assert subprocess.run(["bash", "-n", run_dir / "launch.sh"], check=False).returncode == 0
    # execute it with the final `exec` replaced by printing its words, as bash parsed them
    dry = re.sub(r"^exec ", lambda _: "printf '%s\\0' ", launch_sh, flags=re.M)
    words = subprocess.run(
        ["bash", "-c", dry], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    argv = words.stdout.split("\0")[:-1]
    assert argv[-3:] == ["--module", "dplaunch.train", str(run_dir.absolute())]
    assert argv[argv.index("--config_file") + 1] == str(run_dir.absolute() / "accelerate.yaml")
    assert_nothing_ran(tmp_path)
    assert_modes(run_dir, umask=0o077)


def assert_nothing_ran(tmp: Path) -> None:
    for where in (tmp, REPO, Path.cwd()):
        assert not any(where.glob("pwned*")), f"a value was executed by a shell in {where}"


def assert_modes(run_dir: Path, umask: int) -> None:
    """The run directory and everything in it carry the user's umask: no extra permission bits."""
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o777 & ~umask
    for path in [run_dir, *run_dir.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert not mode & stat.S_IWOTH, f"{path} is world-writable ({oct(mode)})"
        assert not mode & umask, f"{path} has {oct(mode)} despite umask {oct(umask)}"


def test_model_code_runs_only_when_trusted(tmp_path):
    """A model folder that maps itself to its own Python code: refused before launch unless
    model.trust_remote_code is set (and the code really runs when it is: the check is not idle)."""
    model = tmp_path / "custom-model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil-llama",
                "auto_map": {
                    "AutoConfig": "evil.EvilConfig",
                    "AutoModelForCausalLM": "evil.EvilModel",
                },
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 259,
            }
        )
    )
    (model / "evil.py").write_text(
        # transformers imports a copy of this file from its module cache: name the marker absolutely
        f"open({str(model / 'CODE_RAN')!r}, 'w').write('yes')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil-llama'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    config = write_config(tmp_path / "run.yaml", model={"config": None, "name_or_path": str(model)})
    result = run_dplaunch(
        "train", config, "--cpu", "--gpus", "2", "-o", tmp_path / "run", timeout=60
    )
    assert result.returncode == 2
    assert "model.trust_remote_code" in result.stderr and "evil.EvilModel" in result.stderr
    assert not (tmp_path / "run").exists() and not (model / "CODE_RAN").exists()

    trusted = subprocess.run(
        [sys.executable, "-c", f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(model)!r}, trust_remote_code=True)"],
        capture_output=True, text=True, timeout=120, env=child_environment(), check=False,
    )  # fmt: skip
    assert trusted.returncode == 0, trusted.stderr
    assert (model / "CODE_RAN").exists()


def test_sbatch_script_keeps_secrets_out_and_quotes_paths_and_job_names(tmp_path):
    """`dplaunch slurm` with tokens in the environment and a job name and run directory made to
    break a shell: the script parses, hands srun the exact words, runs nothing by accident."""
    run_dir = tmp_path / EVIL
    result = run_dplaunch(
        "slurm", TINY_LLAMA, "--gpus", "8", "--nodes", "2", "--job-name", EVIL,
        "--out", "-", "-o", run_dir, env=child_environment(**SECRETS), cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    script = result.stdout
    for name, value in SECRETS.items():
        assert value not in script + result.stderr, f"{name} leaked into the sbatch script"
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", tmp_path / "job.sbatch"], check=False).returncode == 0
    # run it as SLURM would, with srun replaced by a function that prints the words it was given
    fake_srun = "srun() { printf '%s\\0' \"$@\" > srun-argv; }; scontrol() { :; }; . ./job.sbatch"
    ran = subprocess.run(
        ["bash", "-c", fake_srun], cwd=tmp_path, capture_output=True, text=True, check=False,
        env=child_environment(SLURM_JOB_ID="42"),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    argv = (tmp_path / "srun-argv").read_text().split("\0")[:-1]
    assert argv[argv.index("--output-dir") + 1] == str(run_dir)
    assert_nothing_ran(tmp_path)
