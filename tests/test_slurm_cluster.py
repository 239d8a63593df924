"""Jobs on a real one-host SLURM: the fixture works, and our scripts and detection hold up."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dplaunch.cluster.hostlist import parse_hostlist
from dplaunch.rendering.sbatch import SbatchSpec, render_sbatch
from tests.helpers import TINY_LLAMA, read_metrics, run_dplaunch, train_losses

try:  # a conftest may re-export it too; one definition per session is enough either way
    from tests.slurm_cluster import TERMINAL_STATES, slurm_cluster  # noqa: F401
except ImportError:  # tests/ is on sys.path but the repo root is not
    from slurm_cluster import TERMINAL_STATES, slurm_cluster  # noqa: F401

pytestmark = pytest.mark.slurm
REPO_ROOT = Path(__file__).resolve().parents[1]


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body).lstrip())
    return path


def test_the_cluster_starts_quickly_and_runs_a_two_task_job(slurm_cluster, tmp_path):
    print(f"local SLURM started in {slurm_cluster.startup_seconds:.2f}s")
    script = write_script(
        tmp_path / "two_tasks.sbatch",
        """
        #SBATCH --job-name=two-tasks
        #SBATCH --ntasks=2
        #SBATCH --output=two_tasks.out
        srun hostname
        srun bash -c 'echo rank $SLURM_PROCID of $SLURM_NTASKS'
        """,
    )
    job_id = slurm_cluster.submit(script, cwd=tmp_path)
    assert slurm_cluster.wait(job_id, timeout=60) == "COMPLETED"
    lines = (tmp_path / "two_tasks.out").read_text().splitlines()
    assert lines.count(slurm_cluster.hostname) == 2
    # one host can run a multi-task step: what an `srun --ntasks=2` training would need
    assert sorted(line for line in lines if line.startswith("rank")) == [
        "rank 0 of 2",
        "rank 1 of 2",
    ]


def test_one_task_per_node_sees_its_node_id_and_the_node_list(slurm_cluster, tmp_path):
    script = write_script(
        tmp_path / "per_node.sbatch",
        """
        #SBATCH --nodes=1
        #SBATCH --ntasks-per-node=1
        #SBATCH --output=per_node.out
        srun --ntasks-per-node=1 bash -c 'echo $SLURM_NODEID $SLURM_JOB_NODELIST'
        """,
    )
    job_id = slurm_cluster.submit(script, cwd=tmp_path)
    assert slurm_cluster.wait(job_id, timeout=60) == "COMPLETED"
    assert (tmp_path / "per_node.out").read_text().split() == ["0", slurm_cluster.hostname]


def test_a_failing_job_is_reported_failed(slurm_cluster, tmp_path):
    script = write_script(tmp_path / "fails.sbatch", "#SBATCH --output=fails.out\nexit 3\n")
    job_id = slurm_cluster.submit(script, cwd=tmp_path)
    assert slurm_cluster.wait(job_id, timeout=60) == "FAILED"


def test_the_final_state_survives_in_the_completion_log(slurm_cluster, tmp_path):
    script = write_script(tmp_path / "quick.sbatch", "#SBATCH --output=quick.out\ntrue\n")
    job_id = slurm_cluster.submit(script, cwd=tmp_path)
    assert slurm_cluster.wait(job_id, timeout=60) == "COMPLETED"
    # what wait() falls back to once slurmctld forgets the job
    assert slurm_cluster._jobcomp_state(job_id) == "COMPLETED"


@pytest.mark.parametrize(
    "nodelist", ["jean-zay-[1-3,7],gpu[01-02]", "n[1-2]-ib[3-4]", "a,b[9-11]", "x[008-010]"]
)
def test_the_python_hostlist_expander_agrees_with_scontrol(slurm_cluster, nodelist):
    result = slurm_cluster.run("scontrol", "show", "hostnames", nodelist)
    assert parse_hostlist(nodelist) == result.stdout.split()


DETECT = """
import dataclasses, json, os
from dplaunch.cluster.slurm import check_allocation, detect_allocation
alloc = detect_allocation(os.environ)
extra = {"warnings": check_allocation(alloc, None), "master_port": alloc.master_port}
print(json.dumps(dataclasses.asdict(alloc) | extra))
"""


def test_a_rendered_script_with_a_hostile_name_runs_and_sees_its_allocation(
    slurm_cluster, tmp_path
):
    name = 'my job $(touch canary) `touch canary` "q" #1 \\ end l\'exp'
    spec = SbatchSpec(
        job_name=name,
        command=[sys.executable, "detect.py"],
        cpu=True,
        cpus_per_task=slurm_cluster.cpus,
        time="5",
        log_dir="logs",
        env={"PYTHONPATH": str(REPO_ROOT), "EVIL": "$(touch canary)"},
        setup_lines=["test \"$EVIL\" = '$(touch canary)'"],
    )
    (tmp_path / "detect.py").write_text(DETECT)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    (tmp_path / "logs").mkdir()  # sbatch does not create the log directory

    job_id = slurm_cluster.submit(script, cwd=tmp_path)
    state = slurm_cluster.wait(job_id, timeout=60)
    out = tmp_path / "logs" / f"{name}-{job_id}.out"
    err = tmp_path / "logs" / f"{name}-{job_id}.err"
    assert state == "COMPLETED", err.read_text() if err.exists() else slurm_cluster.logs_tail()
    assert not (tmp_path / "canary").exists()

    # sbatch read the quoted name back exactly
    shown = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
    assert f"JobName={name}" in shown

    seen = json.loads(out.read_text().strip().splitlines()[-1])
    assert seen["job_id"] == job_id
    assert seen["num_nodes"] == 1
    assert seen["node_rank"] == 0
    assert seen["hostnames"] == [slurm_cluster.hostname]
    assert seen["inside_step"] is True
    assert seen["ntasks_per_node"] == 1
    assert seen["cpus_per_task"] == slurm_cluster.cpus
    assert seen["gpus_per_node"] is None
    assert seen["warnings"] == []
    assert 20000 <= seen["master_port"] < 32768


HANDLER = """
import signal, sys, time
def checkpoint(signum, frame):
    print("rank got USR1", flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR1, checkpoint)
