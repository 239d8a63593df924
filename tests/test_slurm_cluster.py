"""Jobs on a real one-host SLURM: the fixture works, and our scripts and detection hold up."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dplaunch.cluster.hostlist import parse_hostlist
from dplaunch.rendering.sbatch import SbatchSpec, render_sbatch

try:  # a conftest may re-export it too; one definition per session is enough either way
    from tests.slurm_cluster import slurm_cluster  # noqa: F401
except ImportError:  # tests/ is on sys.path but the repo root is not
    from slurm_cluster import slurm_cluster  # noqa: F401

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
    name = 'my job $(touch canary) `touch canary` "q" #1 \\ end'
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
