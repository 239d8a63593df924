"""`make demo` on a fresh clone, as a first-time user reads it: the commands it runs, none of the
Makefile's comments (make prints a tab-indented comment of a recipe as a shell line)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers import REPO


def test_make_demo_prints_its_commands_and_not_the_makefiles_comments(tmp_path):
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make here")
    # a virtual environment whose python and pip do nothing and whose dplaunch says what it got:
    # the install recipe runs (no stamp yet), then the demo's training command
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    dplaunch = venv / "bin" / "dplaunch"
    dplaunch.write_text('#!/bin/sh\necho "fake dplaunch $*"\n')
    dplaunch.chmod(0o755)
    result = subprocess.run(
        [make, "--no-print-directory", "demo", f"VENV={venv}", "PY=true", "PYTHON=true"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = result.stdout.splitlines()
    assert "true -m pip install --quiet -c constraints.txt -e '.[dev,docs]'" in lines
    assert "fake dplaunch train --gpus 2 --output-dir runs/demo-" in result.stdout
    assert [line for line in lines if line.lstrip().startswith("#")] == []
