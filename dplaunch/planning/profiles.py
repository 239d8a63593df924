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
either, known GPUs (H100, H200, A100, L40S, V100 and their PCIe and NVL cards) and interconnect
classes (NVLink, PCIe, InfiniBand, Ethernet) get datasheet figures: ``source`` is then
"datasheet, not calibrated". A profile used for more GPUs or nodes than it was measured on gets
the links it lacks (no collectives on one GPU, none across nodes on one node) from the datasheet,
or for a device without one from its interconnect's class, and a note that says so.

Pure Python: no torch. Reading and writing a profile file are the only side effects.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
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
    # engine family → the seconds per unit of its overheads (planning/forecast.py Overheads),
    # fitted to calibrate's short real steps; {}: none measured (an older profile, a
    # datasheet's): the forecast takes its defaults and says so
    overheads: dict[str, dict[str, float]] = field(default_factory=dict)

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
    def from_dict(cls, data: Any) -> Profile:
        """Inverse of to_dict; ProfileFormatError says in words what a file lacks. Keys it does
        not know are left out (a newer dplaunch's), keys it lacks that have a default take it
        (an older one's)."""
        known = _fields_of(cls, data, "it")
        known["dense"] = tuple(
            DensePoint(**_fields_of(DensePoint, p, "a dense point")) for p in known.get("dense", ())
        )
        known["attention"] = tuple(
            AttentionPoint(**_fields_of(AttentionPoint, p, "an attention point"))
            for p in known.get("attention", ())
        )
        collectives = known.get("collectives", {})
        if not isinstance(collectives, dict) or not all(
            isinstance(ops, dict) for ops in collectives.values()
        ):
            raise ProfileFormatError("its collectives are not a table of scopes and ops")
        known["collectives"] = {
            scope: {
                op: Link(**_fields_of(Link, link, f"its {op} link")) for op, link in ops.items()
            }
            for scope, ops in collectives.items()
        }
        known["notes"] = tuple(known.get("notes", ()))
        return cls(**known)


class ProfileFormatError(ValueError):
    """A profile file that is JSON but not a profile: what it lacks, in words."""


