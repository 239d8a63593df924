"""`dplaunch launch` for TensorFlow and Horovod scripts: which framework a script uses, and the
prepared run that starts its workers (nothing written, nothing started here).

A TensorFlow script (tf.distribute.MultiWorkerMirroredStrategy) needs no torchrun: each worker is
a plain process whose TF_CONFIG names every worker's host:port and its own index. dplaunch's
worker launcher (launching.workers) starts this node's workers under the same supervisor as
PyTorch ranks. The layout (one worker per node on GPUs, per CPU rank on CPU) is decided in
rendering.tf_config.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path

from dplaunch.cluster.hostfile import is_local, launch_for_hostfile, read_hostfile
from dplaunch.cluster.slurm import SlurmAllocation
from dplaunch.config.flags import Framework, RunFlags
from dplaunch.config.schema import LaunchConfig
from dplaunch.errors import UserError
from dplaunch.launching.devices import visible_gpu_count
from dplaunch.launching.ports import claim_free_port, claim_port
from dplaunch.launching.prepare import (
    PreparedRun,
    check_script_exists,
    current_allocation,
    launch_for_cluster,
    load_script_config,
    openmp_threads,
    own_host_names,
    rank_environment,
    run_files,
    script_run_dir,
)
from dplaunch.launching.workers import Worker, render_workers_spec
from dplaunch.planning.plan import Machine, Plan, make_plan
from dplaunch.rendering.tf_config import (
    WorkerLayout,
    default_worker_ports,
    render_tf_config,
    worker_devices,
    workers_per_node,
)
from dplaunch.run_directory.layout import ERRORS_DIR, WORKERS_FILE, node_file

TENSORFLOW_MODULES = frozenset({"tensorflow", "keras", "tf_keras"})
TORCH_MODULES = frozenset(
    {"torch", "accelerate", "lightning", "pytorch_lightning", "deepspeed", "transformers"}
)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# each worker runs the script as `python SCRIPT ARGS…` would (dplaunch.train.script)
WORKER_ENTRY = ["-u", "-m", "dplaunch.train.script"]


def imported_modules(source: str) -> set[str]:
    """Top-level names of the modules a script imports (anywhere in it); none if it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def detect_framework(script: Path) -> str:
    """horovod if the script imports it; tensorflow if it imports TensorFlow/Keras and nothing of
    PyTorch's; else pytorch (what `dplaunch launch` always ran)."""
    try:
        modules = imported_modules(script.read_text(errors="replace"))
    except OSError:
        return "pytorch"  # a missing script is reported later, with the run file's checks first
    if "horovod" in modules:
        return "horovod"
    if modules & TENSORFLOW_MODULES and not modules & TORCH_MODULES:
        return "tensorflow"
    return "pytorch"


def resolve_framework(choice: Framework, script: Path) -> str:
    """The framework to launch: the one given, or (auto) the one the script imports."""
    return detect_framework(script) if choice == "auto" else choice


def check_horovod() -> None:
    """Refuse --framework horovod: where Horovod cannot be imported (its last release builds
    from source and fails against torch >= 2.1's C++17 headers), and where it can, for dplaunch
    has no Horovod launch it could test (docs: Horovod)."""
    if importlib.util.find_spec("horovod") is None:
        raise UserError(
            "--framework",
            "horovod cannot be imported here (Horovod 0.28.1, its last release, builds from "
            "source and does not build against this torch: it compiles as C++14, torch needs C++17)",
            "run the script with torch.distributed instead (`dplaunch launch` starts DDP scripts "
            "as they are), or install a Horovod that imports and start it with horovodrun --gloo",
        )
    raise UserError(
        "--framework",
        "dplaunch does not start Horovod jobs (no Horovod builds against this stack to test one)",
        "start it with Horovod's own launcher: horovodrun --gloo -np N python SCRIPT",
    )


