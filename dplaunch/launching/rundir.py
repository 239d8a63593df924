"""The launcher's side of the run directory: is it usable, then write the rendered files into it.

Created only after the plan is valid; the names and formats of its files: dplaunch/run_directory/.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dplaunch.errors import UserError
from dplaunch.run_directory.files import write_text_atomic
from dplaunch.run_directory.layout import CHECKPOINTS_DIR, RUN_MARKERS


def check_run_dir(run_dir: Path, *, resuming: bool) -> str:
    """Raise UserError when the run dir cannot be used; return a free-space line."""
    existing = [marker for marker in RUN_MARKERS if (run_dir / marker).exists()]
    if existing and not resuming:
        fix = (
            "pass --resume auto to continue it, or choose another --output-dir"
            if CHECKPOINTS_DIR in existing
            else "choose another --output-dir (it holds no checkpoint to continue from)"
        )
        raise UserError("output_dir", f"{run_dir} already holds a run ({', '.join(existing)})", fix)
    return check_output_dir(run_dir, "output_dir")


def check_output_dir(directory: Path, field: str) -> str:
    """Raise UserError unless ``directory`` is, or can be created as, a writable directory.

    Returns a free-space line. ``field`` names the flag in the error (output_dir: --output-dir).
    """
    probe = directory
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(field, f"{probe} is not a directory", f"choose another {_option(field)}")
    _check_writable(probe, field)
    free_gb = shutil.disk_usage(probe).free / 1e9
    return f"{free_gb:.1f} GB free on the output directory's disk"


def check_output_file(path: Path, field: str, example_name: str) -> None:
    """Raise UserError unless a file can be written at ``path`` (its folder may still be missing)."""
    if path.is_dir():
        raise UserError(
            field, f"{path} is a directory", f"give a file path, e.g. {path / example_name}"
        )
    check_output_dir(path.parent, field)


def _option(field: str) -> str:
    return "--output-dir" if field == "output_dir" else field


def _check_writable(directory: Path, field: str) -> None:
    # os.access says yes to root everywhere, and nothing about read-only mounts or quotas:
    # create and remove a real file instead
    try:
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".dplaunch-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        reason = error.strerror or str(error)
        raise UserError(
            field,
            f"cannot create files in {directory} ({reason})",
            f"choose a writable {_option(field)}",
        ) from None


def write_run_files(run_dir: Path, files: dict[str, str]) -> None:
    """Create the run directory (with the user's umask) and write the rendered files into it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_text_atomic(run_dir / name, text, 0o777 if name.endswith(".sh") else None)
