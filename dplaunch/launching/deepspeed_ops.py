"""DeepSpeed's C++ ops a plan needs: where the ranks JIT-build them, and whether they can.

DeepSpeed builds an op the first time a rank needs it (ninja, a C++ compiler, Python's headers),
with `-march=native`: a build is only good for the CPU type that made it. Without the tools every
rank fails minutes into the launch; dplaunch says so before. Nothing here imports torch.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from dplaunch.errors import UserError
from dplaunch.planning.plan import Plan

# the variable that makes `pip install deepspeed` compile an op ahead of time
BUILD_VARIABLES = {"cpu_adam": "DS_BUILD_CPU_ADAM", "deepspeed_shm_comm": "DS_BUILD_SHM_COMM"}


def loads_deepspeed(plan: Plan) -> bool:
    """Whether the ranks of ``plan`` run DeepSpeed's code: its engine, or Ulysses' collectives."""
    return plan.uses_deepspeed or plan.sequence_parallel_size > 1


def needed_ops(plan: Plan) -> dict[str, str]:
    """The ops the ranks of ``plan`` build, each with the plan setting that needs it."""
    ops = {}
    if plan.offload != "none":
        ops["cpu_adam"] = "parallel.offload"  # ZeRO-Offload's optimizer: DeepSpeedCPUAdam
    if plan.target == "cpu" and loads_deepspeed(plan):
        # DeepSpeed's collectives between CPU ranks (deepspeed.comm, also under Ulysses' sp)
        field = "parallel" if plan.uses_deepspeed else "parallel.sp"
        ops["deepspeed_shm_comm"] = field
    return ops


def cpu_architecture_key(machine: str | None = None, flags: str | None = None) -> str:
    """The CPU type a `-march=native` build is good for: machine and a digest of its CPU flags."""
    machine = machine or platform.machine() or "unknown"
    flags = _cpu_flags() if flags is None else flags
    return f"{machine}-{hashlib.sha1(' '.join(sorted(flags.split())).encode()).hexdigest()[:8]}"


def _cpu_flags() -> str:
    # x86 lists "flags", ARM "Features"; the first processor speaks for the node
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return value
    except OSError:
        pass
    return platform.processor()


def torch_extensions_dir(architecture: str | None = None) -> Path:
    """Where the ranks' DeepSpeed JIT-builds its ops: one folder per Python environment and CPU type.

    DeepSpeed's default is one shared folder: two installs (venvs) then rebuild each other's
    ops, a build killed halfway leaves a lock every later run waits on forever, and on a $HOME
    shared by nodes of several CPU types one node's `-march=native` build crashes another's
    ranks with an illegal instruction."""
    environment = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    architecture = architecture or cpu_architecture_key()
    return (
        Path.home() / ".cache" / "dplaunch" / "torch_extensions" / f"{environment}-{architecture}"
    )


def prebuilt_ops(accelerator: str) -> set[str]:
    """Ops the installed DeepSpeed ships compiled for ``accelerator`` ("cuda", "cpu").

    Read from deepspeed/git_version_info_installed.py without importing DeepSpeed (and torch)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return set()
    path = Path(spec.submodule_search_locations[0]) / "git_version_info_installed.py"
    values: dict[str, object] = {}
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):  # a source checkout: everything is JIT-built
        return set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    installed = values.get("installed_ops")
    if values.get("accelerator_name") != accelerator or not isinstance(installed, dict):
        return set()
    return {name for name, built in installed.items() if built}


def missing_build_tools(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """What a JIT build would miss here, each with its fix: [(what, how to get it)]."""
    environ = os.environ if environ is None else environ
    path = environ.get("PATH", "")
    compiler = environ.get("CXX") or "c++"  # what torch's cpp_extension calls
    missing = []
    if shutil.which("ninja", path=path) is None:
        missing.append(("ninja", "pip install ninja"))
    if shutil.which(compiler, path=path) is None:
        missing.append((f"a C++ compiler ({compiler})", "apt install g++, or module load gcc"))
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        missing.append(("Python's headers (Python.h)", "apt install python3-dev"))
    return missing


def check_ops_can_be_built(plan: Plan, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a plan whose ops are neither prebuilt, nor built already, nor buildable here."""
    environ = os.environ if environ is None else environ
    ops = needed_ops(plan)
    if not ops:
        return
    folder = Path(environ.get("TORCH_EXTENSIONS_DIR") or torch_extensions_dir())
    prebuilt = prebuilt_ops("cuda" if plan.target == "gpu" else "cpu")
    to_build = [
        name
        for name in ops
        if name not in prebuilt and not (folder / name / f"{name}.so").is_file()
    ]
    missing = missing_build_tools(environ) if to_build else []
    if not missing:
        return
    name = to_build[0]
    raise UserError(
        ops[name],
        f"this plan needs DeepSpeed's {name} op, which is not prebuilt nor built in {folder}, "
        f"and this machine lacks what building it takes: {', '.join(what for what, _ in missing)}",
        f"{'; '.join(fix for _, fix in missing)} (or install DeepSpeed with the op prebuilt: "
        f"{BUILD_VARIABLES[name]}=1 pip install deepspeed)",
    )