def prepare_tensorflow_launch(flags: RunFlags, script: list[str]) -> PreparedRun:
    """Plan a TensorFlow script's workers on this node, each with its TF_CONFIG."""
    config = load_script_config(flags)
    allocation = current_allocation()
    launch, hosts, notes = worker_hosts(config.launch, allocation, own_host_names())
    config = config.model_copy(update={"launch": launch})
    check_script_exists(script)
    machine = Machine(visible_gpus=visible_gpu_count())
    plan = make_plan(config.launch, config.parallel, config.train, machine, extra_notes=notes)
    _refuse_model_parallelism(plan)
    per_node = workers_per_node(plan)
    # in the batch shell (a job, no step) dplaunch only reruns itself with srun: the ports are
    # for the step's dplaunch to claim, and a claim held here would push it off them
    relaunching = allocation is not None and not allocation.inside_step
    ports, port_notes = _worker_ports(
        plan, per_node, explicit=config.launch.master_port, claim=not relaunching
    )
    layout = WorkerLayout(hosts, per_node, ports)
    run_dir = script_run_dir(config, script)
    config = config.model_copy(update={"output_dir": str(run_dir)})
    run_abs = run_dir.absolute()
    workers = tensorflow_workers(
        plan, layout, script, devices=worker_devices(plan, os.environ.get("CUDA_VISIBLE_DEVICES"))
    )
    spec_name = workers_spec_name(plan)
    # settled on this machine: its workers' ports, the layout they form
    plan = replace(
        plan,
        framework="tensorflow",
        notes=(*plan.notes, *port_notes, *_layout_notes(plan, layout, spec_name)),
    )
    argv = [sys.executable, "-m", "dplaunch.launching.workers", str(run_abs / spec_name)]
    # threads per worker from SLURM's CPUs for this task; elsewhere the workers' own default
    threads = openmp_threads(plan, allocation) if allocation is not None else None
    env = {
        **rank_environment(plan, run_abs / ERRORS_DIR),
        **({"OMP_NUM_THREADS": threads[0]} if threads else {}),
    }
    spec = {spec_name: render_workers_spec(workers, run_abs / ERRORS_DIR)}
    return run_files(config, plan, run_dir, argv, env, workers=spec)


def tensorflow_workers(
    plan: Plan, layout: WorkerLayout, script: list[str], *, devices: str
) -> list[Worker]:
    """This node's workers: each runs the script with its TF_CONFIG and devices."""
    total = len(layout.ports)
    workers = []
    for local, index in enumerate(layout.node_workers(plan.node_rank)):
        env = {
            "TF_CONFIG": render_tf_config(layout.addresses, index),
            "CUDA_VISIBLE_DEVICES": devices,
            # for the script's own logging and dplaunch's failure report; TF reads TF_CONFIG
            "RANK": str(index),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(total),
        }
        workers.append(Worker(index, [sys.executable, *WORKER_ENTRY, *script], env))
    return workers


def workers_spec_name(plan: Plan) -> str:
    """workers.json, or workers-nodeR.json on node R > 0 (nodes may share the run directory)."""
    return node_file(WORKERS_FILE, plan.node_rank)


def worker_hosts(
    launch: LaunchConfig, allocation: SlurmAllocation | None, own_names: tuple[str, ...]
) -> tuple[LaunchConfig, tuple[str, ...], list[str]]:
    """The launch section, the host of every node (TF_CONFIG names them all) and plan notes.

    SLURM: its node list. A hostfile: its hosts; each node runs dplaunch itself (no pdsh) and is
    found by its name or --node-rank. --nodes M alone names only the head node, which is enough
    when every node is this machine (loopback).
    """
    if allocation is not None:
        resolved, notes = launch_for_cluster(launch, allocation=allocation, render_only=False)
        return resolved, allocation.hostnames, notes
    if launch.hostfile:
        return _hostfile_hosts(launch, own_names)
    if launch.nodes == 1 or launch.master_addr in LOOPBACK:
        return launch, (launch.master_addr,) * launch.nodes, []
    raise UserError(
        "launch.hostfile",
        f"TF_CONFIG names the host of every worker, and --nodes {launch.nodes} with "
        f"--master-addr {launch.master_addr} names only the head node",
        "list the nodes in a hostfile ('host slots=GPUS' lines) and run "
        "`dplaunch launch SCRIPT --hostfile FILE` on each node, or launch inside a SLURM job",
    )


