"""Count the GPUs a process would see, without importing torch."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping


def visible_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """GPUs visible to this process: CUDA_VISIBLE_DEVICES when set, else what nvidia-smi lists."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        visible = visible.strip()
        if visible in ("", "-1", "none", "NoDevFiles"):
            return 0
        return len([item for item in visible.split(",") if item.strip()])
    return _nvidia_smi_count()


def _nvidia_smi_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode != 0:
        return 0
    return len([line for line in out.stdout.splitlines() if line.strip()])


def host_memory_gb(env: Mapping[str, str] | None = None) -> float | None:
    """GiB of RAM the ranks of this node may use: the machine's (psutil), or less when a SLURM
    job was given less (SLURM_MEM_PER_NODE, MiB); None when it cannot be read."""
    env = os.environ if env is None else env
    try:
        import psutil  # accelerate requires it; light (no torch)

        total = psutil.virtual_memory().total / 2**30
    except (ImportError, OSError):
        return None
    granted = env.get("SLURM_MEM_PER_NODE", "")
    if granted.isdigit() and int(granted) > 0:
        total = min(total, int(granted) / 1024)
    return total
