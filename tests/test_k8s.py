"""Kubernetes without an API server: `dplaunch k8s` writes a TrainJob that validates against the
Trainer's CRD, and `dplaunch train` in a pod reads what the runtime sets (as SkyPilot's and
dstack's variables) like SLURM's. Two "pods" on this machine, started with the environment a
2-node TrainJob gives its pods, train like `dplaunch train --gpus 2`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from dplaunch.cluster.environments import detect_job
from dplaunch.cluster.jobs import launch_for_job
from dplaunch.config.schema import LaunchConfig
from dplaunch.errors import UserError
from dplaunch.run_directory.environment import JOB_ID_ENV
from tests.conftest import COMPARISON_FLAGS
from tests.helpers import (
    REPO,
    TINY_LLAMA,
    child_environment,
    files_under,
    free_port,
    max_relative_gap,
    read_metrics,
    refusal_line,
    run_cli,
    train_losses,
)

SCHEMAS = REPO / "tests" / "kubernetes_schemas"
IMAGE = "ghcr.io/example/train:1.0"
# what the torch-distributed runtime gives pod 1 of a 2-node TrainJob "llama" with
# numProcPerNode 4 (kubeflow/trainer v2.3, pkg/runtime/framework/plugins/torch/torch.go)
TRAINJOB_POD_1 = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "llama-node-0-0.llama",
    "PET_MASTER_PORT": "29500",
    "HOSTNAME": "llama-node-0-1",
}


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def write_manifests(tmp_path: Path, *args, name: str = "trainjob.yaml") -> list[dict]:
    run_dir = tmp_path / "run"
    result = run_cli("k8s", TINY_LLAMA, "--image", IMAGE, *args, "-o", run_dir)
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all((run_dir / name).read_text()))


def launch(**values) -> LaunchConfig:
    return LaunchConfig.model_validate(values)


# ---------------------------------------------------------------- what `dplaunch k8s` writes


@pytest.fixture(scope="module")
def trainjob_of_8_gpus(tmp_path_factory) -> list[dict]:
    """The ConfigMap and TrainJob of the tiny Llama on 8 GPUs in 2 pods."""
    folder = tmp_path_factory.mktemp("k8s")
    return write_manifests(folder, "--gpus", "8", "--nodes", "2", "--pvc", "rwx")


def test_8_gpus_on_2_nodes_is_a_trainjob_of_2_pods_of_4_that_validates(trainjob_of_8_gpus):
    configmap, trainjob = trainjob_of_8_gpus
    jsonschema.validate(trainjob, schema("trainjob.v1alpha1.json"))
    assert (trainjob["apiVersion"], trainjob["kind"]) == (
        "trainer.kubeflow.org/v1alpha1",
        "TrainJob",
    )
    spec = trainjob["spec"]
    assert spec["runtimeRef"]["name"] == "torch-distributed"
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 4}}
    # the Trainer's webhook refuses a TrainJob whose env sets the runtime's own variables
    assert not [env for env in trainer["env"] if env["name"].startswith("PET_")]
    # every pod is of one job for the run directory's lock, a pod started again too
    assert {"name": JOB_ID_ENV, "value": "trainjob/default/tiny-llama"} in trainer["env"]
    command = trainer["command"]
    assert command[:3] == ["dplaunch", "train", "/etc/dplaunch/tiny-llama.yaml"]
    assert command[-4:] == ["--output-dir", "/runs/tiny-llama", "--resume", "auto"]
    # the run file travels verbatim in the ConfigMap the pods mount
    assert configmap["kind"] == "ConfigMap"
    assert configmap["data"] == {"tiny-llama.yaml": TINY_LLAMA.read_text()}
    (patch,) = spec["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["run-file"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "rwx"
    (container,) = pod["containers"]
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert mounts["/etc/dplaunch"] == "run-file" and mounts["/runs"] == "runs"


def test_the_schema_catches_a_misspelt_field_and_a_name_that_is_no_dns_label(trainjob_of_8_gpus):
    # the check above can fail: the derived schema refuses what the API server refuses
    _, trainjob = trainjob_of_8_gpus
    misspelt = json.loads(json.dumps(trainjob))
    misspelt["spec"]["trainer"]["numProcsPerNode"] = 2
    renamed = json.loads(json.dumps(trainjob))
    renamed["metadata"]["name"] = "Tiny_llama"
    for bad in (misspelt, renamed):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema("trainjob.v1alpha1.json"))


def test_kind_pytorchjob_writes_a_master_and_workers_that_validate(tmp_path):
    _, job = write_manifests(
        tmp_path, "--gpus", "8", "--nodes", "2", "--pvc", "rwx", "--kind", "pytorchjob",
        name="pytorchjob.yaml",
    )  # fmt: skip
    jsonschema.validate(job, schema("pytorchjob.v1.json"))
    assert job["spec"]["nprocPerNode"] == "4"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 1)
    (container,) = replicas["Worker"]["template"]["spec"]["containers"]
    assert container["name"] == "pytorch" and container["command"][:2] == ["dplaunch", "train"]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("--gpus", "8", "--image", "Not An/Image!"), "--image"),
        (("--gpus", "8", "--nodes", "3", "--pvc", "rwx"), "launch.nodes"),
        (("--gpus", "8", "--namespace", "Team_A"), "--namespace"),
        (("--gpus", "8", "--nodes", "2"), "--pvc"),
        (("--gpus", "8", "--job-name", "9lives"), "--job-name"),
        (("--gpus", "8", "--master-port", "29511"), "--master-port"),
    ],
)
def test_a_value_the_cluster_would_refuse_is_one_line_and_nothing_is_written(tmp_path, args, field):
    result = run_cli("k8s", TINY_LLAMA, "--image", IMAGE, *args, "-o", tmp_path / "run")
    refusal_line(result, field)
    assert files_under(tmp_path) == []


def test_submit_without_a_cluster_is_one_line_after_the_file_is_written(tmp_path):
    env = child_environment(KUBECONFIG=str(tmp_path / "no-such-kubeconfig"))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    result = run_cli(
        "k8s", TINY_LLAMA, "--gpus", "2", "--image", IMAGE, "--submit", "-o", tmp_path / "run",
        env=env,
    )  # fmt: skip
    refusal_line(result, "--submit", "no Kubernetes cluster")
    assert (tmp_path / "run" / "trainjob.yaml").is_file()


# ---------------------------------------------------------------- what a pod's dplaunch reads


def test_a_trainjob_pod_is_node_1_of_2_with_the_head_pod_and_port_of_the_runtime():
    job = detect_job(TRAINJOB_POD_1)
    assert job.label == "Kubeflow TrainJob llama" and job.job_id == "llama"
    resolved, notes = launch_for_job(launch(), job)
    assert (resolved.nodes, resolved.node_rank, resolved.gpus, resolved.gpus_per_node) == (
        2,
        1,
        8,
        4,
    )
    assert (resolved.master_addr, resolved.master_port) == ("llama-node-0-0.llama", 29500)
    assert notes[-1].startswith("Kubeflow TrainJob llama: this is node 1 of 2 (llama-node-0-1)")


def test_auto_processes_per_pod_need_the_total_from_the_command_line():
    job = detect_job(TRAINJOB_POD_1 | {"PET_NPROC_PER_NODE": "auto"})
    assert job.gpus_per_node is None
    with pytest.raises(UserError) as error:
        launch_for_job(launch(), job)
    assert error.value.field == "--gpus"
    resolved, _ = launch_for_job(launch(gpus=8), job)
    assert (resolved.nodes, resolved.gpus, resolved.gpus_per_node) == (2, 8, None)


def test_a_pod_of_4_gpus_refuses_a_plan_of_another_count():
    with pytest.raises(UserError) as error:
        launch_for_job(launch(gpus=4), detect_job(TRAINJOB_POD_1))
    assert error.value.field == "--gpus" and "holds 8" in error.value.line()
    with pytest.raises(UserError) as error:
        launch_for_job(launch(nodes=4), detect_job(TRAINJOB_POD_1))
    assert error.value.field == "launch.nodes"


def test_a_pytorchjob_worker_pod_is_read_from_its_pet_variables_first():
    # training-operator 1.7+: worker 0 is node 1; WORLD_SIZE counts processes, not pods
    env = {
        "MASTER_ADDR": "llama-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "8",
        "RANK": "1",
        "PET_MASTER_ADDR": "llama-master-0",
        "PET_MASTER_PORT": "23456",
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_NPROC_PER_NODE": "4",
    }
    job = detect_job(env)
    assert (job.label, job.num_nodes, job.node_rank, job.gpus_per_node) == (
        "PyTorchJob llama", 2, 1, 4,
    )  # fmt: skip
    assert job.master_port == 23456


def test_an_older_pytorchjob_pod_is_read_from_master_addr_rank_and_world_size():
    env = {"MASTER_ADDR": "llama-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}
    job = detect_job(env)
    assert (job.label, job.num_nodes, job.node_rank, job.head_node) == (
        "PyTorchJob llama", 3, 2, "llama-master-0",
    )  # fmt: skip
    # the same names in a rank a launcher started (torchrun's LOCAL_RANK, dplaunch's own
    # DPLAUNCH_ERRORS_DIR) are that rank's, not a pod's
    assert detect_job(env | {"LOCAL_RANK": "0"}) is None
    assert detect_job(env | {"DPLAUNCH_ERRORS_DIR": "/runs/x/errors"}) is None


def test_skypilot_and_dstack_nodes_are_read_from_their_own_variables():
    skypilot = detect_job(
        {
            "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n",
            "SKYPILOT_NODE_RANK": "1",
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "8",
            "SKYPILOT_TASK_ID": "sky-2026-12-07-llama",
        }
    )
    dstack = detect_job(
        {
            "DSTACK_MASTER_NODE_IP": "10.0.1.2",
            "DSTACK_NODE_RANK": "0",
            "DSTACK_NODES_NUM": "4",
            "DSTACK_GPUS_PER_NODE": "8",
            "DSTACK_NODES_IPS": "10.0.1.2\n10.0.1.3\n10.0.1.4\n10.0.1.5",
            "DSTACK_RUN_NAME": "llama",
        }
    )
    for job, expected in (
        (skypilot, (2, 1, "10.0.0.5", 8, "10.0.0.6")),
        (dstack, (4, 0, "10.0.1.2", 8, "10.0.1.2")),
    ):
        shape = (job.num_nodes, job.node_rank, job.head_node, job.gpus_per_node, job.this_node)
        assert shape == expected
        resolved, _ = launch_for_job(launch(), job)
        assert (resolved.gpus, resolved.master_addr) == (expected[0] * 8, expected[2])


def test_a_variable_that_is_not_a_count_is_named_with_the_fix():
    with pytest.raises(UserError) as error:
        detect_job(TRAINJOB_POD_1 | {"PET_NODE_RANK": "2"})
    assert error.value.field == "PET_NODE_RANK" and "0..1" in error.value.line()
    with pytest.raises(UserError) as error:
        detect_job({"DSTACK_MASTER_NODE_IP": "10.0.1.2", "DSTACK_NODE_RANK": "0"})
    assert error.value.field == "DSTACK_NODES_NUM"


def test_in_a_pod_dplaunch_train_says_first_where_its_layout_comes_from(tmp_path):
    env = child_environment(
        **(TRAINJOB_POD_1 | {"PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "127.0.0.1"})
    )
    result = run_cli(
        "train", TINY_LLAMA, "--cpu", "--gpus", "2", "--dry-run", "-o", tmp_path / "run", env=env
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()[:2]
    assert first.startswith("Kubeflow TrainJob llama: this is node 1 of 2 (llama-node-0-1)")
    assert second == "world size 2 (2 node(s) × 1 CPU rank(s), backend gloo)"
    # said once: the plan's notes (printed after the world) do not repeat it
    assert f"note: {first}" not in result.stdout.splitlines()


# ---------------------------------------------------------------- two "pods" on this machine


def pod_environment(trainjob: dict, node_rank: int, port: int) -> dict[str, str]:
    """What the torch-distributed runtime gives pod NODE_RANK of TRAINJOB (the head pod's
    service name replaced by loopback: both "pods" are this machine), and the TrainJob's env."""
    trainer, name = trainjob["spec"]["trainer"], trainjob["metadata"]["name"]
    runtime = {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "HOSTNAME": f"{name}-node-0-{node_rank}",
    }
    return child_environment(**{e["name"]: e["value"] for e in trainer["env"]}, **runtime)


