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


def memory_fields(device: Any, cuda: Any = None) -> dict[str, float]:
    """The memory a train record logs, in GB (1e9 bytes).

    GPU: memory_gb is the peak the tensors took (max_memory_allocated); beside it the peak the
    caching allocator held (max_memory_reserved: what an out-of-memory error counts, fragmentation
    included) and what the device has free and in all right now (mem_get_info: other processes,
    the CUDA context and NCCL's buffers included). CPU: memory_gb alone, the peak resident memory
    of the process. CUDA is torch.cuda (a stand-in in tests)."""
    if device.type == "cuda":
        if cuda is None:
            import torch

            cuda = torch.cuda
        free, total = cuda.mem_get_info(device)
        return {
            "memory_gb": _gb(cuda.max_memory_allocated(device)),
            "memory_reserved_gb": _gb(cuda.max_memory_reserved(device)),
            "memory_free_gb": _gb(free),
            "memory_total_gb": _gb(total),
        }
    import resource

    # Linux reports ru_maxrss in KiB
    return {"memory_gb": _gb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}


def _gb(size: float) -> float:
    return round(size / 1e9, 3)