def _fields_of(cls: Any, data: Any, what: str) -> dict[str, Any]:
    """DATA's values of CLS's fields; ProfileFormatError naming those without a default it lacks."""
    if not isinstance(data, dict):
        raise ProfileFormatError(f"{what} is not a JSON object")
    names = {f.name for f in fields(cls)}
    required = [
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    ]
    missing = [name for name in required if name not in data]
    if missing:
        raise ProfileFormatError(f"{what} lacks {', '.join(missing)}")
    return {key: value for key, value in data.items() if key in names}


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
    NVLink and host (PCIe) bandwidth per direction, its memory."""

    peak_flops: dict[str, float]
    memory_bytes_per_s: float
    nvlink_bytes_per_s: float | None
    host_bytes_per_s: float
    # NIC bandwidth per GPU in the usual InfiniBand build of its generation (NDR, HDR, EDR)
    infiniband_bytes_per_s: float
    # GiB of one card (the largest of that name: a name that says "40GB" says otherwise)
    memory_gb: float
    # the GPUs one NVLink joins: 0 every GPU of the node (SXM boards, NVSwitch); PCIe and NVL
    # cards only through bridges, in pairs (or fours), where bridges are fitted
    nvlink_span: int = 0


_HOPPER = {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}
_HOPPER_NVL = {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}
_AMPERE = {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}
GPU_SHEETS = {
    # SXM boards; fp32 without TF32: torch leaves allow_tf32 off for matrix products. PCIe and
    # NVL cards: lower clocks (HBM2e on the H100 PCIe), NVLink through bridges only
    "H100": GpuSheet(_HOPPER, 3.35e12, 450e9, 55e9, 50e9, 80),
    "H100 PCIe": GpuSheet(
        {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}, 2.0e12, 300e9, 55e9, 50e9, 80, 2
    ),
    "H100 NVL": GpuSheet(_HOPPER_NVL, 3.9e12, 300e9, 55e9, 50e9, 94, 2),
    "H200": GpuSheet(_HOPPER, 4.8e12, 450e9, 55e9, 50e9, 141),
    "H200 NVL": GpuSheet(_HOPPER_NVL, 4.8e12, 450e9, 55e9, 50e9, 141, 4),
    "A100": GpuSheet(_AMPERE, 2.0e12, 300e9, 25e9, 25e9, 80),
    "A100 PCIe": GpuSheet(_AMPERE, 1.935e12, 300e9, 25e9, 25e9, 80, 2),
    "L40S": GpuSheet(
        {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}, 0.86e12, None, 25e9, 25e9, 48
    ),
    "V100": GpuSheet({"fp16": 125e12, "fp32": 15.7e12}, 0.9e12, 150e9, 12e9, 12.5e9, 32),
    "V100 PCIe": GpuSheet({"fp16": 112e12, "fp32": 14e12}, 0.9e12, None, 12e9, 12.5e9, 32),
}
# the interconnect classes and what the datasheet fallback assumes of them; "shared memory" is
# what CPU ranks of one host talk over (gloo: TCP over loopback)
INTERCONNECTS = ("nvlink", "pcie", "infiniband", "ethernet")
BETWEEN_NODES = ("infiniband", "ethernet")
INSIDE_A_NODE = ("nvlink", "pcie")
# what a busy collective achieves of the wire's bandwidth (nccl-tests reach ~80 %)
WIRE_EFFICIENCY = 0.8
LATENCY_S = {
    "nvlink": 10e-6,
    "pcie": 15e-6,
    "infiniband": 20e-6,
    "ethernet": 60e-6,
    "shared memory": 200e-6,
}
# a link of a class for a device without a datasheet (CPU ranks, an unknown GPU), bytes/s per
# direction: NVLink 3 and PCIe 4 (A100's), HDR InfiniBand per GPU, 100 GbE per node (the usual
# Ethernet cluster), and gloo between CPU ranks: × WIRE_EFFICIENCY, the all-reduce that
# `dplaunch calibrate --cpu --gpus 2` measured on a 2-core Xeon (0.28 GB/s bus bandwidth at
# 4 MiB, 120-250 µs at 4 KiB; 2026-12-07)
CLASS_BYTES_PER_S = {
    "nvlink": 300e9,
    "pcie": 25e9,
    "infiniband": 25e9,
    "ethernet": 12.5e9,
    "shared memory": 0.35e9,
}
ETHERNET_NODE_BYTES_PER_S = CLASS_BYTES_PER_S["ethernet"]
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
    """The datasheet a GPU name matches ("NVIDIA H100 80GB HBM3" → "H100", "NVIDIA H100 PCIe"
    → "H100 PCIe", "Tesla V100-PCIE-16GB" → "V100 PCIe"), None if none."""
    words = re.split(r"[\s_-]+", device.upper())
    # a card's own sheet (two words: "H100 NVL") before its family's
    for name in sorted(GPU_SHEETS, key=lambda name: -len(name.split())):
        if all(word in words for word in name.upper().split()):
            return name
    return None


def gpu_memory_gb(device: str) -> float | None:
    """GiB of one GPU by its name: what the name states ("A100-SXM4-40GB" → 40), else its
    datasheet's largest card; None for a GPU without a datasheet."""
    name = gpu_sheet_name(device)
    if name is None:
        return None
    stated = re.search(r"(\d+)\s*GB\b", device, flags=re.IGNORECASE)
    return float(stated.group(1)) if stated else GPU_SHEETS[name].memory_gb


@dataclass(frozen=True)
class LinkFigures:
    """The datasheet's (or a class's) links inside a node and across nodes, in words."""

    intra: str
    between: str
    collectives: dict[str, dict[str, Link]]
    # scope → where the figures come from ("the H100 datasheet's NVLink")
    sources: dict[str, str]
    notes: tuple[str, ...] = ()


