"""What every rank of `dplaunch calibrate` runs: the rates a training step is made of, measured.

Started by the launcher exactly as training ranks are (as `dplaunch doctor`'s ranks), as
`python -m dplaunch.train.script THIS_FILE OUT_JSON BACKEND TIMEOUT_S QUICK`. Every rank measures
at once (on CPU ranks they share the cores as training does) and each time is the slowest rank's.
Rank 0 writes OUT_JSON; `dplaunch calibrate` turns it into a profile (planning/profiles.py):

- dense: a Llama-shaped block without its attention core (RMSNorm, q/k/v/o, gate/up/down with
  SiLU, residual adds), forward + backward, at a few (hidden, tokens) shapes per dtype:
  FLOP/s = 6 · tokens · (4h² + 3h·I) / seconds;
- attention: causal attention forward + backward per kernel (sdpa, eager; flash when installed)
  at a few sequence lengths: FLOP/s = 12 · b · heads · s² · head_dim / seconds;
- collectives: all-reduce, all-gather, reduce-scatter, all-to-all, broadcast and a send at a few
  sizes, inside a node and across nodes, fitted to latency + bus bytes / bus bandwidth;
- overlap: a matrix product loop beside an asynchronous all-reduce, against each alone;
- the optimizer (AdamW with gradient clipping), DeepSpeed's CPU Adam when its op is built,
  and host ↔ device copies.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# (dtype, hidden, tokens) of the dense block; (kernel, seq_len) of attention; collective sizes
CPU_DENSE = [("fp32", h, t) for h in (128, 256, 512, 1024) for t in (256, 1024)] + [
    ("bf16", h, 1024) for h in (256, 1024)
]
GPU_DENSE = [
    (dtype, h, t)
    for dtype in ("bf16", "fp16")
    for h in (1024, 2048, 4096, 8192)
    for t in (2048, 8192)
] + [("fp32", h, 4096) for h in (1024, 4096)]
QUICK_DENSE = [("fp32", h, 128) for h in (64, 256)]
CPU_ATTENTION = (128, 512, 1024)
GPU_ATTENTION = (512, 2048, 8192)
QUICK_ATTENTION = (64, 256)
CPU_SIZES = (4 << 10, 256 << 10, 4 << 20)
GPU_SIZES = (64 << 10, 4 << 20, 64 << 20, 256 << 20)
QUICK_SIZES = (4 << 10, 256 << 10)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# each measurement repeats until this many seconds (at least once, after a warm-up run)
SECONDS_PER_POINT = 0.4
QUICK_SECONDS = 0.05


class Ranks:
    """The process group, this rank's device, and timing that waits for the slowest rank."""

    def __init__(self, backend: str, timeout_s: float, quick: bool):
        self.device = torch.device("cpu")
        if backend == "nccl":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.nodes = max(1, self.world // self.per_node)
        self.quick = quick
        self.seconds = QUICK_SECONDS if quick else SECONDS_PER_POINT

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's SECONDS."""
        value = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def timed(self, run: Any, group: Any = None) -> float:
        """Seconds of one RUN: a warm-up, then repeated for self.seconds (every rank as often as
        rank 0 decides), the slowest rank's mean."""
        run()
        self.sync()
        dist.barrier(group=group)
        started = time.perf_counter()
        run()
        self.sync()
        one = time.perf_counter() - started
        count = torch.tensor(
            [max(1, min(50, int(self.seconds / max(one, 1e-6))))], device=self.device
        )
        dist.broadcast(
            count, dist.get_global_rank(group, 0) if group is not None else 0, group=group
        )
        repeats = int(count.item())
        dist.barrier(group=group)
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        self.sync()
        return (time.perf_counter() - started) / repeats


def intermediate(hidden: int) -> int:
    """Llama's MLP width for a hidden size: 8/3 · h rounded up to a multiple of 64."""
    return 64 * math.ceil(8 * hidden / 3 / 64)


class DenseBlock(torch.nn.Module):
    """A Llama decoder block with a cheap elementwise stand-in for the attention core."""

    def __init__(self, hidden: int):
        super().__init__()
        width = intermediate(hidden)
        linear = lambda n_in, n_out: torch.nn.Linear(n_in, n_out, bias=False)  # noqa: E731
        self.q, self.k, self.v, self.o = (linear(hidden, hidden) for _ in range(4))
        self.gate, self.up, self.down = (
            linear(hidden, width),
            linear(hidden, width),
            linear(width, hidden),
        )
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.o(self.q(h) * torch.sigmoid(self.k(h)) + self.v(h))
        h = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def dense_points(ranks: Ranks) -> list[dict[str, Any]]:
    shapes = QUICK_DENSE if ranks.quick else GPU_DENSE if ranks.device.type == "cuda" else CPU_DENSE
    points = []
    for dtype, hidden, tokens in shapes:
        block = DenseBlock(hidden).to(ranks.device, DTYPES[dtype])
        x = torch.randn(
            tokens, hidden, device=ranks.device, dtype=DTYPES[dtype], requires_grad=True
        )

        def step(block: torch.nn.Module = block, x: torch.Tensor = x) -> None:
            block(x).float().sum().backward()

        seconds = ranks.slowest(ranks.timed(step))
        flops = 6 * tokens * (4 * hidden * hidden + 3 * hidden * intermediate(hidden))
        points.append(
            {"dtype": dtype, "hidden": hidden, "tokens": tokens, "flops_per_s": flops / seconds}
        )
        del block, x
    return points


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    length = q.shape[-2]
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def _kernels(device: torch.device) -> dict[str, Any]:
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    kernels = {"sdpa": sdpa, "eager": _eager}
    if device.type == "cuda":
        try:
            from flash_attn import flash_attn_func

            kernels["flash"] = lambda q, k, v: flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True
            )
        except ImportError:
            pass
    return kernels


