"""Mistakes on the command line itself: mistyped flags, output paths that cannot be written, a
run file given to `launch`, a refused sbatch. Each is one line naming the flag and the fix, exit
code 2, no traceback, and nothing written. The cases run the command line through its main() in
this process (tests/helpers.run_cli); the help and one mistyped flag run as a process too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import (
    TINY_LLAMA,
    child_environment,
    files_under,
    refusal_line,
    run_cli,
    run_dplaunch,
)

# a 16-GPU job on 4-GPU nodes: only the output path below is wrong
SLURM_JOB = ["slurm", TINY_LLAMA, "--gpus", "16", "--gpus-per-node", "4", "--global-batch", "16"]
# the same layout rendered by `dplaunch config`
CLUSTER = [TINY_LLAMA, "--gpus", "16", "--nodes", "4", "--global-batch", "16"]


def test_the_in_process_command_line_sees_the_environment_a_process_would(monkeypatch):
    # run_cli once emptied os.environ before copying it: its commands ran without PATH, HOME or
    # the suite's cache folder, and a plan needing a DeepSpeed op found no compiler unless an
    # earlier test had happened to build the op (a CI failure of test_planning_tools)
    from dplaunch import cli

    seen: dict[str, str] = {}
    monkeypatch.setattr(cli, "main", lambda: seen.update(os.environ))
    assert run_cli("--help").returncode == 0
    for name in ("PATH", "HOME", "XDG_CACHE_HOME"):
        assert seen.get(name) == os.environ[name], name
    assert seen["OMP_NUM_THREADS"] == "1"  # and the ranks' own settings (child_environment)


# ------------------------------------------------------------------ mistyped flags


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["train", TINY_LLAMA, "--gpu", "2", "--dry-run"],
            ["--gpu: no such option — did you mean one of --cpu, --gpus, --tp?"],
        ),
        (
            ["train", TINY_LLAMA, "--gpus", "four"],
            ["--gpus: 'four' is invalid", "valid integer", "see dplaunch train --help"],
        ),
        (
            ["train", TINY_LLAMA, "--zero", "4"],
            ["--zero: '4' is invalid", "less than or equal to 3"],
        ),
        (
            ["train", TINY_LLAMA, "--offload", "cpu"],
            ["--offload: 'cpu' is not one of 'none', 'optimizer', 'all'"],
        ),
        (
            ["train", TINY_LLAMA, "extra"],
            ["extra: unexpected extra argument — dplaunch train takes only CONFIG"],
        ),
        (["export", "runs/x"], ["--out: this option is required — see dplaunch export --help"]),
        (["launch", "--resume"], ["--resume: no such option", "see dplaunch launch --help"]),
        (["config", "--dry-run"], ["--dry-run: no such option", "see dplaunch config --help"]),
        (["launch"], ["SCRIPT: this argument is required"]),
        (["train", "--gpus"], ["--gpus: needs a value — see dplaunch train --help"]),
        (["trian"], ["COMMAND: no such command 'trian' — did you mean 'train'?"]),
    ],
    ids=[
        "unknown-option",
        "not-an-integer",
        "zero-out-of-range",
        "offload-not-a-choice",
        "extra-argument",
        "export-without-out",
        "launch-has-no-resume",
        "config-has-no-dry-run",
        "launch-without-script",
        "option-without-value",
        "unknown-command",
    ],
)
def test_a_mistyped_command_line_is_one_line_naming_the_flag(tmp_path, argv, expected):
    result = run_cli(*argv, cwd=tmp_path, timeout=60)
    line = refusal_line(result, *expected)
    assert "╭" not in result.stderr and "Usage:" not in result.stderr, line
    assert files_under(tmp_path) == []


def test_a_mistyped_flag_in_a_process_is_one_line_and_no_traceback(tmp_path):
    result = run_dplaunch("train", TINY_LLAMA, "--gpu", "2", cwd=tmp_path, timeout=60)
    refusal_line(result, "--gpu: no such option — did you mean one of --cpu, --gpus, --tp?")
    assert "╭" not in result.stderr and files_under(tmp_path) == []


def test_help_and_no_arguments_still_show_the_help(tmp_path):
    helped = run_dplaunch("train", "--help", cwd=tmp_path, timeout=60)
    assert helped.returncode == 0 and "--gpus" in helped.stdout and helped.stderr == ""
    bare = run_dplaunch(cwd=tmp_path, timeout=60)
    assert bare.returncode == 2 and "Usage: " in bare.stdout and "export" in bare.stdout
    assert "dplaunch: error" not in bare.stderr


# ------------------------------------------------------------------ output paths


def test_slurm_out_naming_a_directory_writes_nothing(tmp_path):
    (tmp_path / "adir").mkdir()
    result = run_cli(*SLURM_JOB, "--out", tmp_path / "adir", "-o", tmp_path / "run")
    refusal_line(result, f"--out: {tmp_path / 'adir'} is a directory", "adir/job.sbatch")
    assert files_under(tmp_path) == ["adir"]


def test_slurm_out_where_no_file_can_be_created_writes_nothing(tmp_path):
    result = run_cli(*SLURM_JOB, "--out", "/proc/job.sbatch", "-o", tmp_path / "run")
    refusal_line(result, "--out: cannot create files in /proc")
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("flag", ["--out", "-o"])
def test_config_into_an_existing_file_is_refused_by_the_flag_given(tmp_path, flag):
    (tmp_path / "afile").write_text("x")
    result = run_cli("config", *CLUSTER, flag, tmp_path / "afile")
    field = "--out" if flag == "--out" else "output_dir"
    refusal_line(result, f"{field}: {tmp_path / 'afile'} is not a directory")
    assert (tmp_path / "afile").read_text() == "x" and files_under(tmp_path) == ["afile"]


def test_config_into_an_unwritable_place_is_refused(tmp_path):
    result = run_cli("config", *CLUSTER, "--out", "/proc/cl")
    refusal_line(result, "--out: cannot create files in /proc")


def _run_with_metrics(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    record = {"type": "train", "step": 1, "loss": 1.0, "lr": 1e-3}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return run


@pytest.mark.parametrize(
    ("out", "expected"),
    [("afile", "is not a directory"), ("/proc/rep", "cannot create files in /proc")],
)
def test_report_out_that_cannot_hold_the_plots_is_refused(tmp_path, out, expected):
    run = _run_with_metrics(tmp_path)
    (tmp_path / "afile").write_text("x")
    before = files_under(tmp_path)
    result = run_cli("report", run, "--out", out, cwd=tmp_path, timeout=120)
    refusal_line(result, "--out: ", expected)
    assert files_under(tmp_path) == before


def test_export_into_an_existing_unwritable_directory_is_refused_before_loading(tmp_path):
    # a checkpoint as export reads it: run.yaml and plan.json (from `dplaunch config`), its step
    checkpoint = tmp_path / "step-1"
    rendered = run_cli("config", TINY_LLAMA, "--cpu", "--out", checkpoint)
    assert rendered.returncode == 0, rendered.stderr
    (checkpoint / "checkpoint.json").write_text('{"step": 1}')
    # sysfs refuses new files even to root
    result = run_cli("export", checkpoint, "--out", "/sys/kernel", timeout=120)
    refusal_line(result, "--out: cannot create files in /sys/kernel")


# ------------------------------------------------------------------ launch's script


def test_launch_refuses_a_run_file_and_points_to_train(tmp_path):
    result = run_cli(
        "launch", TINY_LLAMA, "--cpu", "--gpus", "2", "-o", tmp_path / "run", timeout=300
    )
    refusal_line(result, "SCRIPT: ", "is a run file, not a Python script", "dplaunch train ")
    assert files_under(tmp_path) == []


def test_launch_of_a_directory_says_it_is_a_directory(tmp_path):
    result = run_cli("launch", ".", "--dry-run", cwd=tmp_path, timeout=60)
    refusal_line(result, "SCRIPT: . is a directory")
    assert files_under(tmp_path) == []


# ------------------------------------------------------------------ slurm


def test_a_job_sbatch_refuses_is_one_line_and_the_script_stays(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(
        "#!/bin/sh\necho 'sbatch: warning: a note first' >&2\n"
        "echo 'sbatch: error: Batch job submission failed: Invalid account' >&2\nexit 1\n"
    )
    (fake / "sbatch").chmod(0o755)
    script = tmp_path / "job.sbatch"
    result = run_cli(
        *SLURM_JOB,
        "--submit",
        "--out",
        script,
        "-o",
        tmp_path / "run",
        env=child_environment(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}"),
    )
    refusal_line(
        result,
        "--submit: sbatch refused the job: sbatch: error: Batch job submission failed: "
        "Invalid account — ",
        f"sbatch {script}",
    )
    assert script.read_text().startswith("#!/bin/bash\n")


def test_a_job_name_with_a_line_break_is_named_as_the_job_name(tmp_path):
    result = run_cli(*SLURM_JOB, "--job-name", "a\nb", "--out", "-", "-o", tmp_path / "run")
    refusal_line(result, "--job-name: 'a\\nb' contains a line break")
    assert files_under(tmp_path) == []


def test_a_multi_line_setup_stays_one_comment_line_in_the_script(tmp_path):
    script = tmp_path / "job.sbatch"
    result = run_cli(
        *SLURM_JOB, "--setup", "echo a\necho b", "--out", script, "-o", tmp_path / "run"
    )
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    assert "--setup $'echo a\\necho b'" in text and "\necho a\necho b\n" in text


# ------------------------------------------------------------------ verify, train


@pytest.mark.parametrize("tolerance", ["-1", "0", "nan"])
def test_verify_refuses_a_tolerance_that_is_not_positive_before_training(tmp_path, tolerance):
    result = run_cli(
        "verify",
        TINY_LLAMA,
        "--cpu",
        "--steps",
        "1",
        "--tolerance",
        tolerance,
        "-o",
        tmp_path / "v",
        timeout=300,
    )
    refusal_line(result, "--tolerance: ", "is not a positive relative loss gap")
    assert files_under(tmp_path) == []


def test_zero_cpu_ranks_do_not_suggest_the_cpu_flag_given(tmp_path):
    result = run_cli("train", TINY_LLAMA, "--cpu", "--gpus", "0", "-o", tmp_path / "run")
    line = refusal_line(result, "--gpus: 0 CPU ranks requested — give --gpus 1 or more")
    assert "use --cpu" not in line


def test_a_resume_path_that_does_not_exist_points_to_resume_auto(tmp_path):
    result = run_cli(
        "train", TINY_LLAMA, "--cpu", "--resume", "latest", "-o", tmp_path / "run", cwd=tmp_path
    )
    refusal_line(result, "--resume: latest does not exist — give --resume auto")
    assert files_under(tmp_path) == []


def test_config_out_dash_is_refused_instead_of_making_a_directory_named_dash(tmp_path):
    result = run_cli("config", TINY_LLAMA, "--cpu", "--out", "-", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--out: dplaunch config writes several files" in result.stderr
    assert list(tmp_path.iterdir()) == []
