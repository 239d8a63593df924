"""`dplaunch ray`: the plan of `dplaunch train`, run as a Ray Train job (one Ray worker per rank).

The run directory is written here (on the storage the workers share: RunConfig's storage_path),
then Ray places the workers and every worker runs dplaunch's own rank entry
(launching/ray_ranks.py says how, and why Ray makes no process group for them).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dplaunch.commands.options import command
from dplaunch.config.flags import RunFlags
from dplaunch.errors import UserError

if TYPE_CHECKING:
    from dplaunch.cluster.ray_job import RayJob
    from dplaunch.launching.prepare import PreparedRun

_RAY = "Ray"


@dataclass
class RayOptions:
    """The `dplaunch ray` options that are not run flags, each one typer option."""

    address: Annotated[
        str | None,
        typer.Option(
            "--address",
            help="The Ray cluster (ray.init's address, e.g. head:6379 or ray://head:10001; "
            "default: RAY_ADDRESS, else a cluster `ray start` runs on this machine, else a "
            "local one started for the run).",
            rich_help_panel=_RAY,
        ),
    ] = None
    cpus_per_worker: Annotated[
        float,
        typer.Option(
            "--cpus-per-worker",
            help="CPUs each Ray worker (rank) asks for.",
            rich_help_panel=_RAY,
        ),
    ] = 1.0
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print the plan, rendered files and the Ray objects; start nothing."
        ),
    ] = False
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume", help="'auto' (newest checkpoint that verifies) or a checkpoint path."
        ),
    ] = None


@command()
def ray_command(flags: RunFlags, options: RayOptions) -> int:
    """Train with this plan as a Ray Train job on a Ray cluster (one Ray worker per rank)."""
    return run_ray(flags, options)


def run_ray(flags: RunFlags, options: RayOptions) -> int:
    """Plan as `dplaunch train` does, write the run directory, run the ranks as Ray workers."""
    from dplaunch.commands.slurm import refuse_flags_the_job_decides
    from dplaunch.commands.train import _print_resume, result_line
    from dplaunch.launching import restarts
    from dplaunch.launching.preview import print_prepared
    from dplaunch.launching.resume import plan_resume, resume_file_text
    from dplaunch.launching.rundir import check_run_dir, write_run_files
    from dplaunch.run_directory.layout import RESUME_FILE

    refuse_flags_the_job_decides(
        flags, "Ray", "(its placement of the workers, rank 0's node and a free port)"
    )
    prepared, job = _prepare(flags, options)
    disk_line = check_run_dir(prepared.run_dir, resuming=options.resume is not None)
    choice = None
    if options.resume is not None:
        choice = plan_resume(prepared.run_dir, options.resume, prepared.config, prepared.plan)
    point = choice.point if choice is not None else None
    prepared.files[RESUME_FILE] = resume_file_text(point)
    print_prepared(prepared, show_files=options.dry_run)
    for line in job.describe():
        typer.echo(f"ray: {line}")
    if options.dry_run:
        _print_resume(choice, options.resume, set_aside=False)
        return 0
    typer.echo(f"run directory: {prepared.run_dir} ({disk_line})")
    with _run_dir_held(prepared):
        _print_resume(choice, options.resume, set_aside=True)
        write_run_files(prepared.run_dir, prepared.files)
        config = _worker_config(prepared, job, restarts.metrics_size(prepared.run_dir), point)
        code = _fit(job, config)
    if code == 0:
        typer.echo(result_line(prepared.run_dir))
    return code


def _run_dir_held(prepared: PreparedRun) -> Any:
    """The run directory's lock, held here while Ray's workers write it: the job is this
    `dplaunch ray` (its workers and their restarts run inside it)."""
    import functools
    import socket

    from dplaunch.launching.rundir import job_identity, run_dir_lock
    from dplaunch.run_directory.environment import JOB_ID_ENV

    driver = {JOB_ID_ENV: f"dplaunch ray pid {os.getpid()} on {socket.gethostname()}"}
    job = job_identity(prepared.plan, driver)
    return run_dir_lock(prepared.run_dir, job, say=functools.partial(typer.echo, err=True))


def _prepare(flags: RunFlags, options: RayOptions) -> tuple[PreparedRun, RayJob]:
    """The prepared run (for the workers' layout, not this machine's) and its Ray job."""
    from dplaunch.cluster.ray_job import RayJob
    from dplaunch.config.load import load_run_config
    from dplaunch.launching.prepare import prepare_training_run
    from dplaunch.planning.plan import _nodes
    from dplaunch.rendering.launch_command import launch_script_name

    _check_ray_installed()
    config = load_run_config(
        flags.config, overrides=flags.overrides(), assignments=flags.assignments
    )
    if config.launch.gpus is None:
        raise UserError("--gpus", "dplaunch ray needs the total GPU count", "pass --gpus N")
    if options.cpus_per_worker <= 0:
        raise UserError("--cpus-per-worker", f"{options.cpus_per_worker} is not above 0", "use 1")
    nodes, per_node = _nodes(config.launch, config.launch.gpus)
    plan_flags = dataclasses.replace(
        flags, gpus=nodes * per_node, gpus_per_node=per_node, nodes=None
    )
    # Ray places the ranks: nothing of this machine (ports, GPUs, ops) is claimed or built here
    prepared = prepare_training_run(plan_flags, render_only=True, use_allocation=False)
    run_dir = prepared.run_dir.absolute()
    job = RayJob(
        name=run_dir.name,
        storage_path=str(run_dir.parent),
        num_workers=prepared.plan.world_size,
        num_nodes=prepared.plan.num_nodes,
        use_gpu=prepared.plan.target == "gpu",
        cpus_per_worker=options.cpus_per_worker,
        max_failures=prepared.config.launch.max_restarts,
        address=options.address,
    )
    prepared.run_dir = run_dir
    # each worker starts its rank itself: no launcher, so no launch.sh of one
    prepared.files.pop(launch_script_name(prepared.plan), None)
    prepared.argv = [sys.executable, "-m", "dplaunch.train", str(run_dir)]
    return prepared, job


def _worker_config(
    prepared: PreparedRun, job: RayJob, metrics_start: int, point: Any
) -> dict[str, Any]:
    """What every worker gets (train_loop_config): the run, its ranks' variables, the shape."""
    from dplaunch.launching.ray_ranks import accelerate_environment
    from dplaunch.rendering.accelerate_config import accelerate_config_name

    env = {
        **accelerate_environment(prepared.run_dir / accelerate_config_name(prepared.plan)),
        **prepared.env,
    }
    plan = prepared.plan
    if plan.target == "cpu" or plan.offload != "none":
        # CPU ranks (and CPU Adam) compute on the CPUs Ray gave their worker
        env["OMP_NUM_THREADS"] = str(max(1, int(job.cpus_per_worker)))
    return {
        "run_dir": str(prepared.run_dir),
        "env": env,
        "job": dataclasses.asdict(job),
        "metrics_start": metrics_start,
        "newest_step_at_launch": _newest_step(prepared.run_dir),
    }


