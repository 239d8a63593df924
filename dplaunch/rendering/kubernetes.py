"""PodJob → Kubernetes manifests: a Kubeflow Trainer v2 TrainJob (or a legacy PyTorchJob) that
runs `dplaunch train` in every pod, and the ConfigMap holding the run file. Pure: dicts and text.

The TrainJob uses the `torch-distributed` ClusterTrainingRuntime with v2.2+ field names
(trainer.numNodes, an int32 numProcPerNode, resourcesPerNode, runtimePatches); the runtime gives
every pod PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT,
which `dplaunch train` reads (cluster/environments.py) as it reads SLURM's. The Trainer's
webhook refuses a TrainJob whose own env names any of them, so none is written here.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from dplaunch.run_directory.layout import RUN_FILE

TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
PYTORCHJOB_API = "kubeflow.org/v1"
# the ClusterTrainingRuntime every Kubeflow Trainer install ships for torchrun-style jobs
TORCH_RUNTIME = "torch-distributed"
# the runtime's replicated job and its trainer container (manifests/base/runtimes)
TRAINER_JOB = "node"
TRAINER_CONTAINER = "node"
# training-operator finds the training container of a PyTorchJob by this name
PYTORCHJOB_CONTAINER = "pytorch"
GPU_RESOURCE = "nvidia.com/gpu"
# where the pods find the run file (the ConfigMap) and keep their run directories (the PVC)
RUN_FILE_FOLDER = "/etc/dplaunch"
RUNS_FOLDER = "/runs"
# the patch entries dplaunch owns in a TrainJob's runtimePatches
PATCH_MANAGER = "dplaunch"
# NCCL and the ranks' shared-memory queues need more than a container's default 64 MB /dev/shm
SHM_VOLUME = "dshm"
# the names the torch plugin sets in every pod; a TrainJob that sets one itself is refused
RESERVED_ENV = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
)

# RFC 1035 (a TrainJob's name: its pods and service are named after it) and RFC 1123 (a namespace)
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# an image reference: [host[:port]/]path[:tag][@digest] (the distribution project's grammar)
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
IMAGE_REFERENCE = re.compile(
    rf"(?:{_HOST}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
)


@dataclass(frozen=True)
class PodJob:
    """One training job on Kubernetes: its pods, what each runs, and what it mounts."""

    name: str
    namespace: str
    image: str
    # what every pod runs: `dplaunch train RUN_FILE … --output-dir RUNS/NAME --resume auto`
    command: list[str]
    num_nodes: int
    # ranks per pod (numProcPerNode), GPUs too unless the ranks are CPU ranks
    procs_per_node: int
    cpu: bool = False
    env: dict[str, str] = field(default_factory=dict)
    # the run file's text (the ConfigMap); None: the image's dplaunch uses its embedded default
    run_file: str | None = None
    run_file_name: str = RUN_FILE
    # a PersistentVolumeClaim every pod mounts at RUNS_FOLDER; None: the pod's own disk
    pvc: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def configmap_name(self) -> str:
        """The ConfigMap of the run file: the job's name with a suffix (63 characters at most)."""
        return f"{self.name[:57]}-run"

    @property
    def run_file_path(self) -> str:
        """Where every pod reads the run file."""
        return f"{RUN_FILE_FOLDER}/{self.run_file_name}"


def check_pod_job(job: PodJob) -> None:
    """ValueError naming the field of a value the API server would refuse."""
    if not DNS_1035_LABEL.fullmatch(job.name):
        raise ValueError(f"name: {job.name!r} is not a DNS label (RFC 1035)")
    if not DNS_1123_LABEL.fullmatch(job.namespace):
        raise ValueError(f"namespace: {job.namespace!r} is not a DNS label (RFC 1123)")
    if not IMAGE_REFERENCE.fullmatch(job.image):
        raise ValueError(f"image: {job.image!r} is not an image reference")
    if job.pvc is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", job.pvc):
        raise ValueError(f"pvc: {job.pvc!r} is not a PersistentVolumeClaim name")
    reserved = sorted(set(job.env) & set(RESERVED_ENV))
    if reserved:
        raise ValueError(f"env: {', '.join(reserved)} are the runtime's to set")


