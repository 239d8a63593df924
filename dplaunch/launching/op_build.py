"""Build the DeepSpeed ops a plan needs once, in the launcher, before any rank starts; clear the
lock a killed build left behind.

torch JIT-builds an op under a lock file, `FOLDER/OP/lock` (torch.utils.file_baton.FileBaton):
created with O_EXCL, held open while building or loading, removed at the end. Every later
process that loads the op waits until it is gone, silently and forever. A build killed halfway
(kill -9, the OOM killer, a time limit, an automatic restart's own kill) leaves it, and the lock
records no owner. Who owns it is found another way: a process on this node that holds it open
(/proc/PID/fd). On a filesystem other nodes share, a builder on another node is invisible from
here, so dplaunch's own builds touch their lock every HEARTBEAT_SECONDS, and a lock nobody here
holds is stale once it is SHARED_STALE_SECONDS old.

The ranks then only load what the launcher built: a lock lives for a fraction of a second.
The build runs in a child process (`python -m dplaunch.launching.op_build FOLDER OP…`: it
imports DeepSpeed and torch; this module's top imports neither).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dplaunch.errors import UserError
from dplaunch.launching.deepspeed_ops import (
    needed_ops,
    prebuilt_ops,
    torch_extensions_dir,
)
from dplaunch.planning.plan import Plan
from dplaunch.run_directory.layout import op_build_log_file

# torch's FileBaton in an op's build folder
LOCK_FILE = "lock"
# how often a build of dplaunch's touches its lock (seen from other nodes as alive)
HEARTBEAT_SECONDS = 10
# a lock on a shared filesystem that no process of this node holds, untouched this long: stale
SHARED_STALE_SECONDS = 60
# a lock no process holds on a node-local filesystem: stale once older than this (a load's lock
# lives for a fraction of a second, and torch closes it just before it removes it)
LOCAL_STALE_SECONDS = 2
# waiting on a lock or a build, a line this often: never silent
NOTE_EVERY_SECONDS = 30
POLL_SECONDS = 0.2
# filesystems a single node owns: nobody elsewhere can hold a lock on them
LOCAL_FILESYSTEMS = {
    "ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "ramfs", "vfat",
}  # fmt: skip
# how long a build takes, as measured (deepspeed_shm_comm: 30 s on 2 idle cores, 115 s and 249 s
# on 2 cores busy with other work; cpu_adam: 150 s on those): what the first line promises
BUILD_TIME = "30 s on 2 idle CPU cores, up to about 4 min on 2 busy ones"
# the DeepSpeed builder class of each op dplaunch builds ahead (deepspeed.ops.op_builder)
BUILDERS = {"cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}

Say = Callable[[str], None]


@dataclass(frozen=True)
class BuildLock:
    """An op's build lock as found now: who holds it and how old it is."""

    path: Path
    # processes of this node that hold it open; None: this system cannot tell (no /proc)
    holders: tuple[int, ...] | None
    age_s: float
    # on a filesystem other nodes may share (NFS, Lustre…): a holder there is invisible here
    shared: bool

    @property
    def stale(self) -> bool:
        """Whether its owner is gone: nobody holds it (and, where others could, nobody touches it)."""
        if self.holders:
            return False
        if self.holders is None or self.shared:
            return self.age_s >= SHARED_STALE_SECONDS
        return self.age_s >= LOCAL_STALE_SECONDS

    def owner_text(self) -> str:
        """Who holds it, in words."""
        if self.holders:
            return ", ".join(f"process {pid} ({_command_of(pid)})" for pid in self.holders)
        if self.holders is None:
            return "an unknown process (this system does not say who holds a file)"
        if self.shared:
            return "no process of this node (a build on another node sharing the folder touches it)"
        return "no process"


def find_lock(lock: Path) -> BuildLock | None:
    """The build lock at ``lock`` as it is now, None when there is none."""
    try:
        modified = lock.stat().st_mtime
    except OSError:
        return None
    return BuildLock(
        lock, lock_holders(lock), max(time.time() - modified, 0.0), not on_local_filesystem(lock)
    )


def lock_holders(path: Path) -> tuple[int, ...] | None:
    """The processes of this node that hold ``path`` open; None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(path)
    holders = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            descriptors = os.scandir(f"{entry.path}/fd")
        except OSError:  # gone, or another user's
            continue
        with descriptors:
            for descriptor in descriptors:
                with contextlib.suppress(OSError):
                    if os.readlink(descriptor.path) == target:
                        holders.append(int(entry.name))
                        break
    return tuple(sorted(holders))


def on_local_filesystem(path: Path) -> bool:
    """Whether ``path`` lies on a filesystem of this node only (from /proc/mounts; unknown: no)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    resolved = os.path.realpath(path)
    best, kind = "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind in LOCAL_FILESYSTEMS


