"""What every comparison shares: alternating repetitions, medians and ratios, process launching,
the machine facts that go into each result file, and the charts.

The harness itself imports no torch: contenders run in their own processes, so their start-up
and memory are theirs alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from dplaunch.run_directory.layout import LAUNCH_SCRIPT

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
CONFIGS = BENCHMARKS / "configs"
PYTHON = sys.executable
# the console scripts a user types, next to this interpreter (the venv's bin/)
BIN = Path(PYTHON).parent
SHARED_MACHINE_NOTE = (
    "The machine may have been shared with other engineers' test suites while this ran: absolute "
    "times are noisy. Contenders run alternately (A B C, B C A, …) and only medians of "
    "repetitions and ratios are reported; a ratio compares runs made minutes apart under the "
    "same load."
)
# torch extension cache of the benchmarks alone (see bench_environment)
EXTENSIONS_CACHE = Path.home() / ".cache" / "dplaunch-benchmarks" / "torch_extensions"
# a contender run that takes longer is stopped (and repeated once): it hangs, it does not compute
RUN_LIMIT_S = 420
# time_to_lines' key for the moment the command exited
EXIT = "<exit>"
VERSIONED_PACKAGES = (
    "torch",
    "accelerate",
    "deepspeed",
    "transformers",
    "datasets",
    "typer",
    "dplaunch",
)


@dataclass
class Options:
    """What `python -m benchmarks.run` was asked for."""

    quick: bool = False
    reps: int | None = None
    # last optimizer step of the flags and scaling_peers runs (None: their default)
    steps: int | None = None
    work_dir: Path = field(default_factory=lambda: Path("/tmp"))
    write: bool = True
    # the load average when the current comparison started (set by benchmarks.run)
    load_at_start: tuple[float, ...] = ()

    def folder(self, name: str) -> Path:
        """WORK_DIR/NAME, created: where one comparison keeps its run directories and logs."""
        work = self.work_dir / name
        work.mkdir(parents=True, exist_ok=True)
        return work

    def repetitions(self, full: int, quick: int = 1) -> int:
        """--reps wins; else ``quick`` under --quick and ``full`` otherwise."""
        if self.reps is not None:
            return self.reps
        return quick if self.quick else full


# ---------------------------------------------------------------------------------------------
# statistics


def median(values: list[float]) -> float:
    return statistics.median(values)


def alternate(
    contenders: dict[str, Callable[[int], float]],
    reps: int,
    *,
    retried: list[str] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, list[float]]:
    """Run every contender once per repetition, rotating who goes first, and collect the values.

    Adjacent runs share the machine's load, so a per-repetition ratio compares like with like;
    rotating the order keeps a warm page cache or a slow neighbour from always favouring one side.
    A run that fails or hangs (on a shared machine, other jobs' DeepSpeed shared-memory segments
    have been seen to interfere) is repeated once and noted in ``retried``.
    """
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            try:
                value = contenders[name](rep)
            except RunFailed as error:
                note = f"{name}, repetition {rep + 1}: {failure_note(error)}"
                say(f"  rep {rep + 1}/{reps}  {name}: failed, running it again ({note})")
                if retried is not None:
                    retried.append(note)
                value = contenders[name](rep)
            samples[name].append(value)
            say(f"  rep {rep + 1}/{reps}  {name:<28} {value:10.3f}")
    return samples


def failure_note(error: RunFailed) -> str:
    """The failed command and its last line of output (its log is gone with the work dir)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    note = f"{lines[0]} → {lines[-1].strip() if len(lines) > 1 else 'no output'}"
    # the note goes into benchmarks/results/, which is committed: paths relative to the checkout
    return note.replace(f"{REPO}/", "").replace(str(REPO), ".")


def paired_ratios(top: list[float], bottom: list[float]) -> list[float]:
    """top[i] / bottom[i] for each repetition i."""
    return [a / b for a, b in zip(top, bottom, strict=True)]


def ratio_entry(
    top: list[float],
    bottom: list[float],
    *,
    goal: float | None,
    higher_is_better: bool,
    meaning: str,
) -> dict[str, Any]:
    """A ratio of two contenders: median of the per-repetition ratios (the headline), the ratio of
    the medians, the goal and whether it was met (None: a ratio reported without a goal)."""
    pairs = paired_ratios(top, bottom)
    value = median(pairs)
    met = None if goal is None else (value >= goal if higher_is_better else value <= goal)
    return {
        "value": round(value, 4),
        "ratio_of_medians": round(median(top) / median(bottom), 4),
        "per_repetition": [round(x, 4) for x in pairs],
        "goal": None if goal is None else f"{'≥' if higher_is_better else '≤'} {goal}",
        "higher_is_better": higher_is_better,
        "met": met,
        "meaning": meaning,
    }


