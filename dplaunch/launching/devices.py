"""The GPUs this process may use: CUDA_VISIBLE_DEVICES and one nvidia-smi query, without torch.

`dplaunch env`, the planner (count, memory, compute capability) and the GPU claims all read
this one probe.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

NVIDIA_SMI_TIMEOUT_S = 5
# the name goes last: it may hold commas. compute_cap needs a 2021+ driver (asked again without it)
QUERY_FIELDS = ("index", "uuid", "memory.total", "compute_cap", "name")
# what `dplaunch doctor` asks besides (put before the name): uncorrected ECC errors since the
# driver loaded, memory other processes hold, SM clock now and its maximum, temperature
HEALTH_FIELDS = (
    "ecc.errors.uncorrected.volatile.total",
    "memory.used",
    "clocks.sm",
    "clocks.max.sm",
    "temperature.gpu",
)
# CUDA_VISIBLE_DEVICES values that hide every GPU
HIDDEN = ("", "-1", "none", "NoDevFiles")


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi lists it."""

    index: int
    uuid: str
    name: str
    memory_mib: int | None
    compute_capability: float | None  # 7.0 for a V100, 8.0 for an A100; None when not reported
    # the extra fields asked for (probe_gpus(extra=…)), as nvidia-smi printed them ("[N/A]" too)
    details: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class GpuProbe:
    """Every GPU of the machine (CUDA_VISIBLE_DEVICES not applied), and how the query went."""

    gpus: tuple[Gpu, ...]
    status: str  # "ok", or why there is no list


def probe_gpus(extra: tuple[str, ...] = ()) -> GpuProbe:
    """Ask nvidia-smi for the machine's GPUs (at most NVIDIA_SMI_TIMEOUT_S seconds); ``extra``:
    more --query-gpu fields, kept in each Gpu's details."""
    if shutil.which("nvidia-smi") is None:
        return GpuProbe((), "nvidia-smi not found")
    fields = (*QUERY_FIELDS[:-1], *extra, QUERY_FIELDS[-1])
    for _attempt in range(2):
        try:
            result = subprocess.run(
                ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=NVIDIA_SMI_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return GpuProbe((), f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S} s")
        except OSError as exc:
            return GpuProbe((), f"nvidia-smi failed: {exc}")
        if result.returncode == 0:
            return GpuProbe(tuple(_parse(result.stdout, fields)), "ok")
        message = (result.stderr or result.stdout).strip()
        if "compute_cap" not in message or "compute_cap" not in fields:
            break
        fields = tuple(name for name in fields if name != "compute_cap")  # an older driver
    first = message.splitlines()[0] if message else ""
    return GpuProbe((), f"nvidia-smi exit {result.returncode}: {first}".strip())


def _parse(text: str, fields: tuple[str, ...]) -> list[Gpu]:
    gpus = []
    for line in text.strip().splitlines():
        parts = [part.strip() for part in line.split(",", len(fields) - 1)]
        if len(parts) != len(fields) or not parts[0].isdigit():
            continue
        row = dict(zip(fields, parts, strict=True))
        memory = row["memory.total"].split()[0]  # "81559" (nounits), or "81559 MiB"
        gpus.append(
            Gpu(
                index=int(row["index"]),
                uuid=row["uuid"],
                name=row["name"],
                memory_mib=int(memory) if memory.isdigit() else None,
                compute_capability=_number(row.get("compute_cap", "")),
                details=tuple((name, row[name]) for name in fields if name not in QUERY_FIELDS),
            )
        )
    return gpus


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]"
        return None


