"""The launcher's side of the run directory: is it usable and free (one job at a time writes
it), then write the rendered files into it.

Created only after the plan is valid; the names and formats of its files: dplaunch/run_directory/.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dplaunch.errors import UserError
from dplaunch.run_directory.environment import JOB_ID_ENV
from dplaunch.run_directory.files import write_text_atomic
from dplaunch.run_directory.layout import CHECKPOINTS_DIR, RUN_LOCK_FILE, RUN_MARKERS

if TYPE_CHECKING:
    from dplaunch.planning.plan import Plan


def check_run_dir(run_dir: Path, *, resuming: bool) -> str:
    """Raise UserError when the run dir cannot be used; return a free-space line."""
    existing = [marker for marker in RUN_MARKERS if (run_dir / marker).exists()]
    if existing and not resuming:
        fix = (
            "pass --resume auto to continue it, or choose another --output-dir"
            if CHECKPOINTS_DIR in existing
            else "choose another --output-dir (it holds no checkpoint to continue from)"
        )
        raise UserError("output_dir", f"{run_dir} already holds a run ({', '.join(existing)})", fix)
    return check_output_dir(run_dir, "output_dir")


def check_output_dir(directory: Path, field: str) -> str:
    """Raise UserError unless ``directory`` is, or can be created as, a writable directory.

    Returns a free-space line. ``field`` names the flag in the error (output_dir: --output-dir).
    """
    probe = directory
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(field, f"{probe} is not a directory", f"choose another {_option(field)}")
    _check_writable(probe, field)
    free_gb = shutil.disk_usage(probe).free / 1e9
    return f"{free_gb:.1f} GB free on the output directory's disk"


def check_output_file(path: Path, field: str, example_name: str) -> None:
    """Raise UserError unless a file can be written at ``path`` (its folder may still be missing)."""
    if path.is_dir():
        raise UserError(
            field, f"{path} is a directory", f"give a file path, e.g. {path / example_name}"
        )
    check_output_dir(path.parent, field)


def _option(field: str) -> str:
    return "--output-dir" if field == "output_dir" else field


def _check_writable(directory: Path, field: str) -> None:
    # os.access says yes to root everywhere, and nothing about read-only mounts or quotas:
    # create and remove a real file instead
    try:
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".dplaunch-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        reason = error.strerror or str(error)
        raise UserError(
            field,
            f"cannot create files in {directory} ({reason})",
            f"choose a writable {_option(field)}",
        ) from None


def write_run_files(run_dir: Path, files: dict[str, str]) -> None:
    """Create the run directory (with the user's umask) and write the rendered files into it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_text_atomic(run_dir / name, text, 0o777 if name.endswith(".sh") else None)


# --- one job at a time: the run directory's lock ------------------------------------------------

# the lock's owner touches it this often; a lock of another host untouched for LOCK_STALE_SECONDS
# belongs to a job that is gone (its pid cannot be asked from here)
LOCK_HEARTBEAT_SECONDS = 30.0
LOCK_STALE_SECONDS = 10 * 60.0
# torchrun's --rdzv-id when none is given: it names no job
NO_RENDEZVOUS_ID = "none"


def job_identity(plan: Plan, environ: Mapping[str, str] | None = None) -> str:
    """The job this dplaunch belongs to: the key of the run directory's lock, which lets in
    every process of the job and refuses the processes of another.

    The rule, for every launcher; the first that applies names the job:
    - DPLAUNCH_JOB_ID: set by a launcher that starts one dplaunch per node or pod for one job
      (Ray, a Kubernetes job's pods: the job's name or uid), or by hand;
    - SLURM_JOB_ID: every node's dplaunch of an allocation, srun's relaunch of dplaunch, and the
      requeued job (which keeps its id);
    - TORCHELASTIC_RUN_ID: torchrun's --rdzv-id (PET_RDZV_ID on Kubernetes), unless "none";
    - several nodes started by hand (--nodes/--node-rank): their rendezvous, the head node's
      address and port, which every node names and no second live job can share;
    - else this process (its host and pid): a single-node job, whose automatic restarts
      (launch.max_restarts) run inside it.
    Two runs started by hand inside one SLURM allocation (salloc) share its id: not told apart.
    """
    environ = os.environ if environ is None else environ
    if environ.get(JOB_ID_ENV):
        return f"job {environ[JOB_ID_ENV]}"
    slurm_job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if slurm_job:
        return f"SLURM job {slurm_job}"
    rendezvous_id = environ.get("TORCHELASTIC_RUN_ID", NO_RENDEZVOUS_ID)
    if rendezvous_id != NO_RENDEZVOUS_ID:
        return f"torchrun job {rendezvous_id}"
    if plan.num_nodes > 1:
        return f"the job of rendezvous {plan.master_addr}:{plan.master_port}"
    return f"dplaunch pid {os.getpid()} on {socket.gethostname()}"


@dataclass(frozen=True)
class LockHolder:
    """What the lock file says: the job, and the dplaunch process that took the lock (its pid
    means something only on its host and in its pid namespace: containers may share a host
    name)."""

    job: str
    pid: int
    host: str
    since: float
    pid_namespace: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        process = f"dplaunch pid {self.pid} on {self.host}"
        return f"{process if self.job == process else f'{self.job} ({process})'}, since {since}"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, job: str, say: Callable[[str], None]) -> Iterator[None]:
    """Hold RUN/dplaunch.lock for JOB while the block runs: a live lock of another job is
    refused (UserError), one of a job that is gone is taken over with a note, one of this job
    (another node, a requeue) lets it in. The owner removes it at the end, and the run
    directory too when the lock made it and nothing else was written."""
    check_output_dir(run_dir, "output_dir")
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / RUN_LOCK_FILE
    mine = LockHolder(job, os.getpid(), socket.gethostname(), time.time(), _pid_namespace())
    owner = False
    try:
        owner = _claim(lock, mine, say)
        with _heartbeat(lock):
            yield
    finally:
        if owner and _read_holder(lock) == mine:
            with contextlib.suppress(OSError):
                lock.unlink()
        if made:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only when empty: refused before anything was written


