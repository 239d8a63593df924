"""Session fixtures shared by the multi-process tests."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import (
    REPO,
    child_environment,
    cpu_rank_environment,
    spy_environment,
    train,
    write_config,
)
from tests.rank_zygote import CLI_SUFFIX, LOG_NAME, REAL_START_VARIABLE, SOCKET_VARIABLE


def pytest_configure(config):
    """The suite never reads the user's caches: a profile saved by `dplaunch calibrate` in
    ~/.cache/dplaunch/profiles would change the forecast and what `parallel: auto` picks."""
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="dplaunch-tests-cache-")


# the test files whose processes (command line, launchers, ranks) start as themselves, not from
# the suite's fork servers (tests/rank_zygote.py): they check how processes start, what they
# import, how much memory they take, their process tree, or SLURM's
REAL_START_FILES = frozenset(
    {
        "test_benchmark_harness.py",
        "test_cli.py",
        "test_estimate.py",
        "test_forecast.py",
        # Ray's workers start the ranks themselves; a rank must be its worker's child
        "test_ray.py",
        "test_reliability.py",
        "test_slurm_cluster.py",
        "test_tensorflow_launch.py",
        "test_trackers.py",
    }
)
ZYGOTE_SITE = Path(__file__).parent / "rank_zygote_site"
_zygote: dict[str, str] = {}


def _zygote_socket() -> str:
    """The socket of this worker's fork servers, started on first use (~5 s of imports): the
    ranks' (its path) and the command line's (the path + CLI_SUFFIX)."""
    if "socket" not in _zygote:
        folder = tempfile.mkdtemp(prefix="dplaunch-zygote-")
        path = os.path.join(folder, "socket")
        log = open(os.path.join(folder, LOG_NAME), "w")  # noqa: SIM115 — the servers' life
        servers = [
            subprocess.Popen(
                [sys.executable, "-u", "-m", "tests.rank_zygote", *options, path + suffix],
                cwd=REPO,
                env=environment,  # what the imports of what it serves would see
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
            for options, suffix, environment in (
                ((), "", cpu_rank_environment()),
                (("--cli",), CLI_SUFFIX, child_environment()),
            )
        ]
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # after the kills below
        for server in servers:
            if not server.stdout.readline().startswith("ready"):
                raise RuntimeError(f"a fork server of the suite did not start: see {log.name}")
            # its group: the server, its keepers and any process it serves still alive
            atexit.register(os.killpg, server.pid, signal.SIGKILL)
        _zygote["socket"] = path
    return _zygote["socket"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around each test but REAL_START_FILES', its module fixtures included: processes from the
    servers."""
    if item.path.name in REAL_START_FILES or os.environ.get(REAL_START_VARIABLE):
        yield
        return
    saved = {name: os.environ.get(name) for name in (SOCKET_VARIABLE, "PYTHONPATH")}
    os.environ[SOCKET_VARIABLE] = _zygote_socket()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ZYGOTE_SITE), saved["PYTHONPATH"]])
    )
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves os.environ as it found it: a command called in this process (export sets
    TQDM_DISABLE for its own process) must not change what later tests' ranks inherit."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# the comparison every layout is checked against: 6 steps, global batch 8 in micro-batches of 2
COMPARISON_FLAGS = ("--max-steps", "6", "--global-batch", "8", "--micro-batch", "2")


@pytest.fixture(scope="session")
def dp_reference(tmp_path_factory) -> Path:
    """A 2-rank pure data-parallel run of the tiny Llama: the numbers other layouts must match
    (and, spied, the collectives DDP issues: tests/test_data_parallel.py)."""
    run_dir = tmp_path_factory.mktemp("reference") / "dp2"
    train(run_dir, "--cpu", "--gpus", "2", *COMPARISON_FLAGS, env=spy_environment(run_dir))
    return run_dir


@pytest.fixture(scope="module")
def run_file(tmp_path_factory) -> Path:
    """The tiny Llama on the first 44 reviews (3 steps per epoch at global batch 8), for the
    checkpoint and restart tests (test_lora has a run_file of its own)."""
    folder = tmp_path_factory.mktemp("small")
    data = folder / "reviews-44.jsonl"
    rows = (REPO / "dplaunch/resources/data/reviews.jsonl").read_text().splitlines()[:44]
    data.write_text("\n".join(rows) + "\n")
    return write_config(folder / "tiny-small.yaml", data={"dataset": str(data)})