def link_figures(
    device: str,
    devices_per_node: int,
    interconnect: str | None = None,
    intra: str | None = None,
    intra_seen: str | None = None,
) -> LinkFigures:
    """The links a GPU's datasheet gives (a device without one: its classes' figures): inside a
    node INTRA (default: NVLink on SXM boards, PCIe for PCIe and NVL cards, else INTRA_SEEN),
    between nodes INTERCONNECT (default InfiniBand; Ethernet between CPU hosts)."""
    if interconnect is not None and interconnect not in BETWEEN_NODES:
        raise UserError(
            "--interconnect",
            f"{interconnect!r} is not a class between nodes",
            "infiniband or ethernet",
        )
    name = gpu_sheet_name(device)
    cpu = device.upper().startswith("CPU")
    between = interconnect or ("ethernet" if cpu else "infiniband")
    notes: list[str] = []
    if name is not None:
        sheet = GPU_SHEETS[name]
        kind, inside = _sheet_inside(name, sheet, devices_per_node, intra, notes)
        nic = sheet.infiniband_bytes_per_s
        where = f"the {name} datasheet's"
    else:
        kind = "shared memory" if cpu else intra or intra_seen or "pcie"
        inside = CLASS_BYTES_PER_S.get(kind, CLASS_BYTES_PER_S["pcie"])
        nic = CLASS_BYTES_PER_S["infiniband"]
        where = "the class figures of"
    inside *= WIRE_EFFICIENCY
    if between == "infiniband":
        # NCCL reduces inside the node first: every GPU's NIC carries 1/n of it
        across = nic * devices_per_node * WIRE_EFFICIENCY
    else:
        across = ETHERNET_NODE_BYTES_PER_S * WIRE_EFFICIENCY
    across = min(across, inside)
    latency = LATENCY_S.get(kind, LATENCY_S["pcie"])
    return LinkFigures(
        intra=kind,
        between=between,
        collectives={
            "intra": {op: Link(latency, inside) for op in OPS},
            "inter": {op: Link(LATENCY_S[between], across) for op in OPS},
        },
        sources={"intra": f"{where} {kind}", "inter": f"{where} {between}"},
        notes=tuple(notes),
    )


def _sheet_inside(
    name: str, sheet: GpuSheet, devices_per_node: int, stated: str | None, notes: list[str]
) -> tuple[str, float]:
    """(class, bytes/s) of the link between a node's GPUs of sheet NAME, STATED or its default."""
    if stated is not None and stated not in INSIDE_A_NODE:
        raise UserError("--intra-node", f"{stated!r} is not a link inside a node", "nvlink or pcie")
    if sheet.nvlink_bytes_per_s is None:
        if stated == "nvlink":
            raise UserError("--intra-node", f"the {name} has no NVLink", "pcie, or leave it out")
        return "pcie", sheet.host_bytes_per_s
    if not sheet.nvlink_span:  # an SXM board: NVLink (NVSwitch) joins every GPU
        if stated == "pcie":
            raise UserError(
                "--intra-node", f"the {name}'s GPUs are joined by NVLink", "nvlink, or leave it out"
            )
        return "nvlink", sheet.nvlink_bytes_per_s
    span = sheet.nvlink_span
    if stated is None:
        notes.append(
            f"{name}: PCIe assumed between its GPUs (NVLink bridges, where fitted, join "
            f"{span}: --intra-node nvlink)"
        )
        return "pcie", sheet.host_bytes_per_s
    if stated == "nvlink" and devices_per_node > span:
        notes.append(
            f"{name}: NVLink bridges join {span} GPUs, so a collective over {devices_per_node} "
            "runs at PCIe speed"
        )
        return "pcie", sheet.host_bytes_per_s
    return stated, sheet.nvlink_bytes_per_s if stated == "nvlink" else sheet.host_bytes_per_s


