"""Hardware profiles: what the forecast (planning/forecast.py) divides by.

A profile holds, for one kind of machine (device name and count per node, node count, the
interconnect between nodes), the rates a training step runs at:

- ``dense``: the FLOP/s a transformer block's matrix products (with their norms, activations
  and residual adds) achieve, measured forward + backward at a few (hidden size, tokens) shapes
  per dtype; the forecast interpolates in log(hidden) and log(tokens);
- ``attention``: the FLOP/s of the attention kernel (sdpa, eager, flash) at a few sequence lengths;
- ``collectives``: latency and bus bandwidth (nccl-tests' convention) of each collective inside a
  node and across nodes: time = latency + bus bytes / bandwidth;
- ``overlap``: the fraction of an overlappable collective hidden behind computation;
- the optimizer step, DeepSpeed's CPU Adam and host ↔ device copies, per parameter or byte.

``dplaunch calibrate`` measures them (dplaunch/train/calibrate_ranks.py) and saves the profile in
the user's cache, keyed by the hardware; ``--profile FILE`` ships one with a run file. Without
either, known GPUs (H100, H200, A100, L40S, V100) and interconnect classes (NVLink, PCIe,
InfiniBand, Ethernet) get datasheet figures: ``source`` is then "datasheet, not calibrated".

Pure Python: no torch. Reading and writing a profile file are the only side effects.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dplaunch.errors import UserError

CALIBRATED = "calibrated"
DATASHEET = "datasheet, not calibrated"
# the collectives a profile times, by the names the spy and the forecast use
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
# train.mixed_precision → the dtype a profile's rates are measured in
DTYPES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
# model.attn_implementation → the kernel a profile's attention rates are measured for
KERNELS = {
    "sdpa": "sdpa",
    "eager": "eager",
    "flash_attention_2": "flash",
    "flash_attention_3": "flash",
    "flex_attention": "sdpa",
}


@dataclass(frozen=True)
class Link:
    """One collective on one scope: seconds = latency_s + bus bytes / bus_bytes_per_s."""

    latency_s: float
    bus_bytes_per_s: float


@dataclass(frozen=True)
class DensePoint:
    """The FLOP/s a transformer block's matrix products achieved at one shape and dtype."""

    dtype: str
    hidden: int
    tokens: int
    flops_per_s: float


@dataclass(frozen=True)
class AttentionPoint:
    """The FLOP/s one attention kernel achieved at one sequence length and dtype."""

    kernel: str
    dtype: str
    seq_len: int
    flops_per_s: float


