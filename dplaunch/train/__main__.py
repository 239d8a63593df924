"""Entry point of every rank: `python -m dplaunch.train RUN_DIR` (started by `accelerate launch`)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from dplaunch.run_directory.layout import ERRORS_DIR, rank_error_file
from dplaunch.train.quick_start import pause_collector
from dplaunch.train.rank_process import begin_rank, exit_rank, note_failure_stack

# the terminal line stays short; the whole message and traceback are in the file
MAX_MESSAGE_CHARS = 600


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m dplaunch.train RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    try:
        from dplaunch.train.loop import train

        return train(run_dir)
    except Exception as error:  # noqa: BLE001 — one line per failing rank, the full traceback in a file
        return report_failure(run_dir, error)


def report_failure(run_dir: Path, error: BaseException) -> int:
    """Write this rank's traceback to RUN/errors/rank-N.txt, print one line about it; return 1."""
    rank = os.environ.get("RANK", "0")
    report = run_dir / ERRORS_DIR / rank_error_file(rank)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("".join(traceback.format_exception(error)))
    note_failure_stack(error)
    # one line, written at once: dplaunch's launcher recognises it (launching.process.RANK_ERROR_RE)
    # and prints only the first failing rank's, last; 16 ranks' lines must not interleave
    sys.stderr.write(f"[rank {rank}] {one_line(error)} (traceback: {report})\n")
    sys.stderr.flush()
    return 1


def one_line(error: BaseException) -> str:
    """`Type: message` on one line (messages of some libraries span several)."""
    message = " ".join(str(error).split())
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


if __name__ == "__main__":
    begin_rank()
    pause_collector()  # until the engine is ready (train.loop.train)
    exit_rank(main(sys.argv[1:]))
