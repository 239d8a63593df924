"""Session fixtures shared by the multi-process tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO, spy_environment, train, write_config


def pytest_configure(config):
    """The suite never reads the user's caches: a profile saved by `dplaunch calibrate` in
    ~/.cache/dplaunch/profiles would change the forecast and what `parallel: auto` picks."""
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="dplaunch-tests-cache-")


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
