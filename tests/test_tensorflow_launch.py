"""TensorFlow and Horovod scripts under `dplaunch launch`: workers with TF_CONFIG, supervised like
PyTorch ranks.

The Keras tests really train with MultiWorkerMirroredStrategy on 2 CPU workers (skipped where
TensorFlow is not installed: `pip install 'dplaunch[tensorflow]'`, which `make test` does). The
supervision tests run scripts that only look like TensorFlow scripts (--framework tensorflow),
so they cost no TensorFlow start-up; the SLURM tests read a faked allocation's variables.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from dplaunch.config.flags import RunFlags
from dplaunch.config.schema import LaunchConfig
from dplaunch.errors import UserError
from dplaunch.launching.frameworks import detect_framework, worker_hosts
from tests.helpers import (
    PRINTS_TF_CONFIG,
    REPO,
    child_environment,
    files_under,
    last_line,
    output,
    refusal_line,
    run_dplaunch,
    run_processes,
    start_dplaunch,
    tf_configs,
    wait_for,
    worker_script,
)

KERAS_EXAMPLE = REPO / "examples" / "keras_multiworker.py"
HAS_TENSORFLOW = all(importlib.util.find_spec(name) for name in ("tensorflow", "tf_keras"))
needs_tensorflow = pytest.mark.skipif(
    not HAS_TENSORFLOW,
    reason="TensorFlow and tf_keras are not installed (pip install 'dplaunch[tensorflow]')",
)
TRAIN_STEPS = 4
# float32 gradients of 4 + 4 samples summed across workers vs of 8 in one worker: the order of
# the additions differs, nothing else. Measured: at most 6e-8 apart after 4 steps. One SGD step
# moves these weights by ~1e-2, so a wrong average (a sum, or one worker's half batch) is far
# outside this tolerance while rounding is far inside it
WEIGHT_TOLERANCE = 1e-6


def tf_environment(**extra: str) -> dict[str, str]:
    # TensorFlow's C++ start-up chatter (oneDNN, cpu features) off, and Keras 2 (tf_keras):
    # Keras 3's model.fit fails under MultiWorkerMirroredStrategy (keras-team/keras#20585)
    return child_environment(TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1", **extra)


def reports(stdout: str) -> list[dict]:
    return [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("REPORT ")]


def keras_run(root: Path, workers: int) -> tuple[object, Path]:
    out = root / f"weights-{workers}"
    result = run_dplaunch(
        "launch", KERAS_EXAMPLE, "--cpu", "--gpus", workers, "-o", root / f"run-{workers}",
        "--", "--steps", TRAIN_STEPS, "--out", out,
        env=tf_environment(), timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result, out


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """One 2-worker Keras run, shared by the tests that read it (TensorFlow starts slowly)."""
    return keras_run(tmp_path_factory.mktemp("keras"), 2)


# --- a Keras model on 2 CPU workers ---------------------------------------------------------------


@needs_tensorflow
@pytest.mark.multiprocess
def test_keras_on_2_cpu_workers_each_worker_sees_2_replicas(two_workers):
    result, _ = two_workers
    assert sorted((r["worker"], r["replicas"]) for r in reports(result.stdout)) == [(0, 2), (1, 2)]
    assert "tensorflow: 2 worker(s), one per CPU rank" in result.stdout
    # the launcher is dplaunch's own (no torchrun, no accelerate in between)
    assert "launch: " in result.stdout and "dplaunch.launching.workers" in result.stdout


@needs_tensorflow
@pytest.mark.multiprocess
def test_keras_weights_after_2_workers_equal_1_worker_on_the_same_global_batch(
    two_workers, tmp_path
):
    _, two = two_workers
    _, one = keras_run(tmp_path, 1)
    alone = np.load(one / "worker-0.npz")
    names = [name for name in alone if not name.startswith("start_")]
    for worker in (0, 1):
        trained = np.load(two / f"worker-{worker}.npz")
        assert sorted(trained) == sorted(alone)
        for name in names:
            gap = np.abs(trained[name] - alone[name]).max()
            assert gap <= WEIGHT_TOLERANCE, (worker, name, gap)
            # the same start, and training moved the weights far more than the tolerance
            assert np.array_equal(trained[f"start_{name}"], alone[f"start_{name}"])
        moved = max(np.abs(alone[n] - alone[f"start_{n}"]).max() for n in names)
        assert moved > 1000 * WEIGHT_TOLERANCE, moved


# worker 1 stops taking part; worker 0's all-reduce gives up after launch.timeout_minutes, which
# the script passes to the strategy as dplaunch's example does
STALLS_ON_WORKER_1 = """
import os, time
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import tensorflow as tf
timeout_s = float(os.environ["DPLAUNCH_TIMEOUT_MINUTES"]) * 60
strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_s)
)
if strategy.cluster_resolver.task_id == 1:
    time.sleep(300)
