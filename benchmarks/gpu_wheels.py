"""The wheels benchmarks/gpu.sh carries to the GPU machine, which cannot reach PyPI.

They are the dependency closure of what the benchmark imports beyond the image's PyTorch
(DeepSpeed, datasets, pydantic), read from the package metadata of the environment that prepares
them (installed with constraints.txt, so the versions are the tested ones) for the device's
CPython 3.12 on x86-64 Linux. A few large packages the image is known to hold are left to it
(the device's pip decides from the image what it still needs: see gpu.sh).

    python -m benchmarks.gpu_wheels pins     name==version per line, to `pip download`
    python -m benchmarks.gpu_wheels roots    the same for ROOTS, what the device's pip resolves
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# what the benchmark imports beyond the image's torch, accelerate and transformers
ROOTS = ("deepspeed", "datasets", "pydantic")
# left to the image: torch (built for its CUDA), and packages of the image's package list
# (/work/.library/device/KINDS.md) at versions datasets accepts, so that the rest fits a call's
# 64 MiB beside pyarrow (54 MiB; datasets needs >= 24): numpy, pandas and pyyaml (any recent one),
# huggingface-hub (1.33 there; datasets wants >= 1.31, < 3) with its own dependencies
FROM_THE_IMAGE = ("torch", "numpy", "pandas", "pyyaml", "huggingface-hub")
# DeepSpeed has only an sdist: gpu.sh builds its (pure Python) wheel here
BUILT_HERE = ("deepspeed",)
# the device's interpreter, for requirement markers
DEVICE_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


def dependency_closure(roots: tuple[str, ...], stop: tuple[str, ...] = ()) -> dict[str, str]:
    """Every distribution ``roots`` need on the device, with the version installed here.

    Requirements of ``stop`` packages are not followed (the image brings them, with their own)."""
    stopped = {canonicalize_name(name) for name in stop}
    versions: dict[str, str] = {}
    pending = list(roots)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in versions:
            continue
        distribution = importlib.metadata.distribution(name)
        versions[name] = distribution.version
        if name in stopped:
            continue
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(DEVICE_MARKERS):
                pending.append(requirement.name)
    return versions


def carried_pins() -> dict[str, str]:
    """The wheels to download for the device: the closure less the image's and those built here."""
    left_out = {canonicalize_name(name) for name in (*FROM_THE_IMAGE, *BUILT_HERE)}
    closure = dependency_closure(ROOTS, stop=FROM_THE_IMAGE)
    return {name: version for name, version in sorted(closure.items()) if name not in left_out}


def main(argv: list[str]) -> int:
    if argv == ["pins"]:
        pins = carried_pins()
    elif argv == ["roots"]:
        pins = {name: importlib.metadata.version(name) for name in ROOTS}
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for name, version in pins.items():
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
