"""Packaging tells the truth: the wheel trains the default run from anywhere, its dependency floors
are the ones dplaunch checks, and an older library is one line before launch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from dplaunch.errors import UserError
from dplaunch.requirements import CHECKED, check_installed_versions, floors, release
from tests.helpers import REPO, child_environment, read_metrics, refusal_line
from tests.helpers import run_dplaunch as dplaunch

# not part of a source tree a user would build from
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "runs", "build", "site", "*.egg-info", "__pycache__", ".whl", ".tmp"
)


def fake_distribution(root: Path, name: str, version: str) -> Path:
    """A dist-info that importlib.metadata finds before the real one when ROOT leads sys.path."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def test_releases_compare_by_their_numbers():
    assert release("2.13.0+cu128") == release("2.13") > release("2.6.0") > release("2.5.1")
    assert release("0.19.8") > release("0.19.7") and release("5.24.0rc1") == release("5.24")


def test_an_old_library_is_refused_in_one_line_with_what_needs_it():
    versions = {name: "99.0" for name in CHECKED} | {"transformers": "4.45.2"}
    with pytest.raises(UserError) as refused:
        check_installed_versions(versions.__getitem__)
    assert refused.value.field == "transformers"
    assert "4.45.2 is installed, dplaunch needs 5.24 or newer" in str(refused.value)
    assert "dtype=" in str(refused.value)
    check_installed_versions({name: "99.0" for name in CHECKED}.__getitem__)  # new enough


def test_dplaunch_train_with_an_old_transformers_stops_before_launch(tmp_path):
    """The story of the issue: transformers 4.45.2 inside the old declared range used to fail in
    every rank with `unexpected keyword argument 'dtype'`."""
    fake = fake_distribution(tmp_path / "old", "transformers", "4.45.2")
    paths = [str(fake), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = child_environment(PYTHONPATH=os.pathsep.join(paths))
    result = dplaunch("train", "--gpus", "2", "--dry-run", "-o", tmp_path / "run", env=env)
    refusal_line(
        result, "dplaunch: error: transformers: 4.45.2 is installed", "'transformers>=5.24'"
    )
    assert not (tmp_path / "run").exists()


def test_the_floors_are_at_least_what_the_code_needs_and_at_most_what_is_tested():
    pinned = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if version:
            pinned[name.strip()] = version.strip()
    declared = floors()
    assert set(CHECKED) <= set(declared)
    for name, floor in declared.items():
        assert name in pinned, f"{name} has a floor but no tested pin in constraints.txt"
        assert release(floor) <= release(pinned[name]), (name, floor, pinned[name])
    # what the code calls: from_pretrained(dtype=...) and masking_utils (transformers >= 4.56),
    # unwrap_model(keep_torch_compile=...)
    assert release(declared["transformers"]) >= release("4.56")


@pytest.mark.multiprocess
def test_the_wheel_trains_the_default_run_from_outside_the_checkout(tmp_path):
    """Build the wheel from a copy of the sources, install it (no deps) into a fresh venv whose
    dependencies come from this environment's site-packages (a .pth line: only the package
    itself comes from the wheel), then train 2 steps of the default run from another folder."""
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--wheel-dir", str(wheels), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("dplaunch-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "dplaunch/resources/default.yaml" in names
    assert "dplaunch/resources/data/reviews.jsonl" in names
    assert "dplaunch/resources/requirements.txt" in names
    for name, floor in floors().items():  # one list: the metadata's is the checked one
        assert f"Requires-Dist: {name}>={floor}" in metadata, name

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # the dependencies, already installed here (their .pth files, an editable dplaunch's among
    # them, are not run from a folder added this way)
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
        + ["--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = child_environment()
    env.pop("PYTHONPATH", None)
    where = subprocess.run(
        [python, "-c", "import dplaunch; print(dplaunch.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(site), where
    result = subprocess.run(
        [venv / "bin" / "dplaunch", "train", "--gpus", "2", "-o", "run"]
        + ["--set", "train.max_steps=2", "--set", "train.eval_every=null"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = read_metrics(elsewhere / "run")
    assert records[0]["world_size"] == 2
    assert [r["step"] for r in records if r["type"] == "summary"] == [2]
    assert (elsewhere / "run" / "model" / "config.json").exists()
    resolved = (elsewhere / "run" / "run.yaml").read_text()
    # the default run file and its data came from the installed wheel, not from this checkout
    assert f"{site}/dplaunch/resources/data/reviews.jsonl" in resolved
    # nothing from the checkout's sources (the pretrained model lives in the test venv, which may
    # itself sit inside the checkout, as .venv does under `make test`)
    from_checkout = [
        line for line in resolved.splitlines() if str(REPO) in line and sys.prefix not in line
    ]
    assert not from_checkout, from_checkout
