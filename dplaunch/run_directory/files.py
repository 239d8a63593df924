"""Reading and writing each file of a run directory; every write is atomic, durable where it must be.

The launcher writes run.yaml, plan.json and resume.json before the ranks start and reads
stopped.json after they end; the ranks read the first three and write the rest. Both sides read
and write them here, so their format is stated once. Torch-free.
"""

from __future__ import annotations

import json
import os
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from dplaunch.run_directory.layout import (
    DATA_POSITION_PREFIX,
    DEEPSPEED_FILE,
    LATEST_FILE,
    META_FILE,
    METRICS_FILE,
    MODEL_FILES_DIR,
    PLAN_FILE,
    RESUME_FILE,
    RUN_FILE,
    STOP_FILE,
    TEMP_PREFIX,
    data_position_file,
)

# ---------------------------------------------------------------------------------------------
# atomic and durable writes


def write_text_atomic(
    path: Path, text: str, mode: int | None = None, *, durable: bool = False
) -> None:
    """Write via a temporary file and rename: readers see the old or the new file, never half.

    ``mode`` (default 0o666) is reduced by the umask, as for any new file. ``durable`` fsyncs the
    file before the rename: a checkpoint's files must still be whole after the node crashes.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        # created with the mode asked for: the kernel applies the umask, as it does to any new file
        handle = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode
        )
        with os.fdopen(handle, "w") as out:
            out.write(text)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def fsync_file(path: Path) -> None:
    """Flush a written file to disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_directory(path: Path) -> None:
    """Flush a folder's entries (created, renamed, removed names) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_to_disk(folder: Path, local_rank: int, local_size: int) -> list[Path]:
    """fsync FOLDER's files and folders, shared among the ranks of a node; return this rank's.

    Every node syncs every file: dirty pages live in the page cache of the node that wrote them
    (Lustre and NFS clients too), and a node does not know which files its ranks wrote. A
    TEMP_PREFIX name is another rank's write_text_atomic in flight: it may be renamed away under
    this rank's feet, and its writer makes it durable itself."""
    entries = sorted(entry for entry in folder.rglob("*") if not entry.name.startswith(TEMP_PREFIX))
    mine = [entry for index, entry in enumerate(entries) if index % local_size == local_rank]
    for entry in mine:
        if entry.is_dir():
            fsync_directory(entry)
        elif entry.is_file():
            fsync_file(entry)
    if local_rank == 0:
        fsync_directory(folder)
    return mine


# ---------------------------------------------------------------------------------------------
# run.yaml and plan.json (in RUN/ and, copied, in every checkpoint), deepspeed.json


def read_run_file(directory: Path) -> Any:
    """The resolved run file in DIRECTORY (a run or a checkpoint), as YAML data."""
    return yaml.safe_load((directory / RUN_FILE).read_text())


def plan_text(plan: dict[str, Any]) -> str:
    """plan.json's text for a plan's dict (Plan.to_dict())."""
    return json.dumps(plan, indent=2) + "\n"


def read_plan_file(directory: Path) -> dict[str, Any]:
    """The plan in DIRECTORY (a run or a checkpoint), as its dict (Plan.from_dict takes it)."""
    return json.loads((directory / PLAN_FILE).read_text())


def read_deepspeed_file(run_dir: Path) -> dict[str, Any]:
    """The rendered DeepSpeed config (deepspeed.json) of a run, as its dict."""
    return json.loads((run_dir / DEEPSPEED_FILE).read_text())


# ---------------------------------------------------------------------------------------------
# resume.json: the launcher's choice of checkpoint, read by every rank


def resume_text(
    checkpoint: Path | None = None,
    step: int = 0,
    load_dir: Path | None = None,
    universal: bool = False,
) -> str:
    """resume.json: the checkpoint the ranks continue from and the folder the engine loads
    (its universal conversion, if re-sharded); no checkpoint: a fresh start."""
    if checkpoint is None:
        return json.dumps({"checkpoint": None}, indent=2) + "\n"
    record = {
        "checkpoint": str(checkpoint.absolute()),
        "step": step,
        "load_dir": str((load_dir or checkpoint).absolute()),
        "universal": universal,
    }
    return json.dumps(record, indent=2) + "\n"


def read_resume(run_dir: Path) -> dict[str, Any] | None:
    """What the launcher decided to resume from (resume.json), or None for a fresh start."""
    path = run_dir / RESUME_FILE
    if not path.is_file():
        return None
    resume = json.loads(path.read_text())
    if not resume.get("checkpoint"):
        return None
    if not all(Path(resume[key]).exists() for key in ("checkpoint", "load_dir")):
        # launch.sh rerun after train.keep_last rotated the launch's checkpoint away
        raise FileNotFoundError(
            f"{path} resumes from {resume['checkpoint']}, which is gone (train.keep_last keeps "
            "only the newest): continue with `dplaunch train RUN_FILE -o "
            f"{run_dir} --resume auto`"
        )
    return resume


# ---------------------------------------------------------------------------------------------
# stopped.json: rank 0 tells the launcher how a launch ended early


def write_stop_record(
    run_dir: Path, step: int, reason: str, checkpoint: Path, exit_status: int
) -> None:
    """Why this launch stopped before its last step, and where it checkpointed (rank 0)."""
    record = {
        "step": step,
        "reason": reason,
        "checkpoint": str(checkpoint),
        "exit_status": exit_status,
    }
    write_text_atomic(run_dir / STOP_FILE, json.dumps(record) + "\n", durable=True)


