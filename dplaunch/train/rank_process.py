"""How a rank process writes its output and how it ends.

Output: ranks run with `python -u` (Accelerate's launcher adds it), where print() issues one
write per piece ("text", " ", "more", "\n"), so the lines of ranks sharing one pipe run into each
other. line_buffered_output() makes each line one write (atomic on a pipe up to 4 KiB) while
still streaming every line at once.

Exit: exit handlers, then out without tearing the interpreter down.

A rank that used gloo can abort *after* its work is done. Gloo's worker threads still hold the
last collective's tensors; when the interpreter finalizes, a worker frees them, asks for the GIL
of an interpreter that is going away and is killed by std::terminate ("terminate called without
an active exception", SIGABRT). Calling destroy_process_group() does not always help: DeepSpeed
and Accelerate keep references to the groups, so the threads outlive it. Measured here: 1 run in
about 12 of an unmodified two-rank Accelerate script (core dump: ProcessGroupGloo::runLoop →
~AsyncWork → decref → take_gil during Py_FinalizeEx).

So every rank dplaunch starts ends like a normal exit (thread pools stopped, non-daemon threads
joined, atexit handlers run, streams flushed) and then leaves with os._exit, skipping the finalization that races.

Supervisor: if the dplaunch process that started the job dies, even by SIGKILL, the rank gets
SIGTERM. The launcher in between (accelerate → torchrun's agent) normally passes its own
parent-death SIGTERM on, but only through a Python exception that a finalizer running at that
moment can swallow; the rank does not depend on it.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import select
import signal
import sys
import threading
import time
from typing import NoReturn

from dplaunch.run_directory.environment import ERRORS_DIR_ENV, SUPERVISOR_PID_ENV
from dplaunch.run_directory.layout import rank_stacks_file
from dplaunch.stop_signals import STACK_DUMP_SIGNAL, TIMEOUT_RE, exit_handle
from dplaunch.train.quick_start import skip_unused_imports

# without pidfd (Linux < 5.3) the supervisor is polled this often
SUPERVISOR_POLL_S = 1.0


# this rank's RUN/errors/stacks-rank-N.txt, open while the rank runs (faulthandler writes to it)
_stacks: dict[str, object] = {}


def begin_rank() -> None:
    """What every rank dplaunch starts does first: whole-line output, stop with dplaunch, dump
    its stack when asked, no import it never uses."""
    skip_unused_imports()
    line_buffered_output()
    stop_with_supervisor()
    arm_stack_dump()


def arm_stack_dump() -> None:
    """SIGUSR2 writes every thread's Python stack to RUN/errors/stacks-rank-N.txt.

    The supervisor sends it to every rank when a collective times out. faulthandler writes from
    its C signal handler, so a rank blocked in C++ (a collective, a sleep) dumps at once; the file
    is opened now because nothing can be opened then. Appended to: a restarted launch keeps the
    stacks of the one before."""
    errors_dir = os.environ.get(ERRORS_DIR_ENV)
    if not errors_dir:
        return  # not started by dplaunch
    path = os.path.join(errors_dir, rank_stacks_file(os.environ.get("RANK", "0")))
    try:
        os.makedirs(errors_dir, exist_ok=True)
        stream = open(path, "a")  # noqa: SIM115 — open for the rank's whole life
    except OSError:
        return  # no dump rather than no training
    faulthandler.register(STACK_DUMP_SIGNAL, file=stream, all_threads=True)
    _stacks.update(path=path, stream=stream)


def note_failure_stack(error: BaseException) -> None:
    """A rank whose collective timed out writes where it waited (its traceback) to its stacks
    file itself: it may be gone before the supervisor's SIGUSR2 arrives."""
    stream = _stacks.get("stream")
    if stream is None or not TIMEOUT_RE.search(str(error)):
        return
    import traceback

    with contextlib.suppress(OSError, ValueError):
        stream.write("Timed out here (this rank's traceback):\n")
        stream.write("".join(traceback.format_exception(error)))
        stream.flush()


def _drop_empty_stacks_file() -> None:
    # nothing was dumped: leave no empty file (nor an empty errors folder) behind
    path, stream = _stacks.get("path"), _stacks.get("stream")
    if path is None:
        return
    # the supervisor's SIGUSR2 can still come while this rank ends (it saw the timeout this rank
    # reports): ignore it from now on. faulthandler.unregister would put back the default action,
    # which kills the rank with status 140 instead of its own; os._exit follows, so faulthandler
    # never restores it
    with contextlib.suppress(ValueError):  # not the main thread: leave faulthandler's handler
        signal.signal(STACK_DUMP_SIGNAL, signal.SIG_IGN)
    with contextlib.suppress(OSError, ValueError):
        stream.close()
        if os.path.getsize(path) == 0:
            os.unlink(path)
            os.rmdir(os.path.dirname(path))


def stop_with_supervisor() -> None:
    """SIGTERM this process once the dplaunch process named in the environment has ended."""
    try:
        supervisor = int(os.environ[SUPERVISOR_PID_ENV])
    except (KeyError, ValueError):
        return  # not started by dplaunch (a plain `accelerate launch` of our entry point)
    threading.Thread(
        target=_wait_then_stop, args=(supervisor,), name="dplaunch-supervisor", daemon=True
    ).start()


def _wait_then_stop(supervisor: int) -> None:
    handle = exit_handle(supervisor)
    if handle is not None:
        select.select([handle], [], [])  # readable once the process has exited
        os.close(handle)
    else:  # no pidfd here (or already gone: then the first check ends the loop)
        while _alive(supervisor):
            time.sleep(SUPERVISOR_POLL_S)
    # the rank's own SIGTERM handling: the training loop saves a checkpoint and stops, a plain
    # script ends as it would under `kill`
    with contextlib.suppress(ProcessLookupError):
        os.kill(os.getpid(), signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def line_buffered_output() -> None:
    """Whole lines per write on stdout and stderr, flushed at each newline."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError):  # replaced by something that is not a TextIOWrapper
            pass


def exit_rank(status: int) -> NoReturn:
    """Leave the process with ``status`` the way a normal exit would, minus finalization."""
    # what Python's own exit does first: the threading exit callbacks (they tell thread pools,
    # torch.compile's among them, to stop), then a join of every non-daemon thread
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    try:
        atexit._run_exitfuncs()  # the user's handlers and the libraries' (trackers, loggers)
    finally:
        _drop_empty_stacks_file()
        # no destroy_process_group(): it does not stop the race, and with a dead peer it can block
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 — a closed stream must not change the status
                pass
        os._exit(status)


def status_of(exit_request: SystemExit) -> int:
    """The status `sys.exit(code)` asks for, with Python's rules (None → 0, text → 1)."""
    code = exit_request.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