def _newest_step(run_dir: Path) -> int | None:
    from dplaunch.run_directory.checkpoints import newest_intact_checkpoint
    from dplaunch.run_directory.layout import CHECKPOINTS_DIR

    newest = newest_intact_checkpoint(run_dir / CHECKPOINTS_DIR, digests=False).info
    return newest.step if newest is not None else None


def _fit(job: RayJob, config: dict[str, Any]) -> int:
    """Connect to (or start) the cluster, run the trainer; the exit status."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from dplaunch.launching.ray_ranks import RankBackendConfig, run_rank

    # every rank's lines as it printed them (Ray folds repeated lines of its workers into one)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    context = ray.init(address=job.address, log_to_driver=True)
    dashboard = getattr(context, "dashboard_url", None)
    typer.echo(
        f"ray: cluster {context.address_info.get('gcs_address', '?')}"
        + (f", dashboard http://{dashboard}" if dashboard else "")
    )
    trainer = DataParallelTrainer(
        run_rank,
        train_loop_config=config,
        backend_config=RankBackendConfig(),
        scaling_config=ScalingConfig(**job.scaling_config()),
        run_config=RunConfig(
            name=job.name,
            storage_path=job.storage_path,
            failure_config=FailureConfig(max_failures=job.max_failures),
        ),
    )
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 — Ray's TrainingFailedError and its causes
        typer.echo(f"dplaunch: the Ray job failed: {_first_line(error)}", err=True)
        return 1
    finally:
        ray.shutdown()
    return 0


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:600] or type(error).__name__


def _check_ray_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        raise UserError(
            "dplaunch ray",
            "Ray Train is not installed",
            "pip install 'dplaunch[ray]' (ray[train]) here and on every node of the cluster",
        )
    if os.environ.get("RAY_TRAIN_V2_ENABLED", "1") == "0":
        raise UserError(
            "RAY_TRAIN_V2_ENABLED",
            "dplaunch ray runs on Ray Train V2 (the default of the Ray 2.60 it is tested with)",
            "unset RAY_TRAIN_V2_ENABLED",
        )
