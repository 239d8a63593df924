"""The variables of the schedulers other than SLURM, read into a ClusterJob (cluster/jobs.py).

What each one sets on every node (pod) of a job, as of the versions named:
- Kubeflow Trainer v2 (`TrainJob`, torch plugin): PET_NNODES, PET_NPROC_PER_NODE (a count, or
  "auto": the pod's GPUs), PET_NODE_RANK, PET_MASTER_ADDR (`<job>-node-0-0.<job>`),
  PET_MASTER_PORT. The legacy `PyTorchJob` (kubeflow.org/v1, training-operator >= 1.7) sets the
  same PET_* (PET_NPROC_PER_NODE only with nprocPerNode) besides MASTER_ADDR, MASTER_PORT, RANK
  (the pod's index) and WORLD_SIZE (pods × processes); older operators set only those four, one
  process per pod.
- SkyPilot: SKYPILOT_NODE_IPS (one per line, the head first), SKYPILOT_NODE_RANK,
  SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE, SKYPILOT_TASK_ID.
- dstack: DSTACK_MASTER_NODE_IP, DSTACK_NODE_RANK, DSTACK_NODES_NUM, DSTACK_GPUS_PER_NODE,
  DSTACK_NODES_IPS (one per line), DSTACK_RUN_NAME.

MASTER_ADDR, RANK and WORLD_SIZE are also what torchrun and every dplaunch launcher give each
rank, so they are read as a PyTorchJob's only in a process that no launcher started: one without
LOCAL_RANK (torchrun's, per rank) and without DPLAUNCH_ERRORS_DIR (dplaunch's, per rank).

Pure: each reader takes the environment as a mapping. SLURM's variables: cluster/slurm.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from dplaunch.cluster.jobs import ClusterJob
from dplaunch.errors import UserError
from dplaunch.run_directory.environment import ERRORS_DIR_ENV

# the Trainer's rendezvous host: the first pod of the job's headless service
TRAINJOB_HEAD_RE = re.compile(r"(?P<job>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-node-0-0\.(?P=job)(\..*)?")
# a TrainJob pod's own host name (JobSet's): <job>-node-0-<index>
TRAINJOB_POD_RE = re.compile(r"(?P<job>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-node-0-\d+")
# training-operator's: the master replica's service
PYTORCHJOB_HEAD_RE = re.compile(r"(?P<job>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-master-0(\..*)?")


def detect_job(env: Mapping[str, str]) -> ClusterJob | None:
    """The job of a pod or cloud launcher this process runs in, None outside one (SLURM's
    allocation is cluster/slurm.py's, and is looked for first)."""
    for reader in READERS:
        job = reader(env)
        if job is not None:
            return job
    return None


def torch_pod_job(env: Mapping[str, str]) -> ClusterJob | None:
    """A Kubeflow TrainJob's (or PyTorchJob's) pod, from its PET_* variables."""
    if not env.get("PET_NNODES"):
        return None
    nodes = _count(env, "PET_NNODES")
    head = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or ""
    per_node = env.get("PET_NPROC_PER_NODE", "auto").strip()
    trainjob = TRAINJOB_HEAD_RE.fullmatch(head) or TRAINJOB_POD_RE.fullmatch(
        env.get("HOSTNAME", "")
    )
    pytorchjob = PYTORCHJOB_HEAD_RE.fullmatch(head)
    if trainjob is not None:
        label, name = f"Kubeflow TrainJob {trainjob['job']}", trainjob["job"]
        shape = "the TrainJob's trainer.numNodes"
    elif pytorchjob is not None:
        label, name = f"PyTorchJob {pytorchjob['job']}", pytorchjob["job"]
        shape = "the PyTorchJob's replicas"
    else:
        label, name, shape = "a torchrun-style job (PET_* variables)", None, "the job"
    return ClusterJob(
        label=label,
        source="the pod's PET_* variables",
        num_nodes=nodes,
        node_rank=_rank(env, "PET_NODE_RANK", nodes),
        head_node=_needed(env, head, "PET_MASTER_ADDR"),
        master_port=_port(env, "PET_MASTER_PORT") or _port(env, "MASTER_PORT"),
        # "auto": torchrun's one process per GPU the pod sees, which dplaunch counts itself
        gpus_per_node=None if per_node == "auto" else _count(env, "PET_NPROC_PER_NODE"),
        this_node=env.get("HOSTNAME") or "this pod",
        shape=shape,
        gpu_fix="set trainer.resourcesPerNode nvidia.com/gpu and numProcPerNode to {gpus}",
        gpu_request=" (numProcPerNode is auto: pass --gpus N)",
        job_id=name,
    )


def legacy_pytorchjob(env: Mapping[str, str]) -> ClusterJob | None:
    """A pod of an older PyTorchJob (MASTER_ADDR, RANK and WORLD_SIZE per pod, one process
    each), where no launcher set those names for a rank."""
    names = ("MASTER_ADDR", "RANK", "WORLD_SIZE")
    if not all(env.get(name) for name in names) or env.get("LOCAL_RANK") or env.get(ERRORS_DIR_ENV):
        return None
    nodes = _count(env, "WORLD_SIZE")
    head = env["MASTER_ADDR"]
    match = PYTORCHJOB_HEAD_RE.fullmatch(head)
    return ClusterJob(
        label=f"PyTorchJob {match['job']}" if match else "a PyTorchJob-style pod",
        source="the pod's MASTER_ADDR, RANK and WORLD_SIZE",
        num_nodes=nodes,
        node_rank=_rank(env, "RANK", nodes),
        head_node=head,
        master_port=_port(env, "MASTER_PORT"),
        gpus_per_node=None,
        this_node=env.get("HOSTNAME") or "this pod",
        shape="the PyTorchJob's replicas",
        gpu_request=" (pass --gpus N)",
        job_id=match["job"] if match else None,
    )


def skypilot_job(env: Mapping[str, str]) -> ClusterJob | None:
    """A node of a SkyPilot task (num_nodes: K)."""
    if not env.get("SKYPILOT_NODE_RANK") or not env.get("SKYPILOT_NODE_IPS"):
        return None
    hosts = env["SKYPILOT_NODE_IPS"].split()
    nodes = _count(env, "SKYPILOT_NUM_NODES") if env.get("SKYPILOT_NUM_NODES") else len(hosts)
    rank = _rank(env, "SKYPILOT_NODE_RANK", nodes)
    _check_hosts(hosts, nodes, "SKYPILOT_NODE_IPS")
    gpus = env.get("SKYPILOT_NUM_GPUS_PER_NODE")
    return ClusterJob(
        label="SkyPilot task"
        + (f" {env['SKYPILOT_TASK_ID']}" if env.get("SKYPILOT_TASK_ID") else ""),
        source="SkyPilot's SKYPILOT_* variables",
        num_nodes=nodes,
        node_rank=rank,
        head_node=hosts[0],
        master_port=None,
        gpus_per_node=_count(env, "SKYPILOT_NUM_GPUS_PER_NODE") if gpus else None,
        this_node=hosts[rank],
        shape="the task's num_nodes",
        gpu_fix="ask for accelerators NAME:{gpus} in the task's resources",
        gpu_request=" (ask for accelerators in the task's resources)",
        job_id=env.get("SKYPILOT_TASK_ID"),
    )


def dstack_job(env: Mapping[str, str]) -> ClusterJob | None:
    """A node of a dstack distributed task (nodes: K)."""
    if not env.get("DSTACK_NODE_RANK") or not env.get("DSTACK_MASTER_NODE_IP"):
        return None
    nodes = _count(env, "DSTACK_NODES_NUM")
    rank = _rank(env, "DSTACK_NODE_RANK", nodes)
    hosts = env.get("DSTACK_NODES_IPS", "").split()
    if hosts:
        _check_hosts(hosts, nodes, "DSTACK_NODES_IPS")
    gpus = env.get("DSTACK_GPUS_PER_NODE")
    return ClusterJob(
        label="dstack run" + (f" {env['DSTACK_RUN_NAME']}" if env.get("DSTACK_RUN_NAME") else ""),
        source="dstack's DSTACK_* variables",
        num_nodes=nodes,
        node_rank=rank,
        head_node=env["DSTACK_MASTER_NODE_IP"],
        master_port=None,
        gpus_per_node=_count(env, "DSTACK_GPUS_PER_NODE") if gpus else None,
        this_node=hosts[rank] if hosts else env.get("HOSTNAME", "this node"),
        shape="the task's nodes",
        gpu_fix="ask for gpu: {gpus} in the task's resources",
        gpu_request=" (ask for gpu in the task's resources)",
        job_id=env.get("DSTACK_RUN_NAME"),
    )


# looked for in this order: a pod's PET_* first (a PyTorchJob pod has MASTER_ADDR too)
READERS: tuple[Callable[[Mapping[str, str]], ClusterJob | None], ...] = (
    torch_pod_job,
    skypilot_job,
    dstack_job,
    legacy_pytorchjob,
)


def _refuse(name: str, value: str, problem: str) -> UserError:
    return UserError(
        name,
        f"{value!r} {problem}",
        f"start dplaunch as the job's command, or unset {name} to run on this machine alone",
    )


def _count(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "").strip()
    if not value.isdigit() or int(value) < 1:
        raise _refuse(name, value, "is not a count of 1 or more")
    return int(value)


def _rank(env: Mapping[str, str], name: str, nodes: int) -> int:
    value = env.get(name, "").strip()
    if not value.isdigit() or int(value) >= nodes:
        raise _refuse(name, value, f"is not a node rank of a {nodes}-node job (0..{nodes - 1})")
    return int(value)


def _port(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise _refuse(name, value, "is not a TCP port")
    return int(value)


def _needed(env: Mapping[str, str], value: str, name: str) -> str:
    if not value:
        raise _refuse(name, env.get(name, ""), "is empty: the pods have no rendezvous")
    return value


def _check_hosts(hosts: list[str], nodes: int, name: str) -> None:
    if len(hosts) != nodes:
        raise _refuse(name, " ".join(hosts), f"lists {len(hosts)} hosts for {nodes} nodes")
