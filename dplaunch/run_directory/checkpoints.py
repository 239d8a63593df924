"""Finding the complete checkpoints of a run and verifying them, torch-free: the launcher (a
resume), `dplaunch export` and the ranks (rotation) read RUN/checkpoints/ through these.

A checkpoint's checkpoint.json records every other file's size and CRC-32 (written by the
ranks at the commit, dplaunch/train/checkpoint.py); a damaged checkpoint is named, never resumed
over, and set aside as damaged-step-N rather than deleted."""

from __future__ import annotations

import json
import os
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplaunch.errors import UserError
from dplaunch.run_directory.files import file_digest, read_checkpoint_meta, read_latest
from dplaunch.run_directory.layout import (
    CHECKPOINTS_DIR,
    DAMAGED_PREFIX,
    META_FILE,
    STEP_DIR,
    TEMP_PREFIX,
)

# threads that check a checkpoint's digests (zlib's CRC-32 releases the GIL: they run in parallel)
VERIFY_THREADS = min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk and what checkpoint.json says about it."""

    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def has_digests(self) -> bool:
        """Whether checkpoint.json records its files (dplaunch versions before did not)."""
        return isinstance(self.meta.get("files"), dict)


@dataclass(frozen=True)
class DamagedCheckpoint:
    """A committed checkpoint (step-N) that cannot be trusted, and why."""

    path: Path
    problem: str

    def line(self) -> str:
        """The damage in one clause."""
        return f"{self.path} is damaged ({self.problem})"


@dataclass(frozen=True)
class IntactSearch:
    """The newest checkpoint that verifies, and the newer ones that did not."""

    info: CheckpointInfo | None
    damaged: tuple[DamagedCheckpoint, ...] = ()


def read_checkpoint(path: Path) -> CheckpointInfo | None:
    """The checkpoint at ``path`` if it is complete (has its checkpoint.json), else None."""
    if path.name.startswith(TEMP_PREFIX):
        return None
    try:
        meta = read_checkpoint_meta(path)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or "step" not in meta:
        return None
    return CheckpointInfo(path, meta)


def complete_checkpoints(checkpoints_dir: Path) -> list[CheckpointInfo]:
    """Every complete checkpoint in a checkpoints directory, oldest step first."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for entry in checkpoints_dir.iterdir():
        if STEP_DIR.match(entry.name) and entry.is_dir():
            info = read_checkpoint(entry)
            if info is not None:
                found.append(info)
    return sorted(found, key=lambda info: info.step)


