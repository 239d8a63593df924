"""What SLURM gave us: the allocation read from SLURM_* variables, and the checks on it.

Everything here is pure: it reads the environment mapping it is given and never calls SLURM,
so the same code runs in unit tests, on a login node (no allocation) and inside `srun`.
dplaunch starts one launcher per node (like idr_accelerate): the launcher on node
`node_rank` spawns one rank per GPU and meets the others at `head_node:master_port`.
Outside an srun step (the batch script, an salloc shell) dplaunch starts that step itself
with `srun_argv`.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dplaunch.cluster.hostlist import parse_hostlist
from dplaunch.cluster.jobs import ClusterJob, check_job_gpus, launch_for_job
from dplaunch.config.schema import LaunchConfig
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
    # CPUs the job holds on this node (SLURM_CPUS_ON_NODE)
    cpus_on_node: int | None
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
        return self.job().total_gpus

    def job(self) -> ClusterJob:
        """The allocation as every scheduler's job is seen (cluster/jobs.py)."""
        # the batch script and an salloc shell run on the first node; SLURM_NODEID says so in a step
        node_rank = self.node_rank if self.node_rank is not None else 0
        return ClusterJob(
            label=f"SLURM job {self.job_id}",
            source="SLURM",
            num_nodes=self.num_nodes,
            node_rank=node_rank,
            head_node=self.head_node,
            master_port=self.master_port,
            gpus_per_node=self.gpus_per_node,
            this_node=self.hostnames[node_rank],
            shape="the allocation",
            gpu_fix="ask SLURM for --gres=gpu:{gpus}",
            gpu_request=" (request them with --gres=gpu:N)",
            job_id=self.job_id,
        )


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
        cpus_on_node=_int(env.get("SLURM_CPUS_ON_NODE")),
        inside_step=_inside_step(env),
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
    """The largest number of tasks on any node ("1(x4)" and "2,1" forms understood).

    Inside an srun step the step's own count wins: `srun --ntasks-per-node=1` in a job
    submitted with `--ntasks-per-node=4` runs one task per node, and that is what counts.
    """
    names = ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if _inside_step(env):
        names = ("SLURM_STEP_TASKS_PER_NODE", *names)
    value = next((env[name] for name in names if env.get(name)), None)
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
    # outside a step the job's task count does not matter: dplaunch starts its own step with
    # one task per node; inside one, several tasks would start several launchers per node
    if alloc.inside_step and alloc.ntasks_per_node is not None and alloc.ntasks_per_node > 1:
        raise UserError(
            "--ntasks-per-node",
            f"SLURM job {alloc.job_id} runs {alloc.ntasks_per_node} tasks per node",
            "dplaunch starts one launcher per node: use --ntasks-per-node=1 "
            "(or run dplaunch without srun: it starts `srun --ntasks-per-node=1` itself)",
        )
    return check_job_gpus(alloc.job(), requested_gpus)


def launch_for_allocation(
    launch: LaunchConfig, alloc: SlurmAllocation
) -> tuple[LaunchConfig, list[str]]:
    """The launch section as this node of the allocation sees it, and notes for the plan
    (cluster/jobs.launch_for_job, after SLURM's own check of the task count)."""
    if alloc.inside_step:
        check_allocation(alloc, None)  # the task count
    return launch_for_job(launch, alloc.job())


def srun_argv(alloc: SlurmAllocation, argv: list[str]) -> list[str]:
    """`srun` starting `argv` once on every node of the allocation (the step dplaunch needs)."""
    srun = [
        "srun",
        # all three: a job submitted with --ntasks=8 passes SLURM_NTASKS=8 to srun, and srun
        # then ignores a lone --ntasks-per-node=1 (measured on SLURM 22.05)
        f"--nodes={alloc.num_nodes}",
        f"--ntasks={alloc.num_nodes}",
        "--ntasks-per-node=1",
        # a launcher that fails ends the step on every node instead of leaving the others waiting
        "--kill-on-bad-exit=1",
    ]
    # the one launcher of a node and its ranks get every CPU the job holds there (a job
    # submitted with one task per GPU has --cpus-per-task for one GPU only); since SLURM 22.05
    # srun does not inherit the job's --cpus-per-task anyway
    cpus = alloc.cpus_on_node or alloc.cpus_per_task
    if cpus is not None:
        srun.append(f"--cpus-per-task={cpus}")
    return [*srun, *argv]


