"""`dplaunch ray` on a real Ray cluster on this machine: a head and a second node (another
loopback address, so that Ray sees two nodes), each run as `ray start --block`. Two CPU ranks,
one Ray worker per node, train like `dplaunch train --gpus 2`; a killed worker is restarted by
Ray (launch.max_restarts → FailureConfig) and the run ends with the straight run's losses.

The ranks start as themselves (a Ray worker's child), not from the suite's fork servers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from dplaunch.cluster.ray_job import RayJob, placement_problem
from dplaunch.run_directory.environment import CHECKPOINT_FAULT_ENV
from tests.conftest import COMPARISON_FLAGS
from tests.helpers import (
    TINY_LLAMA,
    child_environment,
    free_port,
    max_relative_gap,
    read_metrics,
    refusal_line,
    run_cli,
    train_losses,
)

RAY = Path(sys.executable).with_name("ray")
# the killed run saves every 2 steps; step 4's save waits this long between its write and its
# commit, in every attempt: the window in which the test kills a worker
SAVE_PAUSE_S = 2


def ray_environment(**extra: str) -> dict[str, str]:
    """The ranks' environment for Ray's processes here and dplaunch ray, without Ray's token
    authentication: Ray 2.60 turns it on for a cluster when ~/.ray/auth_token exists (a local
    ray.init() writes one), and the test's nodes and driver must not depend on that file."""
    env = child_environment(RAY_AUTH_MODE="disabled", **extra)
    env.pop("RAY_ADDRESS", None)
    return env


