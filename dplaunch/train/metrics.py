"""metrics.jsonl and TensorBoard events, and the terminal output, written by rank 0 only."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import IO, Any

from dplaunch.run_directory.environment import PROGRESS_ENV
from dplaunch.run_directory.layout import METRICS_FILE, TENSORBOARD_DIR

# cursor to the line above, erased: the bar is redrawn as a whole line, so it passes through the
# launcher's line-by-line relay of the ranks' output and still replaces itself on the terminal
REDRAW = "\x1b[1A\x1b[2K"
BAR_CELLS = 30


def progress_width(environ: dict[str, str] | None = None) -> int | None:
    """The terminal width dplaunch passed to the ranks, or None: no progress bar."""
    value = (os.environ if environ is None else environ).get(PROGRESS_ENV, "")
    return max(40, int(value)) if value.isdigit() else None


class RankPrinter:
    """Rank 0's terminal output. Messages are lines; a logged training step is a line too
    (`step 20/60  loss …`), or, on an interactive terminal, a live progress bar redrawn in
    place: step/total, loss, tokens/s, ETA, with messages printed above it."""

    def __init__(self, enabled: bool, stream: IO[str] | None = None, width: int | None = None):
        self.enabled = enabled
        self.stream = stream
        self.width = width
        self._bar = ""  # the bar on the terminal's last line, "" when none

    def __call__(self, message: str) -> None:
        """Print one message (above the progress bar when one is shown)."""
        if not self.enabled:
            return
        if self._bar:
            self._write(f"{REDRAW}{message}\n{self._bar}\n")
        else:
            self._write(f"{message}\n")

    def train_step(self, step: int, total_steps: int, record: dict[str, Any], start_step: int):
        """A logged step: its line, or the progress bar on a terminal."""
        if not self.enabled:
            return
        if self.width is None:
            data = data_fields(record)
            mfu = f"  MFU {record['mfu']:.1%}" if "mfu" in record else ""
            self._write(
                f"step {step}/{total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"tokens/s {record['tokens_per_s']:.0f}{mfu}{'  ' + data if data else ''}\n"
            )
            return
        done = step - start_step
        eta = record["elapsed_s"] / done * (total_steps - step) if done > 0 else 0.0
        bar = progress_bar(
            step,
            total_steps,
            record["loss"],
            record["tokens_per_s"],
            eta,
            self.width,
            data_fields(record),
            mfu=record.get("mfu"),
        )
        self._write((REDRAW if self._bar else "") + bar + "\n")
        # the last step's bar stays where it is: what follows (evaluation, export) goes below
        self._bar = bar if step < total_steps else ""

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(text)
        stream.flush()


@contextlib.contextmanager
def library_progress(printer: RankPrinter):
    """On a terminal, rank 0 shows the progress bars of `datasets` (tokenising, packing a large
    corpus); elsewhere they stay off. tqdm redraws a bar with a carriage return, which the
    launcher's line-by-line relay would hold until the bar ends: its redraws become lines."""
    if not printer.enabled or printer.width is None:
        yield
        return
    import datasets

    real = sys.stderr
    sys.stderr = RedrawnLines(real)  # tqdm looks its stream up when a bar starts
    datasets.enable_progress_bars()
    try:
        yield
    finally:
        datasets.disable_progress_bars()
        sys.stderr = real


class RedrawnLines(io.TextIOBase):
    """A stream for tqdm: each carriage-return redraw becomes a whole line that replaces the
    previous one on the terminal (REDRAW), so it passes through a line-by-line relay."""

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self._shown = False  # the last line on the terminal is a bar being redrawn

    def write(self, text: str) -> int:
        out = []
        for chunk in text.replace("\r\n", "\n").split("\r"):
            *ended, last = chunk.split("\n")
            for line in ended:  # a bar left standing, or an ordinary line
                if line.strip():
                    out.append((REDRAW if self._shown else "") + line.rstrip() + "\n")
                self._shown = False
            if last.strip():
                out.append((REDRAW if self._shown else "") + last.rstrip() + "\n")
                self._shown = True
        if out:
            self.stream.write("".join(out))
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def data_fields(record: dict[str, Any]) -> str:
    """The log's data part: the tokens read so far and the data loader's share of the time."""
    if "tokens" not in record:
        return ""
    return f"tokens {_count(record['tokens'])}  data {100 * record['data_share']:.0f}%"


