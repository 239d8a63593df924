"""Claims on this machine's rendezvous ports and GPUs, so that two runs do not take the same.

Checking that a port is free and the rendezvous store binding it are seconds apart (the
launcher starts in between), so two runs started together on one machine would both take
29500. A run therefore also *claims* its port: an flock on a per-user lock file, held by the
dplaunch process for as long as it lives. Another dplaunch on the machine skips a claimed port.
GPUs are claimed the same way, in a folder every user shares (a GPU is busy for all of them).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

# lock files of the ports and GPUs this process has claimed; kept open (and locked) until it exits
_claims: list[int] = []
# their paths: a process may claim again what it holds (`launch.preflight`: the doctor, then training)
_held: set[str] = set()
# GPU claims of every user of the machine (sticky and world-writable, like /tmp itself)
GPU_CLAIMS_DIR = Path(tempfile.gettempdir()) / "dplaunch-gpus"


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on (host, port) and we could bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host if host not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port the kernel says is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def claim_port(port: int) -> str | None:
    """Claim ``port`` for this process's run; None when done, else why not ("busy", "claimed")."""
    if not port_is_free(port):
        return "busy"
    directory = Path(tempfile.gettempdir()) / f"dplaunch-{os.getuid()}-ports"
    directory.mkdir(mode=0o700, exist_ok=True)
    return None if _lock(directory / f"{port}.lock", 0o600) else "claimed"


def claim_gpu(key: str) -> bool:
    """Claim the GPU ``key`` (its UUID) for this process's run; False when another run holds it."""
    if not GPU_CLAIMS_DIR.is_dir():
        GPU_CLAIMS_DIR.mkdir(exist_ok=True)
        try:
            GPU_CLAIMS_DIR.chmod(0o1777)
        except PermissionError:  # another user made it meanwhile
            pass
    return _lock(GPU_CLAIMS_DIR / f"{key.replace('/', '_')}.lock", 0o644)


def _lock(path: Path, mode: int) -> bool:
    if str(path) in _held:
        return True
    # read-only is enough for flock, and opens another user's lock file
    try:
        handle = os.open(path, os.O_RDONLY | os.O_CREAT, mode)
    except PermissionError:
        handle = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        return False
    _claims.append(handle)
    _held.add(str(path))
    return True


def claim_free_port() -> int:
    """A port that is free now and that no other dplaunch on this machine has claimed."""
    while True:
        port = free_port()
        if claim_port(port) is None:
            return port