def attention_points(ranks: Ranks) -> list[dict[str, Any]]:
    cuda = ranks.device.type == "cuda"
    lengths = QUICK_ATTENTION if ranks.quick else GPU_ATTENTION if cuda else CPU_ATTENTION
    dtype = "bf16" if cuda else "fp32"
    rows, heads, head_dim = (2, 16, 128) if cuda else (1, 4, 64)
    points = []
    for kernel, attend in _kernels(ranks.device).items():
        for length in lengths:
            shape = (rows, heads, length, head_dim)
            q, k, v = (
                torch.randn(shape, device=ranks.device, dtype=DTYPES[dtype], requires_grad=True)
                for _ in range(3)
            )

            def step(attend: Any = attend, q: Any = q, k: Any = k, v: Any = v) -> None:
                attend(q, k, v).float().sum().backward()

            seconds = ranks.slowest(ranks.timed(step))
            flops = 12 * rows * heads * length * length * head_dim
            points.append(
                {
                    "kernel": kernel,
                    "dtype": dtype,
                    "seq_len": length,
                    "flops_per_s": flops / seconds,
                }
            )
    return points


def _collective(op: str, size: int, group: Any, ranks: Ranks, pair: tuple[int, int]) -> Any:
    """A function that runs OP once over GROUP with SIZE bytes (float32), or None when this rank
    takes no part (a send involves two ranks)."""
    members = dist.get_process_group_ranks(group)
    count = len(members)
    elements = max(count, size // 4 // count * count)
    buffer = torch.ones(elements, device=ranks.device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buffer, group=group)
    if op == "all_gather":
        part = torch.ones(elements // count, device=ranks.device)
        return lambda: dist.all_gather_into_tensor(buffer, part, group=group)
    if op == "reduce_scatter":
        part = torch.empty(elements // count, device=ranks.device)
        return lambda: dist.reduce_scatter_tensor(part, buffer, group=group)
    if op == "all_to_all":
        out = torch.empty_like(buffer)
        return lambda: dist.all_to_all_single(out, buffer, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(buffer, members[0], group=group)
    sender, receiver = pair
    if ranks.rank == sender:
        # there and back: two sends, so a rep is one send each way
        return lambda: (dist.send(buffer, receiver), dist.recv(buffer, receiver))
    if ranks.rank == receiver:
        return lambda: (dist.recv(buffer, sender), dist.send(buffer, sender))
    return None


def _bus_bytes(op: str, size: int, count: int) -> float:
    if op == "all_reduce":
        return size * 2 * (count - 1) / count
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return size * (count - 1) / count
    return size


def fit_link(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares of seconds = latency + bus bytes / bandwidth over (bus bytes, seconds)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    smallest = min(points)
    if slope <= 0:  # a flat line: bandwidth from the largest point alone
        largest = max(points)
        slope = largest[1] / max(largest[0], 1.0)
    latency = max(mean_y - slope * mean_x, 0.0)
    latency = min(latency, smallest[1])
    return {"latency_s": latency, "bus_bytes_per_s": 1.0 / slope}


def collective_links(ranks: Ranks) -> dict[str, dict[str, Any]]:
    sizes = QUICK_SIZES if ranks.quick else GPU_SIZES if ranks.device.type == "cuda" else CPU_SIZES
    scopes: dict[str, tuple[Any, tuple[int, int]]] = {}
    # every rank creates every group, in the same order
    node_groups = [
        dist.new_group(list(range(n * ranks.per_node, (n + 1) * ranks.per_node)))
        for n in range(ranks.nodes)
    ]
    if ranks.per_node > 1:
        scopes["intra"] = (node_groups[0], (0, 1))
    if ranks.nodes > 1:
        scopes["inter"] = (dist.group.WORLD, (0, ranks.per_node))
    links: dict[str, dict[str, Any]] = {}
    for scope, (group, pair) in scopes.items():
        inside = ranks.rank in dist.get_process_group_ranks(group)
        links[scope] = {}
        for op in COLLECTIVES:
            points = []
            for size in sizes:
                run = _collective(op, size, group, ranks, pair) if inside else None
                seconds = ranks.timed(run) if run is not None and op != "send" else 0.0
                if op == "send":
                    seconds = _timed_pair(ranks, run) / 2
                seconds = ranks.slowest(seconds)
                count = len(dist.get_process_group_ranks(group))
                points.append((_bus_bytes(op, size, count), seconds))
            links[scope][op] = {**fit_link(points), "points": points}
    return links


def _timed_pair(ranks: Ranks, run: Any) -> float:
    """Seconds of a round trip between the two ranks that send; 0 on the others (every rank
    still passes the barriers)."""
    dist.barrier()
    if run is None:
        dist.barrier()
        return 0.0
    run()
    started = time.perf_counter()
    repeats = 5 if ranks.quick else 20
    for _ in range(repeats):
        run()
    ranks.sync()
    seconds = (time.perf_counter() - started) / repeats
    dist.barrier()
    return seconds


def overlap_share(ranks: Ranks, links: dict[str, dict[str, Any]]) -> float:
    """How much of an all-reduce hides behind a matrix product loop running at the same time:
    (alone + alone − together) / the shorter alone, in [0, 1]."""
    if not links:
        return 0.0
    link = links.get("inter") or links["intra"]
    target = 0.05 if ranks.quick else 0.2
    rate = link["all_reduce"]["bus_bytes_per_s"]
    elements = max(1024, min(int(target * rate / 2 / 4), 64 << 20))
    buffer = torch.ones(elements, device=ranks.device)
    size = 256 if ranks.device.type == "cpu" else 4096
    a = torch.randn(size, size, device=ranks.device)

    def compute(times: int) -> None:
        for _ in range(times):
            a @ a

    one = ranks.timed(lambda: compute(1))
    loops = max(1, int(target / max(one, 1e-6)))
    alone = ranks.slowest(ranks.timed(lambda: compute(loops)))
    talk = ranks.slowest(ranks.timed(lambda: dist.all_reduce(buffer)))

    def both() -> None:
        work = dist.all_reduce(buffer, async_op=True)
        compute(loops)
        work.wait()

    together = ranks.slowest(ranks.timed(both))
    hidden = (alone + talk - together) / max(min(alone, talk), 1e-9)
    return max(0.0, min(1.0, hidden))


def _model_like(count: int, device: torch.device) -> list[torch.nn.Parameter]:
    # a few large matrices and some vectors, as a transformer's parameters
    sizes = [count // 8] * 7 + [count - 7 * (count // 8)]
    return [torch.nn.Parameter(torch.randn(size, device=device)) for size in sizes]


def optimizer_rate(ranks: Ranks) -> float:
    """Seconds per parameter of AdamW's step with gradient clipping (fused on GPUs)."""
    count = 200_000 if ranks.quick else 4_000_000 if ranks.device.type == "cpu" else 64_000_000
    parameters = _model_like(count, ranks.device)
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, fused=ranks.device.type == "cuda")

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()

    return ranks.slowest(ranks.timed(step)) / count


def cpu_adam_rate(ranks: Ranks) -> float | None:
    """Seconds per parameter of DeepSpeed's CPU Adam; None when its op is not built (building it
    takes minutes: `dplaunch train` with offload builds it)."""
    built = _cpu_adam_built()
    if not built:
        ranks.slowest(0.0)
        return None
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    count = 200_000 if ranks.quick else 4_000_000
    parameters = _model_like(count, torch.device("cpu"))
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer = DeepSpeedCPUAdam(parameters, lr=1e-4, adamw_mode=True)
    return ranks.slowest(ranks.timed(optimizer.step)) / count


def _cpu_adam_built() -> bool:
    """Whether DeepSpeed's CPU Adam op loads without a build: installed prebuilt, or in the
    extension cache dplaunch builds it into (pointed to for the import)."""
    from dplaunch.launching.deepspeed_ops import prebuilt_ops, torch_extensions_dir

    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError:
        return False
    name = CPUAdamBuilder().name
    if name in prebuilt_ops("cpu"):
        return True
    folder = os.environ.get("TORCH_EXTENSIONS_DIR") or str(torch_extensions_dir())
    if any(Path(folder).glob(f"{name}/*.so")):
        os.environ["TORCH_EXTENSIONS_DIR"] = folder
        return True
    return False


def host_device_rate(ranks: Ranks) -> float:
    """Bytes per second of copies between host and device memory (each way, averaged); on CPU
    ranks, a copy within host memory."""
    size = (4 << 20) if ranks.quick else (64 << 20) if ranks.device.type == "cpu" else (256 << 20)
    elements = size // 4
    if ranks.device.type == "cuda":
        host = torch.empty(elements, pin_memory=True)
        device = torch.empty(elements, device=ranks.device)

        def there_and_back() -> None:
            device.copy_(host, non_blocking=True)
            host.copy_(device, non_blocking=True)

        return 2 * size / ranks.slowest(ranks.timed(there_and_back))
    source, target = torch.ones(elements), torch.empty(elements)
    return size / ranks.slowest(ranks.timed(lambda: target.copy_(source)))


def main(out: Path, backend: str, timeout_s: float, quick: bool) -> None:
    started = time.perf_counter()
    ranks = Ranks(backend, timeout_s, quick)
    torch.manual_seed(ranks.rank)
    device_name = torch.cuda.get_device_name(ranks.device) if ranks.device.type == "cuda" else "cpu"
    links = collective_links(ranks)
    record = {
        "world_size": ranks.world,
        "nodes": ranks.nodes,
        "per_node": ranks.per_node,
        "backend": backend,
        "device_name": device_name,
        "quick": quick,
        "dense": dense_points(ranks),
        "attention": attention_points(ranks),
        "collectives": links,
        "overlap": overlap_share(ranks, links),
        "optimizer_s_per_param": optimizer_rate(ranks),
        "cpu_adam_s_per_param": cpu_adam_rate(ranks),
        "host_device_bytes_per_s": host_device_rate(ranks),
    }
    record["seconds"] = time.perf_counter() - started
    if ranks.rank == 0:
        out.write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()


if __name__ == "__main__":
    from dplaunch.train.quick_start import skip_unused_imports

    skip_unused_imports()
    main(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4] == "quick")