open("ready", "w").close()
time.sleep(120)
"""


def test_the_time_limit_signal_reaches_the_ranks_under_srun_not_the_batch_shell(
    slurm_cluster, tmp_path
):
    # the step is "launcher ignoring USR1 → rank handling it", like dplaunch → accelerate → rank;
    # `scancel --signal=USR1` (no --batch) takes the path `#SBATCH --signal=USR1@N` takes at the
    # time limit, without waiting for a time limit (SLURM checks those only every ~30 s)
    (tmp_path / "rank.py").write_text(HANDLER)
    launcher = f"trap '' USR1; {sys.executable} rank.py; echo launcher still alive"
    spec = SbatchSpec(
        job_name="signal",
        command=["bash", "-c", launcher],
        cpu=True,
        time="5",
        log_dir=".",
        signal_seconds=120,
        setup_lines=["trap 'echo batch shell got USR1' USR1"],
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    job_id = slurm_cluster.submit(script, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline, slurm_cluster.job_state(job_id)
        time.sleep(0.1)
    slurm_cluster.run("scancel", "--signal=USR1", job_id)
    assert slurm_cluster.wait(job_id, timeout=60) == "COMPLETED"
    output = (tmp_path / f"signal-{job_id}.out").read_text()
    assert "rank got USR1" in output
    assert "launcher still alive" in output
    assert "batch shell got USR1" not in output


# ---------------------------------------------------------------- dplaunch's own jobs


def job_environment(slurm_cluster) -> dict[str, str]:
    """What a user's shell on the login node holds: the cluster, and the tests' rank settings."""
    # sbatch exports the submitting environment to the job (--export=ALL)
    return slurm_cluster.env | {
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def submit_with_dplaunch(
    slurm_cluster, tmp_path: Path, run_dir: Path, *args, submit: bool = True
) -> str:
    """`dplaunch slurm tiny-llama.yaml --cpu --gpus 2 … --submit`, or without --submit and then
    the `sbatch …` it says to run; the job id."""
    environment = job_environment(slurm_cluster)
    result = run_dplaunch(
        "slurm",
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "2",
        "--time",
        "10",
        "-o",
        run_dir,
        *args,
        *(["--submit"] if submit else []),
        env=environment,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    if submit:
        return re.search(r"submitted batch job (\d+)", result.stdout).group(1)
    command = re.search(r"^submit with: (sbatch .*)$", result.stdout, re.M).group(1)
    sbatch = subprocess.run(
        [*shlex.split(command.replace("sbatch ", "sbatch --parsable ", 1))],
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert sbatch.returncode == 0, sbatch.stderr
    return sbatch.stdout.strip().split(";")[0]


def job_logs(run_dir: Path) -> str:
    """The job's .out and .err files, whole."""
    return "\n".join(
        f"--- {path.name}\n{path.read_text(errors='replace')}"
        for path in sorted((run_dir / "logs").glob("*.*"))
    )


