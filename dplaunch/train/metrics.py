"""metrics.jsonl and TensorBoard events, written by rank 0 only."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends one JSON object per line; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.start = time.time()
        self._file = None
        self._board = None
        if not enabled:
            return
        self._file = (run_dir / "metrics.jsonl").open("a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional at run time
            self._board = None

    def write(self, record_type: str, **fields: Any) -> None:
        """One line of metrics.jsonl (and TensorBoard scalars under the record type)."""
        if not self.enabled:
            return
        record = {"type": record_type, **fields}
        self._file.write(json.dumps(record) + "\n")
        if self._board is not None and "step" in fields:
            for name, value in fields.items():
                if (
                    name != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self._board.add_scalar(f"{record_type}/{name}", value, fields["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._board is not None:
            self._board.close()
