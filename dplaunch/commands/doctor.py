"""`dplaunch doctor`: check the nodes a plan uses before a job burns hours on them.

One doctor runs on every node, started as `dplaunch train` is (by hand with --nodes/--node-rank,
by srun inside a SLURM allocation). Before any rank starts, each node checks that the head node's
address resolves, names the network interface the ranks will use, measures its write speed to the
run directory and reads its GPUs' health (nvidia-smi). Then the nodes meet on the rendezvous port:
node 0 listens on it and every other node connects and hands over its checks, so a node that
cannot reach the port (or that never started) is named. Last, the ranks start through the same
launcher as training (dplaunch.train.doctor_ranks) and time an all-reduce of increasing sizes;
node 0 prints each size's bus bandwidth (as nccl-tests counts it). PASS or FAIL (exit 1) within
DEADLINE_S seconds. Torch is imported only by the ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from dplaunch.commands.options import command
from dplaunch.config.flags import RunFlags
from dplaunch.errors import UserError
from dplaunch.run_directory.layout import (
    DEFAULT_RUNS_DIR,
    DOCTOR_DIR,
    DOCTOR_PROBE_PREFIX,
    DOCTOR_RESULT_FILE,
)

if TYPE_CHECKING:
    from dplaunch.launching.prepare import PreparedRun

# the whole check, start to verdict; the nodes' meeting gets HANDSHAKE_S of it
DEADLINE_S = 60
HANDSHAKE_S = 20
# what each node writes to measure the run directory's disk (fsync'd, then deleted)
WRITE_TEST_BYTES = 32 << 20
# a node writing slower than this fraction of the fastest is named as slow
SLOW_WRITE_FRACTION = 0.25
# the doctor's own files (launch files of its ranks, their result) in the run directory
BACKEND_PLACEHOLDER = "backend-of-the-plan"
RANKS_SCRIPT = Path(__file__).resolve().parent.parent / "train" / "doctor_ranks.py"


@dataclass
class NodeReport:
    """What one node found before the ranks started."""

    node: int
    host: str
    facts: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    write_mb_s: float | None = None

    @property
    def name(self) -> str:
        return f"node {self.node} ({self.host})"

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> NodeReport:
        return cls(**json.loads(text))


class DoctorTimeout(Exception):
    """The deadline passed while the ranks ran."""


@command(config_option=True)
def doctor_command(flags: RunFlags) -> int:
    """Check every node of the plan (name resolution, rendezvous port, interface, all-reduce bandwidth, GPUs, disk): PASS/FAIL within 60 s."""
    return run_doctor(flags)


def run_doctor(flags: RunFlags) -> int:
    """Check this node (and, on node 0, every node's report and the ranks); 0 PASS, 1 FAIL."""
    from dplaunch.launching.prepare import prepare_script_launch

    started = time.monotonic()
    run_dir = Path(flags.output_dir or Path(DEFAULT_RUNS_DIR) / DOCTOR_DIR)
    # the doctor's ranks are launched as a script's are; the run's parallel layout does not matter
    doctor_flags = replace(flags, output_dir=str(run_dir / DOCTOR_DIR), pp=1, tp=1)
    result_file = (run_dir / DOCTOR_DIR / DOCTOR_RESULT_FILE).absolute()
    timeout_s = str(DEADLINE_S - HANDSHAKE_S)  # how long a collective of the ranks may wait
    try:
        prepared = prepare_script_launch(
            doctor_flags, [str(RANKS_SCRIPT), str(result_file), BACKEND_PLACEHOLDER, timeout_s]
        )
    except UserError as error:
        if error.field != "launch.master_addr":
            raise
        # the planner refuses a head node that does not resolve: for the doctor that is a finding
        node = NodeReport(flags.node_rank or 0, socket.gethostname())
        typer.echo(f"doctor: FAIL: {node.name}: {error.problem}", err=True)
        typer.echo(f"doctor: FAIL ({time.monotonic() - started:.1f} s)")
        return 1
    plan = prepared.plan
    prepared = with_backend(prepared, plan.backend)
    from dplaunch.commands.slurm import srun_relaunch_argv

    relaunch = srun_relaunch_argv(prepared)
    if relaunch is not None:  # a SLURM job outside an srun step: one doctor per node
        from dplaunch.commands.slurm import run_under_srun

        return run_under_srun(prepared, relaunch, dry_run=False)

    typer.echo(
        f"doctor: {plan.num_nodes} node(s), {plan.world_size} rank(s), backend {plan.backend}, "
        f"rendezvous {plan.master_addr}:{plan.master_port}"
    )
    report = check_node(plan.node_rank, plan.master_addr, run_dir, {**os.environ, **prepared.env})
    reports = [report]
    if plan.num_nodes > 1 and not prepared.config.launch.hostfile:
        reports = meet(plan.node_rank, plan.num_nodes, plan.master_addr, plan.master_port, report)
    for each in sorted(reports, key=lambda r: r.node):
        typer.echo(f"{each.name}: " + "; ".join(each.facts))
    failures = [f"{r.name}: {text}" for r in reports for text in r.failures]
    warnings = [f"{r.name}: {text}" for r in reports for text in r.warnings]
    warnings += slow_writers(reports)
    for line in warnings:
        typer.echo(f"doctor: warning: {line}")
    if not failures:
        failures += _run_ranks(prepared, result_file, DEADLINE_S - (time.monotonic() - started))
    verdict = "FAIL" if failures else "PASS"
    for line in failures:
        typer.echo(f"doctor: FAIL: {line}", err=True)
    typer.echo(f"doctor: {verdict} ({time.monotonic() - started:.1f} s)")
    return 1 if failures else 0


def with_backend(prepared: PreparedRun, backend: str) -> PreparedRun:
    """PREPARED with the plan's backend where the ranks' command line holds BACKEND_PLACEHOLDER
    (the plan that decides the backend is made with that command line: filled in after)."""
    return replace(
        prepared,
        argv=[backend if part == BACKEND_PLACEHOLDER else part for part in prepared.argv],
        files={
            name: text.replace(BACKEND_PLACEHOLDER, backend)
            for name, text in prepared.files.items()
        },
    )


# --- the checks of one node, before any rank starts ---------------------------------------


def check_node(node: int, master_addr: str, run_dir: Path, env: dict[str, str]) -> NodeReport:
    """Resolution of the head node, the interface, write speed and GPU health on this node."""
    report = NodeReport(node, socket.gethostname())
    address = resolve(master_addr)
    if address is None:
        report.failures.append(
            f"cannot resolve launch.master_addr {master_addr!r} (the head node): give its "
            "address with --master-addr, or fix the name in DNS or /etc/hosts"
        )
    else:
        report.facts.append(f"head node {master_addr} is {address}")
        report.facts.append(f"interface {network_interface(address, env)}")
    report.write_mb_s, problem = write_speed(run_dir)
    if problem:
        report.failures.append(problem)
    else:
        report.facts.append(f"run directory writes {report.write_mb_s:.0f} MB/s")
    gpu_health(report)
    report.warnings += build_lock_warnings(extension_folders(env))
    return report


def resolve(host: str) -> str | None:
    """The first address of HOST, or None when it does not resolve in time."""
    from dplaunch.launching.prepare import MASTER_ADDR_RESOLVE_SECONDS

    found: list[str] = []

    def lookup() -> None:
        with contextlib.suppress(OSError, UnicodeError, IndexError):
            found.append(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])

    # getaddrinfo has no timeout of its own (as the planner's check_master_addr)
    resolver = threading.Thread(target=lookup, daemon=True)
    resolver.start()
    resolver.join(MASTER_ADDR_RESOLVE_SECONDS)
    return found[0] if found else None


