"""Installed versions against dplaunch's floors (resources/requirements.txt, also the package's
dependencies): an older library is one line before launch, not a TypeError in every rank.

Reads package metadata only (importlib.metadata): nothing heavy is imported, and not even
`packaging` (the floors are plain `name>=X.Y` lines; a release compares as its numbers).
"""

from __future__ import annotations

import re
from importlib import metadata, resources

from dplaunch.errors import UserError

REQUIREMENTS_FILE = "requirements.txt"
# the libraries whose old versions fail inside the ranks, and what the code needs from them
CHECKED = {
    "torch": "transformers 5.24 declares torch>=2.6",
    "accelerate": "Accelerator.unwrap_model(keep_torch_compile=...)",
    "deepspeed": "the ZeRO checkpoint and AutoTP code is written for 0.19",
    "transformers": "from_pretrained(dtype=...) and transformers.masking_utils",
    "datasets": "the Arrow cache layout the data checks read",
}
_FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)$")
_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def floors() -> dict[str, str]:
    """Library → its lowest supported version, from resources/requirements.txt."""
    text = resources.files("dplaunch.resources").joinpath(REQUIREMENTS_FILE).read_text()
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = _FLOOR.match(line)
            if not match:  # the file is ours: every line is name>=version
                raise ValueError(f"{REQUIREMENTS_FILE}: {line!r} is not name>=version")
            found[match.group(1)] = match.group(2)
    return found


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: 2.13.0+cu128 → (2, 13, 0); 2.6.0rc1 → (2, 6, 0)."""
    match = _RELEASE.match(version)
    numbers = [int(part) for part in match.group(1).split(".")] if match else [0]
    while len(numbers) > 1 and numbers[-1] == 0:  # 5.24 == 5.24.0
        numbers.pop()
    return tuple(numbers)


def missed_floors(installed_version=metadata.version, only=None) -> dict[str, str | None]:
    """The libraries of resources/requirements.txt (or of ONLY) installed below their floor:
    name → the version found, None where it is not installed; in the file's order."""
    missed: dict[str, str | None] = {}
    for name, floor in floors().items():
        if only is not None and name not in only:
            continue
        try:
            found = installed_version(name)
        except metadata.PackageNotFoundError:
            missed[name] = None
            continue
        if release(found) < release(floor):
            missed[name] = found
    return missed


def check_installed_versions(installed_version=metadata.version) -> None:
    """Refuse (UserError) the first checked library that is missing or older than its floor."""
    wanted = floors()
    for name, found in missed_floors(installed_version, only=CHECKED).items():
        floor = wanted[name]
        if found is None:
            raise UserError(name, "is not installed", f"pip install '{name}>={floor}'")
        raise UserError(
            name,
            f"{found} is installed, dplaunch needs {floor} or newer ({CHECKED[name]})",
            f"pip install -U '{name}>={floor}'",
        )