def visible_ids(env: Mapping[str, str] | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (indices or UUIDs); None when unset, [] when it hides all."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    if visible.strip() in HIDDEN:
        return []
    return [item.strip() for item in visible.split(",") if item.strip()]


def visible_gpus(env: Mapping[str, str] | None = None, probe: GpuProbe | None = None) -> list[Gpu]:
    """The probed GPUs CUDA_VISIBLE_DEVICES lets this process use, in its order."""
    ids = visible_ids(env)
    gpus = (probe or probe_gpus()).gpus
    if ids is None:
        return list(gpus)
    return [gpu for wanted in ids for gpu in gpus if _names(gpu, wanted)]


def visible_keys(gpus: list[Gpu], env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """Each GPU this process may use as (its name for CUDA_VISIBLE_DEVICES, a machine-wide key).

    The key is the GPU's UUID where nvidia-smi gave one: indices change with CUDA_VISIBLE_DEVICES."""
    ids = visible_ids(env)
    if ids is None:
        return [(str(gpu.index), gpu.uuid or str(gpu.index)) for gpu in gpus]
    return [
        (wanted, next((gpu.uuid for gpu in gpus if _names(gpu, wanted) and gpu.uuid), wanted))
        for wanted in ids
    ]


def _names(gpu: Gpu, wanted: str) -> bool:
    # CUDA takes an index, a full UUID or a unique prefix of one ("GPU-8932f937")
    return wanted == str(gpu.index) or (wanted.startswith("GPU-") and gpu.uuid.startswith(wanted))


def visible_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """GPUs visible to this process: CUDA_VISIBLE_DEVICES when set, else what nvidia-smi lists."""
    ids = visible_ids(env)
    return len(ids) if ids is not None else len(probe_gpus().gpus)


def local_gpus(env: Mapping[str, str] | None = None) -> tuple[int, list[Gpu]]:
    """How many GPUs this process may use, and those nvidia-smi describes (one query).

    The count trusts CUDA_VISIBLE_DEVICES where it is set (nvidia-smi may be missing, or list
    GPUs by indices the container renumbered)."""
    ids = visible_ids(env)
    probe = probe_gpus()
    gpus = visible_gpus(env, probe)
    return (len(ids) if ids is not None else len(probe.gpus)), gpus


def smallest_gpu_memory_gb(gpus: list[Gpu] | None = None) -> float | None:
    """GiB of the smallest of ``gpus`` (default: those this process may use); None when unknown."""
    sizes = [gpu.memory_mib for gpu in (visible_gpus() if gpus is None else gpus) if gpu.memory_mib]
    return min(sizes) / 1024 if sizes else None


def oldest_compute_capability(gpus: list[Gpu]) -> tuple[float, str] | None:
    """The lowest compute capability among ``gpus`` and that GPU's name; None when unknown."""
    known = [(gpu.compute_capability, gpu.name) for gpu in gpus if gpu.compute_capability]
    return min(known) if known else None


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


def cpu_device_name(cpuinfo: str | None = None) -> str:
    """The name "CPU <model>" of this machine (/proc/cpuinfo's model name): the device of CPU ranks, as
    `dplaunch calibrate` and `dplaunch plan` name it."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as handle:
                cpuinfo = handle.read()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name") and ":" in line:
            return "CPU " + " ".join(line.split(":", 1)[1].split())
    import platform

    return "CPU " + (platform.processor() or platform.machine() or "unknown")


def interconnect_seen(nodes: int, gpus: list[Gpu], sys_root: str = "/sys") -> str:
    """The link a calibration runs over: between nodes InfiniBand when a port is active (else
    Ethernet); inside one node NVLink when nvidia-smi's topology shows NV links, else PCIe, and
    shared memory between CPU ranks."""
    if nodes > 1:
        ports = os.path.join(sys_root, "class", "infiniband")
        try:
            for device in os.listdir(ports):
                for port in os.listdir(os.path.join(ports, device, "ports")):
                    with open(os.path.join(ports, device, "ports", port, "state")) as handle:
                        if "ACTIVE" in handle.read():
                            return "infiniband"
        except OSError:
            pass
        return "ethernet"
    if not gpus:
        return "shared memory"
    if shutil.which("nvidia-smi") is None:
        return "pcie"
    try:
        topology = subprocess.run(
            ["nvidia-smi", "topo", "-m"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "pcie"
    return (
        "nvlink"
        if any(word.startswith("NV") and word[2:].isdigit() for word in topology.split())
        else "pcie"
    )
