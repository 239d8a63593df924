"""What every rank of `dplaunch calibrate` runs: the rates a training step is made of, measured.

Started by the launcher exactly as training ranks are (as `dplaunch doctor`'s ranks), as
`python -m dplaunch.train.script THIS_FILE OUT_JSON BACKEND TIMEOUT_S BUDGET_S QUICK CPU_ADAM`
(QUICK "quick" or "full", CPU_ADAM "cpu_adam" when the launcher has DeepSpeed's CPU Adam op
built). Every rank measures at once (on CPU ranks they share the cores as training does) and
each time is the slowest rank's. Rank 0 writes OUT_JSON; `dplaunch calibrate` turns it into a
profile (planning/profiles.py):

- collectives: all-reduce, all-gather, reduce-scatter, all-to-all, broadcast and a send at a few
  sizes, inside each node (all nodes at once) and across nodes, fitted to latency + bus bytes /
  bus bandwidth;
- dense: a Llama-shaped block without its attention core (RMSNorm, q/k/v/o, gate/up/down with
  SiLU, residual adds), forward + backward, at a few (hidden, tokens) shapes per dtype:
  FLOP/s = 6 · tokens · (4h² + 3h·I) / seconds;
- attention: causal attention forward + backward per kernel (sdpa, eager; flash when installed
  and the GPU runs it) at a few sequence lengths: FLOP/s = 12 · b · heads · s² · head_dim / seconds;
- overlap: a matrix product loop beside an asynchronous all-reduce, against each alone;
- the optimizer (AdamW with gradient clipping), DeepSpeed's CPU Adam when its op is built,
  and host ↔ device copies;
- engine steps: a few real optimizer steps of each engine family on small models of its own
  (train/calibrate_engines.py), which planning/overhead_fit.py turns into the forecast's
  overhead terms.

The measuring keeps to BUDGET_S seconds, counted from the moment the process group is up, on a
loaded machine too: the sections share it (SHARES, what one leaves passes to the next), each
point repeats as often as its share of what is left allows (at most SECONDS_PER_POINT), and a
point whose warm-up and first run would not fit (foreseen from the last rate of its series) is
left out, as is every point once the time is spent, except the first of each series. Rank 0's
clock decides for every rank (a broadcast), so all ranks run the same collectives. What was left
out, and what the device cannot run (flash-attention before Ampere, bf16 without it, shapes
larger than its free memory), is listed in the record's ``skipped``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dplaunch.train.calibrate_engines import engine_steps, preload_engines

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
# the budget's share of each section, in the order they are measured
SHARES = {
    "collectives": 0.2,
    "dense": 0.2,
    "attention": 0.13,
    "overlap": 0.04,
    "optimizer": 0.04,
    "cpu_adam": 0.03,
    "host_device": 0.03,
    # short real steps of each engine family (train/calibrate_engines.py): the overheads
    "engines": 0.33,
}
# a point repeats for at most this many seconds (and MAX_REPEATS times), after a warm-up run
SECONDS_PER_POINT = 0.4
QUICK_SECONDS = 0.05
MAX_REPEATS = 50
# of a GPU's free memory a shape may take (the allocator's cache and fragmentation keep the rest)
MEMORY_FRACTION = 0.8
# bytes an eager attention step keeps per score (b · heads · s²) beside its 16-bit copies: the
# fp32 softmax, its output and their gradients (reported on GPUs: ~25-30 GB at 2 × 16 heads ×
# 8192² in bf16; this count gives 32 GiB)
EAGER_BYTES_PER_SCORE = 12
# (rows, heads, head_dim) of the attention shapes
GPU_ATTENTION_SHAPE = (2, 16, 128)
CPU_ATTENTION_SHAPE = (1, 4, 64)


class Clock:
    """Rank 0's measuring budget: the seconds left for the whole, for a section, for a point."""

    def __init__(
        self, seconds: float, point_s: float, now: Callable[[], float] = time.perf_counter
    ):
        self.now = now
        self.started = now()
        self.deadline = self.started + seconds
        self.point_s = point_s
        self.section_end = self.deadline
        self.points_left = 1
        self.shares_left = sum(SHARES.values())

    def start(self, section: str, points: int) -> None:
        """SECTION begins, with POINTS points: its share of the time left."""
        now = self.now()
        share = SHARES[section] / self.shares_left if self.shares_left > 0 else 1.0
        self.shares_left -= SHARES[section]
        self.section_end = now + max(self.deadline - now, 0.0) * share
        self.points_left = max(points, 1)

    def target(self, predicted: float | None, essential: bool) -> float:
        """Seconds the next point may take, warm-up included; 0 to leave it out (the section's
        time is spent, or PREDICTED seconds of one run twice would not fit). An ESSENTIAL point
        (the first of its series) is measured whatever the clock: once after its warm-up."""
        left = self.section_end - self.now()
        share = min(self.point_s, left / self.points_left)
        self.points_left = max(1, self.points_left - 1)
        if left > 0 and (predicted is None or 2 * predicted <= left):
            return max(share, 1e-9)
        return 1e-9 if essential else 0.0