def rank_threads(alloc: SlurmAllocation, ranks_per_node: int) -> int | None:
    """OMP threads per rank: the CPUs SLURM gave this node's launcher, shared by its ranks."""
    if alloc.cpus_per_task is None:
        return None
    return max(1, alloc.cpus_per_task // max(1, ranks_per_node))


@dataclass(frozen=True)
class SinfoRow:
    """One row of `sinfo -h -o "%P|%G|%c|%Z|%f"`: nodes of one partition that look alike."""

    partition: str  # as sinfo prints it: the default partition ends with '*'
    gpus: int | None  # GPUs per node, None when the GRES has none
    cores: int  # physical cores per node (CPUs / threads per core)
    features: frozenset[str] = frozenset()  # what --constraint selects (Jean-Zay: v100-32g, h100)


SINFO_FORMAT = "%P|%G|%c|%Z|%f"


def parse_sinfo_nodes(text: str) -> list[SinfoRow]:
    """Rows of `sinfo -h -o SINFO_FORMAT` (a missing features column means none).

    %G is the node's GRES ("gpu:4", "gpu:h100:4(S:0-1)", "(null)"), %c its CPUs, %Z its
    threads per core (cores = CPUs / threads, what --hint=nomultithread hands out) and %f its
    features, comma-separated.
    """
    rows = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.strip().split("|")]
        if len(parts) not in (4, 5):
            continue
        partition, gres, cpus, threads = parts[:4]
        gpus = None
        for item in gres.split(","):
            match = re.match(r"gpu(?::[\w.-]+)?:(\d+)", item.strip())
            if match:
                gpus = (gpus or 0) + int(match.group(1))
        cpu_count = _int(cpus.rstrip("+"))
        thread_count = _int(threads) or 1
        if cpu_count is None:
            continue
        features = frozenset(
            name
            for name in (parts[4] if len(parts) == 5 else "").split(",")
            if name and name != "(null)"
        )
        rows.append(SinfoRow(partition, gpus, max(1, cpu_count // thread_count), features))
    return rows


def node_shape(
    rows: list[SinfoRow], partition: str | None, constraint: str | None = None
) -> tuple[int | None, int | None, str]:
    """(GPUs per node, cores per node, where from) of the nodes a job would get.

    The nodes: those of ``partition``, or, without one, of the default partition (marked '*');
    with a ``constraint`` (features joined by & or |), those of any partition, or of
    ``partition``, that have the features: on Jean-Zay -C h100 picks the nodes, not the
    partition. None where those nodes disagree or sinfo did not say: the caller falls back to
    its defaults and says so.
    """
    wanted = _constraint_test(constraint)
    if partition is not None:
        chosen = [row for row in rows if row.partition.rstrip("*") == partition]
        where = f"partition {partition}"
    elif wanted is None:
        chosen = [row for row in rows if row.partition.endswith("*")]
        where = "the default partition"
    else:
        chosen, where = rows, "any partition"
    if constraint and wanted is None:
        where += f"; --constraint {constraint} not read (only a, a&b and a|b are)"
    if wanted is not None:
        chosen = [row for row in chosen if wanted(row.features)]
        where += f", nodes with {constraint}"
    if not chosen:
        return None, None, f"sinfo lists no such nodes ({where})"
    if partition is None and wanted is None:
        where = f"partition {chosen[0].partition.rstrip('*')}"
    gpus = {row.gpus for row in chosen}
    cores = {row.cores for row in chosen}
    return (
        gpus.pop() if len(gpus) == 1 else None,
        cores.pop() if len(cores) == 1 else None,
        f"sinfo, {where}",
    )


def _constraint_test(constraint: str | None) -> Callable[[frozenset[str]], bool] | None:
    # the common forms only: "a", "a&b", "a|b"; brackets, counts and the like are not read
    if not constraint:
        return None
    names = r"[\w.-]+"
    if re.fullmatch(rf"{names}(&{names})*", constraint):
        needed = set(constraint.split("&"))
        return lambda features: needed <= features
    if re.fullmatch(rf"{names}(\|{names})+", constraint):
        either = set(constraint.split("|"))
        return lambda features: bool(either & features)
    return None


def _job_number(job_id: str) -> int:
    # array and het jobs can look like "123_4" or "123+1"; keep digits only when we can
    digits = re.sub(r"\D", "", job_id)
    return int(digits) if digits else zlib.crc32(job_id.encode())


def _inside_step(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))


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