def datasheet_profile(
    device: str,
    devices_per_node: int,
    nodes: int,
    interconnect: str | None = None,
    intra: str | None = None,
) -> Profile | None:
    """The datasheet profile of a known GPU (None for others), nodes joined by INTERCONNECT
    (default InfiniBand) and GPUs inside a node by INTRA (default: the card's, link_figures)."""
    name = gpu_sheet_name(device)
    if name is None:
        return None
    sheet = GPU_SHEETS[name]
    links = link_figures(name, devices_per_node, interconnect, intra)
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
    peaks = ", ".join(f"{d} {p / 1e12:g} TFLOP/s" for d, p in sheet.peak_flops.items())
    return Profile(
        device=name,
        devices_per_node=devices_per_node,
        nodes=nodes,
        interconnect=links.between if nodes > 1 else links.intra,
        source=DATASHEET,
        peak_flops=dict(sheet.peak_flops),
        dense=dense,
        attention=attention,
        collectives=links.collectives,
        overlap=GPU_OVERLAP,
        optimizer_s_per_param=ADAM_BYTES_PER_PARAM / (0.7 * sheet.memory_bytes_per_s),
        cpu_adam_s_per_param=CPU_ADAM_S_PER_PARAM,
        host_device_bytes_per_s=sheet.host_bytes_per_s * WIRE_EFFICIENCY,
        intra=links.intra,
        notes=(
            f"{name} datasheet: {peaks}; {links.intra} inside a node, {links.between} between nodes",
            *links.notes,
        ),
    )


def with_needed_links(
    profile: Profile,
    devices_per_node: int,
    nodes: int,
    interconnect: str | None = None,
    intra: str | None = None,
) -> Profile:
    """PROFILE with the links a plan of DEVICES_PER_NODE × NODES needs and it has no timing of
    (calibrated on one GPU: none inside a node; on one node: none across nodes) taken from its
    device's datasheet, else its interconnect's class (link_figures); a note says so. Across
    nodes is no faster than the profile measured inside one."""
    needed = [
        scope
        for scope, used in (("intra", devices_per_node > 1), ("inter", nodes > 1))
        if used and not profile.collectives.get(scope)
    ]
    if not needed:
        return profile
    figures = link_figures(profile.device, devices_per_node, interconnect, intra, profile.intra)
    collectives = dict(profile.collectives)
    notes = list(profile.notes)
    measured = f"{profile.devices_per_node} device(s) × {profile.nodes} node(s)"
    for scope in needed:
        table = figures.collectives[scope]
        if scope == "inter" and profile.collectives.get("intra"):
            table = {op: _no_faster(link, profile.link(op, "intra")) for op, link in table.items()}
        collectives[scope] = table
        sample = table["all_reduce"]
        where = "inside a node" if scope == "intra" else "across nodes"
        notes.append(
            f"no collectives measured {where} (calibrated on {measured}): "
            f"{figures.sources[scope]} figures assumed ({sample.latency_s * 1e6:.0f} µs + "
            f"{sample.bus_bytes_per_s / 1e9:.3g} GB/s); calibrate on this layout for its own"
        )
    if "intra" in needed:
        notes += [note for note in figures.notes if note not in notes]
    return replace(profile, collectives=collectives, notes=tuple(notes))


def _no_faster(link: Link, inside: Link) -> Link:
    return Link(
        max(link.latency_s, inside.latency_s), min(link.bus_bytes_per_s, inside.bus_bytes_per_s)
    )


# ---------------------------------------------------------------------------------------------
# a calibration's measurements


def profile_from_record(
    record: dict[str, Any],
    device: str,
    interconnect: str,
    measured_at: str = "",
    intra: str | None = None,
) -> Profile:
    """The profile of what `dplaunch calibrate`'s ranks measured (train/calibrate_ranks.py's
    record) over INTERCONNECT (between nodes, or inside the one node; INTRA inside a node). MFU's
    peak: a known GPU's datasheet figure, else the best dense rate measured. What was not measured
    (CPU Adam without its op, what the time budget or the device left out) is said in
    ``notes``; CPU Adam then keeps the datasheet's figure."""
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
            "assumed; `dplaunch calibrate` without --quick builds it once"
        )
    if not collectives:
        notes.append(
            "one rank: no collectives measured; a plan for more takes its links from the "
            "datasheet (or its interconnect's class) and says so"
        )
    overlap = record.get("overlap")
    if overlap is None:  # one rank: no collective to hide
        overlap = 0.0 if device.upper().startswith("CPU") else GPU_OVERLAP
        notes.append(f"overlap not measured (one rank): {overlap:.0%} assumed")
    notes += [f"not measured: {what}" for what in record.get("skipped", ())]
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
        overlap=float(overlap),
        optimizer_s_per_param=float(record["optimizer_s_per_param"]),
        cpu_adam_s_per_param=float(cpu_adam),
        host_device_bytes_per_s=float(record["host_device_bytes_per_s"]),
        intra=intra or (interconnect if int(record["nodes"]) == 1 else "nvlink"),
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
    for family, terms in profile.overheads.items():
        lines.append(
            f"  {family} overheads: "
            + ", ".join(f"{name} {_seconds(value)}" for name, value in terms.items())
        )
    return lines + [f"  note: {note}" for note in profile.notes]


