"""The run directory: created only after the plan is valid, files written atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dplaunch.errors import UserError

# files a finished or running training run leaves; their presence means "this is a run"
RUN_MARKERS = ("metrics.jsonl", "checkpoints")
# RUN/errors/rank-N.txt: the traceback of a failing rank (written by dplaunch.train.__main__)
ERRORS_DIR = "errors"


def check_run_dir(run_dir: Path, *, resuming: bool) -> str:
    """Raise UserError when the run dir cannot be used; return a free-space line."""
    existing = [marker for marker in RUN_MARKERS if (run_dir / marker).exists()]
    if existing and not resuming:
        fix = (
            "pass --resume auto to continue it, or choose another --output-dir"
            if "checkpoints" in existing
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


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write via a temporary file and rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        if mode is not None:
            os.chmod(temp, mode & ~_umask())
        else:
            os.chmod(temp, 0o666 & ~_umask())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def write_run_files(run_dir: Path, files: dict[str, str]) -> None:
    """Create the run directory (with the user's umask) and write the rendered files into it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_text_atomic(run_dir / name, text, 0o777 if name.endswith(".sh") else None)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