@dataclass(frozen=True)
class Profile:
    """The measured (or datasheet) rates of one kind of machine."""

    device: str
    devices_per_node: int
    nodes: int
    # between nodes: "infiniband", "ethernet"; inside a node: what ``intra`` says
    interconnect: str
    source: str
    # per dtype: the FLOP/s MFU divides by (datasheet peak, or the best rate measured)
    peak_flops: dict[str, float]
    dense: tuple[DensePoint, ...]
    attention: tuple[AttentionPoint, ...]
    # scope ("intra" = inside a node, "inter" = across nodes) → op → link
    collectives: dict[str, dict[str, Link]]
    overlap: float
    optimizer_s_per_param: float
    cpu_adam_s_per_param: float
    host_device_bytes_per_s: float
    intra: str = "nvlink"
    measured_at: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def key(self) -> str:
        """What the profile is found by: device, devices per node, nodes, interconnect."""
        return hardware_key(self.device, self.devices_per_node, self.nodes, self.interconnect)

    @property
    def label(self) -> str:
        """The profile in words, for `dplaunch plan`: "H100 ×8, 2 nodes, infiniband (datasheet, …)"."""
        nodes = f", {self.nodes} nodes" if self.nodes > 1 else ""
        between = f", {self.interconnect}" if self.nodes > 1 else f", {self.intra}"
        return f"{self.device} ×{self.devices_per_node}{nodes}{between} ({self.source})"

    def dense_rate(self, dtype: str, hidden: int, tokens: int) -> float:
        """FLOP/s of a block's matrix products at this shape (interpolated in log space)."""
        points = [p for p in self.dense if p.dtype == dtype] or _fallback_dtype(self.dense, dtype)
        if not points:
            raise UserError("profile", f"the profile has no dense rates ({self.key})")
        by_tokens: dict[int, list[tuple[float, float]]] = {}
        for point in points:
            by_tokens.setdefault(point.tokens, []).append((point.hidden, point.flops_per_s))
        rows = sorted((t, _interpolate(sorted(pts), hidden)) for t, pts in by_tokens.items())
        return _interpolate(rows, tokens)

    def attention_rate(self, kernel: str, dtype: str, seq_len: int, hidden: int) -> float:
        """FLOP/s of attention KERNEL at this sequence length; a profile without that kernel
        falls back to sdpa, then to the dense rate."""
        name = KERNELS.get(kernel, "sdpa")
        for wanted in (name, "sdpa"):
            points = [p for p in self.attention if p.kernel == wanted and p.dtype == dtype]
            points = points or [p for p in self.attention if p.kernel == wanted]
            if points:
                rows = sorted((p.seq_len, p.flops_per_s) for p in points)
                return _interpolate(rows, seq_len)
        return self.dense_rate(dtype, hidden, seq_len)

    def link(self, op: str, scope: str) -> Link:
        """The link an op runs on inside a node ("intra") or across nodes ("inter")."""
        table = self.collectives.get(scope) or self.collectives.get("intra") or {}
        found = table.get(op) or table.get("all_reduce")
        if found is None:
            raise UserError("profile", f"the profile has no {op} timing ({self.key})")
        return found

    def peak(self, dtype: str) -> float:
        """The FLOP/s MFU is measured against for DTYPE."""
        return self.peak_flops.get(dtype) or max(self.peak_flops.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the profile file)."""
        data = asdict(self)
        data["key"] = self.key
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Inverse of to_dict."""
        data = {k: v for k, v in data.items() if k != "key"}
        data["dense"] = tuple(DensePoint(**p) for p in data.get("dense", ()))
        data["attention"] = tuple(AttentionPoint(**p) for p in data.get("attention", ()))
        data["collectives"] = {
            scope: {op: Link(**link) for op, link in ops.items()}
            for scope, ops in data.get("collectives", {}).items()
        }
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)


def _fallback_dtype(points: tuple[DensePoint, ...], dtype: str) -> list[DensePoint]:
    # fp16 runs at bf16's rate and the other way round; anything else at the fastest measured
    for other in {"fp16": ("bf16",), "bf16": ("fp16",)}.get(dtype, ()):
        found = [p for p in points if p.dtype == other]
        if found:
            return found
    return [p for p in points if p.dtype == "fp32"] or list(points)


