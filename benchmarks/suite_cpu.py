"""Where the test suite's CPU goes: `python -m benchmarks.suite_cpu [PYTEST ARGS…]`.

Runs pytest (the arguments as `make test` would take them; default: the whole suite on two
workers) with a tracer that every Python process of the run loads at start-up (a sitecustomize
module on PYTHONPATH): it records the process's command line and the test that started it
(pytest's PYTEST_CURRENT_TEST, which the children inherit), and at exit the CPU the process used
(user + system, its own, not its children's). Then it prints the CPU by kind of process (pytest,
the dplaunch CLI by command, `accelerate launch`, the ranks, the rest) and the CPU of the
processes each test file and each test started — what a faster suite must cut.

A process killed by a signal records no exit (counted under "no exit record"); processes that
SLURM's daemons start are not the test run's children and are not seen. The tracer takes the
place of the interpreter's own sitecustomize; the suite's (tests/rank_zygote_site) runs it after
its own. A rank the suite's fork server starts (tests/rank_zygote.py) inherits the tracer from
the server and records only its exit (its CPU, not the server's imports); the process that waits
for it hands over before the tracer loads and is not measured (tens of milliseconds). The whole
suite takes as long as `make test` (and a little more); `--keep FILE` keeps the records (JSON
lines) for another look, `--records FILE` reports on kept ones without running anything.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOG_VARIABLE = "SUITE_CPU_LOG"
DEFAULT_PYTEST = ("-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile")
XDIST_WORKER = "import sys;exec(eval(sys.stdin.readline()))"

TRACER = f'''
import atexit, json, os, resource, sys

_LOG = os.environ.get("{LOG_VARIABLE}")


def _record(kind):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {{"kind": kind, "pid": os.getpid(), "argv": list(sys.orig_argv),
              "test": os.environ.get("PYTEST_CURRENT_TEST"), "cpu": usage.ru_utime + usage.ru_stime}}
    try:
        with open(_LOG, "a") as log:
            log.write(json.dumps(record) + "\\n")
    except OSError:
        pass


if _LOG:
    _record("start")
    atexit.register(_record, "exit")
    _os_exit = os._exit

    def _exit(status):
        _record("exit")
        _os_exit(status)

    os._exit = _exit
'''


@dataclass
class Process:
    pid: int
    argv: list[str]
    test: str
    cpu: float | None = None

    @property
    def kind(self) -> str:
        """What the process was: pytest, a dplaunch command, the launcher, a rank, or other."""
        words = self.argv[1:4]
        if "accelerate.commands.launch" in words:
            return "accelerate launch"
        if "dplaunch.train" in words:
            return "rank (python -m dplaunch.train)"
        if words[:2] == ["-m", "dplaunch"]:
            return f"dplaunch {words[2] if len(words) > 2 else ''}".strip()
        # pytest itself, and pytest-xdist's workers (execnet starts them reading their code
        # from stdin)
        if words[:2] == ["-m", "pytest"] or XDIST_WORKER in self.argv:
            return "pytest"
        return "other python"


def read_records(lines: Iterable[str]) -> dict[int, Process]:
    """The processes of a run, by pid (the last process a recycled pid named)."""
    processes: dict[int, Process] = {}
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        process = processes.get(record["pid"])
        # a process forked from a measured one (the suite's fork server's ranks: tests/rank_zygote.py)
        # records only its exit, with its own command line and test
        if record["kind"] == "start" or process is None:
            test = (record["test"] or "").split(" (")[0]
            process = processes[record["pid"]] = Process(record["pid"], record["argv"], test)
        if record["kind"] == "exit":
            process.cpu = max(process.cpu or 0.0, record["cpu"])
    return processes


def report(processes: dict[int, Process], top: int = 25) -> str:
    """The tables: CPU by kind of process, by test file, by test."""
    lines: list[str] = []
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    unmeasured: collections.Counter[str] = collections.Counter()
    for process in processes.values():
        if process.cpu is None:
            unmeasured[process.kind] += 1
        else:
            kinds[process.kind].append(process.cpu)
    total = sum(sum(values) for values in kinds.values()) or 1e-9  # none measured: no shares
    lines.append(f"{len(processes)} Python processes, {total:.0f} s of CPU measured")
    lines.append(f"{'kind of process':34} {'count':>6} {'CPU s':>8} {'share':>6} {'mean s':>7}")
    for kind, values in sorted(kinds.items(), key=lambda item: -sum(item[1])):
        lines.append(
            f"{kind:34} {len(values):6d} {sum(values):8.0f} {sum(values) / total:6.1%} "
            f"{sum(values) / len(values):7.2f}"
        )
    if unmeasured:
        lines.append(
            "no exit record (killed): "
            + ", ".join(f"{kind} {count}" for kind, count in unmeasured.most_common())
        )
    by_test: dict[str, float] = collections.defaultdict(float)
    for process in processes.values():
        if process.test and process.cpu is not None and process.kind != "pytest":
            by_test[process.test] += process.cpu
    by_file: dict[str, float] = collections.defaultdict(float)
    for test, cpu in by_test.items():
        by_file[test.split("::")[0]] += cpu
    for title, table in (("test file", by_file), ("test", by_test)):
        lines.append("")
        lines.append(f"CPU of the processes each {title} started (top {top})")
        for name, cpu in sorted(table.items(), key=lambda item: -item[1])[:top]:
            lines.append(f"{cpu:8.1f}  {name}")
    return "\n".join(lines)


def run_traced(pytest_args: list[str], log: Path) -> int:
    """pytest with the tracer in every Python process; its exit status."""
    with tempfile.TemporaryDirectory(prefix="dplaunch-suite-cpu-") as folder:
        (Path(folder) / "sitecustomize.py").write_text(TRACER)
        paths = [folder, *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), LOG_VARIABLE: str(log)}
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "pytest", *pytest_args]
        return subprocess.run(command, env=env, cwd=REPO, check=False).returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite_cpu", description=__doc__)
    parser.add_argument("--keep", type=Path, help="keep the records (JSON lines) in this file")
    parser.add_argument("--records", type=Path, help="report on kept records, run nothing")
    parser.add_argument("--top", type=int, default=25, help="rows of the per-file/test tables")
    options, pytest_args = parser.parse_known_args(argv)
    status = 0
    if options.records:
        log = options.records
    else:
        log = options.keep or Path(tempfile.mkdtemp(prefix="dplaunch-suite-cpu-")) / "log.jsonl"
        log.unlink(missing_ok=True)
        status = run_traced(pytest_args or list(DEFAULT_PYTEST), log)
    print(report(read_records(log.read_text().splitlines()), options.top))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
