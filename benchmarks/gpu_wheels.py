"""The wheels benchmarks/gpu.sh carries to the GPU machine, which cannot reach PyPI.

They are the dependency closure of what the benchmark and its smoke matrix import beyond the
image's PyTorch, Accelerate and transformers (DeepSpeed, datasets, pydantic, peft, bitsandbytes),
read from the package metadata of the environment that prepares them (installed with
constraints.txt, so the versions are the tested ones) for the device's CPython 3.12 on x86-64
Linux. A few large packages the image is known to hold are left to it (the device's pip decides
from the image what it still needs: see gpu.sh). Two wheels are slimmed (``slim``) so that the
carry fits a call's 64 MiB: bitsandbytes keeps the device's CUDA 13 libraries only (43 → 7 MB),
pyarrow leaves out Flight, S3, headers and tests (55 → 35 MB).

    python -m benchmarks.gpu_wheels pins         name==version per line, to `pip download`
    python -m benchmarks.gpu_wheels roots        the same for ROOTS, what the device's pip resolves
    python -m benchmarks.gpu_wheels slim WHEEL   rewrite a wheel without what the device never loads
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# what the benchmark and the smoke matrix (LoRA, QLoRA) import beyond the image's torch,
# accelerate and transformers
ROOTS = ("deepspeed", "datasets", "pydantic", "peft", "bitsandbytes")
# left to the image: torch (built for its CUDA), accelerate and transformers (with their
# tokenizers and safetensors), and packages of the image's package list at versions datasets
# accepts, so that the rest fits a call's 64 MiB beside pyarrow (54 MiB; datasets needs >= 24):
# numpy, pandas and pyyaml (any recent one), huggingface-hub (1.33 there; datasets wants >= 1.31,
# < 3) with its own dependencies
FROM_THE_IMAGE = (
    "torch",
    "accelerate",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "pandas",
    "pyyaml",
    "huggingface-hub",
)
# the device's CUDA (torch 2.11+cu130 there): bitsandbytes' libraries kept for it
DEVICE_CUDA = ("cuda130", "cuda132")
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


# what pyarrow ships that neither datasets nor dplaunch loads: Arrow Flight and the S3 filesystem
# (only pyarrow.flight and S3FileSystem link them: readelf's NEEDED of every library in the
# wheel), C++ headers, Cython sources, tests. Substrait stays: pyarrow.lib links it
PYARROW_UNUSED = re.compile(r"flight|_s3|/include/|/tests/|\.(pyx|pxd|pxi|h|hpp|cc)$|/src/")


def kept(package: str, name: str) -> bool:
    """Whether the device needs file NAME of PACKAGE's wheel (slim's rule)."""
    if package == "bitsandbytes":
        library = Path(name).name
        if not library.startswith("libbitsandbytes_") or "cpu" in library:
            return True
        return any(f"_{version}." in library for version in DEVICE_CUDA)
    if package == "pyarrow":
        return not PYARROW_UNUSED.search(name)
    return True


def slim(wheel: Path) -> int:
    """Rewrite a wheel without what the device never loads (``kept``): other CUDA versions'
    libraries of bitsandbytes, pyarrow's Flight and S3, headers and tests; its RECORD
    rewritten to match. Returns the bytes saved."""
    import zipfile

    package = wheel.name.split("-", 1)[0]
    before = wheel.stat().st_size
    slimmed = wheel.with_suffix(".slim")
    with (
        zipfile.ZipFile(wheel) as source,
        zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as out,
    ):
        for item in source.infolist():
            if not kept(package, item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                rows = data.decode().splitlines()
                data = "".join(
                    f"{row}\n" for row in rows if kept(package, row.split(",", 1)[0])
                ).encode()
            out.writestr(item, data)
    slimmed.replace(wheel)
    return before - wheel.stat().st_size


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "slim":
        saved = slim(Path(argv[1]))
        print(f"{argv[1]}: {saved / 2**20:.0f} MiB the device never loads left out")
        return 0
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
