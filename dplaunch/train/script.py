"""Entry point of every rank of `dplaunch launch SCRIPT ARGS…`: `python -m dplaunch.train.script SCRIPT ARGS…`.

It runs the user's script exactly as `python SCRIPT ARGS…` would (same sys.argv, sys.path[0],
`__name__ == "__main__"`, tracebacks and exit status), then ends the rank with
rank_process.exit_rank, so a finished rank cannot abort in gloo's teardown.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from dplaunch.run_directory.environment import TRACEBACK_PREFIX_ENV
from dplaunch.train.rank_process import begin_rank, exit_rank, note_failure_stack, status_of


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m dplaunch.train.script SCRIPT [ARGS…]", file=sys.stderr)
        return 2
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_request:
        return status_of(exit_request)
    except Exception as error:  # noqa: BLE001 — printed as Python would, then the rank exits 1
        # through sys.excepthook, as Python does: torch's prefixes each line with "[rankN]: ",
        # which is how dplaunch's launcher finds the error of the rank that failed first
        note_failure_stack(error)
        trimmed = _from_script(error.__traceback__, script)
        if os.environ.get(TRACEBACK_PREFIX_ENV):  # a TensorFlow worker: no torch to prefix it
            # a known failure's fix goes last: the line dplaunch's summary ends with
            fix = keras_fix(error)
            _print_prefixed(error.with_traceback(trimmed), os.environ.get("RANK", "0"), fix)
        else:
            sys.excepthook(type(error), error.with_traceback(trimmed), trimmed)
        return 1
    return 0


def _print_prefixed(error: BaseException, rank: str, fix: str | None = None) -> None:
    # one write, so that the lines of two workers failing together do not interleave
    lines = "".join(traceback.format_exception(error)).rstrip("\n").split("\n")
    lines += [fix] if fix else []
    sys.stderr.write("".join(f"[rank{rank}]: {line}\n" for line in lines))
    sys.stderr.flush()


def _from_script(tb, script: str):  # noqa: ANN001, ANN202 — traceback objects
    """The traceback from the script's first frame on (runpy's and ours are noise)."""
    path = os.path.abspath(script)
    current = tb
    while current is not None and os.path.abspath(current.tb_frame.f_code.co_filename) != path:
        current = current.tb_next
    return current or tb


# Keras 3's model.fit under MultiWorkerMirroredStrategy (keras-team/keras#20585, open): every
# worker fails at its first step converting a PerReplica value (TensorFlow 2.21, Keras 3.15)
KERAS_PER_REPLICA_FIX = (
    "dplaunch: Keras 3's model.fit does not run under MultiWorkerMirroredStrategy "
    "(keras-team/keras#20585): use Keras 2, set TF_USE_LEGACY_KERAS=1 before TensorFlow is "
    "imported, with tf-keras installed (pip install 'dplaunch[tensorflow]')"
)


def keras_fix(error: BaseException) -> str | None:
    """The one-line fix of a worker's error when it is Keras 3's PerReplica failure, else None."""
    message = str(error)
    if isinstance(error, ValueError) and "PerReplica" in message and "unsupported type" in message:
        return KERAS_PER_REPLICA_FIX
    return None


if __name__ == "__main__":
    begin_rank()
    exit_rank(main(sys.argv[1:]))
