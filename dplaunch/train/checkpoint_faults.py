"""TEST ONLY: faults injected into a checkpoint save, to prove that a failed save loses nothing.

The tests set DPLAUNCH_TEST_CHECKPOINT_FAULT in the ranks' environment (tests/test_checkpoints.py):

- "STEP:sleep=SECONDS" sleeps in every rank after it wrote its part of checkpoint step STEP and
  before the commit (a window to kill -9 a rank mid-save);
- "STEP:max_file_bytes=N" caps the size of files the ranks write from that save on (RLIMIT_FSIZE:
  the kernel then fails the writes, as on a full disk);
- "0:start_sleep=SECONDS" sleeps in every rank during its start-up, once its process group
  exists (a window to signal a rank that is still loading, as a large model keeps it).

Unset, as in every real run, nothing here does anything. It lives in the ranks because the faults
must happen inside a real save of real ranks started by `dplaunch train`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from dplaunch.run_directory.environment import CHECKPOINT_FAULT_ENV

_KINDS = ("sleep", "max_file_bytes", "start_sleep")


@dataclass(frozen=True)
class CheckpointFault:
    """One fault at one step's save."""

    step: int
    kind: str
    value: float

    def apply(self, step: int, kind: str) -> None:
        """Inject the fault when the save of ``step`` reaches the point ``kind``."""
        if self.step != step or self.kind != kind:
            return
        if kind in ("sleep", "start_sleep"):
            time.sleep(self.value)
        elif kind == "max_file_bytes":
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (int(self.value), resource.RLIM_INFINITY))


def fault_from_environment() -> CheckpointFault | None:
    """The fault the tests asked for, or None (always, outside the tests)."""
    text = os.environ.get(CHECKPOINT_FAULT_ENV, "")
    if not text:
        return None
    step, _, action = text.partition(":")
    kind, _, value = action.partition("=")
    if kind not in _KINDS:
        raise ValueError(
            f"{CHECKPOINT_FAULT_ENV}={text!r}: expected STEP:sleep=SECONDS, "
            "STEP:max_file_bytes=N or 0:start_sleep=SECONDS"
        )
    return CheckpointFault(int(step), kind, float(value))


def hold_start_up() -> None:
    """With 0:start_sleep=SECONDS, hold this rank in its start-up; unset (every real run), nothing."""
    fault = fault_from_environment()
    if fault is not None:
        fault.apply(0, "start_sleep")
