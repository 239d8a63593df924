"""A real one-host SLURM (munged + slurmctld + slurmd) started for the tests.

Use from a conftest or a test module::

    from tests.slurm_cluster import slurm_cluster  # session-scoped pytest fixture

    def test_job(slurm_cluster, tmp_path):
        job_id = slurm_cluster.submit(script, cwd=tmp_path)
        assert slurm_cluster.wait(job_id, timeout=60) == "COMPLETED"

The daemons run in the foreground as children of the test process, on free ports, with every
file (config, munge key and socket, state, spool, logs, pid files) under one private temp dir,
so several test sessions on one machine do not see each other. Nothing is left running after
the session. Missing packages are installed with `.ci/install-slurm.sh` (apt); when that is
impossible the tests that need the cluster are skipped with a loud reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = REPO_ROOT / ".ci" / "install-slurm.sh"
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
REQUIRED_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol")
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started on this machine."""


def _which(tool: str) -> str | None:
    """Find a tool on PATH or in the sbin dirs (root's PATH in containers may lack them)."""
    found = shutil.which(tool)
    if found:
        return found
    for directory in SBIN_DIRS:
        candidate = Path(directory) / tool
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def ensure_slurm_installed() -> None:
    """Install slurm-wlm and munge with apt when their daemons are missing."""
    if all(_which(tool) for tool in REQUIRED_TOOLS):
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("slurm-wlm/munge are not installed and apt-get is not available")
    result = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0:
        raise SlurmUnavailable(
            f"{INSTALL_SCRIPT.name} failed (exit {result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[-1500:]}"
        )
    missing = [tool for tool in REQUIRED_TOOLS if not _which(tool)]
    if missing:
        raise SlurmUnavailable(f"after {INSTALL_SCRIPT.name}, still missing: {missing}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _short_hostname() -> str:
    # slurmd looks itself up by this name in slurm.conf (NodeName); NodeAddr avoids DNS.
    return socket.gethostname().split(".")[0]


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _memory_mb() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 2048


def render_slurm_conf(
    root: Path, hostname: str, cpus: int, memory_mb: int, ctld_port: int, slurmd_port: int
) -> str:
    """A slurm.conf for one host where root runs everything and no cgroups are needed."""
    return f"""\
ClusterName=dpltest{ctld_port}
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/slurmd-%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: containers rarely let us create them, and we need neither limits nor fencing
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# batch jobs wait up to batch_sched_delay (3 s by default) before being scheduled
SchedulerParameters=batch_sched_delay=0
# no mail from a test cluster
MailProg=/bin/true
# no slurmdbd: sacct cannot answer, so finished jobs are kept in memory for an hour
# (MinJobAge) and their final state is also appended to a text file (jobcomp/filetxt)
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
MinJobAge=3600
ReturnToService=2
# trust this file over what slurmd measures (a container may report other sockets/memory)
SlurmdParameters=config_overrides
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
NodeName={hostname} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes={hostname} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


@dataclass
class SlurmCluster:
    """A running one-host SLURM: submit scripts with sbatch and wait for their final state."""

    root: Path
    hostname: str
    cpus: int
    env: dict[str, str]
    startup_seconds: float = 0.0  # daemons started until the node is idle
    install_seconds: float = 0.0  # apt install of slurm-wlm/munge (0 when already there)
    _daemons: list[tuple[str, subprocess.Popen]] = field(default_factory=list, repr=False)

    @property
    def conf_path(self) -> Path:
        """The slurm.conf every tool of this cluster reads (exported as SLURM_CONF)."""
        return self.root / "etc" / "slurm.conf"

    def run(self, *argv: str, timeout: float = 60, check: bool = True, cwd=None):
        """Run a SLURM client command (sinfo, scontrol, ...) against this cluster."""
        result = subprocess.run(
            list(argv), env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}\n"
                f"{self.logs_tail()}"
            )
        return result

    def submit(self, script_path: str | os.PathLike, cwd: str | os.PathLike | None = None) -> str:
        """Submit a batch script with the real `sbatch --parsable`; return the job id."""
        cwd = Path(cwd) if cwd is not None else Path(script_path).resolve().parent
        result = self.run("sbatch", "--parsable", str(script_path), cwd=cwd)
        # --parsable prints "jobid" or "jobid;cluster"
        return result.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str | None:
        """The job's current state (PENDING, RUNNING, COMPLETED, ...), or None if unknown."""
        result = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        if result.returncode == 0:
            for token in result.stdout.split():
                if token.startswith("JobState="):
                    return token.split("=", 1)[1]
        # slurmctld forgot the job (restart, MinJobAge): the completion log still has it
        return self._jobcomp_state(job_id)

    def _jobcomp_state(self, job_id: str) -> str | None:
        path = self.root / "log" / "jobcomp.txt"
        if not path.exists():
            return None
        state = None
        for line in path.read_text(errors="replace").splitlines():
            fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
            if fields.get("JobId") == str(job_id):
                state = fields.get("JobState")
        return state

    def wait(self, job_id: str, timeout: float = 120) -> str:
        """Poll until the job reaches a final state and return it (e.g. "COMPLETED")."""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in TERMINAL_STATES:
                return state
            time.sleep(0.2)
        raise TimeoutError(
            f"job {job_id} still {state} after {timeout:.0f}s\n"
            f"{self.run('scontrol', 'show', 'job', job_id, check=False).stdout}\n{self.logs_tail()}"
        )

    def logs_tail(self, lines: int = 30) -> str:
        """The end of every daemon log, for failure messages."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def wait_until_idle(self, timeout: float = 60) -> None:
        """Block until sinfo reports the node idle (slurmd registered with slurmctld)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, process in self._daemons:
                if process.poll() is not None:
                    raise SlurmUnavailable(
                        f"{name} exited with {process.returncode} during startup\n"
                        f"{self.logs_tail()}"
                    )
            result = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=10)
            last = (result.stdout + result.stderr).strip()
            if result.returncode == 0 and last.startswith("idle"):
                return
            time.sleep(0.2)
        raise SlurmUnavailable(
            f"node not idle after {timeout:.0f}s (sinfo: {last!r})\n{self.logs_tail()}"
        )

    def stop(self) -> None:
        """Cancel leftover jobs and stop the daemons (slurmd, slurmctld, munged)."""
        controller_up = any(
            process.poll() is None for name, process in self._daemons if name == "slurmctld"
        )
        if controller_up:
            # let slurmd end the jobs' processes (slurmstepd and below) before it goes away
            self.run("scancel", "--quiet", "--user=root", check=False, timeout=10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                queue = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.2)
        for _name, process in reversed(self._daemons):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _name, process in reversed(self._daemons):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self._daemons.clear()


