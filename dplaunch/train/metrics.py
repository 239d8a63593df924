"""metrics.jsonl and TensorBoard events, written by rank 0 only."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends one JSON object per line; mirrors scalars to TensorBoard.

    Importing TensorBoard takes a few tenths of a second, and rank 0 would make every rank wait for
    it before the first step; so the TensorBoard writer opens in a background thread, and scalars
    logged before it is ready are replayed to it. metrics.jsonl is written at once, line by line.
    """

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.start = time.time()
        self._file = None
        self._board: Any = None
        self._lock = threading.Lock()
        self._board_opened = False
        self._board_error: BaseException | None = None
        # (tag, value, step) logged before the TensorBoard writer existed
        self._pending: list[tuple[str, float, int]] = []
        self._opener: threading.Thread | None = None
        if not enabled:
            return
        self._file = (run_dir / "metrics.jsonl").open("a", buffering=1)
        self._opener = threading.Thread(
            target=self._open_board,
            args=(run_dir / "tensorboard",),
            name="dplaunch-tensorboard",
            daemon=True,
        )
        self._opener.start()

    def _open_board(self, log_dir: Path) -> None:
        board, error = None, None
        try:
            from torch.utils.tensorboard import SummaryWriter

            board = SummaryWriter(log_dir=str(log_dir))
        except ImportError:  # tensorboard is optional at run time
            board = None
        except Exception as exc:  # noqa: BLE001 — raised again in the training thread
            error = exc
        with self._lock:
            self._board, self._board_error, self._board_opened = board, error, True
            pending, self._pending = self._pending, []
            if board is not None:
                for tag, value, step in pending:
                    board.add_scalar(tag, value, step)

    def write(self, record_type: str, **fields: Any) -> None:
        """One line of metrics.jsonl (and TensorBoard scalars under the record type)."""
        if not self.enabled:
            return
        record = {"type": record_type, **fields}
        self._file.write(json.dumps(record) + "\n")
        if "step" not in fields:
            return
        scalars = [
            (f"{record_type}/{name}", value, fields["step"])
            for name, value in fields.items()
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        with self._lock:
            self._raise_board_error()
            if not self._board_opened:
                self._pending.extend(scalars)
            elif self._board is not None:
                for tag, value, step in scalars:
                    self._board.add_scalar(tag, value, step)

    def text(self, tag: str, text: str, step: int) -> None:
        """A text in TensorBoard (its TEXT tab) under TAG at STEP; metrics.jsonl gets it by write()."""
        if not self.enabled:
            return
        if self._opener is not None:
            self._opener.join()  # rare (each evaluation): wait for the writer rather than queue
        with self._lock:
            self._raise_board_error()
            if self._board is not None:
                self._board.add_text(tag, text, step)

    def close(self) -> None:
        if self._opener is not None:
            self._opener.join()
            self._opener = None
        if self._file is not None:
            self._file.close()
        if self._board is not None:
            self._board.close()
        self._raise_board_error()

    def _raise_board_error(self) -> None:
        if self._board_error is not None:
            error, self._board_error = self._board_error, None
            raise error