def network_interface(address: str, env: dict[str, str]) -> str:
    """The interface the ranks talk over: the one the environment names, else the route to ADDRESS."""
    for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if env.get(variable):
            return f"{env[variable]} ({variable})"
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # UDP: no packet is sent, the kernel only picks a route
            local = probe.getsockname()[0]
    except OSError as error:
        return f"unknown (no route to {address}: {error})"
    return f"{interface_of(local) or '?'} ({local}, the route to {address})"


def interface_of(local_address: str) -> str | None:
    """The name of the interface holding LOCAL_ADDRESS (from `ip -o addr`), None if unknown."""
    try:
        listing = subprocess.run(
            ["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == local_address:
            return parts[1]
    return None


def write_speed(run_dir: Path) -> tuple[float | None, str | None]:
    """(MB/s of an fsync'd write into RUN_DIR, None) or (None, why it failed)."""
    probe = run_dir / f"{DOCTOR_PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}"
    block = os.urandom(1 << 20)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with open(probe, "wb") as handle:
            for _ in range(WRITE_TEST_BYTES >> 20):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
        seconds = time.perf_counter() - started
    except OSError as error:
        return None, f"cannot write to the run directory {run_dir}: {error}"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return WRITE_TEST_BYTES / seconds / 1e6, None


def gpu_health(report: NodeReport) -> None:
    """nvidia-smi's word on this node's GPUs: uncorrected ECC errors fail, busy memory warns."""
    from dplaunch.launching.devices import HEALTH_FIELDS, probe_gpus, visible_gpus

    probe = probe_gpus(extra=HEALTH_FIELDS)
    gpus = visible_gpus(probe=probe)
    if not gpus:
        report.facts.append(f"no GPU ({probe.status})" if probe.status != "ok" else "no GPU")
        return
    for gpu in gpus:
        details = dict(gpu.details)
        ecc = details.get("ecc.errors.uncorrected.volatile.total", "")
        used = _number(details.get("memory.used", ""))
        clock, top = details.get("clocks.sm", "?"), details.get("clocks.max.sm", "?")
        report.facts.append(
            f"GPU {gpu.index} {gpu.name}: ECC uncorrected {ecc or '?'}, memory used "
            f"{details.get('memory.used', '?')}/{gpu.memory_mib} MiB, SM clock {clock}/{top} MHz, "
            f"{details.get('temperature.gpu', '?')} °C"
        )
        if ecc.isdigit() and int(ecc) > 0:
            report.failures.append(
                f"GPU {gpu.index} ({gpu.uuid}) has {ecc} uncorrected ECC errors: drain the node "
                "or reset the GPU"
            )
        if used is not None and gpu.memory_mib and used > 0.05 * gpu.memory_mib:
            report.warnings.append(f"GPU {gpu.index} has {used:.0f} MiB in use by another process")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def slow_writers(reports: list[NodeReport]) -> list[str]:
    """Nodes whose run-directory writes are far slower than the fastest node's."""
    speeds = [r.write_mb_s for r in reports if r.write_mb_s]
    if len(speeds) < 2:
        return []
    fastest = max(speeds)
    return [
        f"{r.name}: writes {r.write_mb_s:.0f} MB/s to the run directory, the fastest node "
        f"{fastest:.0f} MB/s: a slow disk or mount"
        for r in reports
        if r.write_mb_s and r.write_mb_s < SLOW_WRITE_FRACTION * fastest
    ]


# --- the nodes meet on the rendezvous port ---------------------------------------------------


def meet(node: int, nodes: int, master_addr: str, port: int, own: NodeReport) -> list[NodeReport]:
    """Node 0: every node's report (a stand-in for those that never came); others: their own,
    with a failure when node 0 could not be reached on the port within HANDSHAKE_S."""
    deadline = time.monotonic() + HANDSHAKE_S
    if node == 0:
        return _gather_reports(nodes, port, own, deadline)
    address = resolve(master_addr)
    if address is None:
        return [own]  # already a failure
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=2) as connection:
                connection.settimeout(max(deadline - time.monotonic(), 1))
                connection.sendall(own.to_json().encode() + b"\n")
                if connection.makefile().readline().strip() == "ok":
                    return [own]
                last_error = ConnectionError("no answer from node 0's doctor")
        except OSError as error:
            last_error = error
        time.sleep(0.5)
    own.failures.append(
        f"cannot reach the head node's rendezvous port {master_addr}:{port} within "
        f"{HANDSHAKE_S} s ({last_error}): is node 0's doctor running, is the port open "
        "(firewall), is --master-addr an address this node reaches?"
    )
    return [own]


def _gather_reports(nodes: int, port: int, own: NodeReport, deadline: float) -> list[NodeReport]:
    reports = {0: own}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(("", port))
        except OSError as error:
            own.failures.append(f"cannot listen on the rendezvous port {port}: {error}")
            return [own]
        server.listen(nodes)
        while len(reports) < nodes and time.monotonic() < deadline:
            server.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                connection, _ = server.accept()
            except TimeoutError:
                break
            with connection:
                connection.settimeout(5)
                with contextlib.suppress(OSError, ValueError, TypeError):
                    report = NodeReport.from_json(connection.makefile().readline())
                    reports[report.node] = report
                    connection.sendall(b"ok\n")
    for missing in sorted(set(range(nodes)) - set(reports)):
        stand_in = NodeReport(missing, "?")
        stand_in.failures.append(
            f"never reached the rendezvous port {port} of node 0 within {HANDSHAKE_S} s: not "
            "started, or the port is blocked between it and node 0"
        )
        reports[missing] = stand_in
    return list(reports.values())


# --- the ranks: a timed all-reduce ------------------------------------------------------------


def _run_ranks(prepared: PreparedRun, result_file: Path, seconds_left: float) -> list[str]:
    """Start the ranks as training would; failures (none when they finished in time)."""
    from dplaunch.launching.process import run_supervised
    from dplaunch.launching.rundir import write_run_files

    write_run_files(prepared.run_dir, prepared.files)
    result_file.unlink(missing_ok=True)
    plan = prepared.plan

    def too_late(_signum: int, _frame: Any) -> None:
        raise DoctorTimeout

    previous = signal.signal(signal.SIGALRM, too_late)
    signal.alarm(max(int(seconds_left), 1))
    try:
        code = run_supervised(prepared.argv, {**os.environ, **prepared.env})
    except DoctorTimeout:
        return [
            f"the ranks' all-reduce did not finish within the {DEADLINE_S} s deadline: a node "
            "is slow to start its ranks, or the ranks cannot reach each other (see above)"
        ]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if code != 0:
        return [f"the ranks' all-reduce failed (exit status {code}): see the ranks' errors above"]
    if plan.node_rank != 0:
        typer.echo(f"node {plan.node_rank}: ranks finished; node 0 reports the bandwidth")
        return []
    result = json.loads(result_file.read_text())
    typer.echo(f"all-reduce over {result['world_size']} rank(s) ({result['backend']}):")
    typer.echo(f"{'size':>10} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    for row in result["rows"]:
        typer.echo(
            f"{_size(row['bytes']):>10} {row['time_us']:>12.1f} {row['algbw_gbps']:>13.3g} "
            f"{row['busbw_gbps']:>13.3g}"
        )
    return []


def _size(count: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count >> shift} {unit}"
    return f"{count} B"


# --- DeepSpeed's build locks ---------------------------------------------------------------------


def build_lock_warnings(roots: list[Path]) -> list[str]:
    """A line for each stale DeepSpeed build lock under ROOTS: every DeepSpeed run outside
    dplaunch (and torch's other JIT builds) waits on it forever; `dplaunch train` removes it."""
    from dplaunch.launching.op_build import stale_lock_line, stale_locks

    return [
        f"{stale_lock_line(lock)}: `dplaunch train` removes it before its ranks start, any "
        f"other DeepSpeed launch waits on it forever: rm {lock.path}"
        for lock in stale_locks([root for root in roots if root.is_dir()])
    ]


def extension_folders(env: dict[str, str]) -> list[Path]:
    """Where JIT-built ops live: the run's folder, dplaunch's keyed ones, torch's default."""
    from dplaunch.launching.deepspeed_ops import torch_extensions_dir

    roots = [torch_extensions_dir().parent, Path.home() / ".cache" / "torch_extensions"]
    if env.get("TORCH_EXTENSIONS_DIR"):
        roots.insert(0, Path(env["TORCH_EXTENSIONS_DIR"]))
    return roots