def _interpolate(rows: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log(x) through (x, y) rows sorted by x; flat beyond the ends."""
    if len(rows) == 1 or x <= rows[0][0]:
        return rows[0][1]
    if x >= rows[-1][0]:
        return rows[-1][1]
    for (x0, y0), (x1, y1) in zip(rows, rows[1:], strict=False):
        if x0 <= x <= x1:
            share = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + share * (y1 - y0)
    return rows[-1][1]


def hardware_key(device: str, devices_per_node: int, nodes: int, interconnect: str) -> str:
    """ "NVIDIA H100 80GB HBM3 x8, 1 node, nvlink": how profiles are told apart."""
    return f"{device} x{devices_per_node}, {nodes} node{'s' if nodes > 1 else ''}, {interconnect}"


# ---------------------------------------------------------------------------------------------
# datasheet figures


@dataclass(frozen=True)
class GpuSheet:
    """What a GPU's datasheet says: dense tensor-core peaks (no sparsity), memory bandwidth,
    NVLink and host (PCIe) bandwidth per direction."""

    peak_flops: dict[str, float]
    memory_bytes_per_s: float
    nvlink_bytes_per_s: float | None
    host_bytes_per_s: float
    # NIC bandwidth per GPU in the usual InfiniBand build of its generation (NDR, HDR, EDR)
    infiniband_bytes_per_s: float


GPU_SHEETS = {
    # fp32 without TF32: torch leaves allow_tf32 off for matrix products
    "H100": GpuSheet({"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 3.35e12, 450e9, 55e9, 50e9),
    "H200": GpuSheet({"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 4.8e12, 450e9, 55e9, 50e9),
    "A100": GpuSheet({"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 2.0e12, 300e9, 25e9, 25e9),
    "L40S": GpuSheet({"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}, 0.86e12, None, 25e9, 25e9),
    "V100": GpuSheet({"fp16": 125e12, "fp32": 15.7e12}, 0.9e12, 150e9, 12e9, 12.5e9),
}
# the interconnect classes and what the datasheet fallback assumes of them
INTERCONNECTS = ("nvlink", "pcie", "infiniband", "ethernet")
# what a busy collective achieves of the wire's bandwidth (nccl-tests reach ~80 %)
WIRE_EFFICIENCY = 0.8
LATENCY_S = {"nvlink": 10e-6, "pcie": 15e-6, "infiniband": 20e-6, "ethernet": 60e-6}
# 100 GbE per node: the usual Ethernet cluster
ETHERNET_NODE_BYTES_PER_S = 12.5e9
# fraction of a GPU's peak its matrix products reach at hidden size h: 0.7·h/(h + 1024)
# (≈ 56 % at h = 4096, the MFU large-model trainings report), attention kernels at long sequences
DENSE_EFFICIENCY_SCALE = 0.7
ATTENTION_EFFICIENCY = {"flash": 0.5, "sdpa": 0.45, "eager": 0.1}
# AdamW (fused) reads parameter, gradient and two moments and writes three: 28 bytes a parameter
ADAM_BYTES_PER_PARAM = 28
# DeepSpeed's CPU Adam (AVX, a rank's share of the host's cores)
CPU_ADAM_S_PER_PARAM = 2e-9
# NCCL runs on its own stream: nearly all of an overlappable collective hides
GPU_OVERLAP = 0.9


def gpu_sheet_name(device: str) -> str | None:
    """The datasheet a GPU name matches ("NVIDIA H100 80GB HBM3" → "H100"), None if none."""
    for name in GPU_SHEETS:
        if re.search(rf"\b{name}\b", device, flags=re.IGNORECASE) or device.upper() == name:
            return name
    return None


def datasheet_profile(
    device: str, devices_per_node: int, nodes: int, interconnect: str | None = None
) -> Profile | None:
    """The datasheet profile of a known GPU (None for others), nodes joined by INTERCONNECT
    (default InfiniBand) and GPUs inside a node by NVLink (PCIe for the L40S)."""
    name = gpu_sheet_name(device)
    if name is None:
        return None
    sheet = GPU_SHEETS[name]
    between = interconnect or "infiniband"
    if between not in ("infiniband", "ethernet"):
        raise UserError(
            "--interconnect", f"{between!r} is not a class between nodes", "infiniband or ethernet"
        )
    intra = "nvlink" if sheet.nvlink_bytes_per_s else "pcie"
    inside = (sheet.nvlink_bytes_per_s or sheet.host_bytes_per_s) * WIRE_EFFICIENCY
    if between == "infiniband":
        # NCCL reduces inside the node over NVLink first: every GPU's NIC carries 1/n of it
        across = sheet.infiniband_bytes_per_s * devices_per_node * WIRE_EFFICIENCY
    else:
        across = ETHERNET_NODE_BYTES_PER_S * WIRE_EFFICIENCY
    across = min(across, inside)
    collectives = {
        "intra": {op: Link(LATENCY_S[intra], inside) for op in OPS},
        "inter": {op: Link(LATENCY_S[between], across) for op in OPS},
    }
    dense = tuple(
        DensePoint(dtype, hidden, 8192, peak * DENSE_EFFICIENCY_SCALE * hidden / (hidden + 1024))
        for dtype, peak in sheet.peak_flops.items()
        for hidden in (512, 1024, 2048, 4096, 8192, 16384)
    )
    attention = tuple(
        AttentionPoint(kernel, dtype, seq, peak * share * seq / (seq + 512))
        for kernel, share in ATTENTION_EFFICIENCY.items()
        for dtype, peak in sheet.peak_flops.items()
        for seq in (512, 2048, 8192, 32768)
    )
    return Profile(
        device=name,
        devices_per_node=devices_per_node,
        nodes=nodes,
        interconnect=between if nodes > 1 else intra,
        source=DATASHEET,
        peak_flops=dict(sheet.peak_flops),
        dense=dense,
        attention=attention,
        collectives=collectives,
        overlap=GPU_OVERLAP,
        optimizer_s_per_param=ADAM_BYTES_PER_PARAM / (0.7 * sheet.memory_bytes_per_s),
        cpu_adam_s_per_param=CPU_ADAM_S_PER_PARAM,
        host_device_bytes_per_s=sheet.host_bytes_per_s * WIRE_EFFICIENCY,
        intra=intra,
        notes=(
            f"{name} datasheet: {', '.join(f'{d} {p / 1e12:g} TFLOP/s' for d, p in sheet.peak_flops.items())}; "
            f"{intra} inside a node, {between} between nodes",
        ),
    )


# ---------------------------------------------------------------------------------------------
# a calibration's measurements


def profile_from_record(
    record: dict[str, Any], device: str, interconnect: str, measured_at: str = ""
) -> Profile:
    """The profile of what `dplaunch calibrate`'s ranks measured (train/calibrate_ranks.py's
    record). MFU's peak: a known GPU's datasheet figure, else the best dense rate measured. What
    was not measured (CPU Adam without its op) keeps the datasheet's figure, said in ``notes``."""
    dense = tuple(DensePoint(**point) for point in record["dense"])
    attention = tuple(AttentionPoint(**point) for point in record["attention"])
    collectives = {
        scope: {op: Link(link["latency_s"], link["bus_bytes_per_s"]) for op, link in ops.items()}
        for scope, ops in record["collectives"].items()
    }
    sheet = GPU_SHEETS.get(gpu_sheet_name(device) or "")
    measured_peak: dict[str, float] = {}
    for point in dense:
        measured_peak[point.dtype] = max(measured_peak.get(point.dtype, 0.0), point.flops_per_s)
    peak = dict(sheet.peak_flops) if sheet else measured_peak
    notes = [
        "MFU against the "
        + ("datasheet peak" if sheet else "best dense rate measured (no datasheet for this device)")
    ]
    cpu_adam = record.get("cpu_adam_s_per_param")
    if cpu_adam is None:
        cpu_adam = CPU_ADAM_S_PER_PARAM
        notes.append(
            f"CPU Adam not measured (its DeepSpeed op is not built): {cpu_adam:g} s a parameter "
            "assumed; calibrate again after a run with offload has built it"
        )
    if record.get("quick"):
        notes.append("--quick: few shapes and sizes, for a smoke test")
    return Profile(
        device=device,
        devices_per_node=int(record["per_node"]),
        nodes=int(record["nodes"]),
        interconnect=interconnect,
        source=CALIBRATED,
        peak_flops=peak,
        dense=dense,
        attention=attention,
        collectives=collectives,
        overlap=float(record["overlap"]),
        optimizer_s_per_param=float(record["optimizer_s_per_param"]),
        cpu_adam_s_per_param=float(cpu_adam),
        host_device_bytes_per_s=float(record["host_device_bytes_per_s"]),
        intra=interconnect if int(record["nodes"]) == 1 else "nvlink",
        measured_at=measured_at,
        notes=tuple(notes),
    )