@pytest.fixture(scope="module")
def two_pods(tmp_path_factory) -> tuple[Path, list[str]]:
    """A 2-node CPU TrainJob's command run in two "pods" (its run file and volume folders
    mapped onto this machine): the run directory and each pod's output."""
    root = tmp_path_factory.mktemp("pods")
    result = run_cli(
        "k8s", TINY_LLAMA, "--cpu", "--gpus", "2", "--nodes", "2", *COMPARISON_FLAGS,
        "--image", IMAGE, "--pvc", "rwx", "-o", root / "local",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    configmap, trainjob = yaml.safe_load_all((root / "local" / "trainjob.yaml").read_text())
    ((file_name, text),) = configmap["data"].items()
    (root / file_name).write_text(text)
    mapped = {"/etc/dplaunch": str(root), "/runs": str(root / "runs")}
    command = [sys.executable, "-m", "dplaunch"] + [
        next((word.replace(a, b, 1) for a, b in mapped.items() if word.startswith(a)), word)
        for word in trainjob["spec"]["trainer"]["command"][1:]
    ]
    port = free_port()
    pods = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=pod_environment(trainjob, rank, port),
            cwd=root,
        )
        for rank in (0, 1)
    ]
    outputs = [pod.communicate(timeout=600)[0] for pod in pods]
    for rank, pod in enumerate(pods):
        assert pod.returncode == 0, f"pod {rank}:\n{outputs[rank][-4000:]}"
    return root / "runs" / trainjob["metadata"]["name"], outputs


@pytest.mark.multiprocess
def test_two_pods_of_a_trainjob_form_one_world_and_train_like_two_ranks(two_pods, dp_reference):
    run_dir, outputs = two_pods
    for rank, output in enumerate(outputs):
        first = output.splitlines()[0]
        assert first.startswith(f"Kubeflow TrainJob tiny-llama: this is node {rank} of 2"), first
    header = read_metrics(run_dir)[0]
    assert (header["world_size"], header["num_nodes"]) == (2, 2)
    losses = train_losses(run_dir)
    assert len(losses) == 6
    assert max_relative_gap(losses, train_losses(dp_reference)) < 1e-6