def read_stop_record(run_dir: Path) -> dict[str, Any] | None:
    """What rank 0 wrote when it stopped before the last step (None when it did not)."""
    try:
        return json.loads((run_dir / STOP_FILE).read_text())
    except (OSError, ValueError):
        return None


def clear_stop_record(run_dir: Path) -> None:
    """Forget the stop record of a previous launch of this run directory."""
    (run_dir / STOP_FILE).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# metrics.jsonl (written by dplaunch.train.metrics; read whole by dplaunch.report)


def finished_at(run_dir: Path) -> int | None:
    """The step at which the newest launch recorded in RUN/metrics.jsonl finished; None when that
    launch stopped early, failed or is not recorded."""
    for line in _lines_from_the_end(run_dir / METRICS_FILE):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed rank
        kind = record.get("type") if isinstance(record, dict) else None
        if kind == "summary":
            return int(record.get("step", 0))
        if kind in ("header", "stop"):
            return None
    return None


def newest_results(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The newest launch's records in RUN/metrics.jsonl by type, the last of each: "summary"
    (there when it finished), "eval", "train"; empty when nothing is recorded."""
    found: dict[str, dict[str, Any]] = {}
    for line in _lines_from_the_end(run_dir / METRICS_FILE):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        kind = record.get("type") if isinstance(record, dict) else None
        if kind == "header":
            break
        if kind in ("summary", "eval", "train"):
            found.setdefault(kind, record)
    return found


def _lines_from_the_end(path: Path, block: int = 1 << 20) -> Iterator[bytes]:
    # a long run's metrics.jsonl holds a line per logged step: read only as far back as needed
    try:
        handle = path.open("rb")
    except OSError:
        return
    with handle:
        end = handle.seek(0, os.SEEK_END)
        rest = b""
        while end > 0:
            start = max(0, end - block)
            handle.seek(start)
            lines = (handle.read(end - start) + rest).split(b"\n")
            rest = lines.pop(0) if start > 0 else b""  # maybe the tail of a line further back
            yield from reversed(lines)
            end = start


# ---------------------------------------------------------------------------------------------
# a checkpoint's checkpoint.json and the checkpoints folder's `latest`


def read_checkpoint_meta(checkpoint: Path) -> Any:
    """checkpoint.json of a checkpoint folder (raises OSError/ValueError when missing or torn)."""
    return json.loads((checkpoint / META_FILE).read_text())


def write_checkpoint_meta(checkpoint: Path, meta: dict[str, Any]) -> None:
    """checkpoint.json, durably: its presence is what makes a checkpoint complete."""
    write_text_atomic(checkpoint / META_FILE, json.dumps(meta, indent=2) + "\n", durable=True)


# the digest of a checkpoint's files: CRC-32 finds accidental damage (a truncated, zero-filled or
# overwritten block), not tampering. zlib's runs at ~4 GB/s a core and releases the GIL, so the
# ranks split a save's files and the launcher checks a resume with threads; SHA-256 runs at
# ~1.8 GB/s with SHA extensions, ~0.4 GB/s on CPUs without them
DIGEST_CHUNK_BYTES = 8 << 20


def file_digest(path: Path) -> str:
    """The CRC-32 of a file's bytes, 8 hex digits."""
    crc = 0
    buffer = bytearray(DIGEST_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
    return f"{crc:08x}"


def file_record(path: Path) -> dict[str, Any]:
    """What checkpoint.json records of one file: its size and digest."""
    return {"bytes": path.stat().st_size, "crc32": file_digest(path)}


def read_latest(checkpoints_dir: Path) -> str:
    """The checkpoint name `latest` holds ("" when there is none)."""
    try:
        return (checkpoints_dir / LATEST_FILE).read_text().strip()
    except OSError:
        return ""


def write_latest(checkpoints_dir: Path, name: str) -> None:
    """Point `latest` at a complete checkpoint, durably."""
    write_text_atomic(checkpoints_dir / LATEST_FILE, name + "\n", durable=True)


# ---------------------------------------------------------------------------------------------
# a stream's position in a checkpoint (data.streaming)


def write_data_position(checkpoint: Path, data_parallel_rank: int, position: dict) -> None:
    """data-position-N.json: where data-parallel rank N's lanes stand (dplaunch/data/streams.py)."""
    path = checkpoint / data_position_file(data_parallel_rank)
    write_text_atomic(path, json.dumps(position) + "\n", durable=True)


def read_data_positions(checkpoint: Path) -> list[dict]:
    """Every data-parallel rank's stream position in a checkpoint (none for a cached run's)."""
    return [
        json.loads(path.read_text())
        for path in sorted(checkpoint.glob(f"{DATA_POSITION_PREFIX}*.json"))
    ]


def copy_checkpoint_description(source: Path, out: Path) -> None:
    """What a checkpoint holds besides the engine's state, copied beside a conversion of it: the
    run file, the plan, the model's own files (hf/) and a stream's positions."""
    import shutil

    for name in (RUN_FILE, PLAN_FILE):
        shutil.copy2(source / name, out / name)
    for path in source.glob(f"{DATA_POSITION_PREFIX}*.json"):
        shutil.copy2(path, out / path.name)
    if (source / MODEL_FILES_DIR).is_dir():
        shutil.copytree(source / MODEL_FILES_DIR, out / MODEL_FILES_DIR)