@dataclass
class DeviceLimits:
    """What the device can run, agreed by every rank: bf16, and the free memory (None on CPU)."""

    bf16: bool = True
    free_bytes: float | None = None
    capability: tuple[int, int] | None = None
    skipped: list[str] = field(default_factory=list)

    def fits(self, needed: float) -> bool:
        """Whether NEEDED bytes fit in the free memory's usable share."""
        return self.free_bytes is None or needed <= MEMORY_FRACTION * self.free_bytes

    def too_large(self, what: str, needed: float) -> str:
        assert self.free_bytes is not None
        return f"{what} (needs ~{needed / 2**30:.0f} GiB, {self.free_bytes / 2**30:.0f} GiB free)"


def device_limits(device: torch.device) -> DeviceLimits:
    """DEVICE's bf16 support (compute capability 8.0 on: a V100 has none) and free memory."""
    if device.type != "cuda":
        return DeviceLimits()
    capability = tuple(torch.cuda.get_device_capability(device))
    free, _total = torch.cuda.mem_get_info(device)
    return DeviceLimits(bf16=capability >= (8, 0), free_bytes=float(free), capability=capability)


class Ranks:
    """The process group, this rank's device, and timing that keeps to the budget and waits for
    the slowest rank."""

    def __init__(self, backend: str, timeout_s: float, quick: bool, budget_s: float):
        self.device = torch.device("cpu")
        if backend == "nccl":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        _init_process_group(backend, timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.nodes = max(1, self.world // self.per_node)
        self.quick = quick
        self.budget_s = budget_s
        self.clock = Clock(budget_s, QUICK_SECONDS if quick else SECONDS_PER_POINT)
        self.limits = self.agreed(device_limits(self.device))
        # section → the points the budget left out
        self.over_budget: dict[str, list[str]] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's SECONDS."""
        value = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def agree(self, yes: bool) -> bool:
        """True when every rank says YES (what one rank cannot run, none runs)."""
        return self.slowest(0.0 if yes else 1.0) == 0.0

    def agreed(self, limits: DeviceLimits) -> DeviceLimits:
        """LIMITS as every rank can keep them: bf16 where all have it, the least free memory."""
        limits.bf16 = self.agree(limits.bf16)
        if limits.free_bytes is not None:
            limits.free_bytes = -self.slowest(-limits.free_bytes)
        return limits

    def start(self, section: str, points: int) -> None:
        """A section of POINTS points begins (the clock is rank 0's; the others follow it)."""
        self.clock.start(section, points)

    def measure(
        self,
        run: Callable[[], Any] | None,
        group: Any = None,
        *,
        predicted: float | None = None,
        essential: bool = False,
        label: str = "",
        section: str = "",
    ) -> float | None:
        """Seconds of one RUN, the slowest rank's mean over the repeats rank 0's clock allows
        after a warm-up; every rank calls it, those outside GROUP with RUN None. None on every
        rank when the clock leaves the point out (noted as LABEL of SECTION)."""
        decision = torch.tensor(
            [self.clock.target(predicted, essential) if self.rank == 0 else 0.0],
            dtype=torch.float64,
            device=self.device,
        )
        dist.broadcast(decision, 0)
        target = float(decision.item())
        if target <= 0:
            self.over_budget.setdefault(section, []).append(label)
            return None
        return self.slowest(self._timed(run, group, target) if run is not None else 0.0)

    def _timed(self, run: Callable[[], Any], group: Any, target: float) -> float:
        run()
        self.sync()
        dist.barrier(group=group)
        started = time.perf_counter()
        run()
        self.sync()
        one = time.perf_counter() - started
        # the group's first rank decides the repeats, so every member runs as many collectives;
        # none when the warm-up and the first run took the point's time (that run is the time)
        count = torch.tensor(
            [max(0, min(MAX_REPEATS, int(target / max(one, 1e-6)) - 2))], device=self.device
        )
        leader = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(count, leader, group=group)
        repeats = int(count.item())
        if repeats == 0:
            return one
        dist.barrier(group=group)
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        self.sync()
        return (time.perf_counter() - started) / repeats

    def skipped(self) -> list[str]:
        """What was not measured, and why: the device's limits, then the budget's."""
        over = [
            f"{section} at {', '.join(labels)} (over the {self.budget_s:g} s budget)"
            for section, labels in self.over_budget.items()
        ]
        return [*self.limits.skipped, *over]


def _init_process_group(backend: str, timeout_s: float) -> None:
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return
    # one rank: Accelerate starts it without torchrun, so without RANK or MASTER_ADDR
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s)
    )


