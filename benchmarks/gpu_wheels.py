"""The wheels benchmarks/gpu.sh carries to the GPU machine, which cannot reach PyPI.

They are the dependency closure of what the benchmark and its smoke matrix import beyond the
image's PyTorch and Accelerate (DeepSpeed, datasets, pydantic, peft, bitsandbytes, and
transformers: the image's 5.17 is below dplaunch's floor), and of dplaunch's own small
dependencies whose versions in the image were not read (``FLOORS``), read from the package
metadata of the environment that prepares them (installed with constraints.txt, so the versions
are the tested ones; a root that environment lacks, as `make install`'s lacks bitsandbytes, is
read from its downloaded wheel) for the device's CPython 3.12 on x86-64 Linux. A few large
packages the image is known to hold are left to it (the device's pip decides from the image
what it still needs: see gpu.sh). Three wheels are slimmed (``slim``) so that the carry fits a
call's 64 MiB: bitsandbytes keeps the device's CUDA 13.0 library only (43 → 3.5 MB), pyarrow
leaves out Flight, S3, headers, tests and the link-time copies of its libraries (55 → 33 MB),
transformers its modular_ and convert_ sources (13 → 11 MB).

    python -m benchmarks.gpu_wheels roots        what the device's pip resolves: name==version
                                                 per root, name>=floor per FLOORS package
    python -m benchmarks.gpu_wheels absent       the roots not installed here, to `pip download`
                                                 before ``pins`` reads them
    python -m benchmarks.gpu_wheels pins         name==version per line, to `pip download`
    python -m benchmarks.gpu_wheels slim WHEEL   rewrite a wheel without what the device never loads
    python -m benchmarks.gpu_wheels floors       one line: dplaunch's floors this python meets or
                                                 misses (status 1 on a miss); gpu.sh runs it first
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
# where gpu.sh prepares the carry (git-ignored), and the tested versions
WHEELS = REPO / ".whl"
CONSTRAINTS = REPO / "constraints.txt"
# what the benchmark and the smoke matrix (LoRA, QLoRA) import beyond the image's torch and
# accelerate, at the tested versions; transformers too: the image's 5.17 is below dplaunch's 5.24
ROOTS = ("deepspeed", "datasets", "pydantic", "peft", "bitsandbytes", "transformers")
# dplaunch's dependencies the image holds at versions not read there, small enough to carry:
# roots.txt asks for dplaunch's floor (name>=X), so the device's pip keeps the image's where it
# meets it and installs the carried one where it does not
FLOORS = ("typer", "rich", "psutil", "pyyaml")
# left to the image: torch (built for its CUDA), accelerate 1.15, tokenizers 0.23.2, safetensors
# 0.8 and huggingface-hub 1.33 (transformers 5.24 wants >= 0.23.1, >= 0.8, >= 1.31), numpy and
# pandas (any recent one), and CHECKED_ON_THE_DEVICE, so that the rest fits a call's 64 MiB
# beside pyarrow (33 MiB; datasets needs >= 24, the image's version is not known)
FROM_THE_IMAGE = (
    "torch",
    "accelerate",
    "tokenizers",
    "safetensors",
    "numpy",
    "pandas",
    "huggingface-hub",
    "matplotlib",
    "tensorboard",
)
# dplaunch's dependencies left to the image whose versions there were not read: with their own
# dependencies each is about 20 MiB, which the carry has no room for. Neither is needed to train
# (tensorboard is optional at run time; matplotlib draws `dplaunch report`'s and gpu.png's
# plots); `floors` checks them on the device with the rest
CHECKED_ON_THE_DEVICE = ("matplotlib", "tensorboard")
# the device's CUDA (torch 2.11+cu130 there): bitsandbytes loads the library of torch's CUDA
# version by name (cuda_specs: torch.version.cuda 13.0 → libbitsandbytes_cuda130)
DEVICE_CUDA = ("cuda130",)
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


def tested_version(name: str) -> str:
    """NAME's version installed here, else its pin in constraints.txt (`make install` has no
    bitsandbytes, the [qlora] extra of `make test`)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    for line in CONSTRAINTS.read_text().splitlines():
        pinned, _, version = line.split("#", 1)[0].partition("==")
        if version and canonicalize_name(pinned) == canonicalize_name(name):
            return version.strip()
    raise SystemExit(f"gpu_wheels: {name} is neither installed here nor pinned in constraints.txt")


def root_requirements() -> list[str]:
    """roots.txt: each root at its tested version, each FLOORS package at dplaunch's floor."""
    from dplaunch.requirements import floors

    wanted = floors()
    return [f"{name}=={tested_version(name)}" for name in ROOTS] + [
        f"{name}>={wanted[name]}" for name in FLOORS
    ]