def _write_munge_key(path: Path) -> None:
    path.write_bytes(os.urandom(1024))
    path.chmod(0o400)


@contextlib.contextmanager
def start_slurm_cluster(root: Path | None = None, keep: bool = False) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd for this host; stop them and clean up on exit."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("the local SLURM cluster needs root (slurmd runs jobs as any user)")
    installing = time.monotonic()
    ensure_slurm_installed()
    started = time.monotonic()
    # a short path: the munge socket path must fit in sun_path (108 bytes)
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="dpl-slurm-", dir="/tmp")) if own_root else Path(root)
    # munged demands that every directory above its socket be executable by all
    root.chmod(0o755)
    for sub in ("etc", "munge", "state", "spool", "run", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o755)
    hostname = _short_hostname()
    (root / "spool" / f"slurmd-{hostname}").mkdir()

    cpus = _cpu_count()
    memory_mb = max(256, _memory_mb() // 2)
    conf = render_slurm_conf(root, hostname, cpus, memory_mb, _free_port(), _free_port())
    (root / "etc" / "slurm.conf").write_text(conf)
    _write_munge_key(root / "munge" / "munge.key")

    env = dict(os.environ)
    env["SLURM_CONF"] = str(root / "etc" / "slurm.conf")
    env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN_DIRS])
    # a test session may itself run inside a SLURM job: do not leak that job into ours
    for key in list(env):
        if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and key != "SLURM_CONF":
            del env[key]
    cluster = SlurmCluster(root=root, hostname=hostname, cpus=cpus, env=env)
    cluster.install_seconds = started - installing

    daemons = [
        (
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={root}/munge/munge.socket",
                f"--key-file={root}/munge/munge.key",
                f"--pid-file={root}/run/munged.pid",
                f"--log-file={root}/log/munged.log",
                f"--seed-file={root}/munge/munged.seed",
            ],
        ),
        # -i: ignore any saved state; -D: foreground so that we own the process
        ("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(cluster.conf_path)]),
        ("slurmd", [_which("slurmd"), "-D", "-f", str(cluster.conf_path)]),
    ]
    try:
        for name, argv in daemons:
            log = open(root / "log" / f"{name}.stdout", "wb")  # noqa: SIM115 - closed with the fd
            process = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            log.close()
            cluster._daemons.append((name, process))
            if name == "munged":
                _wait_for_path(root / "munge" / "munge.socket", process, cluster)
            elif name == "slurmctld":
                _wait_for_controller(cluster, process)
        cluster.wait_until_idle()
        cluster.startup_seconds = time.monotonic() - started
        yield cluster
    finally:
        cluster.stop()
        if own_root and not keep:
            shutil.rmtree(root, ignore_errors=True)


