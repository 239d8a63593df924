"""A scheduler's job as one of its nodes sees it, and the launch section it decides.

Every scheduler dplaunch runs under tells each node the same few things in its own variables:
how many nodes, which one this is, where the rendezvous is and how many GPUs a node has. SLURM's
are read in cluster/slurm.py, those of Kubernetes pods (Kubeflow Trainer, PyTorchJob), SkyPilot
and dstack in cluster/environments.py; each gives a ClusterJob, and launch_for_job turns any of
them into the launch section, the same way for all. Pure: nothing here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from dplaunch.config.schema import LaunchConfig
from dplaunch.errors import UserError


@dataclass(frozen=True)
class ClusterJob:
    """One job of a scheduler, from one of its nodes (or pods)."""

    # how messages name the job: "SLURM job 4242", "Kubeflow TrainJob llama"
    label: str
    # where the values come from, for notes and fixes: "SLURM", "the TrainJob's PET_* variables"
    source: str
    num_nodes: int
    node_rank: int
    # where rank 0 and the rendezvous live, as the other nodes reach it
    head_node: str
    # the rendezvous port the scheduler gives (None: the run file's, else dplaunch's default)
    master_port: int | None
    # GPUs (ranks) on each node; None when the scheduler does not say
    gpus_per_node: int | None
    # this node's name, for the note
    this_node: str
    # what a user changes to get another shape: "the allocation", "the TrainJob's numNodes"
    shape: str = "the job"
    # the fix for other GPUs per node, with {gpus} for the count: "ask SLURM for --gres=gpu:{gpus}"
    gpu_fix: str = "change the job's GPUs per node to {gpus}"
    # said after "states no GPUs" when the job has no GPU count: how to ask for them
    gpu_request: str = ""
    # the scheduler's identity of the job (every node and restart of it has the same); None: none
    job_id: str | None = None

    @property
    def total_gpus(self) -> int | None:
        """GPUs of the whole job (nodes × GPUs per node), None when unknown."""
        if self.gpus_per_node is None:
            return None
        return self.num_nodes * self.gpus_per_node

    def note(self) -> str:
        """The line that says where the launch section came from (dplaunch train's first)."""
        return (
            f"{self.label}: this is node {self.node_rank} of {self.num_nodes} "
            f"({self.this_node}); nodes, head node, port and GPUs per node come from "
            f"{self.source}"
        )


def launch_for_job(launch: LaunchConfig, job: ClusterJob) -> tuple[LaunchConfig, list[str]]:
    """The launch section as this node of the job sees it, and notes for the plan (the job's
    own line last).

    The scheduler decides nodes, this node's rank, the head node, the port and GPUs per node;
    values the user stated must agree with it (UserError naming the field otherwise). With
    launch.cpu the job's GPUs do not matter: --gpus N means N CPU ranks in total.
    """
    given = launch.model_fields_set
    _refuse_disagreement(launch, job)
    nodes = job.num_nodes
    update: dict[str, object] = {"nodes": nodes, "node_rank": job.node_rank}
    notes: list[str] = []
    if launch.cpu:
        if launch.gpus is None and launch.gpus_per_node is None:
            update["gpus"] = nodes  # one CPU rank per node
    elif job.gpus_per_node is not None:
        _check_gpus_per_node(launch, job)
        check_job_gpus(job, launch.gpus)
        update.update(gpus=job.total_gpus, gpus_per_node=job.gpus_per_node)
    elif launch.gpus is not None:
        notes += check_job_gpus(job, launch.gpus)
    elif launch.gpus_per_node is None and nodes > 1:
        # this node's GPUs would be taken for all nodes' together
        raise UserError(
            "--gpus",
            f"{job.label} does not say how many GPUs each of its {nodes} nodes has",
            "pass --gpus N, the GPUs of all nodes together",
        )
    if launch.master_port is None and job.master_port is not None:
        update["master_port"] = job.master_port
    if nodes > 1 and "master_addr" not in given:
        update["master_addr"] = job.head_node
    notes.append(job.note())
    return launch.model_copy(update=update), notes


def _refuse_disagreement(launch: LaunchConfig, job: ClusterJob) -> None:
    # a hostfile, --nodes or --node-rank that the job's own values contradict
    given = launch.model_fields_set
    if launch.hostfile:
        raise UserError(
            "launch.hostfile",
            f"a hostfile inside {job.label}",
            f"drop --hostfile: dplaunch reads the nodes from {job.source}",
        )
    if "nodes" in given and launch.nodes != job.num_nodes:
        raise UserError(
            "launch.nodes",
            f"{launch.nodes} node(s) planned but {job.label} holds {job.num_nodes}",
            f"drop --nodes (dplaunch reads it from {job.source}) or change {job.shape}",
        )
    if "node_rank" in given and launch.node_rank != job.node_rank:
        raise UserError(
            "launch.node_rank",
            f"--node-rank {launch.node_rank} but {job.source} says this is node "
            f"{job.node_rank} of {job.label}",
            f"drop --node-rank inside {job.label.split(' ')[0]} jobs",
        )


def check_job_gpus(job: ClusterJob, requested_gpus: int | None) -> list[str]:
    """Refuse a --gpus the job does not hold (UserError); a warning when it cannot be checked."""
    total = job.total_gpus
    if requested_gpus is None:
        return []
    if total is None:
        if requested_gpus == 0:
            return []
        return [
            f"cannot check --gpus {requested_gpus}: {job.label} states no GPUs{job.gpu_request}"
        ]
    if requested_gpus != total:
        raise UserError(
            "--gpus",
            f"{requested_gpus} GPUs requested but {job.label} holds {total} "
            f"({job.num_nodes} nodes × {job.gpus_per_node} GPUs)",
            f"use --gpus {total} or change {job.shape}",
        )
    return []


def _check_gpus_per_node(launch: LaunchConfig, job: ClusterJob) -> None:
    if launch.gpus_per_node is not None and launch.gpus_per_node != job.gpus_per_node:
        raise UserError(
            "launch.gpus_per_node",
            f"the plan puts {launch.gpus_per_node} GPUs on each node but {job.label} has "
            f"{job.gpus_per_node} per node",
            f"use --gpus-per-node {job.gpus_per_node} or drop it, or "
            + job.gpu_fix.format(gpus=launch.gpus_per_node),
        )