def job_field(slurm_cluster, job_id: str, name: str) -> str | None:
    shown = slurm_cluster.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
    match = re.search(rf"\b{name}=(\S+)", shown)
    return match.group(1) if match else None


def wait_until(condition, timeout: float, what: str, slurm_cluster, job_id: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        state = slurm_cluster.job_state(job_id)
        assert state not in ("COMPLETED", "FAILED", "CANCELLED"), (
            f"job {job_id} {state} before {what}"
        )
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s (job {state})"
        time.sleep(0.5)


def release_requeued(slurm_cluster, job_id: str) -> None:
    """Let a requeued job start now instead of after SLURM's delay (the 120 s credential life)."""
    wait_until(
        lambda: (
            job_field(slurm_cluster, job_id, "Restarts") == "1"
            and slurm_cluster.job_state(job_id) == "PENDING"
        ),
        120,
        "requeue",
        slurm_cluster,
        job_id,
    )
    # slurmd refuses a launch whose credential is not newer than the revoked one of the first
    # run (1 s resolution: "Job credential revoked"), which is what the delay protects against
    time.sleep(2.5)
    slurm_cluster.run("scontrol", "update", f"jobid={job_id}", "StartTime=now")


def test_a_job_written_and_submitted_by_dplaunch_slurm_trains_two_cpu_ranks(
    slurm_cluster, tmp_path
):
    # the job name is data everywhere: in #SBATCH, in the log file names, never run; an
    # apostrophe, in it and in the job's directory (--chdir), is one more quote to sbatch
    name = "tiny $(touch canary) `touch canary` l'exp"
    folder = tmp_path / "l'expérience"
    folder.mkdir()
    run_dir = folder / "run"
    started = time.monotonic()
    # submitted the way dplaunch says to without --submit: its log directory must exist already
    job_id = submit_with_dplaunch(
        slurm_cluster, folder, run_dir, "--max-steps", "3", "--job-name", name, submit=False
    )
    state = slurm_cluster.wait(job_id, timeout=600)
    print(f"dplaunch slurm job {job_id}: {state} in {time.monotonic() - started:.1f}s")
    assert state == "COMPLETED", job_logs(run_dir)[-6000:]
    log = (run_dir / "logs" / f"{name}-{job_id}.out").read_text()
    assert f"SLURM job {job_id}: this is node 0 of 1 ({slurm_cluster.hostname})" in log
    header = read_metrics(run_dir)[0]
    assert (header["world_size"], header["data_parallel_size"], header["num_nodes"]) == (2, 2, 1)
    assert len(train_losses(run_dir)) == 3
    assert not (folder / "canary").exists()
    assert not list((run_dir / "logs").glob(".requeue-*"))


def test_at_the_time_limit_signal_the_job_checkpoints_requeues_itself_and_resumes(
    slurm_cluster, tmp_path
):
    pytest.importorskip("dplaunch.train.checkpoint", reason="needs the checkpoint engine")
    run_dir = tmp_path / "run"
    steps = 50  # enough that the signal lands while the ranks still train (~0.1 s a step)
    job_id = submit_with_dplaunch(slurm_cluster, tmp_path, run_dir, "--max-steps", str(steps))
    wait_until(
        lambda: (run_dir / "metrics.jsonl").exists() and len(train_losses(run_dir)) >= 2,
        600,
        "training steps",
        slurm_cluster,
        job_id,
    )
    # what `#SBATCH --signal=USR1@120` does near the time limit: USR1 to the processes of the
    # job's steps (SLURM checks time limits only every ~30 s, so we do not wait for one)
    slurm_cluster.run("scancel", "--signal=USR1", job_id)
    release_requeued(slurm_cluster, job_id)
    state = slurm_cluster.wait(job_id, timeout=600)
    logs = job_logs(run_dir)
    assert state == "COMPLETED", logs[-6000:]
    assert f"requeueing job {job_id}" in logs and "resume: " in logs
    # one run, continued: every step once, in order, in one metrics file
    assert [r["step"] for r in read_metrics(run_dir) if r["type"] == "train"] == list(
        range(1, steps + 1)
    )


def test_a_time_limit_signal_during_start_up_ends_the_job_instead_of_requeueing_it_forever(
    slurm_cluster, tmp_path
):
    # a time limit shorter than start-up + --signal-seconds: the signal comes before step 1 of
    # every run, so a requeue would never make progress. The signal is sent again and again from
    # the start of the job's step: a rank ignores it (as its launcher does) until it installs its
    # handler, the first thing it does, and its first step comes seconds of start-up later. Not
    # before the step has run a moment: the node launcher's shell ignores SIGUSR1 from its first
    # statement, and a signal in the milliseconds before that kills it (seen once in CI), which
    # nothing started by a shell can avoid; SLURM's real warning comes minutes into the job
    run_dir = tmp_path / "run"
    job_id = submit_with_dplaunch(slurm_cluster, tmp_path, run_dir, "--max-steps", "3")
    deadline = time.monotonic() + 600
    step = f"{job_id}.0"
    while not re.search(
        rf"\bStepId={re.escape(step)}\b",
        slurm_cluster.run("scontrol", "-o", "show", "step", step, check=False).stdout,
    ):
        assert slurm_cluster.job_state(job_id) not in TERMINAL_STATES, job_logs(run_dir)[-6000:]
        assert time.monotonic() < deadline, job_logs(run_dir)[-6000:]
        time.sleep(0.1)
    time.sleep(0.5)
    while slurm_cluster.job_state(job_id) in ("RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, job_logs(run_dir)[-6000:]
        slurm_cluster.run("scancel", "--signal=USR1", job_id, check=False)
        time.sleep(0.2)
    state = slurm_cluster.wait(job_id, timeout=60)
    logs = job_logs(run_dir)
    assert state == "FAILED", logs[-6000:]
    assert job_field(slurm_cluster, job_id, "Restarts") in ("0", None), logs[-6000:]
    assert "requeueing" not in logs
    assert (
        "dplaunch: error: --time: the job's time-limit signal (SIGUSR1) came before its first "
        "step (step 1)" in logs
    ), logs[-6000:]
    assert not train_losses(run_dir)


def test_the_requeue_lines_of_a_rendered_script_rerun_a_launcher_that_exits_75(
    slurm_cluster, tmp_path
):
    # a stand-in for the launcher: 75 (checkpointed) on the first run, success on the rerun
    launcher = (
        'if [ -z "${SLURM_RESTART_COUNT:-}" ]; then exit 75; fi; echo "rerun $SLURM_RESTART_COUNT"'
    )
    spec = SbatchSpec(
        job_name="requeue",
        command=["bash", "-c", launcher],
        cpu=True,
        time="5",
        log_dir="logs",
        requeue=True,
        signal_seconds=120,
    )
    (tmp_path / "job.sbatch").write_text(render_sbatch(spec))
    (tmp_path / "logs").mkdir()
    job_id = slurm_cluster.submit(tmp_path / "job.sbatch", cwd=tmp_path)
    release_requeued(slurm_cluster, job_id)
    assert slurm_cluster.wait(job_id, timeout=120) == "COMPLETED"
    out = (tmp_path / "logs" / f"requeue-{job_id}.out").read_text()
    err = (tmp_path / "logs" / f"requeue-{job_id}.err").read_text()
    # both runs' output, appended to one log
    assert f"requeueing job {job_id}" in err and "rerun 1" in out


def test_dplaunch_train_in_a_batch_script_starts_its_own_step_with_one_task_per_node(
    slurm_cluster, tmp_path
):
    # a hand-written script that asked for 2 tasks and forgot srun: dplaunch does the srun
    script = write_script(
        tmp_path / "self.sbatch",
        f"""
        #SBATCH --ntasks=2
        #SBATCH --output=self.out
        #SBATCH --error=self.err
        {sys.executable} -m dplaunch train {TINY_LLAMA} --cpu --gpus 2 --max-steps 2 -o run
        """,
    )
    job_id = slurm_cluster.submit(script, cwd=tmp_path)
    state = slurm_cluster.wait(job_id, timeout=600)
    out = (tmp_path / "self.out").read_text()
    assert state == "COMPLETED", out + (tmp_path / "self.err").read_text()
    assert f"SLURM job {job_id}, not in an srun step: starting one launcher per node" in out
    assert "srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --kill-on-bad-exit=1" in out
    assert f"SLURM job {job_id}: this is node 0 of 1" in out  # printed by the launcher in the step
    assert read_metrics(tmp_path / "run")[0]["world_size"] == 2


def test_a_tensorflow_script_in_a_batch_script_gets_the_allocations_host_and_port(
    slurm_cluster, tmp_path
):
    from dplaunch.cluster.slurm import MASTER_PORT_BASE, MASTER_PORT_SPAN
    from tests.helpers import PRINTS_TF_CONFIG, tf_configs, worker_script

    # TF_CONFIG from SLURM's own variables: dplaunch starts the step, the node's 2 CPU workers
    # listen on the job's port and the next one, on the node SLURM names
    script = worker_script(tmp_path, "prints.py", PRINTS_TF_CONFIG)
    batch = write_script(
        tmp_path / "tf.sbatch",
        f"""
        #SBATCH --ntasks=1
        #SBATCH --output=tf.out
        #SBATCH --error=tf.err
        {sys.executable} -m dplaunch launch {script} --framework tensorflow --cpu --gpus 2 -o run
        """,
    )
    job_id = slurm_cluster.submit(batch, cwd=tmp_path)
    state = slurm_cluster.wait(job_id, timeout=300)
    out = (tmp_path / "tf.out").read_text()
    assert state == "COMPLETED", out + (tmp_path / "tf.err").read_text()
    port = MASTER_PORT_BASE + int(job_id) % MASTER_PORT_SPAN
    cluster = [f"{slurm_cluster.hostname}:{port}", f"{slurm_cluster.hostname}:{port + 1}"]
    assert tf_configs(out) == [
        {"cluster": {"worker": cluster}, "task": {"type": "worker", "index": index}}
        for index in (0, 1)
    ]
