"""What SLURM gave us: the allocation read from SLURM_* variables, and the checks on it.

Everything here is pure: it reads the environment mapping it is given and never calls SLURM,
so the same code runs in unit tests, on a login node (no allocation) and inside `srun`.
dplaunch starts one launcher per node (like idr_accelerate): the launcher on node
`node_rank` spawns one rank per GPU and meets the others at `head_node:master_port`.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dplaunch.cluster.hostlist import parse_hostlist
from dplaunch.errors import UserError

# below Linux's ephemeral range (32768+) so the port is not taken by some outgoing connection,
# above the usual service ports; one job id always gives the same port on every node
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 12000


@dataclass(frozen=True)
class SlurmAllocation:
    """One SLURM job as seen from one of its nodes."""

    job_id: str
    num_nodes: int
    hostnames: tuple[str, ...]
    # SLURM_NODEID: 0-based index of this node in `hostnames`; None outside job/step context
    node_rank: int | None
    # GPUs on each node; None when the job has no GPU variables (CPU job or no --gres)
    gpus_per_node: int | None
    # tasks SLURM started on each node (1 is what dplaunch needs); None when unknown
    ntasks_per_node: int | None
    cpus_per_task: int | None
    # True under `srun` (SLURM_STEP_ID set), False in the batch script itself or salloc shell
    inside_step: bool

    @property
    def head_node(self) -> str:
        """The first host of the allocation: where rank 0 and the rendezvous live."""
        return self.hostnames[0]

    @property
    def master_port(self) -> int:
        """A rendezvous port derived from the job id, so two jobs sharing a node do not clash."""
        return MASTER_PORT_BASE + _job_number(self.job_id) % MASTER_PORT_SPAN

    @property
    def total_gpus(self) -> int | None:
        """GPUs in the whole allocation (nodes × GPUs per node), None when unknown."""
        if self.gpus_per_node is None:
            return None
        return self.num_nodes * self.gpus_per_node


def detect_allocation(
    env: Mapping[str, str], expand: Callable[[str], list[str]] = parse_hostlist
) -> SlurmAllocation | None:
    """Read the SLURM allocation from an environment mapping; None outside a SLURM job."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hostnames = tuple(expand(nodelist)) if nodelist else ()
    num_nodes = _int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"))
    if num_nodes is None:
        num_nodes = len(hostnames)
    if not hostnames:
        raise ValueError(f"SLURM job {job_id} has no SLURM_JOB_NODELIST")
    if num_nodes != len(hostnames):
        raise ValueError(
            f"SLURM job {job_id}: SLURM_JOB_NUM_NODES={num_nodes} but the node list "
            f"{nodelist!r} has {len(hostnames)} hosts"
        )
    return SlurmAllocation(
        job_id=job_id,
        num_nodes=num_nodes,
        hostnames=hostnames,
        node_rank=_int(env.get("SLURM_NODEID")),
        gpus_per_node=gpus_per_node(env),
        ntasks_per_node=ntasks_per_node(env),
        cpus_per_task=_int(env.get("SLURM_CPUS_PER_TASK")),
        inside_step=bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")),
    )


def gpus_per_node(env: Mapping[str, str]) -> int | None:
    """GPUs allocated on this node, from the first SLURM variable that states it."""
    on_node = _int(env.get("SLURM_GPUS_ON_NODE"))
    if on_node is not None:
        return on_node
    # --gpus-per-node=4, =h100:4, =gpu:4 (or several types: "a100:2,v100:2")
    per_node = env.get("SLURM_GPUS_PER_NODE")
    if per_node:
        return _count_typed(per_node)
    # device indices of this node: "0,1,2,3" (ranges such as "0-3" are also seen)
    for name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        indices = env.get(name)
        if indices:
            return _count_indices(indices)
    # --gres=gpu:4 shows up as "gres/gpu:4" (22.05+) or "gres:gpu:h100:4"
    tres = env.get("SLURM_TRES_PER_NODE", "")
    match = re.search(r"gres[/:]gpu(?::[\w.-]+)?:(\d+)", tres)
    if match:
        return int(match.group(1))
    return None


def ntasks_per_node(env: Mapping[str, str]) -> int | None:
    """The largest number of tasks on any node ("1(x4)" and "2,1" forms understood)."""
    value = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not value:
        return None
    counts = parse_tasks_per_node(value)
    return max(counts) if counts else None


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand SLURM's compressed per-node counts: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ValueError(f"cannot read SLURM task counts {value!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def check_allocation(alloc: SlurmAllocation, requested_gpus: int | None) -> list[str]:
    """Refuse allocations dplaunch cannot use (UserError); return warnings for doubtful ones."""
    warnings: list[str] = []
    if alloc.ntasks_per_node is not None and alloc.ntasks_per_node > 1:
        raise UserError(
            "--ntasks-per-node",
            f"SLURM job {alloc.job_id} runs {alloc.ntasks_per_node} tasks per node",
            "dplaunch starts one launcher per node: use --ntasks-per-node=1",
        )
    total = alloc.total_gpus
    if requested_gpus is not None:
        if total is None and requested_gpus > 0:
            warnings.append(
                f"cannot check --gpus {requested_gpus}: SLURM job {alloc.job_id} states no GPUs "
                "(request them with --gres=gpu:N)"
            )
        elif total is not None and requested_gpus != total:
            raise UserError(
                "--gpus",
                f"{requested_gpus} GPUs requested but SLURM job {alloc.job_id} holds {total} "
                f"({alloc.num_nodes} nodes × {alloc.gpus_per_node} GPUs)",
                f"use --gpus {total} or change the allocation",
            )
    if alloc.num_nodes > 1 and not alloc.inside_step:
        warnings.append(
            f"SLURM job {alloc.job_id} has {alloc.num_nodes} nodes but this is not an srun step: "
            "only this node would start; run dplaunch under `srun --ntasks-per-node=1`"
        )
    return warnings


def _job_number(job_id: str) -> int:
    # array and het jobs can look like "123_4" or "123+1"; keep digits only when we can
    digits = re.sub(r"\D", "", job_id)
    return int(digits) if digits else zlib.crc32(job_id.encode())


def _int(value: str | None) -> int | None:
    if value is None or not value.strip():
        return None
    match = re.match(r"\s*(\d+)", value)  # "4(x2)" style values: the first count
    return int(match.group(1)) if match else None


def _count_typed(value: str) -> int | None:
    total = 0
    for part in value.split(","):
        count = part.rsplit(":", 1)[-1].strip()
        if not count.isdigit():
            return None
        total += int(count)
    return total


def _count_indices(value: str) -> int:
    total = 0
    for part in value.split(","):
        low, dash, high = part.strip().partition("-")
        if dash and low.isdigit() and high.isdigit():
            total += int(high) - int(low) + 1
        elif part.strip():
            total += 1
    return total
