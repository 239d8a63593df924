"""dplaunch's ranks as Ray Train workers: each worker runs one `python -m dplaunch.train RUN`.

Imported only by `dplaunch ray` and in Ray's workers (it imports ray).

Why a backend that makes no process group (RankBackendConfig) instead of TorchTrainer's: a
dplaunch rank is a process of its own (it ends with os._exit, handles the stop signals, watches
its supervisor), so it cannot live inside Ray's worker actor, and a torch process group the actor
made would be of no use to it. Ray's TorchConfig backend also makes that group in every actor
(`dist.init_process_group` in ray/train/torch/config.py, with its own timeout_s, 1800 s by
default; on GPUs an NCCL communicator that holds memory on each GPU beside the rank's). So the
worker only hands its rank what torchrun would: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK from Ray's train context, MASTER_ADDR/MASTER_PORT from rank 0's worker (its node's
address, a free port), and the variables `accelerate launch` sets from the run's
accelerate.yaml; the engines then make their process groups as under `dplaunch train`, every
one with launch.timeout_minutes (train/collective_timeout.py: DeepSpeed's and the meshes' too,
not Ray's timeout_s). The backend keeps
Ray's sharing of CUDA_VISIBLE_DEVICES among the workers of a node, so that LOCAL_RANK indexes
the rank's own GPU (Ray sorts a node's workers by GPU id, and the shared list is sorted too).

A restarted worker group (FailureConfig.max_failures) runs every worker's function again: rank 0
then points resume.json at the newest checkpoint that verifies, written since the launch began,
and records the restart in metrics.jsonl, as `dplaunch train`'s own restarts do. The ranks of
a worker that is gone are killed at once (_die_with_worker), so none is still saving when the
next group starts.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from ray.train.backend import Backend, BackendConfig

from dplaunch.run_directory.environment import RESTARTS_ENV
from dplaunch.run_directory.layout import CHECKPOINTS_DIR, METRICS_FILE, RESUME_FILE

# the variables a launcher's torchrun gives every rank, which the Ray worker sets itself
RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class _RankBackend(Backend):
    # no process group (on_start does nothing); a node's workers see all its workers' GPUs
    share_cuda_visible_devices: bool = True


class RankBackendConfig(BackendConfig):
    """Ray's backend for dplaunch's ranks: no torch process group, shared CUDA_VISIBLE_DEVICES."""

    @property
    def backend_cls(self) -> type[Backend]:
        return _RankBackend


def accelerate_environment(config_file: Path) -> dict[str, str]:
    """The variables `accelerate launch --config_file CONFIG_FILE` sets for its ranks beyond the
    rendezvous (ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_*…),
    from accelerate's own launch code, so that a Ray worker's rank builds its Accelerator as a
    rank of `dplaunch train` does."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(config_file), "--module", "dplaunch.train"])
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    # one machine, any port: only the ranks' own variables are wanted, not a rendezvous
    args.num_machines, args.machine_rank, args.main_process_port = 1, 0, 0
    before = dict(os.environ)
    if args.use_deepspeed and not args.cpu:
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        if mp_from_config_flag:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    # the driver's paths and devices are not the workers': Ray decides CUDA_VISIBLE_DEVICES
    dropped = {*RANK_VARIABLES, "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"}
    return {
        name: value
        for name, value in env.items()
        if before.get(name) != value and name not in dropped
    }


def run_rank(config: dict[str, Any]) -> None:
    """The function every Ray worker runs: one dplaunch rank, started and waited for.

    Raises when the rank fails, which Ray counts against FailureConfig.max_failures."""
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    context = ray.train.get_context()
    rank = context.get_world_rank()
    problem = _placement_problem(config, context)
    start = None
    if rank == 0 and problem is None:
        start = {
            "address": ray.util.get_node_ip_address(),
            "port": _free_port(),
            "restarts": _continue_after_a_restart(config),
        }
    start = broadcast_from_rank_zero(start)  # rank 0's resume.json is written after this
    if problem is not None or start is None:
        raise RuntimeError(problem or "rank 0's worker could not place the job")
    env = {
        **os.environ,
        **config["env"],
        **_rank_variables(context, start["address"], start["port"]),
        RESTARTS_ENV: str(start["restarts"]),
    }
    command = [sys.executable, "-m", "dplaunch.train", config["run_dir"]]
    status = subprocess.run(command, env=env, check=False, preexec_fn=_die_with_worker).returncode
    if status != 0:
        raise RuntimeError(
            f"rank {rank} exited with status {status} (its error: "
            f"{Path(config['run_dir']) / 'errors'})"
        )