def render_configmap(job: PodJob) -> dict[str, Any]:
    """The ConfigMap that holds the run file."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, job.configmap_name),
        "data": {job.run_file_name: job.run_file or ""},
    }


def render_trainjob(job: PodJob) -> dict[str, Any]:
    """The TrainJob: numNodes pods of the torch-distributed runtime, each running the command."""
    trainer: dict[str, Any] = {
        "image": job.image,
        "command": list(job.command),
        "numNodes": job.num_nodes,
        "numProcPerNode": job.procs_per_node,
        "env": _env(job),
    }
    resources = _resources(job)
    if resources:
        trainer["resourcesPerNode"] = resources
    pod = {"volumes": _volumes(job), "containers": [_mounts(job, TRAINER_CONTAINER)]}
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": TRAINER_JOB, "template": {"spec": {"template": {"spec": pod}}}}
                    ]
                }
            }
        },
    }
    return {
        "apiVersion": TRAINJOB_API,
        "kind": "TrainJob",
        "metadata": _metadata(job, job.name),
        "spec": {
            "runtimeRef": {
                "name": TORCH_RUNTIME,
                "kind": "ClusterTrainingRuntime",
                "apiGroup": "trainer.kubeflow.org",
            },
            "trainer": trainer,
            "runtimePatches": [patch],
        },
    }


def render_pytorchjob(job: PodJob) -> dict[str, Any]:
    """The same job as a legacy PyTorchJob (kubeflow.org/v1, training-operator 1.7+): a Master
    and numNodes - 1 Workers; the operator sets the PET_* variables (nprocPerNode given)."""
    container = {
        "name": PYTORCHJOB_CONTAINER,
        "image": job.image,
        "command": list(job.command),
        "env": _env(job),
        **_mounts(job, PYTORCHJOB_CONTAINER),
    }
    resources = _resources(job)
    if resources:
        container["resources"] = resources
    template = {"spec": {"containers": [container], "volumes": _volumes(job)}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if job.num_nodes > 1:
        replicas["Worker"] = {
            "replicas": job.num_nodes - 1,
            "restartPolicy": "OnFailure",
            "template": template,
        }
    return {
        "apiVersion": PYTORCHJOB_API,
        "kind": "PyTorchJob",
        "metadata": _metadata(job, job.name),
        "spec": {"nprocPerNode": str(job.procs_per_node), "pytorchReplicaSpecs": replicas},
    }


class _ManifestDumper(yaml.SafeDumper):
    """Safe YAML whose multi-line strings (the run file) are literal blocks, as written."""


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ManifestDumper.add_representer(str, _represent_text)


def render_manifests(documents: list[dict[str, Any]], comments: list[str]) -> str:
    """The documents as one YAML file (`kubectl apply -f` takes it), after comment lines."""
    header = "".join(f"# {line}\n" for line in comments)
    body = yaml.dump_all(
        documents,
        Dumper=_ManifestDumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
    )
    return header + body


def follow_commands(job: PodJob, kind: str) -> list[str]:
    """kubectl lines that show the job and follow its pods' output."""
    namespace = shlex.quote(job.namespace)
    if kind == "TrainJob":
        resource, selector = "trainjob", f"jobset.sigs.k8s.io/jobset-name={job.name}"
    else:
        resource, selector = "pytorchjob", f"training.kubeflow.org/job-name={job.name}"
    return [
        f"kubectl -n {namespace} get {resource} {job.name}",
        f"kubectl -n {namespace} get pods -l {selector} -w",
        f"kubectl -n {namespace} logs -f -l {selector} --prefix --max-log-requests "
        f"{max(job.num_nodes, 5)}",
    ]


def _metadata(job: PodJob, name: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": job.namespace}
    if job.labels:
        metadata["labels"] = dict(job.labels)
    return metadata


def _env(job: PodJob) -> list[dict[str, str]]:
    return [{"name": name, "value": value} for name, value in sorted(job.env.items())]


def _resources(job: PodJob) -> dict[str, Any]:
    # GPUs as an integer quantity: the API server takes "8" and 8 alike, some clients only 8
    if job.cpu:
        return {}
    return {"limits": {GPU_RESOURCE: job.procs_per_node}}


def _volumes(job: PodJob) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]
    if job.run_file is not None:
        volumes.append({"name": "run-file", "configMap": {"name": job.configmap_name}})
    if job.pvc is not None:
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": job.pvc}})
    else:
        volumes.append({"name": "runs", "emptyDir": {}})
    return volumes


def _mounts(job: PodJob, container: str) -> dict[str, Any]:
    mounts: list[dict[str, Any]] = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    if job.run_file is not None:
        mounts.append({"name": "run-file", "mountPath": RUN_FILE_FOLDER, "readOnly": True})
    mounts.append({"name": "runs", "mountPath": RUNS_FOLDER})
    return {"name": container, "volumeMounts": mounts}