def _command_of(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(part.decode(errors="replace") for part in argv if part)
    return text if len(text) <= 80 else text[:79] + "…"


def stale_lock_line(lock: BuildLock) -> str:
    """What was wrong with a stale lock, for the line that says it was removed (or must be)."""
    return (
        f"a stale DeepSpeed build lock {lock.path} ({lock.owner_text()} holds it, "
        f"{lock.age_s:.0f} s old: a build or load killed halfway)"
    )


def stale_locks(roots: list[Path]) -> list[BuildLock]:
    """The stale build locks in extension folders under ROOTS (ROOT/OP/lock, ROOT/KEY/OP/lock…)."""
    found = []
    for root in roots:
        for depth in range(1, 4):
            for path in sorted(root.glob("/".join(["*"] * depth + [LOCK_FILE]))):
                lock = find_lock(path)
                if lock is not None and lock.stale:
                    found.append(lock)
    return found


def clear_stale_lock(op_dir: Path, say: Say, *, note_every: float = NOTE_EVERY_SECONDS) -> bool:
    """Wait for a live lock of op_dir to go (saying so), remove a stale one; whether one was removed."""
    path = op_dir / LOCK_FILE
    next_note = time.monotonic()
    while True:
        lock = find_lock(path)
        if lock is None:
            return False
        if lock.stale:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            say(
                f"dplaunch: removed {stale_lock_line(lock)}; every DeepSpeed run would have "
                "waited on it forever"
            )
            return True
        if time.monotonic() >= next_note:
            left = (
                f"; taken as stale in {SHARED_STALE_SECONDS - lock.age_s:.0f} s unless it is touched"
                if not lock.holders
                else ""
            )
            say(f"dplaunch: waiting for {lock.owner_text()} to release {path}{left}")
            next_note = time.monotonic() + note_every
        time.sleep(POLL_SECONDS)


def is_built(folder: Path, name: str) -> bool:
    """Whether FOLDER holds a build of op NAME made since DeepSpeed was installed."""
    built = folder / name / f"{name}.so"
    try:
        built_at = built.stat().st_mtime
    except OSError:
        return False
    installed = _deepspeed_install_time()
    return installed is None or built_at >= installed


def _deepspeed_install_time() -> float | None:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    with contextlib.suppress(OSError):
        marker = Path(spec.submodule_search_locations[0]) / "git_version_info_installed.py"
        return marker.stat().st_mtime
    return None


def prepare_ops(plan: Plan, env: Mapping[str, str], log_dir: Path, say: Say) -> None:
    """Before the ranks start: clear stale locks of the ops the plan needs, build those not built.

    Raises UserError when a build fails (its output is in LOG_DIR)."""
    accelerator = "cuda" if plan.target == "gpu" else "cpu"
    build_missing(needed_ops(plan), accelerator, env, log_dir, say)


def build_missing(
    ops: dict[str, str], accelerator: str, env: Mapping[str, str], log_dir: Path, say: Say
) -> None:
    """Build each op of OPS (name → the setting that needs it) not prebuilt for ACCELERATOR nor
    built in the ranks' extension folder; clear a stale lock first."""
    if not ops:
        return
    folder = Path(env.get("TORCH_EXTENSIONS_DIR") or torch_extensions_dir())
    prebuilt = prebuilt_ops(accelerator)
    to_build = []
    for name in ops:
        if name in prebuilt:
            continue
        # after a stale lock the build may be half done: ninja finishes what it lacks
        if clear_stale_lock(folder / name, say) or not is_built(folder, name):
            to_build.append(name)
    for name in to_build:
        build_op(name, folder, env, log_dir / op_build_log_file(name), ops[name], say)


def build_op(
    name: str,
    folder: Path,
    env: Mapping[str, str],
    log: Path,
    field: str,
    say: Say,
    *,
    note_every: float = NOTE_EVERY_SECONDS,
) -> None:
    """Build op NAME into FOLDER in a child process, saying so while it takes long."""
    say(
        f"dplaunch: building DeepSpeed's {name} op in {folder} before the ranks start "
        f"(once per Python environment and CPU type; {BUILD_TIME}; a line every "
        f"{note_every:g} s until it is built)"
    )
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "wb") as output:
        child = subprocess.Popen(
            [sys.executable, "-m", "dplaunch.launching.op_build", str(folder), name],
            env={**env, "TORCH_EXTENSIONS_DIR": str(folder)},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            next_note = started + note_every
            while child.poll() is None:
                time.sleep(POLL_SECONDS)
                if time.monotonic() >= next_note:
                    say(f"dplaunch: still building {name} ({time.monotonic() - started:.0f} s)")
                    next_note += note_every
        except BaseException as stop:
            if isinstance(stop, KeyboardInterrupt):
                # Ctrl-C reached the child too (one process group): torch releases its lock
                # on the way out, unless a SIGTERM cuts that short
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=10)
            if child.poll() is None:
                child.terminate()
                child.wait()
            raise
    if child.returncode != 0:
        raise UserError(
            field,
            f"DeepSpeed's {name} op did not build: {_last_line(log)}",
            f"its whole output is in {log}",
        )
    say(f"dplaunch: built {name} in {time.monotonic() - started:.1f} s")


def _last_line(log: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
        errors = [line for line in lines if "error" in line.lower()]
        found = (errors or [line for line in lines if line])[-1:]
        if found:
            return found[0][:300]
    return "no output"


# --- the child process that builds ---------------------------------------------------------------


def _heartbeat(lock: Path, done: threading.Event) -> None:
    # touch the lock while this process holds it: another node sharing the folder sees it alive
    while not done.wait(HEARTBEAT_SECONDS):
        holders = lock_holders(lock)
        if holders and os.getpid() in holders:
            with contextlib.suppress(OSError):
                os.utime(lock)


def build_here(folder: Path, names: list[str]) -> None:
    """Build (or load, when built) each op into FOLDER with DeepSpeed's own builder."""
    from deepspeed.accelerator import get_accelerator

    for name in names:
        builder = get_accelerator().create_op_builder(BUILDERS[name])
        if builder is None:  # not an op of this accelerator: the ranks never load it
            continue
        done = threading.Event()
        beat = threading.Thread(target=_heartbeat, args=(folder / name / LOCK_FILE, done))
        beat.daemon = True
        beat.start()
        try:
            builder.load(verbose=False)
        finally:
            done.set()


if __name__ == "__main__":
    build_here(Path(sys.argv[1]), sys.argv[2:])