@tf.function
def step():
    return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.ones([1])))
step()
"""


@needs_tensorflow
@pytest.mark.multiprocess
def test_a_stalled_worker_fails_the_job_at_the_collective_timeout(tmp_path):
    script = tmp_path / "stalls.py"
    script.write_text(STALLS_ON_WORKER_1)
    started = time.monotonic()
    result = run_dplaunch(
        "launch", script, "--cpu", "--gpus", "2", "-o", tmp_path / "run",
        "--set", "launch.timeout_minutes=0.1", env=tf_environment(), timeout=280,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    # worker 1 sleeps 300 s: ending before that means the timeout ended it
    assert time.monotonic() - started < 250
    assert "launch.timeout_minutes = 0.1 (6 s)" in result.stderr
    # the stalled worker dumped its stack (it is in the script's sleep), as a PyTorch rank does,
    # and the last line names it; unarmed, it was killed by the dump signal (SIGUSR2) and the
    # job ended with status 140 whenever it died before worker 0
    errors = tmp_path / "run" / "errors"
    stalled = errors / "stacks-rank-1.txt"
    assert f'File "{script}", line' in stalled.read_text()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-2:] == [
        "[rank 0] Collective has timed out waiting for other workers.",
        "dplaunch: rank(s) 1 not inside the collective that timed out (the others waited there "
        f"for it); its stack: {stalled} (every rank's: {errors}/stacks-rank-N.txt)",
    ], result.stderr[-3000:]
    assert run_processes(str(script)) == []


# --- supervision: the same as for PyTorch ranks ----------------------------------------------------

# looks like a worker of a TensorFlow job; imports nothing heavy, so the tests stay fast
WORKER_1_RAISES = """
if index == 1:
    time.sleep(1)
    raise ValueError("worker one broke on purpose")
time.sleep(120)  # worker 0 waits in its collective; the launcher must stop it
"""
WORKER_1_KILLS_ITSELF = """
if index == 1:
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""
WORKER_1_EXITS_3 = """
if index == 1:
    sys.exit(3)
time.sleep(120)
"""
WORKERS_WAIT = """
while True:
    time.sleep(0.2)
"""


def launch_workers(tmp: Path, script: Path, *args, timeout: float = 120):
    return run_dplaunch(
        "launch", script, "--framework", "tensorflow", "--cpu", "--gpus", "2",
        "-o", tmp / "run", *args, timeout=timeout,
    )  # fmt: skip


def test_a_worker_that_raises_ends_the_job_with_its_line_last_and_no_process_left(tmp_path):
    script = worker_script(tmp_path, "raises.py", WORKER_1_RAISES)
    started = time.monotonic()
    result = launch_workers(tmp_path, script)
    assert result.returncode == 1, result.stderr
    assert last_line(result.stderr) == "[rank 1] ValueError: worker one broke on purpose"
    # its traceback went by above, prefixed as torch's ranks do; the summary once
    assert "[rank1]: Traceback (most recent call last):" in result.stderr
    assert result.stderr.count("[rank 1] ValueError") == 1
    assert "rank 0" not in result.stderr  # stopped by the launcher: no failure of its own
    # worker 0 sleeps 120 s: the job ended because the launcher stopped it
    assert time.monotonic() - started < 100
    assert run_processes(str(script)) == []


def test_a_worker_killed_by_a_signal_is_named_with_the_signal(tmp_path):
    script = worker_script(tmp_path, "dies.py", WORKER_1_KILLS_ITSELF)
    result = launch_workers(tmp_path, script)
    assert result.returncode == 128 + signal.SIGKILL
    assert last_line(result.stderr).startswith(
        "[rank 1] was killed by signal 9 (SIGKILL) before it could report an error"
    ), result.stderr
    assert run_processes(str(script)) == []


def test_a_worker_exit_status_is_the_jobs(tmp_path):
    script = worker_script(tmp_path, "exits.py", WORKER_1_EXITS_3)
    result = launch_workers(tmp_path, script)
    assert result.returncode == 3
    assert last_line(result.stderr).startswith("[rank 1] exited with status 3"), result.stderr


