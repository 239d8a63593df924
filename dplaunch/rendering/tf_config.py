"""TF_CONFIG for tf.distribute.MultiWorkerMirroredStrategy: every worker's host:port, and this
worker's index. Pure: from the plan and the nodes' host names to text.

Workers: on GPUs one per node, holding all the node's GPUs (the strategy mirrors over a worker's
local GPUs in-process and all-reduces across workers; one TensorFlow runtime, tf.data pipeline
and GPU memory allocator per node instead of one per GPU). A TensorFlow process on CPU is one
replica whatever its cores, so on CPU there is one worker per CPU rank (--gpus N: N replicas).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from dplaunch.planning.plan import Plan


@dataclass(frozen=True)
class WorkerLayout:
    """Where MultiWorkerMirroredStrategy's workers run: host and port of each, in index order."""

    hosts: tuple[str, ...]  # one per node, node rank order
    workers_per_node: int
    ports: tuple[int, ...]  # one per worker, all nodes

    @property
    def addresses(self) -> list[str]:
        """`host:port` of every worker; worker w runs on node w // workers_per_node."""
        return [
            f"{self.hosts[index // self.workers_per_node]}:{port}"
            for index, port in enumerate(self.ports)
        ]

    def node_workers(self, node_rank: int) -> range:
        """The indices of the workers node ``node_rank`` starts."""
        first = node_rank * self.workers_per_node
        return range(first, first + self.workers_per_node)


def workers_per_node(plan: Plan) -> int:
    """One worker per node with all its GPUs; on CPU one per CPU rank (module docstring)."""
    return 1 if plan.target == "gpu" else plan.processes_per_node


def default_worker_ports(base_port: int, workers: int) -> tuple[int, ...]:
    """base, base+1, …: distinct even when every "node" is this machine (loopback runs)."""
    return tuple(base_port + index for index in range(workers))


def render_tf_config(addresses: Sequence[str], index: int) -> str:
    """The TF_CONFIG of worker ``index`` in a cluster of ``addresses`` (one JSON line)."""
    return json.dumps(
        {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}
    )


def worker_devices(plan: Plan, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES of a worker: none on CPU; on GPUs the node's first gpus_per_node
    (of those the user made visible, when CUDA_VISIBLE_DEVICES narrows them)."""
    if plan.target != "gpu":
        return ""
    devices = [item.strip() for item in (visible or "").split(",") if item.strip()]
    if not devices:
        devices = [str(index) for index in range(plan.processes_per_node)]
    return ",".join(devices[: plan.processes_per_node])