# prctl(PR_SET_PDEATHSIG): the signal a process gets when the thread that started it ends
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_worker() -> None:
    """In the rank, before it runs: be killed when this Ray worker is gone.

    Not dplaunch train's stop on a lost supervisor (SIGTERM, a checkpoint, exit 75): when Ray
    tears a worker group down or a worker dies, the ranks of the group must be gone before Ray
    starts the next one, which resumes from the newest complete checkpoint; an old rank still
    saving would write beside the new ones."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _placement_problem(config: dict[str, Any], context: Any) -> str | None:
    from dplaunch.cluster.ray_job import RayJob, placement_problem

    job = RayJob(**config["job"])
    return placement_problem(job, context.get_local_world_size(), context.get_world_size())


def _rank_variables(context: Any, address: str, port: int) -> dict[str, str]:
    """What torchrun would give this rank, from Ray's train context."""
    world, local_world = context.get_world_size(), context.get_local_world_size()
    rank = context.get_world_rank()
    values = {
        "RANK": rank,
        "LOCAL_RANK": context.get_local_rank(),
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": local_world,
        "GROUP_RANK": context.get_node_rank(),
        "GROUP_WORLD_SIZE": world // local_world,
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": address,
        "MASTER_PORT": port,
        # torchrun's default for its ranks: an NCCL error ends the rank instead of hanging it
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1,
    }
    return {name: str(value) for name, value in values.items()}


def _free_port() -> int:
    # on every interface: the other nodes connect to this node's address
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _continue_after_a_restart(config: dict[str, Any]) -> int:
    """On rank 0: after a restart, point resume.json at the newest checkpoint that verifies and
    was written since the launch began, and record the restart; the restarts so far."""
    from dplaunch.config.schema import RunConfig
    from dplaunch.launching import restarts
    from dplaunch.launching.resume import plan_resume, resume_file_text
    from dplaunch.planning.plan import Plan
    from dplaunch.run_directory.checkpoints import newest_intact_checkpoint
    from dplaunch.run_directory.files import read_plan_file, read_run_file, write_text_atomic

    run_dir = Path(config["run_dir"])
    done = _restarts_recorded(run_dir, config["metrics_start"])
    newest = newest_intact_checkpoint(run_dir / CHECKPOINTS_DIR).info
    launched_after = config["newest_step_at_launch"]
    began = restarts.metrics_size(run_dir)
    if began <= config["metrics_start"]:
        return done  # the first attempt: the launch's own resume.json stands
    done += 1
    step = None
    if newest is not None and (launched_after is None or newest.step > launched_after):
        run = RunConfig.model_validate(read_run_file(run_dir))
        plan = Plan.from_dict(read_plan_file(run_dir))
        point = plan_resume(run_dir, str(newest.path), run, plan).point
        write_text_atomic(run_dir / RESUME_FILE, resume_file_text(point))
        step = newest.step
    verdict = restarts.Verdict(
        restart=True,
        reason="Ray restarted the worker group (FailureConfig.max_failures)",
        cause="a Ray worker failed",
        checkpoint_step=step,
    )
    restarts.record_restart(run_dir, done, verdict, 0.0)
    return done


def _restarts_recorded(run_dir: Path, since: int) -> int:
    # `restart` records of this launch in metrics.jsonl
    count = 0
    try:
        with (run_dir / METRICS_FILE).open("rb") as metrics:
            metrics.seek(since)
            for line in metrics.read().decode(errors="replace").splitlines():
                try:
                    count += json.loads(line).get("type") == "restart"
                except (ValueError, AttributeError):
                    continue
    except OSError:
        return 0
    return count