def _predicted(last: tuple[float, float] | None, work: float) -> float | None:
    """Seconds of WORK at the rate of the series' LAST (work, seconds) point."""
    return None if last is None else last[1] * work / max(last[0], 1e-30)


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


def dense_flops(hidden: int, tokens: int) -> int:
    return 6 * tokens * (4 * hidden * hidden + 3 * hidden * intermediate(hidden))


def dense_bytes(dtype: str, hidden: int, tokens: int) -> float:
    """Memory of one dense step: weights and gradients, the saved activations, the fp32 sum."""
    element = DTYPES[dtype].itemsize
    weights = 4 * hidden * hidden + 3 * hidden * intermediate(hidden)
    return 2 * weights * element + tokens * (8 * hidden + 4 * intermediate(hidden)) * element


def dense_shapes(ranks: Ranks) -> list[tuple[str, int, int]]:
    """The (dtype, hidden, tokens) shapes to time, cheapest first per dtype, without those the
    device cannot run (noted in its limits)."""
    cuda = ranks.device.type == "cuda"
    shapes = QUICK_DENSE if ranks.quick else GPU_DENSE if cuda else CPU_DENSE
    return runnable_dense(shapes, ranks.limits)


def runnable_dense(
    shapes: list[tuple[str, int, int]], limits: DeviceLimits
) -> list[tuple[str, int, int]]:
    """SHAPES less bf16 on a device without it and those larger than its free memory."""
    kept = []
    if not limits.bf16 and any(dtype == "bf16" for dtype, _, _ in shapes):
        limits.skipped.append(f"bf16 (compute capability {limits.capability} has none)")
    for dtype, hidden, tokens in shapes:
        if dtype == "bf16" and not limits.bf16:
            continue
        needed = dense_bytes(dtype, hidden, tokens)
        if not limits.fits(needed):
            limits.skipped.append(limits.too_large(f"dense {dtype} h{hidden}×t{tokens}", needed))
            continue
        kept.append((dtype, hidden, tokens))
    order = {dtype: index for index, (dtype, _, _) in reversed(list(enumerate(kept)))}
    return sorted(kept, key=lambda s: (order[s[0]], dense_flops(s[1], s[2])))


def measure_series(
    ranks: Ranks, section: str, points: list[tuple[str, str, float, Callable[[], Callable]]]
) -> list[float | None]:
    """Seconds of each of SECTION's POINTS (None: left out), each (series, label, FLOPs, build):
    build() makes its step, whose tensors live only while it is timed. A series' first point is
    always measured; the next ones are foreseen at the series' last rate."""
    ranks.start(section, len(points))
    last: dict[str, tuple[float, float]] = {}
    found: list[float | None] = []
    for series, label, flops, build in points:
        step = build()
        seconds = ranks.measure(
            step,
            predicted=_predicted(last.get(series), flops),
            essential=series not in last,
            label=label,
            section=section,
        )
        del step
        if seconds is not None:
            last[series] = (flops, seconds)
        found.append(seconds)
    return found


def _dense_step(dtype: str, hidden: int, tokens: int, device: torch.device) -> Callable:
    block = DenseBlock(hidden).to(device, DTYPES[dtype])
    x = torch.randn(tokens, hidden, device=device, dtype=DTYPES[dtype], requires_grad=True)
    return lambda: block(x).float().sum().backward()


