"""Entry point of every rank: `python -m dplaunch.train RUN_DIR` (started by `accelerate launch`)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

ERRORS_DIR = "errors"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m dplaunch.train RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    rank = os.environ.get("RANK", "0")
    try:
        from dplaunch.train.loop import train

        return train(run_dir)
    except Exception as error:  # noqa: BLE001 — one line per failing rank, the full traceback in a file
        report = run_dir / ERRORS_DIR / f"rank-{rank}.txt"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(traceback.format_exc())
        print(
            f"[rank {rank}] {type(error).__name__}: {error} (traceback: {report})",
            file=sys.stderr,
            flush=True,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