def _wait_for_path(path: Path, process: subprocess.Popen, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SlurmUnavailable(f"munged did not create {path}\n{cluster.logs_tail()}")
        time.sleep(0.05)


def _wait_for_controller(cluster: SlurmCluster, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while True:
        result = cluster.run("scontrol", "ping", check=False, timeout=10)
        if result.returncode == 0 and "UP" in result.stdout:
            return
        if process.poll() is not None or time.monotonic() > deadline:
            raise SlurmUnavailable(
                f"slurmctld not answering: {result.stdout.strip()} {result.stderr.strip()}\n"
                f"{cluster.logs_tail()}"
            )
        time.sleep(0.1)


def _to_terminal(request: pytest.FixtureRequest, text: str) -> None:
    """Print past pytest's output capture, to stderr (what CI logs show)."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    context = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    with context:
        print(text, file=sys.stderr, flush=True)


def _skip_loudly(request: pytest.FixtureRequest, reason: str) -> None:
    banner = "!" * 78
    message = f"SLURM TESTS SKIPPED: {reason}"
    _to_terminal(request, f"\n{banner}\n{message}\n{banner}")
    warnings.warn(message, pytest.PytestWarning, stacklevel=2)
    if os.environ.get("DPLAUNCH_REQUIRE_SLURM") == "1":
        pytest.fail(f"DPLAUNCH_REQUIRE_SLURM=1 but the local SLURM is unavailable: {reason}")
    pytest.skip(f"local SLURM unavailable: {reason}")


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """A started one-host SLURM for the whole test session (skipped loudly if impossible)."""
    manager = start_slurm_cluster()
    try:
        cluster = manager.__enter__()
    except (SlurmUnavailable, OSError, subprocess.SubprocessError) as error:
        _skip_loudly(request, str(error))
        return
    message = (
        f"local SLURM up in {cluster.startup_seconds:.1f}s "
        f"(+{cluster.install_seconds:.1f}s to install it) "
        f"(node {cluster.hostname}, {cluster.cpus} CPUs, SLURM_CONF={cluster.conf_path})"
    )
    _to_terminal(request, f"\n{message}")
    try:
        yield cluster
    finally:
        manager.__exit__(None, None, None)