def waiting_workers(tmp: Path):
    """dplaunch running 2 workers that wait for ever, once both are up."""
    script = worker_script(tmp, "waits.py", WORKERS_WAIT)
    dplaunch = start_dplaunch(
        tmp,
        "launch",
        script,
        "--framework",
        "tensorflow",
        "--cpu",
        "--gpus",
        "2",
        "-o",
        tmp / "run",
    )
    wait_for(lambda: output(tmp)[0].count("ready") == 2, 60, "both workers ready")
    return dplaunch, script


def test_sigterm_to_dplaunch_stops_every_worker(tmp_path):
    dplaunch, script = waiting_workers(tmp_path)
    assert len(run_processes(str(script))) == 3  # dplaunch and its 2 workers
    dplaunch.send_signal(signal.SIGTERM)
    code = dplaunch.wait(timeout=60)
    assert code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in output(tmp_path)[1]
    wait_for(lambda: run_processes(str(script)) == [], 30, "no worker left")


def test_killing_dplaunch_with_sigkill_leaves_no_worker(tmp_path):
    dplaunch, script = waiting_workers(tmp_path)
    dplaunch.kill()
    dplaunch.wait()
    wait_for(lambda: run_processes(str(script)) == [], 30, "no worker left after kill -9")


# --- TF_CONFIG: one node, several nodes, SLURM ----------------------------------------------------


def test_each_cpu_worker_gets_its_index_the_same_cluster_and_no_gpu(tmp_path):
    script = worker_script(tmp_path, "prints.py", PRINTS_TF_CONFIG)
    result = launch_workers(tmp_path, script)
    assert result.returncode == 0, result.stderr
    configs = tf_configs(result.stdout)
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in (0, 1)]
    cluster = configs[0]["cluster"]["worker"]
    assert configs[1]["cluster"]["worker"] == cluster and len(set(cluster)) == 2
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", address) for address in cluster)
    assert result.stdout.count("DEVICES ''") == 2
    written = json.loads((tmp_path / "run" / "workers.json").read_text())
    assert [json.loads(w["env"]["TF_CONFIG"]) for w in written["workers"]] == configs


def test_two_nodes_on_loopback_render_one_cluster_of_4_workers(tmp_path):
    script = worker_script(tmp_path, "prints.py", PRINTS_TF_CONFIG)
    runs = []
    for rank in (0, 1):
        args = (
            "launch", script, "--framework", "tensorflow", "--cpu", "--gpus", "4",
            "--nodes", "2", "--node-rank", rank, "--master-port", "29710", "-o", tmp_path / "run",
        )  # fmt: skip
        (tmp_path / f"node{rank}").mkdir()
        runs.append(start_dplaunch(tmp_path / f"node{rank}", *args))
    assert [run.wait(timeout=120) for run in runs] == [0, 0]
    stdout = "".join(output(tmp_path / f"node{rank}")[0] for rank in (0, 1))
    configs = tf_configs(stdout)
    expected = [f"127.0.0.1:{port}" for port in (29710, 29711, 29712, 29713)]
    assert [c["task"]["index"] for c in configs] == [0, 1, 2, 3]
    assert all(c["cluster"]["worker"] == expected for c in configs)
    # both nodes write into one run directory without overwriting each other
    assert (tmp_path / "run" / "workers.json").exists()
    assert (tmp_path / "run" / "workers-node1.json").exists()


def test_a_hostfile_run_on_each_node_renders_one_cluster_of_its_hosts(tmp_path):
    # two names of this machine stand for two hosts; each node runs the same command
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    script = worker_script(tmp_path, "prints.py", PRINTS_TF_CONFIG)
    runs = []
    for rank in (0, 1):
        args = (
            "launch", script, "--framework", "tensorflow", "--cpu", "--hostfile", hostfile,
            "--node-rank", rank, "--master-port", "29720", "-o", tmp_path / "run",
        )  # fmt: skip
        (tmp_path / f"node{rank}").mkdir()
        runs.append(start_dplaunch(tmp_path / f"node{rank}", *args))
    assert [run.wait(timeout=120) for run in runs] == [0, 0], output(tmp_path / "node1")[1]
    configs = tf_configs("".join(output(tmp_path / f"node{rank}")[0] for rank in (0, 1)))
    assert configs == [
        {
            "cluster": {"worker": ["localhost:29720", "127.0.0.1:29721"]},
            "task": {"type": "worker", "index": index},
        }
        for index in (0, 1)
    ]