def dense_points(ranks: Ranks) -> list[dict[str, Any]]:
    shapes = dense_shapes(ranks)
    points = [
        (
            dtype,
            f"{dtype} h{hidden}×t{tokens}",
            dense_flops(hidden, tokens),
            lambda d=dtype, h=hidden, t=tokens: _dense_step(d, h, t, ranks.device),
        )
        for dtype, hidden, tokens in shapes
    ]
    seconds = measure_series(ranks, "dense", points)
    return [
        {"dtype": dtype, "hidden": h, "tokens": t, "flops_per_s": dense_flops(h, t) / took}
        for (dtype, h, t), took in zip(shapes, seconds, strict=True)
        if took is not None
    ]


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    length = q.shape[-2]
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def flash_kernel(device: torch.device, dtype: torch.dtype) -> tuple[Callable | None, str | None]:
    """flash-attn's kernel when it is installed and runs on DEVICE, else (None, why not): a GPU
    before Ampere imports it and raises RuntimeError when it is called, so a tiny call tries it."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None, "flash-attention (not installed)"

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True
        ).transpose(1, 2)

    probe = torch.zeros(1, 1, 8, 64, device=device, dtype=dtype)
    try:
        attend(probe, probe, probe)
    except RuntimeError as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return None, f"flash-attention ({reason[:120]})"
    return attend, None


def attention_kernels(ranks: Ranks, dtype: str) -> dict[str, Callable]:
    """The kernels to time: sdpa and eager, and flash on GPUs where every rank runs it."""
    kernels: dict[str, Callable] = {"sdpa": _sdpa, "eager": _eager}
    if ranks.device.type == "cuda":
        flash, why_not = flash_kernel(ranks.device, DTYPES[dtype])
        if ranks.agree(flash is not None) and flash is not None:
            kernels["flash"] = flash
        else:
            ranks.limits.skipped.append(why_not or "flash-attention (another rank cannot run it)")
    return kernels


def attention_bytes(kernel: str, dtype: str, length: int, shape: tuple[int, int, int]) -> float:
    """Memory of one attention step: q, k, v, the output and their gradients, and for eager the
    s × s scores (flash and sdpa's GPU kernels never build them)."""
    rows, heads, head_dim = shape
    element = DTYPES[dtype].itemsize
    tensors = 8 * rows * heads * length * head_dim * element
    if kernel != "eager":
        return tensors
    return tensors + rows * heads * length * length * (2 * element + EAGER_BYTES_PER_SCORE)


def attention_plan(
    ranks: Ranks,
) -> tuple[str, tuple[int, int, int], list[tuple[str, Callable, int]]]:
    """The dtype, the (rows, heads, head_dim) and the (kernel, function, length) points to time,
    shortest first per kernel, without those larger than the device's free memory."""
    cuda = ranks.device.type == "cuda"
    lengths = QUICK_ATTENTION if ranks.quick else GPU_ATTENTION if cuda else CPU_ATTENTION
    dtype = ("bf16" if ranks.limits.bf16 else "fp16") if cuda else "fp32"
    shape = GPU_ATTENTION_SHAPE if cuda else CPU_ATTENTION_SHAPE
    points = []
    for kernel, attend in attention_kernels(ranks, dtype).items():
        for length in lengths:
            needed = attention_bytes(kernel, dtype, length, shape)
            if ranks.limits.fits(needed):
                points.append((kernel, attend, length))
            else:
                what = f"{kernel} attention at {length} tokens in {dtype}"
                ranks.limits.skipped.append(ranks.limits.too_large(what, needed))
    return dtype, shape, points


def _attention_step(
    attend: Callable, dtype: str, length: int, shape: tuple[int, int, int], device: torch.device
) -> Callable:
    rows, heads, head_dim = shape
    q, k, v = (
        torch.randn(
            (rows, heads, length, head_dim), device=device, dtype=DTYPES[dtype], requires_grad=True
        )
        for _ in range(3)
    )
    return lambda: attend(q, k, v).float().sum().backward()


def attention_points(ranks: Ranks) -> list[dict[str, Any]]:
    dtype, shape, plan = attention_plan(ranks)
    rows, heads, head_dim = shape
    flops = {length: 12 * rows * heads * length * length * head_dim for _, _, length in plan}
    points = [
        (
            kernel,
            f"{kernel} {length} tokens",
            flops[length],
            lambda a=attend, n=length: _attention_step(a, dtype, n, shape, ranks.device),
        )
        for kernel, attend, length in plan
    ]
    seconds = measure_series(ranks, "attention", points)
    return [
        {"kernel": kernel, "dtype": dtype, "seq_len": length, "flops_per_s": flops[length] / took}
        for (kernel, _, length), took in zip(plan, seconds, strict=True)
        if took is not None
    ]


@dataclass
class Scope:
    """Where collectives are timed: inside a node (every node's own group at once) or across
    nodes, with the pair that sends; this rank's groups (None: it is not a member)."""

    name: str
    group: Any
    members: list[int]
    pair_group: Any
    pair: tuple[int, int]


def scopes(ranks: Ranks) -> list[Scope]:
    """The scopes of this layout; every rank creates every group, in the same order."""
    per_node, node = ranks.per_node, ranks.rank // ranks.per_node
    nodes = [list(range(n * per_node, (n + 1) * per_node)) for n in range(ranks.nodes)]
    found = []
    if per_node > 1:
        node_groups = [dist.new_group(members) for members in nodes]
        pair_groups = [dist.new_group(members[:2]) for members in nodes]
        mine = nodes[node]
        pair = (mine[0], mine[1])
        in_pair = ranks.rank in pair
        found.append(
            Scope("intra", node_groups[node], mine, pair_groups[node] if in_pair else None, pair)
        )
    if ranks.nodes > 1:
        pair = (0, per_node)
        pair_group = dist.new_group(list(pair))
        members = list(range(ranks.world))
        in_pair = ranks.rank in pair
        found.append(Scope("inter", None, members, pair_group if in_pair else None, pair))
    return found


def _collective(op: str, size: int, scope: Scope, ranks: Ranks) -> Callable[[], Any] | None:
    """A function that runs OP once over SCOPE with SIZE bytes (float32), or None when this rank
    takes no part (a send involves two ranks)."""
    count = len(scope.members)
    elements = max(count, size // 4 // count * count)
    buffer = torch.ones(elements, device=ranks.device)
    group = scope.group
    if op == "all_reduce":
        return lambda: dist.all_reduce(buffer, group=group)
    if op == "all_gather":
        part = torch.ones(elements // count, device=ranks.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(buffer, part, group=group)
    if op == "reduce_scatter":
        part = torch.empty(elements // count, device=ranks.device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, buffer, group=group)
    if op == "all_to_all":
        out = torch.empty_like(buffer)
        return lambda: dist.all_to_all_single(out, buffer, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(buffer, scope.members[0], group=group)
    sender, receiver = scope.pair
    # there and back: two sends, so a run is one send each way
    if ranks.rank == sender:
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
    # the largest size first (the bandwidth), then the smallest (the latency), then the others
    ordered = [max(sizes), min(sizes), *sorted(set(sizes) - {max(sizes), min(sizes)})]
    found = scopes(ranks)
    ranks.start("collectives", len(ordered) * len(found) * len(COLLECTIVES))
    points: dict[str, dict[str, list[tuple[float, float]]]] = {s.name: {} for s in found}
    for size in ordered:
        for scope in found:
            for op in COLLECTIVES:
                inside = scope.pair_group if op == "send" else scope.group
                member = (scope.pair_group is not None) if op == "send" else True
                run = _collective(op, size, scope, ranks) if member else None
                seconds = ranks.measure(
                    run,
                    inside,
                    essential=size == ordered[0],
                    label=f"{scope.name} {op} {size >> 10} KiB",
                    section="collectives",
                )
                if seconds is None:
                    continue
                if op == "send":
                    seconds /= 2  # a run is there and back
                bus = _bus_bytes(op, size, len(scope.members))
                points[scope.name].setdefault(op, []).append((bus, seconds))
    return {
        scope: {op: {**fit_link(pts), "points": pts} for op, pts in ops.items()}
        for scope, ops in points.items()
    }


def overlap_share(ranks: Ranks, links: dict[str, dict[str, Any]]) -> float | None:
    """How much of an all-reduce hides behind a matrix product loop running at the same time:
    (alone + alone − together) / the shorter alone, in [0, 1]; None on one rank (nothing to
    overlap)."""
    if not links:
        return None
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

    ranks.start("overlap", 4)
    one = ranks.measure(lambda: compute(1), essential=True) or 0.0
    loops = max(1, int(target / max(one, 1e-6)))
    alone = ranks.measure(lambda: compute(loops), essential=True) or 0.0
    talk = ranks.measure(lambda: dist.all_reduce(buffer), essential=True) or 0.0

    def both() -> None:
        work = dist.all_reduce(buffer, async_op=True)
        compute(loops)
        work.wait()

    together = ranks.measure(both, essential=True) or 0.0
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

    ranks.start("optimizer", 1)
    return (ranks.measure(step, essential=True) or 0.0) / count


def cpu_adam_rate(ranks: Ranks) -> float:
    """Seconds per parameter of DeepSpeed's CPU Adam (its op built by the launcher, which points
    TORCH_EXTENSIONS_DIR at it)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    count = 200_000 if ranks.quick else 4_000_000
    parameters = _model_like(count, torch.device("cpu"))
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer = DeepSpeedCPUAdam(parameters, lr=1e-4, adamw_mode=True)
    ranks.start("cpu_adam", 1)
    return (ranks.measure(optimizer.step, essential=True) or 0.0) / count


def host_device_rate(ranks: Ranks) -> float:
    """Bytes per second of copies between host and device memory (each way, averaged); on CPU
    ranks, a copy within host memory."""
    size = (4 << 20) if ranks.quick else (64 << 20) if ranks.device.type == "cpu" else (256 << 20)
    elements = size // 4
    ranks.start("host_device", 1)
    if ranks.device.type == "cuda":
        host = torch.empty(elements, pin_memory=True)
        device = torch.empty(elements, device=ranks.device)

        def there_and_back() -> None:
            device.copy_(host, non_blocking=True)
            host.copy_(device, non_blocking=True)

        return 2 * size / (ranks.measure(there_and_back, essential=True) or 1.0)
    source, target = torch.ones(elements), torch.empty(elements)
    return size / (ranks.measure(lambda: target.copy_(source), essential=True) or 1.0)


def measure_all(ranks: Ranks, cpu_adam: bool) -> dict[str, Any]:
    """Every section, in the order of SHARES; the record rank 0 writes."""
    device_name = torch.cuda.get_device_name(ranks.device) if ranks.device.type == "cuda" else "cpu"
    links = collective_links(ranks)
    dense = dense_points(ranks)
    attention = attention_points(ranks)
    overlap = overlap_share(ranks, links)
    optimizer = optimizer_rate(ranks)
    return {
        "world_size": ranks.world,
        "nodes": ranks.nodes,
        "per_node": ranks.per_node,
        "device_name": device_name,
        "quick": ranks.quick,
        "budget_s": ranks.budget_s,
        "collectives": links,
        "dense": dense,
        "attention": attention,
        "overlap": overlap,
        "optimizer_s_per_param": optimizer,
        "cpu_adam_s_per_param": cpu_adam_rate(ranks) if cpu_adam else None,
        "host_device_bytes_per_s": host_device_rate(ranks),
        "engine_steps": engine_steps(ranks, ranks.quick),
        "skipped": ranks.skipped(),
    }


def main(out: Path, backend: str, timeout_s: float, budget_s: float, quick: bool, cpu_adam: bool):
    started = time.perf_counter()
    # what the first optimizer imports (torch._dynamo: seconds, 30 on a loaded 2-core machine)
    # is imported before the budget's clock starts, as training ranks import it before they step
    import torch._dynamo  # noqa: F401

    if cpu_adam:
        import deepspeed.ops.adam  # noqa: F401
    preload_engines()  # the engines' libraries, as a training rank has them before it steps
    ranks = Ranks(backend, timeout_s, quick, budget_s)
    torch.manual_seed(ranks.rank)
    record = {"backend": backend, **measure_all(ranks, cpu_adam)}
    # the measuring, and before it the ranks' start (imports, the rendezvous)
    record["seconds"] = time.perf_counter() - ranks.clock.started
    record["start_s"] = ranks.clock.started - started
    if ranks.rank == 0:
        out.write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()


if __name__ == "__main__":
    from dplaunch.train.quick_start import skip_unused_imports

    skip_unused_imports()
    args = sys.argv[1:]
    main(
        Path(args[0]),
        args[1],
        float(args[2]),
        float(args[3]),
        args[4] == "quick",
        args[5] == "cpu_adam",
    )
