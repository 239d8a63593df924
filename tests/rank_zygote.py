"""Processes that start with their libraries already imported: the suite's fork servers.

Nine tenths of a tiny test rank's CPU is its imports (torch, transformers, Accelerate, datasets,
DeepSpeed: ~3.3 s of ~4.5 s on the 2-core CI machine), and the suite starts ~460 ranks. In every
test file but conftest.REAL_START_FILES (tests of start-up, imports, memory, process trees and
SLURM), each training rank and checkpoint conversion is born from this server instead, which
imported those libraries once:

    python -u -m dplaunch.train RUN   (started by accelerate launch → torchrun, as always)
      └ tests/rank_zygote_site/sitecustomize.py, before anything else: hands its command line,
        environment, working directory and stdin/stdout/stderr to the server over a Unix socket,
        then waits, passing on every signal it gets, and ends with the rank's status
    python -u -m tests.rank_zygote SOCKET   (one per pytest worker, libraries imported)
      └ keeper (fork): starts the rank, relays signals, reports its exit, kills it if the
        waiting process dies (even by SIGKILL: its socket closes)
          └ rank (fork): the stdio, directory, environment and path of the waiting process, then
            runs the module exactly as `python -m` would

The launchers (`python -m accelerate.commands.launch …`, torchrun: ~1.6 s of CPU each, most of
it importing torch) are served the same way, and dplaunch's command line (`python -m dplaunch …`)
by a second server that imported only the command line's modules. dplaunch finds the ranks as
its launcher's children (SIGUSR1 to checkpoint and stop, stack dumps, what is left at the end:
launching/process.ProcessTree), tests find dplaunch's children and signal its process group, but
a served process's children are the server's descendants. So the waiting process of a served
launcher or command line starts a stand-in for each child, in the place the child would have had:

    python -m accelerate.commands.launch …   (dplaunch's child: the launcher's waiting process)
      └ stand-in: `python -I -S -c STAND_IN -u -m dplaunch.train RUN`, the child's command line,
        in a session of its own if the child has one (torchrun's ranks), else in the waiting
        process's group; passes every signal on to the child and ends when it ends; if the
        stand-in is killed, so is the child

A served process is a real process running the same code, with the same stdio, environment and
signals; what differs is who its parent is and that the libraries were imported before its
environment was set (a server imports them with the variables that libraries read at import as
conftest gives them: a CPU rank's for the ranks' server, the tests' for the command line's; a
process whose import-time variables differ starts as usual, as does any command line,
interpreter or flag the servers do not match).
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
import time

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
# dplaunch's command line (`python -m dplaunch …`, ~0.5 s of CPU, half of it imports): served by a
# second server that imported these only (the command line never imports torch), so that what it
# does not import stays unimported; its socket is the ranks' server's with CLI_SUFFIX
CLI = "dplaunch"
CLI_PRELOAD = (
    "dplaunch.cli",
    "dplaunch.commands.train",
    "dplaunch.commands.export",
    "dplaunch.commands.slurm",
    "dplaunch.launching.prepare",
    "dplaunch.launching.process",
    "dplaunch.launching.restarts",
    "dplaunch.launching.reshard",
    "dplaunch.launching.frameworks",
    "psutil",
)
CLI_SUFFIX = "-cli"
# what the waiting process may hand over: dplaunch's training ranks and the ranks of a script
# (`dplaunch launch`), the conversion of a checkpoint to another layout (launching/reshard.py),
# the launchers (Accelerate's, and torchrun that tests/test_pipeline_engine.py calls) and the
# pipeline engine's test driver
LAUNCHERS = ("accelerate.commands.launch", "torch.distributed.run")
MODULES = (CLI, "dplaunch.train", "dplaunch.train.script", "dplaunch.train.convert", *LAUNCHERS)
# the served processes whose children get stand-ins (below): the processes tests and dplaunch
# signal, count and stop through their children (dplaunch's ProcessTree, killpg of a group)
PARENTS = (CLI, *LAUNCHERS)
SCRIPTS = (os.path.join(os.path.dirname(os.path.realpath(__file__)), "pipeline_driver.py"),)
# set in a served PARENTS' environment: "PID:NAME", its pid and the (abstract) socket where its
# waiting process starts stand-ins; a process whose parent is PID asks for one as it starts
PARENT_VARIABLE = "SUITE_RANK_ZYGOTE_PARENT"
# a stand-in's environment: "FD:PID", its end of the child's connection and the child's pid
STAND_IN_VARIABLE = "SUITE_RANK_ZYGOTE_STAND_IN"
# test_rank_zygote only: seconds a served process waits right after its fork (a signal then)
HOLD_VARIABLE = "SUITE_RANK_ZYGOTE_HOLD"
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
    "TQDM_",
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


def serve(path: str, cli: bool) -> None:
    """Import PRELOAD (CLI_PRELOAD for the command line's server) in this process's environment
    (conftest gives it a CPU rank's, tests/helpers.cpu_rank_environment, or the command line's,
    child_environment), then fork a keeper for each waiting process."""
    import importlib

    if cli:
        for module in CLI_PRELOAD:
            importlib.import_module(module)
        heavy = [name for name in ("torch", "transformers", "datasets") if name in sys.modules]
        if heavy:
            raise RuntimeError(f"the command line's server imported {heavy}")
    else:
        from dplaunch.train.quick_start import skip_unused_imports

        skip_unused_imports()  # as a rank does first: DeepSpeed's import skips MLflow
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
    # the rank holds the relayed signals until it has the waiting process's dispositions: one
    # relayed meanwhile would meet the server's (a SIGUSR1 the waiting process ignores killed it)
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    rank = os.fork()
    if rank == 0:
        connection.close()
        become_rank(request, fds, keeper)  # never returns
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
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
    hold = request["environ"].get(HOLD_VARIABLE)
    if hold:
        time.sleep(float(hold))
    if request["session_leader"]:  # started with start_new_session, as dplaunch and torchrun do
        os.setsid()
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
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)  # held since the fork: now as it would be
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["environ"])
    if request["stand_ins"]:
        os.environ[PARENT_VARIABLE] = f"{os.getpid()}:{request['stand_ins']}"
    if request["module"] in SCRIPTS:  # `python SCRIPT` puts the script's folder first
        sys.path[:] = [os.path.dirname(request["module"]), *request["path"]]
        sys.argv = [request["script"], *request["argv"]]
    else:  # `-m` puts the working directory first
        sys.path[:] = [os.getcwd(), *request["path"]]
        sys.argv = ["-m", *request["argv"]]
    sys.orig_argv = request["orig_argv"]  # what the waiting process was started with
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")  # imported by the ranks' server only
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # what torch's import does with the variable
    import runpy

    from dplaunch.train.rank_process import exit_rank, status_of

    status, interrupted = 0, False
    try:
        if request["module"] in SCRIPTS:
            runpy.run_path(request["module"], run_name="__main__")
        else:
            runpy._run_module_as_main(request["module"])
    except SystemExit as request_to_exit:
        status = status_of(request_to_exit)
    except BaseException as error:  # noqa: BLE001 — printed as the interpreter would, status 1
        sys.excepthook(*sys.exc_info())
        status, interrupted = 1, isinstance(error, KeyboardInterrupt)
    if request["module"].startswith("dplaunch."):
        exit_rank(status)  # how dplaunch's rank entry points end
    # the others end as the interpreter ends a program: their threads, their exit handlers, their
    # buffered output
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # an uncaught Ctrl-C: the interpreter ends by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


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
    """(module or SCRIPTS' path, its arguments) for `python [-u] -m MODULE|SCRIPT ARGS…`, else None."""
    options = argv[1:]
    while options and options[0] in ("-u", "-B", "-E", "-s"):
        options = options[1:]
    if len(options) >= 2 and options[0] == "-m" and options[1] in MODULES:
        return options[1], options[2:]
    if options and os.path.realpath(options[0]) in SCRIPTS:
        return os.path.realpath(options[0]), options[1:]
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
    """Run this process's module in the server and end as it ends; return if the server says no."""
    command = module_of(sys.orig_argv)
    if command is None:
        return
    module, argv = command
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path + CLI_SUFFIX if module == CLI else path)
    except OSError:
        return  # no server: start as usual
    stand_ins = name = None
    if module in PARENTS:  # where its children ask for stand-ins: an abstract socket
        name = f"suite-rank-zygote-{os.getpid()}-{os.urandom(6).hex()}"
        stand_ins = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stand_ins.bind(f"\0{name}")
        stand_ins.listen(64)
    request = {
        "module": module,
        # a script as the command line gave it
        "script": None if module in MODULES else sys.orig_argv[-len(argv) - 1],
        "argv": argv,
        "orig_argv": sys.orig_argv,
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "path": sys.path,
        "interpreter": interpreter(),
        "unbuffered": bool(getattr(sys.stdout, "write_through", False)),  # -u or PYTHONUNBUFFERED
        "ignored": [n for n in RELAYED if signal.getsignal(n) == signal.SIG_IGN],
        "session_leader": os.getsid(0) == os.getpid(),
        "stand_ins": name,
    }
    data = json.dumps(request).encode()
    socket.send_fds(connection, [HEADER.pack(len(data)) + data], [0, 1, 2])
    answer = read_exactly(connection, 1)
    if answer != ACCEPTED:
        if stand_ins is not None:
            stand_ins.close()  # its children are its own: no stand-ins
        connection.close()
        return
    read_exactly(connection, HEADER.size)  # the served process's pid

    def relay(number, frame):  # noqa: ANN001, ARG001 — a signal handler
        try:
            connection.sendall(bytes([number]))
        except OSError:
            pass

    for number in RELAYED:
        signal.signal(number, relay)
    code = 1
    try:
        listening = [s for s in (connection, stand_ins, _stand_in) if s is not None]
        running: list[int] = []  # the stand-ins' pidfds
        while True:
            readable, _, _ = select.select(listening + running, [], [])
            if _stand_in in readable:  # this process's stand-in was killed: so is this process
                os.kill(os.getpid(), signal.SIGKILL)
            if stand_ins in readable:
                running += start_stand_in(stand_ins.accept()[0])
            running = reap(running, readable)
            if connection in readable:
                break
        ended = read_exactly(connection, 5)
        code = struct.unpack("!i", ended[1:5])[0] if len(ended) == 5 else 1  # 1: the keeper died
        # a launcher ends after its children, and so after their stand-ins (dplaunch stops what
        # is left of its own when it ends)
        wait_for_exits(running, STAND_IN_END_SECONDS)
        if code < 0:  # killed by signal -code: so is this process
            if -code not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
    finally:  # never on to run the module here as well
        os._exit(code & 0xFF if code >= 0 else 128 - code)


# ---- stand-ins: a served process's children where dplaunch and the tests look for them

# how long a waiting process waits for its stand-ins to end after its served process ended
# (they end as soon as their child has; a launcher killed by a signal leaves its children behind)
STAND_IN_END_SECONDS = 10.0
# the stand-in's program (`python -I -S -c STAND_IN CHILD'S ARGUMENTS…`): pass signals on to the
# child, end when its connection closes (the child ended)
STAND_IN = f"""
import os, signal
fd, pid = (int(part) for part in os.environ["{STAND_IN_VARIABLE}"].split(":"))
def relay(number, frame):
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass
relayed = {[int(n) for n in RELAYED]}
for number in relayed:
    signal.signal(number, relay)
signal.pthread_sigmask(signal.SIG_UNBLOCK, relayed)
while os.read(fd, 64):
    pass
"""
_stand_in: socket.socket | None = None  # this process's connection to its stand-in


def ask_for_stand_in(parent: str) -> None:
    """In a served process's child: have a stand-in started under the process's waiting process
    (PARENT_VARIABLE's value), and wait for it."""
    global _stand_in
    pid, _, name = parent.partition(":")
    if pid != str(os.getppid()):
        return  # not the served process's child (its children's children inherit the variable)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(f"\0{name}")
    except OSError:
        return
    me = {"pid": os.getpid(), "argv": sys.orig_argv, "session_leader": os.getsid(0) == os.getpid()}
    connection.sendall(json.dumps(me).encode() + b"\n")
    if read_exactly(connection, 1) == ACCEPTED:
        _stand_in = connection  # kept open for this process's life: its end ends the stand-in


def start_stand_in(connection: socket.socket) -> list[int]:
    """In a served process's waiting process: start the stand-in a child asks for; [its pidfd]."""
    request = b""
    while not request.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            connection.close()
            return []
        request += more
    child = json.loads(request)
    os.set_inheritable(connection.fileno(), True)
    pid = os.posix_spawn(
        sys.executable,
        [sys.executable, "-I", "-S", "-c", STAND_IN, *child["argv"][1:]],
        {STAND_IN_VARIABLE: f"{connection.fileno()}:{child['pid']}"},
        # its stdio: none (the child holds the streams it shares with the waiting process)
        file_actions=[(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)],
        setsid=child["session_leader"],  # torchrun starts each rank in a session of its own
        setsigmask=RELAYED,  # held until its handlers are in place
    )
    handle = os.pidfd_open(pid)
    connection.sendall(ACCEPTED)
    connection.close()
    return [handle]


def reap(handles: list[int], ended: list) -> list[int]:
    """Reap the processes whose pidfds are in ``ended``; the pidfds of those still running."""
    for handle in handles:
        if handle in ended:
            os.waitid(os.P_PIDFD, handle, os.WEXITED)
            os.close(handle)
    return [handle for handle in handles if handle not in ended]


def wait_for_exits(handles: list[int], seconds: float) -> None:
    """Wait until the processes (pidfds) have ended and reap them, at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while handles and time.monotonic() < deadline:
        readable, _, _ = select.select(handles, [], [], max(0.0, deadline - time.monotonic()))
        handles = reap(handles, readable)


if __name__ == "__main__":  # python -m tests.rank_zygote [--cli] SOCKET
    serve(sys.argv[-1], cli="--cli" in sys.argv)