def _count(number: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if number >= size:
            return f"{number / size:.1f}{unit}"
    return f"{number:.0f}"


def progress_bar(
    step: int,
    total_steps: int,
    loss: float,
    tokens_per_s: float,
    eta_s: float,
    width: int,
    data: str = "",
    mfu: float | None = None,
) -> str:
    """One terminal line (ANSI colours, at most WIDTH cells): step/total, bar, percentage, loss,
    tokens/s, MFU (when the run has a forecast, planning/forecast.py), the data part
    (data_fields), ETA. On a narrow terminal the least useful go first (fit_fields)."""
    from rich.console import Console
    from rich.text import Text

    head = f"step {step}/{total_steps} "
    named = {
        "percent": f"{100 * step / max(total_steps, 1):3.0f}%",
        "loss": f"loss {loss:.4f}",
        "speed": f"tokens/s {tokens_per_s:,.0f}",
        "mfu": f"MFU {mfu:.1%}" if mfu is not None else "",
        "data": data,
        "eta": f"ETA {datetime.timedelta(seconds=round(eta_s))}",
    }
    cells, fields = fit_fields(width - len(head) - 1, named)
    filled = round(cells * step / max(total_steps, 1))
    line = Text.assemble(
        (head, "bold"),
        ("━" * filled, "green"),
        ("━" * (cells - filled), "bright_black"),
        " " + "  ".join(fields),
    )
    console = Console(file=io.StringIO(), force_terminal=True, width=width, color_system="standard")
    console.print(line, no_wrap=True, overflow="ellipsis", crop=True, end="")
    return console.file.getvalue()


def fit_fields(room: int, named: dict[str, str]) -> tuple[int, list[str]]:
    """The bar's cells and the fields (NAMED, in order; empty ones skipped) that fit in ROOM
    cells: the bar shrinks first (to 10 cells), then the data part, MFU, tokens/s, the
    percentage and the loss are left out in that order, so that the ETA is never cut."""
    fields = {name: text for name, text in named.items() if text}

    def cells_left() -> int:
        return room - len("  ".join(fields.values()))

    for dropped in ("data", "mfu", "speed", "percent", "loss"):
        if cells_left() >= 10:
            break
        fields.pop(dropped, None)
    return min(BAR_CELLS, max(10, cells_left())), list(fields.values())


class MetricsWriter:
    """Appends one JSON object per line; mirrors scalars to TensorBoard.

    Importing TensorBoard takes a few tenths of a second, and rank 0 would make every rank wait for
    it before the first step; so the TensorBoard writer opens in a background thread, and scalars
    logged before it is ready are replayed to it. metrics.jsonl is written at once, line by line.
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        *,
        tensorboard: bool = True,
        trackers: list[Any] | None = None,
    ):
        self.enabled = enabled
        # Accelerate trackers (train.report_to: wandb, mlflow, trackio), given the same scalars
        self.trackers = trackers or []
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
        self._file = (run_dir / METRICS_FILE).open("a", buffering=1)
        if not tensorboard:
            self._board_opened = True
            return
        self._opener = threading.Thread(
            target=self._open_board,
            args=(run_dir / TENSORBOARD_DIR,),
            name="dplaunch-tensorboard",
            daemon=True,
        )
        self._opener.start()

    def _open_board(self, log_dir: Path) -> None:
        board, error = None, None
        try:
            _writer_without_tensorflow()
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
        for tracker in self.trackers if scalars else ():
            tracker.log({tag: value for tag, value, _ in scalars}, step=fields["step"])
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
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
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


def memory_now_gb(device: Any) -> float:
    """The memory this rank holds right now, in GB: its tensors' on a GPU (memory_allocated), its
    resident memory on CPU. At the header (model and engine built, no step yet) it is the
    baseline a step's peak adds its activations to."""
    if device.type == "cuda":
        import torch

        return _gb(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as statm:
            return _gb(int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):  # not Linux: the peak so far
        return memory_fields(device)["memory_gb"]


def _gb(size: float) -> float:
    return round(size / 1e9, 3)


def _writer_without_tensorflow() -> None:
    """TensorBoard's writer uses TensorFlow's file API when TensorFlow is installed and its own
    stub otherwise; importing TensorFlow for it costs a rank about 3 s of CPU. Unless the process
    already holds TensorFlow, take tensorboard's own switch to the stub (the module its
    no-TensorFlow build adds: tensorboard.compat.notf). The stub writes the same event files."""
    if "tensorflow" in sys.modules:
        return
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