def _hostfile_hosts(
    launch: LaunchConfig, own_names: tuple[str, ...]
) -> tuple[LaunchConfig, tuple[str, ...], list[str]]:
    entries = read_hostfile(launch.hostfile)
    hosts = tuple(host for host, _ in entries)
    given = "node_rank" in launch.model_fields_set
    # the hostfile's checks (slots, --gpus, --nodes); TensorFlow starts no node over ssh, so
    # each node runs this command and --node-rank is allowed
    resolved, _ = launch_for_hostfile(
        launch.model_copy(update={"node_rank": 0}), entries, own_names
    )
    if given:
        node_rank = launch.node_rank
        if node_rank >= len(hosts):
            raise UserError(
                "launch.node_rank",
                f"{node_rank} is not below the hostfile's {len(hosts)} host(s)",
                f"give 0 to {len(hosts) - 1}",
            )
    else:
        mine = [rank for rank, host in enumerate(hosts) if is_local(host, own_names)]
        if len(mine) != 1:
            which = "none" if not mine else f"{len(mine)} ({', '.join(hosts[r] for r in mine)})"
            raise UserError(
                "launch.node_rank",
                f"of the hostfile's hosts {which} are this machine, so its node rank is unknown",
                "give --node-rank R (the line of this node in the hostfile, from 0)",
            )
        node_rank = mine[0]
    absolute = str(Path(launch.hostfile).absolute())
    resolved = resolved.model_copy(update={"node_rank": node_rank, "hostfile": absolute})
    note = (
        f"hostfile: {len(hosts)} node(s) ({', '.join(hosts)}); this is node {node_rank}: "
        "run the same command on every node"
    )
    return resolved, hosts, [note]


def _refuse_model_parallelism(plan: Plan) -> None:
    if plan.zero_stage or plan.tensor_parallel_size > 1 or plan.pipeline_parallel_size > 1:
        raise UserError(
            "parallel",
            "a TensorFlow script's workers are data-parallel replicas "
            "(MultiWorkerMirroredStrategy): ZeRO, tp and pp are PyTorch engines",
            "drop --zero/--tp/--pp (and parallel: from the run file)",
        )


def _worker_ports(
    plan: Plan, per_node: int, *, explicit: int | None, claim: bool
) -> tuple[tuple[int, ...], list[str]]:
    # every worker listens on its own port: base, base+1, … (the same on every node, so every
    # node renders the same cluster); this node claims its own, as launching.ports describes
    total = per_node * plan.num_nodes
    ports = list(default_worker_ports(plan.master_port, total))
    first = plan.node_rank * per_node
    notes: list[str] = []
    for index in range(first, first + per_node) if claim else ():
        taken = claim_port(ports[index])
        if taken is None:
            continue
        why = "is busy" if taken == "busy" else "is taken by another dplaunch run on this machine"
        if plan.num_nodes > 1:
            raise UserError(
                "launch.master_port",
                f"port {ports[index]} (worker {index}: --master-port + {index}) {why}",
                f"pick a base port whose next {total} ports are free with --master-port, "
                "the same on every node",
            )
        free = claim_free_port()
        reason = "given" if explicit is not None else "default"
        notes.append(f"port {ports[index]} ({reason} + {index}) {why}: worker {index} uses {free}")
        ports[index] = free
    return tuple(ports), notes


def _layout_notes(plan: Plan, layout: WorkerLayout, spec_name: str) -> list[str]:
    total = len(layout.ports)
    if plan.target == "gpu":
        each = f"one per node with its {plan.processes_per_node} GPU(s)"
        replicas = total * plan.processes_per_node
    else:
        each = "one per CPU rank"
        replicas = total
    return [
        f"tensorflow: {total} worker(s), {each}: MultiWorkerMirroredStrategy sees {replicas} "
        f"replica(s); each worker's TF_CONFIG is in {spec_name}",
        f"tensorflow: workers at {', '.join(layout.addresses)}",
    ]
