"""Rank processes that start with their libraries already imported: a test-only fork server.

Nine tenths of a tiny test rank's CPU is its imports (torch, transformers, Accelerate, datasets,
DeepSpeed: ~3.3 s of ~4.5 s on the 2-core CI machine), and the suite starts ~460 ranks. In every
test file but conftest.REAL_START_FILES (tests of start-up, imports, memory and process trees),
each training rank and checkpoint conversion is born from this server instead, which imported
those libraries once:

    python -u -m dplaunch.train RUN   (started by accelerate launch → torchrun, as always)
      └ tests/rank_zygote_site/sitecustomize.py, before anything else: hands its command line,
        environment, working directory and stdin/stdout/stderr to the server over a Unix socket,
        then waits, passing on every signal it gets, and ends with the rank's status
    python -u -m tests.rank_zygote SOCKET   (one per pytest worker, libraries imported)
      └ keeper (fork): starts the rank, relays signals, reports its exit, kills it if the
        waiting process dies (even by SIGKILL: its socket closes)
          └ rank (fork): the stdio, directory, environment and path of the waiting process, then
            runs the module exactly as `python -m` would

The rank is a real process running the same code, with the same stdio, environment and signals;
what differs is who its parent is and that the libraries were imported before its environment
was set (the server imports them with the variables dplaunch sets for CPU ranks that libraries
read at import, and refuses a rank whose import-time variables differ: it starts as usual, as
does any command line, interpreter or flag the server does not match).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import struct
import sys

# what a rank imports before its first line of work (measured: `python -X importtime` of a tiny
# DDP and a ZeRO-3 rank); dplaunch's own modules are not among them: each rank imports its own
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "accelerate",
    "accelerate.utils",
    "datasets",
    "safetensors.torch",
    "deepspeed",
)
# the variable naming the server's socket (set by conftest around each test; the site hook reads
# it too), the server's log beside it, and the variable that turns the server off
SOCKET_VARIABLE = "SUITE_RANK_ZYGOTE"
LOG_NAME = "server.log"
REAL_START_VARIABLE = "SUITE_REAL_START"
# the modules the waiting process may hand over: dplaunch's training ranks and the conversion of
# a checkpoint to another layout (launching/reshard.py)
MODULES = ("dplaunch.train", "dplaunch.train.convert")
# the variables libraries read while they are imported (cache folders, offline modes, log levels,
# DeepSpeed's accelerator): a rank whose values differ from the server's starts as usual
IMPORT_TIME_PREFIXES = (
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "DATASETS_",
    "TORCH_",
    "PYTORCH_",
    "DS_",
    "DEEPSPEED_",
    "XDG_",
    "HOME",
    "MKL_",
    "KMP_",
    "CUDA_",
    "TF_",
    "PYTHON",
)
# ... except these, read later: OMP_NUM_THREADS (the rank sets its thread count itself), where
# DeepSpeed builds its ops, and what torchrun sets for CUDA checks and NCCL process groups
READ_LATER = frozenset(
    {
        "TORCH_EXTENSIONS_DIR",
        "OMP_NUM_THREADS",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        # Accelerate sets these for CPU launches; Intel's OpenMP reads them, and torch's wheel
        # has GNU's (torch/lib/libgomp.so.1), which does not
        "KMP_AFFINITY",
        "KMP_BLOCKTIME",
        # the waiting process's path is sent apart, and its streams are made as -u would
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
    }
)
# sys.flags that change how the same code runs (-u is not among them: see streams())
FLAGS = frozenset(
    {
        "debug",
        "inspect",
        "optimize",
        "dont_write_bytecode",
        "no_user_site",
        "no_site",
        "ignore_environment",
        "verbose",
        "bytes_warning",
        "hash_randomization",
        "isolated",
        "dev_mode",
        "utf8_mode",
        "safe_path",
        "int_max_str_digits",
        "warn_default_encoding",
    }
)
HEADER = struct.Struct("!I")
# the keeper's answers: accepted (then the rank's pid), refused, and the rank's end
ACCEPTED, REFUSED, ENDED = b"A", b"R", b"E"
# the signals the waiting process passes on
RELAYED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)


def interpreter() -> dict:
    """What must be equal between the waiting process and the server for the rank to behave
    as if the waiting process had run it: the interpreter, its flags (but -u: the rank's streams
    are made as the waiting process's were) and the libraries' import-time variables."""
    flags = {name: getattr(sys.flags, name) for name in dir(sys.flags) if name in FLAGS}
    return {
        "executable": sys.executable,
        "flags": flags,
        "warnoptions": list(sys.warnoptions),
        "xoptions": {k: str(v) for k, v in sys._xoptions.items()},
        "import_environment": {
            name: value
            for name, value in sorted(os.environ.items())
            if name.startswith(IMPORT_TIME_PREFIXES) and name not in READ_LATER
        },
    }


def serve(path: str) -> None:
    """Import PRELOAD in this process's environment (conftest gives it a CPU rank's:
    tests/helpers.cpu_rank_environment), then fork a keeper for each waiting process."""
    from dplaunch.train.quick_start import skip_unused_imports

    skip_unused_imports()  # as a rank does first: DeepSpeed's import skips MLflow
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()  # the ranks' collections never walk (and so never copy) the libraries' objects
    me = interpreter()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    print(f"ready {os.getpid()}", flush=True)
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                keep(connection, me)
            finally:
                os._exit(0)
        connection.close()


def receive(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    (size,) = HEADER.unpack_from(data)
    data = data[HEADER.size :]
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            raise EOFError
        data += more
    return json.loads(data), fds


def keep(connection: socket.socket, me: dict) -> None:
    """The keeper: start the rank, pass signals on, report how it ended."""
    request, fds = receive(connection)
    if request["interpreter"] != me or len(fds) != 3:
        mine, theirs = me, request["interpreter"]
        differ = sorted(k for k in {**mine, **theirs} if mine.get(k) != theirs.get(k))
        if "import_environment" in differ:
            ours, yours = mine["import_environment"], theirs["import_environment"]
            differ += sorted(k for k in {**ours, **yours} if ours.get(k) != yours.get(k))
        print(f"refused {request['module']} {request['argv']}: {differ}", file=sys.stderr)
        connection.sendall(REFUSED)
        return
    keeper = os.getpid()
    rank = os.fork()
    if rank == 0:
        connection.close()
        become_rank(request, fds, keeper)
    for fd in fds:
        os.close(fd)
    print(f"started {request['module']} {request['argv']} pid {rank}", file=sys.stderr)
    connection.sendall(ACCEPTED + HEADER.pack(rank))
    ended = os.pidfd_open(rank)
    while True:
        readable, _, _ = select.select([connection, ended], [], [])
        if ended in readable:
            _, status = os.waitpid(rank, 0)
            code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
            connection.sendall(ENDED + struct.pack("!i", code))
            return
        received = connection.recv(64)
        if not received:  # the waiting process is gone: so is its rank
            os.kill(rank, signal.SIGKILL)
            os.waitpid(rank, 0)
            return
        for number in received:
            try:
                os.kill(rank, number)
            except ProcessLookupError:
                pass


def become_rank(request: dict, fds: list[int], keeper: int) -> None:
    """In the forked rank: take the waiting process's place, then run its module as `-m` does."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != keeper:
        os._exit(1)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    streams(request["unbuffered"])
    # the dispositions the waiting process started with (dplaunch's launcher starts ranks with
    # SIGUSR1 ignored until their handler is in place), as the interpreter sets them up
    for number in RELAYED:
        ignored = number in request["ignored"]
        signal.signal(number, signal.SIG_IGN if ignored else signal.SIG_DFL)
    if signal.SIGINT not in request["ignored"]:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["environ"])
    sys.path[:] = [os.getcwd(), *request["path"]]  # `-m` puts the working directory first
    sys.argv = ["-m", *request["argv"]]
    sys.orig_argv = request["orig_argv"]  # what the waiting process was started with
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    import runpy

    status = 0
    try:
        runpy._run_module_as_main(request["module"])
    except SystemExit as request_to_exit:
        from dplaunch.train.rank_process import status_of

        status = status_of(request_to_exit)
    except BaseException:  # noqa: BLE001 — printed as the interpreter would, status 1
        sys.excepthook(*sys.exc_info())
        status = 1
    from dplaunch.train.rank_process import exit_rank

    exit_rank(status)


def streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr as the interpreter makes them for these file descriptors."""
    import io

    def text(fd: int, mode: str, **options) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        tty = raw.isatty()
        if mode == "r":
            return io.TextIOWrapper(io.BufferedReader(raw), line_buffering=tty, **options)
        return io.TextIOWrapper(
            io.BufferedWriter(raw),
            line_buffering=tty or fd == 2,
            write_through=unbuffered,
            **options,
        )

    encoding = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = text(0, "r", encoding=encoding)
    sys.stdout = sys.__stdout__ = text(1, "w", encoding=encoding, errors=sys.stdout.errors)
    sys.stderr = sys.__stderr__ = text(2, "w", encoding=encoding, errors="backslashreplace")


# ---- the waiting process's side (tests/rank_zygote_site/sitecustomize.py calls hand_over)


def module_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) for `python [-u] -m MODULE ARGS…`, else None."""
    options = argv[1:]
    while options and options[0] in ("-u", "-B", "-E", "-s"):
        options = options[1:]
    if len(options) >= 2 and options[0] == "-m" and options[1] in MODULES:
        return options[1], options[2:]
    return None


def read_exactly(connection: socket.socket, size: int) -> bytes:
    """``size`` bytes, or fewer if the other side closed."""
    data = b""
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            break
        data += more
    return data


def hand_over(path: str) -> None:
    """Run this process's rank in the server and end as it ends; return if the server says no."""
    command = module_of(sys.orig_argv)
    if command is None:
        return
    module, argv = command
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        return  # no server: start as usual
    request = {
        "module": module,
        "argv": argv,
        "orig_argv": sys.orig_argv,
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "path": sys.path,
        "interpreter": interpreter(),
        "unbuffered": bool(getattr(sys.stdout, "write_through", False)),  # -u or PYTHONUNBUFFERED
        "ignored": [n for n in RELAYED if signal.getsignal(n) == signal.SIG_IGN],
    }
    data = json.dumps(request).encode()
    socket.send_fds(connection, [HEADER.pack(len(data)) + data], [0, 1, 2])
    answer = read_exactly(connection, 1)
    if answer != ACCEPTED:
        return
    read_exactly(connection, HEADER.size)  # the rank's pid

    def relay(number, frame):  # noqa: ANN001, ARG001 — a signal handler
        try:
            connection.sendall(bytes([number]))
        except OSError:
            pass

    for number in RELAYED:
        signal.signal(number, relay)
    code = 1
    try:
        ended = read_exactly(connection, 5)
        code = struct.unpack("!i", ended[1:5])[0] if len(ended) == 5 else 1  # 1: the keeper died
        if code < 0:  # the rank was killed by signal -code: so is this process
            if -code not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
    finally:  # never on to run the rank here as well
        os._exit(code & 0xFF if code >= 0 else 128 - code)


if __name__ == "__main__":
    serve(sys.argv[1])