def newest_checkpoint(checkpoints_dir: Path) -> CheckpointInfo | None:
    """What `latest` names when that is complete; otherwise the complete checkpoint of highest step."""
    name = read_latest(checkpoints_dir)
    if name and STEP_DIR.match(name):
        info = read_checkpoint(checkpoints_dir / name)
        if info is not None:
            return info
    found = complete_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def verify_checkpoint(info: CheckpointInfo, *, digests: bool = True) -> str | None:
    """None when every file checkpoint.json records is there with its size and CRC-32, else
    what is wrong. Sizes first: a truncated file is found without reading a byte (not
    DIGESTS: the sizes only, what a failure report can afford).

    Checkpoints of dplaunch versions that recorded no digests: the structure of their
    safetensors and torch files (a truncated one no longer parses), read from their headers."""
    records = info.meta.get("files")
    if not isinstance(records, dict):
        return _structure_problem(info.path)
    for name, record in sorted(records.items()):
        try:
            size = (info.path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != record.get("bytes"):
            return f"{name} holds {size:,} bytes, {record.get('bytes'):,} were written"
    if not digests:
        return None

    def digest(name: str) -> str:
        try:
            return file_digest(info.path / name)
        except OSError as error:
            return f"unreadable: {error.strerror or error}"

    names = sorted(records)
    with ThreadPoolExecutor(VERIFY_THREADS) as pool:
        found = dict(zip(names, pool.map(digest, names), strict=True))
    for name in names:
        if found[name] != records[name].get("crc32"):
            return (
                f"{name} does not hold the bytes that were written (CRC-32 {found[name]}, "
                f"recorded {records[name].get('crc32')})"
            )
    return None


def _structure_problem(folder: Path) -> str | None:
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.suffix == ".safetensors":
            problem = _safetensors_problem(path)
        elif path.suffix in (".pt", ".bin", ".pth") and not zipfile.is_zipfile(path):
            # torch.save writes a zip: a cut one has lost its central directory
            problem = "not a whole torch file"
        else:
            continue
        if problem:
            return f"{name}: {problem}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    # 8 bytes of header length, the JSON header, then the tensors up to the largest end offset
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        size = path.stat().st_size
    except (OSError, ValueError, UnicodeDecodeError):
        return "not a whole safetensors file (its header does not parse)"
    ends = [
        entry["data_offsets"][1]
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"holds {size:,} bytes, its header describes {expected:,}"
    return None


def newest_intact_checkpoint(checkpoints_dir: Path, *, digests: bool = True) -> IntactSearch:
    """The checkpoint a resume takes: `latest`'s, else the highest step, among those that
    verify (not DIGESTS: whose files have their sizes); each committed checkpoint tried before
    it and found damaged (an unreadable checkpoint.json included)."""
    if not checkpoints_dir.is_dir():
        return IntactSearch(None)
    committed = sorted(
        (
            entry
            for entry in checkpoints_dir.iterdir()
            if STEP_DIR.match(entry.name) and entry.is_dir()
        ),
        key=lambda entry: -int(STEP_DIR.match(entry.name).group(1)),  # type: ignore[union-attr]
    )
    named = read_latest(checkpoints_dir)
    committed.sort(key=lambda entry: entry.name != named)  # `latest`'s first, stable otherwise
    damaged = []
    for path in committed:
        info = read_checkpoint(path)
        if info is None:
            damaged.append(DamagedCheckpoint(path, f"its {META_FILE} is missing or unreadable"))
            continue
        problem = verify_checkpoint(info, digests=digests)
        if problem is None:
            return IntactSearch(info, tuple(damaged))
        damaged.append(DamagedCheckpoint(path, problem))
    return IntactSearch(None, tuple(damaged))


def set_aside(damaged: DamagedCheckpoint) -> Path:
    """Rename a damaged checkpoint to damaged-step-N (never deleted; nothing reads it again)."""
    target = damaged.path.with_name(f"{DAMAGED_PREFIX}{damaged.path.name}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = damaged.path.with_name(f"{DAMAGED_PREFIX}{damaged.path.name}.{suffix}")
    os.rename(damaged.path, target)
    return target


def find_checkpoint(path: Path, field: str = "--resume") -> IntactSearch:
    """A checkpoint directory (it must verify), or the newest checkpoint that verifies in a
    checkpoints or run directory, with the newer ones that did not."""
    other = (
        "--resume auto (this run's newest checkpoint that verifies) or another checkpoint"
        if field == "--resume"
        else "the run directory (its newest checkpoint that verifies) or another checkpoint"
    )
    if not path.exists():
        raise UserError(
            field,
            f"{path} does not exist",
            "give --resume auto (this run's newest complete checkpoint) or the path of a "
            "checkpoint or run directory"
            if field == "--resume"
            else "give a checkpoint or run directory",
        )
    info = read_checkpoint(path)
    if info is not None:
        problem = verify_checkpoint(info)
        if problem is not None:
            raise UserError(field, DamagedCheckpoint(path, problem).line(), f"give {other}")
        return IntactSearch(info)
    if STEP_DIR.match(path.name) and (path / "..").resolve().name == CHECKPOINTS_DIR:
        # committed (only complete saves get this name), but its checkpoint.json is gone
        problem = f"its {META_FILE} is missing or unreadable"
        raise UserError(field, DamagedCheckpoint(path, problem).line(), f"give {other}")
    for candidate in (path, path / CHECKPOINTS_DIR):
        found = newest_intact_checkpoint(candidate)
        if found.info is not None:
            return found
        if found.damaged:
            raise UserError(
                field,
                f"no checkpoint in {candidate} verifies: "
                + "; ".join(damage.line() for damage in found.damaged),
                "give a checkpoint of another run, or start a new run",
            )
    if path.name.startswith(TEMP_PREFIX) or (path / "..").resolve().name == CHECKPOINTS_DIR:
        raise UserError(
            field,
            f"{path} is not a complete checkpoint (a save that was interrupted)",
            "give the run directory: its newest complete checkpoint is used",
        )
    raise UserError(
        field,
        f"{path} holds no complete dplaunch checkpoint",
        "give a checkpoints/step-N directory or a run directory",
    )