def summary_lines(profile: Profile) -> list[str]:
    """What `dplaunch calibrate` prints of a profile: rates per dtype and kernel, links, the rest."""
    lines = []
    for dtype in sorted({p.dtype for p in profile.dense}):
        rates = [p for p in profile.dense if p.dtype == dtype]
        low, high = min(r.flops_per_s for r in rates), max(r.flops_per_s for r in rates)
        hidden = sorted({r.hidden for r in rates})
        lines.append(
            f"  dense {dtype}: {_flops(low)}–{_flops(high)} (hidden {hidden[0]}–{hidden[-1]})"
        )
    for kernel in sorted({p.kernel for p in profile.attention}):
        rates = [p for p in profile.attention if p.kernel == kernel]
        lengths = sorted({r.seq_len for r in rates})
        lines.append(
            f"  attention {kernel}: {_flops(min(r.flops_per_s for r in rates))}–"
            f"{_flops(max(r.flops_per_s for r in rates))} (sequence {lengths[0]}–{lengths[-1]})"
        )
    for scope, ops in profile.collectives.items():
        where = "inside a node" if scope == "intra" else "across nodes"
        lines.append(
            f"  {where}: "
            + ", ".join(
                f"{op} {link.latency_s * 1e6:.0f} µs + {link.bus_bytes_per_s / 1e9:.2f} GB/s"
                for op, link in ops.items()
            )
        )
    lines.append(
        f"  overlap {profile.overlap:.0%}; AdamW {profile.optimizer_s_per_param * 1e9:.2f} ns a "
        f"parameter; CPU Adam {profile.cpu_adam_s_per_param * 1e9:.2f} ns; host ↔ device "
        f"{profile.host_device_bytes_per_s / 1e9:.1f} GB/s"
    )
    return lines + [f"  note: {note}" for note in profile.notes]


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