def _distribution(name: str) -> importlib.metadata.Distribution:
    """NAME's installed distribution, else the one of its wheel in WHEELS (``absent``)."""
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    for wheel in sorted(WHEELS.glob("*.whl")):
        if canonicalize_name(wheel.name.split("-", 1)[0]) != name:
            continue
        with zipfile.ZipFile(wheel) as archive:
            info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return importlib.metadata.PathDistribution(
            zipfile.Path(wheel, info.rsplit("/", 1)[0] + "/")
        )
    raise SystemExit(
        f"gpu_wheels: {name} is not installed here and {WHEELS.name}/ has no wheel of it: "
        "`python -m benchmarks.gpu_wheels absent` names the roots to `pip download` first"
    )


def dependency_closure(roots: tuple[str, ...], stop: tuple[str, ...] = ()) -> dict[str, str]:
    """Every distribution ``roots`` need on the device, with the version installed here (or of
    its wheel in WHEELS), less the ``stop`` packages, whose requirements are not followed
    either (the image brings them, with their own)."""
    seen = {canonicalize_name(name) for name in stop}
    versions: dict[str, str] = {}
    pending = list(roots)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in seen:
            continue
        seen.add(name)
        distribution = _distribution(name)
        versions[name] = distribution.version
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(DEVICE_MARKERS):
                pending.append(requirement.name)
    return versions


def carried_pins() -> dict[str, str]:
    """The wheels to download for the device: the closure less those built here."""
    closure = dependency_closure((*ROOTS, *FLOORS), stop=FROM_THE_IMAGE)
    built = {canonicalize_name(name) for name in BUILT_HERE}
    return {name: version for name, version in sorted(closure.items()) if name not in built}


# what pyarrow ships that neither datasets nor dplaunch loads: Arrow Flight and the S3 filesystem
# (only pyarrow.flight and S3FileSystem link them: readelf's NEEDED of every library in the
# wheel), C++ headers, Cython sources, tests, and the copies of libarrow_python a build links
# against (libarrow_python.so, .so.2600.1.0: the modules load its soname, .so.2600). Substrait
# stays: pyarrow.lib links it
PYARROW_UNUSED = re.compile(
    r"flight|_s3|/include/|/tests/|\.(pyx|pxd|pxi|h|hpp|cc)$|/src/"
    r"|/libarrow_python[^/]*\.so(\.\d+\.\d+\.\d+)?$"
)
# transformers' sources of its generated modeling files and its checkpoint converters: its
# import structure skips modular_ and convert_ files (utils/import_utils.py), nothing imports them
TRANSFORMERS_UNUSED = re.compile(r"^transformers/models/.*/(modular|convert)_[^/]*\.py$")


def kept(package: str, name: str) -> bool:
    """Whether the device needs file NAME of PACKAGE's wheel (slim's rule)."""
    if package == "bitsandbytes":
        library = Path(name).name
        if not library.startswith("libbitsandbytes_") or "cpu" in library:
            return True
        return any(f"_{version}." in library for version in DEVICE_CUDA)
    if package == "pyarrow":
        return not PYARROW_UNUSED.search(name)
    if package == "transformers":
        return not TRANSFORMERS_UNUSED.search(name)
    return True


def slim(wheel: Path) -> int:
    """Rewrite a wheel without what the device never loads (``kept``): other CUDA versions'
    libraries of bitsandbytes, pyarrow's Flight and S3, headers and tests, transformers'
    modular_ and convert_ sources; its RECORD rewritten to match. Returns the bytes saved."""
    package = wheel.name.split("-", 1)[0]
    before = wheel.stat().st_size
    slimmed = wheel.with_suffix(".slim")
    with (
        zipfile.ZipFile(wheel) as source,
        zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out,
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


def floors_line(installed_version: Callable[[str], str] = importlib.metadata.version):
    """(one line on dplaunch's floors, whether this python meets them all): the versions found,
    or the floors missed, each with what it needs."""
    from dplaunch.requirements import floors, missed_floors

    wanted = floors()
    missed = missed_floors(installed_version)
    if not missed:
        found = ", ".join(f"{name} {installed_version(name)}" for name in wanted)
        return f"dplaunch's floors met: {found}", True
    said = [
        f"{name} {'not installed' if found is None else found} (needs {wanted[name]})"
        for name, found in missed.items()
    ]
    return (
        f"dplaunch's floors missed here: {', '.join(said)}; carry them as wheels "
        "(benchmarks/gpu_wheels.py)",
        False,
    )


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "slim":
        saved = slim(Path(argv[1]))
        print(f"{argv[1]}: {saved / 2**20:.0f} MiB the device never loads left out")
        return 0
    if argv == ["floors"]:
        line, met = floors_line()
        print(line)
        return 0 if met else 1
    if argv == ["pins"]:
        lines = [f"{name}=={version}" for name, version in carried_pins().items()]
    elif argv == ["roots"]:
        lines = root_requirements()
    elif argv == ["absent"]:
        lines = []
        for name in ROOTS:
            try:
                importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                lines.append(f"{name}=={tested_version(name)}")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
