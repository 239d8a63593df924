"""`dplaunch env`: what this machine offers for a distributed run, gathered in about a second.

Versions come from package metadata and torch's own version.py (read, not imported: importing
torch alone takes 1-2 s). torch is imported only to ask NCCL's version on a CUDA build whose
NCCL is not a pip wheel, and DeepSpeed's op builders (which import torch) only when
``probe_ops`` is on.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import logging
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dplaunch.launching.deepspeed_ops import missing_build_tools
from dplaunch.launching.devices import probe_gpus
from dplaunch.launching.ports import port_is_free

PACKAGES = ("torch", "accelerate", "deepspeed", "transformers", "datasets", "dplaunch")
DEFAULT_PORT = 29500
# the DeepSpeed ops a dplaunch plan can need: ZeRO-Offload's CPU Adam, GPU fused Adam, NVMe
# offload (async_io) and the CPU collectives DeepSpeed uses without GPUs
RELEVANT_OPS = ("cpu_adam", "fused_adam", "async_io", "deepspeed_shm_comm")
NCCL_WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl-cu11")
SLURM_FIELDS = {
    "job_id": ("SLURM_JOB_ID",),
    "job_name": ("SLURM_JOB_NAME",),
    "partition": ("SLURM_JOB_PARTITION",),
    "nodes": ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "nodelist": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "gpus_per_node": ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS"),
    "tasks_per_node": ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    "tasks": ("SLURM_NTASKS",),
    "cpus_per_task": ("SLURM_CPUS_PER_TASK",),
}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_build() -> dict[str, str | None]:
    """torch.version.cuda / .hip, read from torch/version.py without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return {"cuda": None, "hip": None}
    values: dict[str, str | None] = {"cuda": None, "hip": None}
    try:
        tree = ast.parse((Path(spec.origin).parent / "version.py").read_text())
    except (OSError, SyntaxError):
        import torch  # an unusual install: ask torch itself

        return {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id in values and isinstance(value, ast.Constant):
            values[target.id] = value.value
    return values


def _nccl_version(torch_cuda: str | None) -> str | None:
    """NCCL that torch uses: the pip wheel's version, else torch.cuda.nccl (imports torch)."""
    if torch_cuda is None:
        return None
    for wheel in NCCL_WHEELS:
        version = _version(wheel)
        if version:
            return version
    try:
        import torch

        version = torch.cuda.nccl.version()
        return (
            ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)
        )
    except Exception:  # no NCCL compiled in, or no driver: report it as absent
        return None


def _gpus() -> tuple[list[dict[str, Any]], str]:
    """GPUs from nvidia-smi (the planner's probe), and a word on how the query went."""
    probe = probe_gpus()
    gpus = [
        {
            "index": gpu.index,
            "name": gpu.name,
            "memory_mib": gpu.memory_mib,
            "compute_capability": gpu.compute_capability,
        }
        for gpu in probe.gpus
    ]
    return gpus, probe.status


def _slurm(env: Mapping[str, str]) -> dict[str, str | None] | None:
    """The allocation as SLURM's environment describes it; None outside a job."""
    if not env.get("SLURM_JOB_ID"):
        return None
    summary: dict[str, str | None] = {}
    for field, names in SLURM_FIELDS.items():
        summary[field] = next((env[name] for name in names if env.get(name)), None)
    return summary


def deepspeed_ops(names: tuple[str, ...] | None = RELEVANT_OPS) -> dict[str, Any]:
    """ds_report's op table (installed / compatible) for ``names`` (all ops when None).

    Imports torch and DeepSpeed's op builders (about 1-2 s); nothing is compiled except the
    small test programs some builders use to look for system libraries (async_io: libaio).
    """
    # what a JIT build would lack here (ninja, a C++ compiler, Python.h), as the launch checks it
    missing = [what for what, _fix in missing_build_tools()]
    report: dict[str, Any] = {"accelerator": None, "build_tools_missing": missing}
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # "Setting accelerator to CPU" is not news in a report
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        try:
            from deepspeed.ops.op_builder.builder import probe_is_compatible
        except ImportError:  # older DeepSpeed

            def probe_is_compatible(builder: Any, verbose: bool) -> bool:
                return builder.is_compatible(verbose)

        current = get_accelerator()._name
        report["accelerator"] = current
        ops = {}
        for name, builder in ALL_OPS.items():
            if names is not None and name not in names:
                continue
            try:
                compatible = bool(probe_is_compatible(builder, False))
            except Exception:  # a broken probe means "not usable"
                compatible = False
            installed = bool(installed_ops.get(name, False)) and accelerator_name == current
            ops[name] = {"installed": installed, "compatible": compatible}
        report["ops"] = ops
    except Exception as exc:  # DeepSpeed missing or broken: say so, do not crash
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        logging.disable(previous)
    return report