def _seconds(value: float) -> str:
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    if value >= 1e-6:
        return f"{value * 1e6:.3g} µs"
    return f"{value * 1e9:.3g} ns"


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


# ---------------------------------------------------------------------------------------------
# profile files


def cache_dir() -> Path:
    """dplaunch's folder in the user's cache: $XDG_CACHE_HOME/dplaunch (~/.cache/dplaunch)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "dplaunch"


def profile_dir() -> Path:
    """Where `dplaunch calibrate` keeps profiles: $XDG_CACHE_HOME/dplaunch/profiles (~/.cache)."""
    return cache_dir() / "profiles"


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
    except IsADirectoryError:
        raise UserError(field_name, f"{path} is a directory", "give a profile file") from None
    except json.JSONDecodeError as error:
        why = f"not JSON (line {error.lineno}, column {error.colno}: {error.msg})"
        raise UserError(
            field_name, f"{path} is {why}", "give a file `dplaunch calibrate` wrote"
        ) from None
    except (ProfileFormatError, OSError, UnicodeDecodeError) as error:
        raise UserError(
            field_name,
            f"{path} is not a dplaunch profile: {error}",
            "give a file `dplaunch calibrate` wrote",
        ) from None
    except (ValueError, TypeError) as error:  # a field of the wrong kind
        raise UserError(
            field_name,
            f"{path} is not a dplaunch profile: a value of the wrong kind ({error})",
            "give a file `dplaunch calibrate` wrote",
        ) from None


def profile_text(profile: Profile) -> str:
    """The profile file's text."""
    return json.dumps(profile.to_dict(), indent=1) + "\n"


def _cached_profiles() -> list[Profile]:
    """Every readable profile in the user's cache."""
    folder = profile_dir()
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            found.append(Profile.from_dict(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError, KeyError):
            continue  # a broken cache file is not the run's problem
    return found


def cached_profile(device: str, devices_per_node: int, nodes: int) -> Profile | None:
    """The calibrated profile of this hardware in the user's cache: the same device, devices per
    node and nodes first, else the same device on the most nodes measured; None when none."""
    found = [profile for profile in _cached_profiles() if profile.device == device]
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
    intra: str | None = None,
    field_name: str = "--profile",
) -> Profile | None:
    """The profile a forecast uses: --profile FILE, else the cache's for this hardware, else the
    datasheet of a known GPU; None when nothing is known (no forecast). The links it was not
    measured on come from the datasheet (with_needed_links)."""
    if path is not None:
        profile: Profile | None = read_profile(path, field_name)
    elif device is None:
        return None
    else:
        profile = cached_profile(device, devices_per_node, nodes) or datasheet_profile(
            device, devices_per_node, nodes, interconnect, intra
        )
    if profile is None:
        return None
    return with_needed_links(profile, devices_per_node, nodes, interconnect, intra)


def known_device(device: str) -> bool:
    """Whether a forecast knows DEVICE: a GPU with a datasheet, or one calibrated here."""
    if gpu_sheet_name(device) is not None:
        return True
    return any(profile.device == device for profile in _cached_profiles())


__all__ = [
    "CALIBRATED",
    "DATASHEET",
    "GPU_SHEETS",
    "INSIDE_A_NODE",
    "INTERCONNECTS",
    "OPS",
    "AttentionPoint",
    "DensePoint",
    "Link",
    "Profile",
    "cache_dir",
    "cached_profile",
    "choose_profile",
    "datasheet_profile",
    "gpu_memory_gb",
    "gpu_sheet_name",
    "hardware_key",
    "known_device",
    "link_figures",
    "profile_dir",
    "profile_file_name",
    "profile_from_record",
    "profile_text",
    "read_profile",
    "summary_lines",
    "with_needed_links",
]