# ---------------------------------------------------------------------------------------------
# profile files


def profile_dir() -> Path:
    """Where `dplaunch calibrate` keeps profiles: $XDG_CACHE_HOME/dplaunch/profiles (~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "dplaunch" / "profiles"


def profile_file_name(key: str) -> str:
    """The cache file of a hardware key (letters, digits and dashes)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", key).strip("-").lower() + ".json"


def read_profile(path: Path, field_name: str = "--profile") -> Profile:
    """A profile file; UserError naming FIELD_NAME when it is missing or not a profile."""
    try:
        data = json.loads(Path(path).read_text())
        return Profile.from_dict(data)
    except FileNotFoundError:
        raise UserError(
            field_name, f"{path} does not exist", "run `dplaunch calibrate` or give another file"
        ) from None
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise UserError(
            field_name,
            f"{path} is not a dplaunch profile ({type(error).__name__}: {error})",
            "give a file `dplaunch calibrate` wrote",
        ) from None


def profile_text(profile: Profile) -> str:
    """The profile file's text."""
    return json.dumps(profile.to_dict(), indent=1) + "\n"


def cached_profile(device: str, devices_per_node: int, nodes: int) -> Profile | None:
    """The calibrated profile of this hardware in the user's cache: the same device, devices per
    node and nodes first, else the same device on the most nodes measured; None when none."""
    folder = profile_dir()
    if not folder.is_dir():
        return None
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            profile = Profile.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            continue  # a broken cache file is not the run's problem
        if profile.device == device:
            found.append(profile)
    exact = [p for p in found if (p.devices_per_node, p.nodes) == (devices_per_node, nodes)]
    if exact:
        return exact[0]
    if found:
        best = max(found, key=lambda p: (p.nodes, p.devices_per_node))
        note = (
            f"calibrated on {best.devices_per_node} device(s) × {best.nodes} node(s), "
            f"planned for {devices_per_node} × {nodes}"
        )
        return replace(best, notes=(*best.notes, note))
    return None


def choose_profile(
    device: str | None,
    devices_per_node: int,
    nodes: int,
    *,
    path: Path | None = None,
    interconnect: str | None = None,
    field_name: str = "--profile",
) -> Profile | None:
    """The profile a forecast uses: --profile FILE, else the cache's for this hardware, else the
    datasheet of a known GPU; None when nothing is known (no forecast)."""
    if path is not None:
        return read_profile(path, field_name)
    if device is None:
        return None
    cached = cached_profile(device, devices_per_node, nodes)
    if cached is not None:
        return cached
    return datasheet_profile(device, devices_per_node, nodes, interconnect)


__all__ = [
    "CALIBRATED",
    "DATASHEET",
    "GPU_SHEETS",
    "INTERCONNECTS",
    "OPS",
    "AttentionPoint",
    "DensePoint",
    "Link",
    "Profile",
    "cached_profile",
    "choose_profile",
    "datasheet_profile",
    "hardware_key",
    "profile_dir",
    "profile_file_name",
    "profile_from_record",
    "profile_text",
    "read_profile",
    "summary_lines",
]
