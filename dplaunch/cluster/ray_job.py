"""The Ray Train objects of a `dplaunch ray` run, as plain values (pure: no ray import).

One Ray worker per rank, placed as the plan needs: all on one node (STRICT_PACK), one per node
(STRICT_SPREAD), or K nodes × N/K (PACK, then checked by every worker: Ray has no placement of
exactly N/K bundles per node). launch.max_restarts is Ray's FailureConfig(max_failures); the run
directory is RunConfig's storage_path/name. dplaunch's own checkpoints stay in the run
directory (Ray's CheckpointConfig keeps only what ray.train.report hands it, and nothing is).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RayJob:
    """What `dplaunch ray` hands Ray: the workers' shape and resources, storage and restarts."""

    name: str
    # RunConfig.storage_path: the run directory's parent (a shared filesystem on a real cluster)
    storage_path: str
    num_workers: int
    num_nodes: int
    use_gpu: bool
    # CPUs each worker (rank) asks Ray for
    cpus_per_worker: float
    max_failures: int
    # ray.init's address; None: RAY_ADDRESS, a cluster `ray start` runs here, else a new local one
    address: str | None = None

    @property
    def workers_per_node(self) -> int:
        """Ranks on each node (the plan's)."""
        return self.num_workers // self.num_nodes

    @property
    def placement_strategy(self) -> str:
        """How Ray places the workers' bundles for this shape."""
        if self.num_nodes == 1:
            return "STRICT_PACK"
        if self.workers_per_node == 1:
            return "STRICT_SPREAD"
        return "PACK"

    @property
    def resources_per_worker(self) -> dict[str, float]:
        """One GPU per worker unless the ranks are CPU ranks."""
        resources = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            resources["GPU"] = 1.0
        return resources

    @property
    def run_dir(self) -> Path:
        """dplaunch's run directory: storage_path/name."""
        return Path(self.storage_path) / self.name

    def scaling_config(self) -> dict[str, object]:
        """ScalingConfig's arguments."""
        return {
            "num_workers": self.num_workers,
            "use_gpu": self.use_gpu,
            "resources_per_worker": self.resources_per_worker,
            "placement_strategy": self.placement_strategy,
        }

    def describe(self) -> list[str]:
        """The Ray objects `dplaunch ray` creates, as Python would write them (--dry-run)."""
        scaling = ", ".join(f"{key}={value!r}" for key, value in self.scaling_config().items())
        init = f"ray.init(address={self.address!r})"
        if not self.address:  # ray.init's own rule
            init += "  # RAY_ADDRESS, else a `ray start` cluster of this machine, else a new one"
        return [
            init,
            f"ScalingConfig({scaling})",
            f"RunConfig(name={self.name!r}, storage_path={self.storage_path!r}, "
            f"failure_config=FailureConfig(max_failures={self.max_failures}))",
            "DataParallelTrainer(dplaunch.launching.ray_ranks.run_rank, "
            "backend_config=RankBackendConfig())  # no process group: the engines make theirs",
        ]


def placement_problem(job: RayJob, local_world_size: int, world_size: int) -> str | None:
    """Why the workers Ray started do not form the plan's layout (None: they do)."""
    if world_size != job.num_workers:
        return f"Ray started {world_size} workers for a plan of {job.num_workers} ranks"
    if local_world_size != job.workers_per_node:
        return (
            f"Ray put {local_world_size} of the {job.num_workers} workers on one node, and the "
            f"plan has {job.workers_per_node} per node on {job.num_nodes} nodes"
        )
    return None
