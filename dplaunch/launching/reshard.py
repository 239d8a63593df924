"""Converting a checkpoint into its universal form for a resume under another layout, in the
launcher, before the ranks start.

Node 0's launcher converts (once, in a child process: dplaunch/train/convert.py) into the launched
run, as the checkpointer saves: a temporary folder, every file synced to disk, a `done` file saying
what it was made from, then one rename to RUN/checkpoints/universal-step-N; the other nodes'
launchers wait for it. Torch-free in this process.
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
from dplaunch.run_directory.files import fsync_directory, sync_to_disk
from dplaunch.run_directory.layout import TEMP_PREFIX, UNIVERSAL_DONE_FILE

# the child's exit status for a conversion refused in one line (errors.EXIT_USER_ERROR's value)
_REFUSED = 2


def convert_to_universal(point: ResumePoint, say: Any = print) -> None:
    """Write the universal form of point's checkpoint into point.load_dir, once, atomically.

    Runs in the launcher, in a child process that shows its progress, before the ranks start:
    every rank then loads its own part of each tensor. The result goes into the launched run (the
    source checkpoint may belong to another, read-only run)."""
    target = point.load_dir
    if _universal_done(point):
        say(f"using the universal form already converted in {target}")
        return
    if target.exists():
        # the conversion of another checkpoint of the same step (another run's, or one saved
        # again since): never load it for this one
        shutil.rmtree(target)
    source = point.checkpoint.path
    temp = target.with_name(f"{TEMP_PREFIX}{target.name}-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.parent.mkdir(parents=True, exist_ok=True)
    say(f"converting {source} into its universal form (once, for this layout)…")
    started = time.perf_counter()
    command = [sys.executable, "-m", "dplaunch.train.convert", str(source), str(temp)]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    # the progress line goes straight to this terminal; the errors are kept for the one line.
    # SLURM signals every process of the step: the time-limit warning (SIGUSR1) is the
    # launcher's to note (run_train), and would otherwise kill the conversion it waits for
    result = subprocess.run(
        command,
        stdout=None,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        check=False,
        preexec_fn=_ignore_usr1,
    )
    if result.returncode != 0:
        shutil.rmtree(temp, ignore_errors=True)
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        if result.returncode == _REFUSED and lines:
            # the child's own one line (the memory budget, a checkpoint that does not fit)
            raise UserError("", lines[-1].removeprefix("dplaunch: error: "))
        tail = "\n".join(lines[-15:])
        raise UserError(
            "--resume",
            f"converting {source} into its universal form failed:\n{tail}\n",
            f"resume with the layout that wrote it ({point.checkpoint.meta.get('world_size')} "
            "GPUs, the same parallel settings): no conversion is needed then",
        )
    # as a checkpoint is committed: the files on disk before the name says "done"
    sync_to_disk(temp, 0, 1)
    (temp / UNIVERSAL_DONE_FILE).write_text(_universal_source(point))
    fsync_directory(temp)
    try:
        os.rename(temp, target)
    except OSError:
        # another node's launcher converted it first: use theirs
        shutil.rmtree(temp, ignore_errors=True)
        if not _universal_done(point):
            raise
    fsync_directory(target.parent)
    say(f"universal form ready in {time.perf_counter() - started:.1f} s: {target}")


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
    up after 10 minutes; converting a large checkpoint can take longer.
    """
    if _universal_done(point):
        return
    say(f"waiting for node 0 to convert {point.checkpoint.name} into {point.load_dir}…")
    started = time.monotonic()
    while not _universal_done(point):
        if time.monotonic() - started > limit_s:
            raise UserError(
                "--resume",
                f"node 0 has not converted {point.checkpoint.path} into {point.load_dir} "
                f"after {limit_s / 60:g} min (launch.timeout_minutes)",
                "look at node 0's output; if the conversion just takes longer, raise "
                "launch.timeout_minutes",
            )
        time.sleep(poll_s)
