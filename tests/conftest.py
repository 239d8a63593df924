"""Session fixtures shared by the multi-process tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import spy_environment, train

# the comparison every layout is checked against: 6 steps, global batch 8 in micro-batches of 2
COMPARISON_FLAGS = ("--max-steps", "6", "--global-batch", "8", "--micro-batch", "2")


@pytest.fixture(scope="session")
def dp_reference(tmp_path_factory) -> Path:
    """A 2-rank pure data-parallel run of the tiny Llama: the numbers other layouts must match
    (and, spied, the collectives DDP issues: tests/test_data_parallel.py)."""
    run_dir = tmp_path_factory.mktemp("reference") / "dp2"
    train(run_dir, "--cpu", "--gpus", "2", *COMPARISON_FLAGS, env=spy_environment(run_dir))
    return run_dir