def verdict(entry: dict[str, Any]) -> str:
    """'goal ≥ 1.0: met', 'goal ≤ 1.05: NOT met' or 'no goal (lower is better)'."""
    if entry["goal"] is None:
        return f"no goal ({'higher' if entry['higher_is_better'] else 'lower'} is better)"
    return f"goal {entry['goal']}: {'met' if entry['met'] else 'NOT met'}"


def summarize(samples: dict[str, list[float]], unit: str) -> dict[str, Any]:
    return {
        name: {
            "median": round(median(values), 4),
            "min": round(min(values), 4),
            "max": round(max(values), 4),
            "samples": [round(v, 4) for v in values],
            "unit": unit,
        }
        for name, values in samples.items()
    }


def print_ratios(title: str, ratios: dict[str, dict[str, Any]]) -> None:
    print(f"\n== {title}")
    for name, entry in ratios.items():
        print(
            f"  {name:<52} {entry['value']:7.3f}×  ({verdict(entry)}; "
            f"per rep {', '.join(f'{x:.3f}' for x in entry['per_repetition'])})"
        )


# ---------------------------------------------------------------------------------------------
# machine and versions


def machine_facts() -> dict[str, Any]:
    """Date, machine, load and versions: what a reader needs to judge the numbers."""
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory_gb = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "cpu_model": cpu_model or platform.processor(),
            "memory_gib": memory_gb,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(),
        },
        "versions": versions,
        "git_commit": _git_commit(),
        "note": SHARED_MACHINE_NOTE,
    }


def _git_commit() -> str | None:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        # the code measured; not the results folder, this run's own output
        paths = ["dplaunch", "benchmarks", f":!{RESULTS.relative_to(REPO)}"]
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *paths],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return commit + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def tokens_payload(
    what: str,
    config: Path,
    reps: int,
    samples: dict[str, list[float]],
    ratios: dict[str, dict[str, Any]],
    retried: list[str],
    **extra: Any,
) -> dict[str, Any]:
    """The result of a comparison of tokens/s: what was measured, on which run file, every sample
    (EXTRA after them), the ratios and the runs that had to be repeated."""
    return {
        "what": what,
        "config": str(config.relative_to(REPO)),
        "repetitions": reps,
        "contenders": summarize(samples, "tokens/s"),
        **extra,
        "ratios": ratios,
        "repeated_runs": retried,
    }


def write_result(name: str, payload: dict[str, Any], options: Options) -> Path | None:
    """benchmarks/results/NAME.json with the machine facts, unless --no-write."""
    if not options.write:
        return None
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {"comparison": name, **machine_facts(), "quick": options.quick, **payload}
    if options.load_at_start:
        record["machine"]["load_average_at_start"] = [round(x, 2) for x in options.load_at_start]
    record["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# processes


def bench_environment(**extra: str) -> dict[str, str]:
    """Ranks run one thread each, see no GPU and never reach the hub.

    DeepSpeed loads its CPU communication op through torch's extension cache, behind a file lock;
    other jobs on the machine (test suites) loading the same op held it for minutes, so the
    benchmarks keep a cache of their own (compiled once, ~30 s, then reused).
    """
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_CACHE),
        }
    )
    env.update(extra)
    return env


def fresh(work: Path, stem: str) -> str:
    """A name under ``work`` that nothing has used yet: STEM, STEM-try2, … (a repeated run gets
    its own run directory and logs)."""
    name, attempt = stem, 1
    while (work / name).exists() or any(work.glob(f"{name}.*")):
        attempt += 1
        name = f"{stem}-try{attempt}"
    return name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunFailed(RuntimeError):
    """A contender's process failed, hung past its limit, or did not print what it should."""


def process_tree(pid: int) -> list[Any]:
    """psutil handles of a process and of everything it started (ranks run in sessions of their
    own, so a process group would miss them); empty once it is gone."""
    import psutil  # dplaunch's and accelerate's dependency; light

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def stop_tree(process: subprocess.Popen) -> None:
    """Stop a command we started and everything it started: SIGTERM, SIGKILL after 15 s. Each is
    thawed first (an interleaved contender may be frozen, and would hold its SIGTERM)."""
    import psutil

    family = process_tree(process.pid)
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.send_signal(signal.SIGCONT)
            member.terminate()
    _, alive = psutil.wait_procs(family, timeout=15)
    for member in alive:
        with contextlib.suppress(psutil.Error):
            member.kill()


def _watched(process: subprocess.Popen, timeout: float) -> threading.Timer:
    """A timer that stops the command's whole process tree after ``timeout`` seconds."""
    timer = threading.Timer(timeout, stop_tree, args=(process,))
    timer.daemon = True
    timer.start()
    return timer


