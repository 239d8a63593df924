"""Finding the complete checkpoints of a run, torch-free: the launcher (a resume), `dplaunch
export` and the ranks (rotation) read RUN/checkpoints/ through these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplaunch.errors import UserError
from dplaunch.run_directory.files import read_checkpoint_meta, read_latest
from dplaunch.run_directory.layout import CHECKPOINTS_DIR, STEP_DIR, TEMP_PREFIX


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


def find_checkpoint(path: Path, field: str = "--resume") -> CheckpointInfo:
    """A checkpoint directory, or the newest complete one in a checkpoints or run directory."""
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
        return info
    for candidate in (path, path / CHECKPOINTS_DIR):
        info = newest_checkpoint(candidate)
        if info is not None:
            return info
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