SLURM_2_NODES = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "tf-node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_CPUS_PER_TASK": "8",
}
# SLURM's port for job 4242 (cluster.slurm: MASTER_PORT_BASE + job id % span)
SLURM_PORT = 20000 + 4242


def prepared_in_slurm(monkeypatch, tmp_path, script: Path, slurm_gpus: str | None, **flags):
    from dplaunch.launching.frameworks import prepare_tensorflow_launch

    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in SLURM_2_NODES.items():
        monkeypatch.setenv(name, value)
    # SLURM's CPUs decide the workers' threads unless the user set them
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if slurm_gpus is not None:
        monkeypatch.setenv("SLURM_GPUS_ON_NODE", slurm_gpus)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(int(slurm_gpus)))))
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    flags = RunFlags(output_dir=str(tmp_path / "run"), **flags)
    return prepare_tensorflow_launch(flags, [str(script)])


def node_workers(prepared) -> list[dict]:
    return json.loads(prepared.files["workers-node1.json"])["workers"]


def test_a_2_node_slurm_gpu_allocation_runs_one_worker_per_node_with_all_its_gpus(
    monkeypatch, tmp_path
):
    script = worker_script(tmp_path, "train.py", "")
    prepared = prepared_in_slurm(monkeypatch, tmp_path, script, slurm_gpus="4")
    (worker,) = node_workers(prepared)  # node 1 starts one worker: worker 1
    assert json.loads(worker["env"]["TF_CONFIG"]) == {
        "cluster": {"worker": [f"tf-node1:{SLURM_PORT}", f"tf-node2:{SLURM_PORT + 1}"]},
        "task": {"type": "worker", "index": 1},
    }
    assert worker["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert prepared.plan.num_nodes == 2 and prepared.plan.node_rank == 1
    assert any("8 replica(s)" in note for note in prepared.plan.notes)


def test_a_2_node_slurm_cpu_allocation_runs_the_cpu_ranks_of_this_node(monkeypatch, tmp_path):
    script = worker_script(tmp_path, "train.py", "")
    prepared = prepared_in_slurm(monkeypatch, tmp_path, script, None, cpu=True, gpus=4)
    workers = node_workers(prepared)
    cluster = [f"tf-node{1 + i // 2}:{SLURM_PORT + i}" for i in range(4)]
    assert [json.loads(w["env"]["TF_CONFIG"]) for w in workers] == [
        {"cluster": {"worker": cluster}, "task": {"type": "worker", "index": i}} for i in (2, 3)
    ]
    assert {w["env"]["CUDA_VISIBLE_DEVICES"] for w in workers} == {""}
    # SLURM's 8 CPUs of this node are shared by its 2 workers
    assert prepared.env["OMP_NUM_THREADS"] == "4"


# --- which scripts are TensorFlow scripts; what is refused ---------------------------------------


@pytest.mark.parametrize(
    ("source", "framework"),
    [
        ("import tensorflow as tf\n", "tensorflow"),
        ("from tensorflow import keras\n", "tensorflow"),
        ("import keras\n", "tensorflow"),
        ("def main():\n    import tensorflow\n", "tensorflow"),
        ("import horovod.tensorflow.keras as hvd\nimport tensorflow\n", "horovod"),
        ("import horovod.torch as hvd\nimport torch\n", "horovod"),
        ("import torch\n", "pytorch"),
        ("from accelerate import Accelerator\n", "pytorch"),
        # TensorBoard's writer or tf.data beside torch: still a PyTorch script
        ("import torch\nimport tensorflow as tf\n", "pytorch"),
        ("this is not python (\n", "pytorch"),
    ],
)
def test_the_framework_is_what_the_script_imports(tmp_path, source, framework):
    script = tmp_path / "script.py"
    script.write_text(source)
    assert detect_framework(script) == framework


def test_several_nodes_named_only_by_their_head_are_refused_with_the_fix():
    launch = LaunchConfig(nodes=2, master_addr="head-node", gpus=2)
    with pytest.raises(UserError) as refused:
        worker_hosts(launch, None, ())
    assert refused.value.field == "launch.hostfile"
    assert "hostfile" in refused.value.fix and "SLURM" in refused.value.fix


def test_a_hostfile_names_every_node_and_this_node_is_found_by_its_name(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu-a slots=4\ngpu-b slots=4\n")
    launch = LaunchConfig(hostfile=str(hostfile))
    resolved, hosts, _ = worker_hosts(launch, None, ("gpu-b",))
    assert hosts == ("gpu-a", "gpu-b")
    assert (resolved.nodes, resolved.gpus_per_node, resolved.node_rank) == (2, 4, 1)
    with pytest.raises(UserError) as unknown:
        worker_hosts(launch, None, ("elsewhere",))
    assert unknown.value.field == "launch.node_rank"


def test_the_plan_of_a_tensorflow_script_shows_its_workers_not_pytorchs_engine(tmp_path):
    # the strategy in the script owns the collectives, the batch and the precision: no gloo
    # backend, dp mesh, DDP engine, micro batch or grad-accum line that TensorFlow never sees
    script = worker_script(tmp_path, "train.py", "import tensorflow\n")
    run = tmp_path / "run"
    result = run_dplaunch("launch", script, "--cpu", "--gpus", "2", "-o", run, "--dry-run")
    assert result.returncode == 0, result.stderr
    plan_lines = result.stdout.split("\n--- ")[0].splitlines()
    assert plan_lines[0] == (
        "world size 2 (1 node(s) × 2 CPU rank(s), collectives by the script's TensorFlow strategy)"
    )
    # the rest are notes (the ports depend on what else listens here)
    assert all(line.startswith("note: ") for line in plan_lines[1:]), plan_lines
    assert "note: --cpu: 2 CPU rank(s)" in plan_lines
    assert (
        "note: tensorflow: 2 worker(s), one per CPU rank: MultiWorkerMirroredStrategy sees 2 "
        "replica(s); each worker's TF_CONFIG is in workers.json"
    ) in plan_lines
    assert "gloo" not in "\n".join(plan_lines)
    # the dry run shows the files it would write: plan.json says which framework
    plan_json = result.stdout.split(f"--- {run / 'plan.json'}\n")[1].split("\n--- ")[0]
    assert json.loads(plan_json)["framework"] == "tensorflow"


def test_zero_for_a_tensorflow_script_is_refused_and_nothing_written(tmp_path):
    script = worker_script(tmp_path, "train.py", "import tensorflow\n")
    result = run_dplaunch(
        "launch", script, "--cpu", "--gpus", "2", "--zero", "2", "-o", tmp_path / "run"
    )
    refusal_line(result, "parallel:", "MultiWorkerMirroredStrategy")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("horovod") is not None, reason="horovod is installed here"
)
def test_horovod_is_refused_in_one_line_when_it_cannot_be_imported(tmp_path):
    script = tmp_path / "hvd_allreduce.py"
    script.write_text("import torch\nimport horovod.torch as hvd\nhvd.init()\n")
    before = files_under(tmp_path)
    for extra in ((), ("--framework", "horovod")):
        result = run_dplaunch("launch", script, "--cpu", "--gpus", "2", *extra)
        refusal_line(result, "--framework: horovod cannot be imported here", "C++17")
    assert files_under(tmp_path) == before


def test_keras_3s_per_replica_failure_ends_with_the_one_line_fix(tmp_path, monkeypatch, capsys):
    # every worker of a Keras 3 model.fit under MultiWorkerMirroredStrategy fails with this
    # (keras-team/keras#20585); the job's summary ends with how to run it instead
    from dplaunch.launching.process import RankWatch
    from dplaunch.launching.workers import TRACEBACK_PREFIX_ENV
    from dplaunch.train import script

    fit = tmp_path / "fit.py"
    fit.write_text(
        'raise ValueError("Attempt to convert a value (PerReplica:{ 0: <tf.Tensor: shape=(4, 4)>'
        " }) with an unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>)"
        ' to a Tensor.")\n'
    )
    monkeypatch.setenv(TRACEBACK_PREFIX_ENV, "1")
    monkeypatch.setenv("RANK", "1")
    assert script.main([str(fit)]) == 1
    watch = RankWatch(tmp_path / "errors")
    for line in capsys.readouterr().err.splitlines():
        watch.filter(line)
    rank, _, line = watch.first_failure()
    assert rank == 1 and line.startswith("[rank 1] dplaunch: Keras 3's model.fit does not run")
    assert "TF_USE_LEGACY_KERAS=1" in line and "tf-keras" in line