def dplaunch_train_argv(config: Path, run_dir: Path, *flags: str) -> list[str]:
    """`dplaunch train CONFIG FLAGS` into RUN_DIR on a free port, run by this interpreter."""
    argv = [PYTHON, "-m", "dplaunch", "train", str(config), *flags]
    return argv + ["--master-port", str(free_port()), "-o", str(run_dir)]


def run_checked(
    argv: list[str], log: Path, env: dict[str, str], timeout: float = RUN_LIMIT_S
) -> float:
    """Run a command to completion with its output in ``log``; return its wall time in seconds."""
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        timer = _watched(process, timeout)
        code = process.wait()
        timer.cancel()
    wall = time.perf_counter() - start
    if code != 0:
        raise RunFailed(
            f"{shlex.join(argv)} exited with {code}"
            + (f" (stopped after {timeout:.0f} s)" if wall >= timeout else "")
            + "; last output:\n"
            + "\n".join(log.read_text().splitlines()[-30:])
        )
    return wall


def time_to_lines(
    argv: list[str],
    prefixes: list[str],
    log: Path,
    env: dict[str, str],
    timeout: float = RUN_LIMIT_S,
) -> dict[str, float]:
    """Seconds from starting ``argv`` to the first stdout line starting with each prefix, and to
    its exit (key ``EXIT``); the command must succeed and print every prefix."""
    start = time.perf_counter()
    seen: dict[str, float] = {}
    with log.open("w") as out:
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=out,
            env=env,
            cwd=REPO,
            text=True,
            bufsize=1,
        )
        timer = _watched(process, timeout)
        assert process.stdout is not None
        for line in process.stdout:
            now = time.perf_counter() - start
            for prefix in prefixes:
                if prefix not in seen and line.startswith(prefix):
                    seen[prefix] = now
            out.write(line)
        code = process.wait()
        timer.cancel()
    seen[EXIT] = time.perf_counter() - start
    missing = [prefix for prefix in prefixes if prefix not in seen]
    if code != 0 or missing:
        raise RunFailed(
            f"{shlex.join(argv)} exited with {code}"
            + (f" (stopped after {timeout:.0f} s)" if seen[EXIT] >= timeout else "")
            + (f" without printing lines starting with {missing}" if missing else "")
            + "; last output:\n"
            + "\n".join(log.read_text().splitlines()[-30:])
        )
    return seen


def render_run(config: Path, out: Path, *flags: str) -> dict[str, Any]:
    """`dplaunch config CONFIG FLAGS --out OUT`: the files every contender reads; returns the
    exported environment and argv of OUT/launch.sh."""
    run_checked(
        [PYTHON, "-m", "dplaunch", "config", str(config), *flags, "--out", str(out)],
        out.parent / f"{out.name}.render.log",
        bench_environment(),
    )
    return read_launch_script(out / LAUNCH_SCRIPT)


def read_launch_script(path: Path) -> dict[str, Any]:
    """The environment (``export`` lines) and argv (``exec`` line) of a dplaunch launch.sh."""
    env: dict[str, str] = {}
    argv: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            env[name] = shlex.split(value)[0] if value else ""
        elif line.startswith("exec "):
            argv = shlex.split(line[len("exec ") :])
    return {"env": env, "argv": argv}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# charts


def bar_chart(
    path: Path,
    title: str,
    groups: dict[str, dict[str, list[float]]],
    *,
    ylabel: str,
    subtitle: str = "",
    goal_line: tuple[float, str] | None = None,
) -> None:
    """Grouped bars of medians with every repetition as a dot; one group per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contenders: list[str] = []
    for samples in groups.values():
        contenders += [name for name in samples if name not in contenders]
    width = 0.8 / max(len(contenders), 1)
    fig, axis = plt.subplots(figsize=(max(6.0, 2.2 * len(groups) + 2.5), 4.2))
    colors = plt.get_cmap("tab10").colors
    labelled: set[str] = set()
    for c, name in enumerate(contenders):
        for g, samples in enumerate(groups.values()):
            if name not in samples:
                continue
            x = g + (c - (len(contenders) - 1) / 2) * width
            values = samples[name]
            axis.bar(
                x,
                median(values),
                width * 0.9,
                color=colors[c % 10],
                label=None if name in labelled else name,
            )
            labelled.add(name)
            axis.scatter([x] * len(values), values, color="black", s=10, zorder=3)
            axis.annotate(
                _short(median(values)),
                (x, median(values)),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
    if goal_line is not None:
        axis.axhline(goal_line[0], color="red", linestyle="--", linewidth=1, label=goal_line[1])
    axis.set_xticks(range(len(groups)), list(groups))
    axis.set_ylabel(ylabel)
    axis.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    axis.legend(fontsize=8, loc="best")
    axis.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