def ray_node(*args: str, env: dict[str, str]) -> subprocess.Popen:
    """`ray start --block ARGS` in a session of its own: 4 logical CPUs (above this machine's
    2 cores, so that two ranks and Ray's own actors fit), a small object store."""
    return subprocess.Popen(
        [str(RAY), "start", "--block", "--num-cpus", "4", "--object-store-memory", "80000000",
         "--disable-usage-stats", *args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray head on 127.0.0.1 and a second node on 127.0.0.2; its address."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="dpray-")  # short: Ray's socket paths live in it
    # what the ranks inherit from the Ray workers (Ray starts them from its raylet): one thread
    # each, and the test seam that pauses step 4's save (the straight run saves nothing)
    env = ray_environment(**{CHECKPOINT_FAULT_ENV: f"4:sleep={SAVE_PAUSE_S}"})
    head = ray_node(
        "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
        "--include-dashboard", "false", "--temp-dir", temp_dir, env=env,
    )  # fmt: skip
    nodes = [head]
    try:
        time.sleep(3)  # the head's GCS must listen before the second node joins it
        nodes.append(
            ray_node("--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.2", env=env)
        )
        yield f"127.0.0.1:{port}"
    finally:
        stop_processes(nodes)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_processes(nodes: list[subprocess.Popen]) -> None:
    """Stop the nodes and everything they started (Ray's workers start sessions of their own)."""
    started = []
    for node in nodes:
        with_children = [psutil.Process(node.pid)] if psutil.pid_exists(node.pid) else []
        with_children += with_children[0].children(recursive=True) if with_children else []
        started += with_children
    for node in nodes:
        with_suppressed(os.killpg, node.pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(started, timeout=3)
    for process in alive:
        with_suppressed(process.kill)
    psutil.wait_procs(alive, timeout=5)


def with_suppressed(call, *args) -> None:
    try:
        call(*args)
    except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
        pass


def ray_train(address: str, run_dir: Path, *args: str) -> subprocess.Popen:
    """`dplaunch ray` of the tiny Llama on 2 CPU ranks, one per node, in the background."""
    command = [
        sys.executable, "-m", "dplaunch", "ray", str(TINY_LLAMA), "--cpu", "--gpus", "2",
        "--nodes", "2", *COMPARISON_FLAGS, "--address", address, "-o", str(run_dir), *args,
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=ray_environment(),
    )  # fmt: skip


def losses_by_step(run_dir: Path) -> list[float]:
    """The loss of every step, as the last launch that reached it logged it."""
    by_step = {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["type"] == "train"}
    return [by_step[step] for step in sorted(by_step)]


def rank_process(rank: int) -> psutil.Process | None:
    """The `python -m dplaunch.train` process of RANK, started by a Ray worker."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            if process.info["cmdline"][1:3] == ["-m", "dplaunch.train"]:
                if process.environ().get("RANK") == str(rank):
                    return process
        except (psutil.Error, TypeError, IndexError):
            continue
    return None


@pytest.mark.multiprocess
def test_two_ray_workers_on_two_nodes_train_like_dplaunch_train(
    ray_cluster, tmp_path, dp_reference
):
    run_dir = tmp_path / "run"
    job = ray_train(ray_cluster, run_dir, "--set", "launch.timeout_minutes=7")
    output = job.communicate(timeout=600)[0]
    assert job.returncode == 0, output[-6000:]
    assert "placement_strategy='STRICT_SPREAD'" in output
    # one worker on each node (Ray's own line), meeting at rank 0's node
    assert "world_rank=1, local_rank=0, node_rank=1" in output
    header = read_metrics(run_dir)[0]
    assert (header["world_size"], header["num_nodes"]) == (2, 2)
    # the engine's own process group, with launch.timeout_minutes (Ray's would hold 1800 s)
    assert header["process_group_timeouts_s"] == [420.0]
    assert max_relative_gap(train_losses(run_dir), train_losses(dp_reference)) < 1e-6


@pytest.mark.multiprocess
def test_a_killed_worker_is_restarted_by_ray_and_the_run_ends_as_the_straight_one(
    ray_cluster, tmp_path, dp_reference
):
    run_dir = tmp_path / "run"
    job = ray_train(
        ray_cluster, run_dir, "--set", "train.checkpoint_every=2", "--set", "launch.max_restarts=1"
    )
    saving = run_dir / "checkpoints" / ".tmp-step-4"
    deadline = time.monotonic() + 300
    while not saving.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    rank = rank_process(1)
    assert saving.exists() and rank is not None, "no save of step 4 in progress"
    worker = rank.parent()  # the Ray worker (a RayTrainWorker actor) that runs rank 1
    worker.kill()
    # meanwhile the run directory is this job's: another `dplaunch ray` into it is refused
    second = run_cli(
        "ray", TINY_LLAMA, "--cpu", "--gpus", "2", "--nodes", "2", *COMPARISON_FLAGS,
        "--address", ray_cluster, "--resume", "auto", "-o", run_dir,
    )  # fmt: skip
    refusal_line(second, "output_dir", "in use by a live run", "dplaunch ray pid")
    output = job.communicate(timeout=600)[0]
    assert job.returncode == 0, output[-6000:]
    assert not psutil.pid_exists(rank.pid) or rank.status() == psutil.STATUS_ZOMBIE
    records = read_metrics(run_dir)
    (restart,) = [r for r in records if r["type"] == "restart"]
    assert restart["checkpoint_step"] == 2  # step 4's save never committed
    assert records[-1]["type"] == "summary" and records[-1]["restarts"] == 1
    assert max_relative_gap(losses_by_step(run_dir), train_losses(dp_reference)) < 1e-6


# ---------------------------------------------------------------- without a cluster


def ray_job(workers: int, nodes: int) -> RayJob:
    return RayJob("run", "/shared/runs", workers, nodes, True, 1.0, 2)


@pytest.mark.parametrize(
    ("workers", "nodes", "strategy"),
    [(8, 1, "STRICT_PACK"), (4, 4, "STRICT_SPREAD"), (16, 2, "PACK")],
)
def test_the_workers_are_placed_as_the_plan_needs(workers, nodes, strategy):
    assert ray_job(workers, nodes).placement_strategy == strategy


def test_a_spread_that_is_not_the_plans_is_named_with_both_counts():
    # PACK on uneven nodes can give 6 + 2 for 2 nodes of 4
    job = ray_job(8, 2)
    assert placement_problem(job, local_world_size=4, world_size=8) is None
    problem = placement_problem(job, local_world_size=6, world_size=8)
    assert "6 of the 8 workers on one node" in problem and "4 per node on 2 nodes" in problem


def test_dry_run_prints_the_plan_and_the_ray_objects_and_starts_nothing(tmp_path):
    result = run_cli(
        "ray", TINY_LLAMA, "--gpus", "16", "--nodes", "2", "--global-batch", "16",
        "--set", "launch.max_restarts=2",
        "--address", "head:6379", "--dry-run", "-o", tmp_path / "run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "world size 16 (2 node(s) × 8 GPU(s), backend nccl)" in result.stdout
    assert (
        "ray: ScalingConfig(num_workers=16, use_gpu=True, resources_per_worker={'CPU': 1.0, "
        "'GPU': 1.0}, placement_strategy='PACK')"
    ) in result.stdout
    assert (
        f"ray: RunConfig(name='run', storage_path='{tmp_path}', "
        "failure_config=FailureConfig(max_failures=2))"
    ) in result.stdout
    assert f"launch: {sys.executable} -m dplaunch.train {tmp_path / 'run'}" in result.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("args", "field"),
    [(("--master-port", "29511"), "--master-port"), (("--nodes", "3"), "launch.nodes")],
)
def test_what_ray_decides_or_cannot_place_is_one_line(tmp_path, args, field):
    result = run_cli("ray", TINY_LLAMA, "--gpus", "8", *args, "-o", tmp_path / "run")
    refusal_line(result, field)
    assert not (tmp_path / "run").exists()


def test_the_command_line_imports_neither_ray_nor_the_kubernetes_client():
    probe = (
        "import sys\n"
        "from dplaunch.cli import main\n"
        "for argv in (['--help'], ['ray', '--help'], ['k8s', '--help']):\n"
        "    sys.argv = ['dplaunch', *argv]\n"
        "    try:\n        main()\n    except SystemExit:\n        pass\n"
        "print('LOADED', sorted({'ray', 'kubernetes', 'torch'} & set(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=child_environment()
    )
    assert result.stdout.splitlines()[-1] == "LOADED []", result.stderr[-2000:]


def test_a_zero_3_rank_gets_the_variables_accelerate_launch_gives_it(tmp_path):
    # what `accelerate launch` set for a rank of `dplaunch launch --cpu --gpus 2 --zero 3`
    # (measured: a probe script's environment), among them ZeRO-3's init flag from
    # accelerate.yaml, which DeepSpeedPlugin would otherwise default to true
    from dplaunch.launching.ray_ranks import accelerate_environment

    result = run_cli("config", TINY_LLAMA, "--cpu", "--gpus", "2", "--zero", "3", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    assert accelerate_environment(tmp_path / "accelerate.yaml") == {
        "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file,zero3_init_flag,"
        "deepspeed_multinode_launcher",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "deepspeed.json"),
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_USE_DEEPSPEED": "true",
    }
