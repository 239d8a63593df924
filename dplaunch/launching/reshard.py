"""Re-sharding a ZeRO checkpoint for another data-parallel size, in the launcher, before the ranks start.

DeepSpeed's ds_to_universal turns the checkpoint into a universal one: every rank of the new
layout then loads its own slice of the full-precision weights and optimizer state. Node 0's
launcher converts (once, atomically, into the launched run: RUN/checkpoints/universal-step-N);
the other nodes' launchers wait for it. Torch-free in this process (the conversion is a child).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from dplaunch.errors import UserError
from dplaunch.launching.resume import ResumePoint
from dplaunch.run_directory.layout import DEEPSPEED_TAG, TEMP_PREFIX, UNIVERSAL_DONE_FILE


def convert_to_universal(point: ResumePoint, say: Any = print) -> None:
    """Write the universal form of a ZeRO checkpoint (DeepSpeed's ds_to_universal), once, atomically.

    Runs in the launcher, in a child process, before the ranks start: every rank then loads its own
    slice of the full-precision weights and optimizer state for the new data-parallel size. The
    result goes into the launched run (the source checkpoint may belong to another, read-only run).
    """
    target = point.load_dir
    if _universal_done(point):
        say(f"using the universal checkpoint in {target}")
        return
    if target.exists():
        # the conversion of another checkpoint of the same step (another run's, or one saved
        # again since): never load it for this one
        shutil.rmtree(target)
    source = point.checkpoint.path
    temp = target.with_name(f"{TEMP_PREFIX}{target.name}-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    say(f"re-sharding {source.name} for the new data-parallel size (DeepSpeed ds_to_universal)…")
    started = time.perf_counter()
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(source / DEEPSPEED_TAG),
        "--output_folder",
        str(temp / DEEPSPEED_TAG),
        "--inject_missing_state",
        "--num_extract_workers",
        workers,
        "--num_merge_workers",
        workers,
    ]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    # SLURM signals every process of the step: the time-limit warning (SIGUSR1) is the launcher's
    # to note (run_train), and would otherwise kill the conversion it waits for
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=env,
        check=False,
        preexec_fn=_ignore_usr1,
    )
    if result.returncode != 0:
        shutil.rmtree(temp, ignore_errors=True)
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise UserError(
            "--resume",
            f"converting {source} to a universal checkpoint failed:\n{tail}\n",
            f"resume on {point.checkpoint.meta.get('world_size')} GPUs (no conversion needed)",
        )
    # the accelerate-level files (scheduler, RNG of every rank) go next to the converted engine state
    for item in source.iterdir():
        if item.is_file() and item.suffix == ".pkl":
            shutil.copy2(item, temp / item.name)
    (temp / UNIVERSAL_DONE_FILE).write_text(_universal_source(point))
    try:
        os.rename(temp, target)
    except OSError:
        # another node's launcher converted it first: use theirs
        shutil.rmtree(temp, ignore_errors=True)
        if not _universal_done(point):
            raise
    say(f"universal checkpoint ready in {time.perf_counter() - started:.1f} s: {target}")


def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _universal_source(point: ResumePoint) -> str:
    """What a universal conversion was made from: its `done` file's text."""
    source = {
        "checkpoint": str(point.checkpoint.path.resolve()),
        "saved_at": point.checkpoint.meta.get("saved_at"),
    }
    return json.dumps(source, sort_keys=True) + "\n"


def _universal_done(point: ResumePoint) -> bool:
    """Whether point.load_dir holds a finished conversion of point's own checkpoint."""
    try:
        return (point.load_dir / UNIVERSAL_DONE_FILE).read_text() == _universal_source(point)
    except OSError:
        return False


def wait_for_universal(
    point: ResumePoint, limit_s: float, say: Any = print, poll_s: float = 2.0
) -> None:
    """On the nodes other than 0: wait for node 0's launcher to finish convert_to_universal.

    Their launchers would otherwise start at once and wait in torchrun's rendezvous, which gives
    up after 10 minutes; converting a large ZeRO checkpoint can take longer.
    """
    if _universal_done(point):
        return
    say(f"waiting for node 0 to re-shard {point.checkpoint.name} into {point.load_dir}…")
    started = time.monotonic()
    while not _universal_done(point):
        if time.monotonic() - started > limit_s:
            raise UserError(
                "--resume",
                f"node 0 has not re-sharded {point.checkpoint.path} into {point.load_dir} "
                f"after {limit_s / 60:g} min (launch.timeout_minutes)",
                "look at node 0's output; if the conversion just takes longer, raise "
                "launch.timeout_minutes",
            )
        time.sleep(poll_s)
