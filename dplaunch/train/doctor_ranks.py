"""What every rank of `dplaunch doctor` runs: a timed all-reduce of increasing sizes.

Started by the launcher exactly as training ranks are (torchrun's environment: RANK, WORLD_SIZE,
MASTER_ADDR…), as `python -m dplaunch.train.script THIS_FILE OUT_JSON BACKEND TIMEOUT_S`. Rank 0
writes OUT_JSON: the hosts of the ranks and, per size, the time of one all-reduce and its bus
bandwidth as nccl-tests counts it (busbw = algbw × 2(n−1)/n, algbw = bytes / time).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# bytes of each all-reduce (float32): gloo on CPU stops at 4 MiB, NCCL goes to 256 MiB
CPU_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
GPU_SIZES = (64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20)
# each size is repeated until this many seconds or MAX_ITERATIONS, after WARMUP unmeasured ones
SECONDS_PER_SIZE = 0.3
MAX_ITERATIONS = 20
WARMUP = 2


def bus_bandwidth(size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of an all-reduce of SIZE_BYTES that took SECONDS (nccl-tests)."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


def _timed_all_reduce(tensor: torch.Tensor, device: torch.device) -> float:
    """Seconds of one all-reduce, the mean over repetitions (every rank repeats as often)."""
    for _ in range(WARMUP):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # rank 0 decides the repetitions, so every rank runs the same number of collectives
    iterations = torch.zeros(1, device=device)
    started = time.perf_counter()
    dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    one = time.perf_counter() - started
    iterations[0] = max(1, min(MAX_ITERATIONS, int(SECONDS_PER_SIZE / max(one, 1e-6))))
    dist.broadcast(iterations, 0)
    count = int(iterations.item())
    started = time.perf_counter()
    for _ in range(count):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / count


def main(out: Path, backend: str, timeout_s: float) -> None:
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    else:
        # one rank: Accelerate starts it without torchrun, so without RANK or MASTER_ADDR
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=timeout_s),
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    rows = []
    for size in GPU_SIZES if device.type == "cuda" else CPU_SIZES:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        seconds = _timed_all_reduce(tensor, device)
        algbw, busbw = bus_bandwidth(size, seconds, world)
        rows.append(
            {"bytes": size, "time_us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw}
        )
    if rank == 0:
        record = {"world_size": world, "backend": backend, "hosts": hosts, "rows": rows}
        out.write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