def _claim(lock: Path, mine: LockHolder, say: Callable[[str], None]) -> bool:
    """Take the lock (True: this process owns it) or join this job's (False); raise UserError
    when another job holds it."""
    for _ in range(20):
        if _create(lock, mine):
            return True
        holder = _read_holder(lock)
        if holder is None and _age_s(lock) < 2:
            time.sleep(0.1)  # being written this instant (or just removed): look again
            continue
        if holder is not None and _alive(holder, lock):
            if holder.job == mine.job:
                return False
            raise UserError(
                "output_dir",
                f"{lock.parent} is in use by a live run: {holder.describe()}",
                "wait for it to end, or choose another --output-dir",
            )
        write_text_atomic(lock, mine.to_json())
        if _read_holder(lock) != mine:
            continue  # another process took it over at the same moment
        if holder is None or holder.job != mine.job:
            gone = holder.describe() if holder is not None else "unreadable"
            say(f"dplaunch: took over {lock} from a run that is gone: {gone}")
        return True
    raise UserError("output_dir", f"cannot take {lock}: it keeps changing", "try again")


def _create(lock: Path, mine: LockHolder) -> bool:
    try:
        handle = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(handle, "w") as out:
        out.write(mine.to_json())
    return True


def _read_holder(lock: Path) -> LockHolder | None:
    try:
        return LockHolder(**json.loads(lock.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _age_s(lock: Path) -> float:
    try:
        return time.time() - lock.stat().st_mtime
    except OSError:
        return 0.0


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _alive(holder: LockHolder, lock: Path) -> bool:
    """Whether the process that wrote the lock still runs: asked of the kernel where its pid
    means the same (a pid started after the lock is another process), judged by its heartbeat
    elsewhere."""
    if (holder.host, holder.pid_namespace) != (socket.gethostname(), _pid_namespace()):
        return _age_s(lock) < LOCK_STALE_SECONDS
    import psutil  # accelerate requires it; light (no torch)

    try:
        process = psutil.Process(holder.pid)
        return (
            process.status() != psutil.STATUS_ZOMBIE and process.create_time() <= holder.since + 1
        )
    except psutil.Error:
        return False


@contextlib.contextmanager
def _heartbeat(lock: Path) -> Iterator[None]:
    # touched while the job lives: the lock of a job on another host is judged by its age
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(LOCK_HEARTBEAT_SECONDS):
            with contextlib.suppress(OSError):
                os.utime(lock)

    thread = threading.Thread(target=beat, daemon=True, name="dplaunch-lock-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