def collect_environment(
    env: Mapping[str, str] | None = None, *, probe_ops: bool = True, all_ops: bool = False
) -> dict[str, Any]:
    """Versions, GPUs, SLURM allocation, rendezvous port and DeepSpeed ops of this machine."""
    env = os.environ if env is None else env
    versions: dict[str, str | None] = {"python": platform.python_version()}
    versions.update({package: _version(package) for package in PACKAGES})
    build = _torch_build() if versions["torch"] else {"cuda": None, "hip": None}
    gpus, gpu_query = _gpus()
    master_port = env.get("MASTER_PORT")
    ports = {str(DEFAULT_PORT): port_is_free(DEFAULT_PORT)}
    if master_port and master_port.isdigit() and master_port != str(DEFAULT_PORT):
        ports[master_port] = port_is_free(int(master_port))
    ops = None
    if probe_ops and versions["deepspeed"]:
        ops = deepspeed_ops(None if all_ops else RELEVANT_OPS)
    return {
        "versions": versions,
        "platform": platform.platform(),
        "torch_cuda": build["cuda"],
        "torch_hip": build["hip"],
        "nccl": _nccl_version(build["cuda"]),
        "gpus": gpus,
        "gpu_query": gpu_query,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "slurm": _slurm(env),
        "ports_free": ports,
        "deepspeed_ops": ops,
    }


def format_environment(d: dict[str, Any]) -> str:
    """The report as aligned text lines."""

    def row(label: str, value: Any) -> str:
        return f"{label:<22}{value}"

    lines = [row("python", d["versions"]["python"]), row("platform", d["platform"])]
    for package in PACKAGES:
        lines.append(row(package, d["versions"].get(package) or "not installed"))
    if d["versions"].get("torch"):
        build = f"CUDA {d['torch_cuda']}" if d["torch_cuda"] else "CPU only"
        if d.get("torch_hip"):
            build = f"ROCm/HIP {d['torch_hip']}"
        lines.append(row("torch build", build))
        if d["torch_cuda"]:
            lines.append(row("NCCL", d["nccl"] or "not found"))
    if d["gpus"]:
        for gpu in d["gpus"]:
            memory = f"{gpu['memory_mib'] / 1024:.0f} GiB" if gpu["memory_mib"] else "?"
            capability = gpu["compute_capability"]
            compute = f", compute capability {capability:.1f}" if capability else ""
            lines.append(row(f"GPU {gpu['index']}", f"{gpu['name']}, {memory}{compute}"))
    else:
        lines.append(row("GPUs", f"none ({d['gpu_query']})"))
    visible = d["cuda_visible_devices"]
    lines.append(row("CUDA_VISIBLE_DEVICES", "unset" if visible is None else repr(visible)))
    if d["slurm"]:
        slurm = d["slurm"]
        lines.append(row("SLURM job", f"{slurm['job_id']} ({slurm.get('job_name') or 'unnamed'})"))
        for key in ("partition", "nodes", "nodelist", "gpus_per_node", "tasks_per_node", "tasks"):
            if slurm.get(key):
                lines.append(row(f"  {key.replace('_', ' ')}", slurm[key]))
    else:
        lines.append(row("SLURM", "not in a job (SLURM_JOB_ID unset)"))
    for port, free in d["ports_free"].items():
        lines.append(row(f"port {port}", "free on 127.0.0.1" if free else "IN USE on 127.0.0.1"))
    ops = d.get("deepspeed_ops")
    if ops:
        if "error" in ops:
            lines.append(row("DeepSpeed ops", f"cannot probe: {ops['error']}"))
        else:
            lines.append(
                row(
                    "DeepSpeed ops",
                    f"accelerator {ops['accelerator']}, JIT builds "
                    + (
                        f"IMPOSSIBLE (no {', '.join(ops['build_tools_missing'])})"
                        if ops["build_tools_missing"]
                        else "possible (ninja, C++ compiler, Python.h)"
                    ),
                )
            )
            for name, status in ops["ops"].items():
                installed = "prebuilt" if status["installed"] else "JIT on first use"
                compatible = "compatible" if status["compatible"] else "NOT compatible"
                lines.append(row(f"  {name}", f"{compatible}, {installed}"))
    return "\n".join(lines)
