"""The GPU side of launching, checked on a machine without GPUs: rendered GPU plans and faked probes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers import TINY_LLAMA, child_environment, run_dplaunch

CORES = len(os.sched_getaffinity(0))


def render_gpu_plan(out: Path, *flags: str) -> subprocess.CompletedProcess:
    """`dplaunch config` for GPUs on this GPU-less machine, with dplaunch deciding the threads."""
    env = child_environment()
    del env["OMP_NUM_THREADS"]
    result = run_dplaunch("config", TINY_LLAMA, *flags, "-o", out, env=env)
    assert result.returncode == 0, result.stderr
    return result


def test_zero_offload_on_two_gpus_gets_the_cores_of_the_node_for_cpu_adam(tmp_path):
    # accelerate launch and torchrun export OMP_NUM_THREADS=1 when it is unset: DeepSpeed's CPU
    # Adam (OpenMP) would step the whole offloaded optimizer on one core
    result = render_gpu_plan(tmp_path, "--gpus", "2", "--zero", "2", "--offload", "optimizer")
    threads = max(1, CORES // 2)
    assert f"export OMP_NUM_THREADS={threads}\n" in (tmp_path / "launch.sh").read_text()
    assert (
        f"note: offload: DeepSpeed's CPU Adam steps on {threads} OpenMP thread(s) per rank "
        f"(OMP_NUM_THREADS: {CORES} cores here ÷ 2 ranks per node)"
    ) in result.stdout


def test_gpu_ranks_without_offload_keep_the_launchers_one_thread(tmp_path):
    render_gpu_plan(tmp_path, "--gpus", "2", "--zero", "2")
    assert "OMP_NUM_THREADS" not in (tmp_path / "launch.sh").read_text()
