"""Converting a checkpoint of any layout into its universal form (dplaunch/train/universal.py), one
parameter at a time, within a host-memory budget.

The launcher runs this as a child process before a resume under another layout (`python -m
dplaunch.train.convert CHECKPOINT OUT`), writing into a folder it then commits atomically
(dplaunch/launching/reshard.py); `dplaunch convert` calls write_universal itself. The result is a
complete checkpoint folder (checkpoint.json, run.yaml, plan.json, hf/, the universal form): any
layout resumes from it, and `--resume` takes it like any checkpoint.

Memory: DPLAUNCH_CONVERT_MEMORY_MB (dplaunch/run_directory/environment.py) bounds what the
conversion holds at once: an eighth for each part's shard being written (the weights', the
optimizer's), and a parameter with its optimizer state may take an eighth (it is held up to
three times over while it is read, copied and written).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dplaunch.errors import UserError
from dplaunch.run_directory.environment import CONVERT_MEMORY_ENV
from dplaunch.run_directory.files import (
    copy_checkpoint_description,
    read_checkpoint_meta,
    read_run_file,
    write_checkpoint_meta,
)
from dplaunch.run_directory.layout import rng_state_file
from dplaunch.train.universal import UniversalWriter

# without DPLAUNCH_CONVERT_MEMORY_MB: shards of 1 GB (Hugging Face writes 5 GB ones)
DEFAULT_MEMORY_MB = 4096


def memory_budget(environ: dict[str, str] | None = None) -> int:
    """The bytes a conversion may hold: DPLAUNCH_CONVERT_MEMORY_MB, else DEFAULT_MEMORY_MB."""
    value = (os.environ if environ is None else environ).get(CONVERT_MEMORY_ENV, "")
    megabytes = int(value) if value.strip().isdigit() and int(value) > 0 else DEFAULT_MEMORY_MB
    return megabytes << 20


class Progress:
    """The conversion's progress line: redrawn in place on a terminal, else a line per quarter."""

    def __init__(self, what: str, total: int, stream: Any = None):
        self.what = what
        self.total = max(1, total)
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.done = 0
        self.bytes = 0
        self.started = time.perf_counter()
        self._quarter = 0

    def advance(self, size: int) -> None:
        """One more parameter of SIZE bytes (weights and optimizer state) converted."""
        self.done += 1
        self.bytes += size
        quarter = 4 * self.done // self.total
        if self.live:
            self.stream.write(f"\r\x1b[2K{self._line()}")
        elif quarter > self._quarter:
            self.stream.write(self._line() + "\n")
        self._quarter = quarter
        self.stream.flush()

    def finish(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self) -> str:
        percent = 100 * self.done // self.total
        return (
            f"  {self.what}: {percent:3d}% ({self.done}/{self.total} parameters, "
            f"{self.bytes / 1e6:.1f} MB, {time.perf_counter() - self.started:.1f} s)"
        )


def peak_rss_bytes() -> int:
    """This process's peak resident memory: the kernel's high-water mark of its address space
    (VmHWM; getrusage's ru_maxrss would also count the parent's at the fork before exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def write_universal(
    checkpoint: Path, out: Path, *, memory_bytes: int, say: Any = print, progress: bool = True
) -> dict[str, Any]:
    """Convert CHECKPOINT (a complete checkpoint folder of any layout) into its universal form in
    OUT (created; the caller makes it atomic). Returns what it did: parameters, bytes, seconds,
    and this process's peak resident memory (what a memory limit would meet)."""
    from dplaunch.config.schema import RunConfig
    from dplaunch.train.checkpoint_sources import open_source

    started = time.perf_counter()
    meta = read_checkpoint_meta(checkpoint)
    config = RunConfig.model_validate(read_run_file(checkpoint))
    out.mkdir(parents=True)
    source = open_source(checkpoint, meta, config, out / ".work", memory_bytes // 8)
    try:
        names = source.names()
        bar = (
            Progress(f"{checkpoint.name} ({source.kind}) → universal", len(names))
            if progress
            else None
        )
        # each part's shard buffer an eighth: a parameter read whole may be held three times
        # over meanwhile (read, copied into the buffer, written)
        writer = UniversalWriter(out, max(1, memory_bytes // 8))
        largest = 0
        for name, weight, state in source.entries():
            size = sum(t.numel() * t.element_size() for t in (weight, *state.values()))
            largest = max(largest, size)
            if size > memory_bytes // 8:
                raise UserError(
                    CONVERT_MEMORY_ENV,
                    f"{name} and its optimizer state take {size / 2**20:.0f} MB, more than an "
                    f"eighth of the conversion's {memory_bytes >> 20} MB",
                    f"set {CONVERT_MEMORY_ENV}={(8 * size >> 20) + 1} or more",
                )
            writer.add(name, weight, state)
            if bar is not None:
                bar.advance(size)
        if bar is not None:
            bar.finish()
        kind = source.kind
        writer.close(
            source.scheduler_state(), {"checkpoint": str(checkpoint.resolve()), "kind": kind}
        )
        for rank, rng in source.rng_states().items():
            torch.save(rng, out / rng_state_file(rank))
    finally:
        source.close()
        shutil.rmtree(out / ".work", ignore_errors=True)
    copy_checkpoint_description(checkpoint, out)
    seconds = time.perf_counter() - started
    size = write_converted_meta(
        out,
        {
            **meta,
            "format": "universal",
            "converted_from": {"checkpoint": str(checkpoint.resolve()), "kind": kind},
            "convert_seconds": round(seconds, 3),
        },
    )
    report = {
        "parameters": len(names),
        "bytes": size,
        "seconds": round(seconds, 3),
        "memory_budget_bytes": memory_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
        "largest_parameter_bytes": largest,
    }
    say(
        f"universal form of {checkpoint.name} written in {seconds:.1f} s: {len(names)} parameters, "
        f"{size / 1e6:.1f} MB, peak RSS {report['peak_rss_bytes'] / 1e6:.0f} MB (the "
        f"conversion's budget: {memory_bytes / 1e6:.0f} MB, {CONVERT_MEMORY_ENV})"
    )
    return report


def write_converted_meta(out: Path, meta: dict[str, Any]) -> int:
    """checkpoint.json of a converted checkpoint in OUT: META with its own files' sizes and
    digests (as a save records them, so a resume verifies it); returns their bytes."""
    from dplaunch.train.checkpoint import merge_digests

    files = merge_digests(out)
    size = sum(record["bytes"] for record in files.values())
    write_checkpoint_meta(out, {**meta, "size_bytes": size, "files": files})
    return size


def main(argv: list[str]) -> int:
    """`python -m dplaunch.train.convert CHECKPOINT OUT [--json]`: the launcher's conversion
    child (--json: the last line is the report as JSON). A checkpoint that cannot convert (it
    does not fit its run file, a parameter larger than the memory budget) is one line, status 2."""
    checkpoint, out = Path(argv[0]), Path(argv[1])
    try:
        report = write_universal(checkpoint, out, memory_bytes=memory_budget())
    except UserError as error:
        print(f"dplaunch: error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"dplaunch: error: --resume: {error}", file=sys.stderr)
        return 2
    if "--json" in argv[2:]:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    from dplaunch.train.quick_start import skip_unused_imports

    skip_unused_imports()
    sys.exit(main(sys.argv[1:]))
