"""The command line as a user meets it: fast help, dry runs, rendered files, launching scripts, the demo."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.helpers import (
    DEFAULT_CONFIG,
    REPO,
    TINY_LLAMA,
    child_environment,
    read_metrics,
    run_dplaunch,
)

HEAVY = ("torch", "accelerate", "deepspeed", "transformers", "datasets")


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["train", "--help"], ["train", str(TINY_LLAMA), "--gpus", "16", "--dry-run"]],
)
def test_help_and_dry_run_import_no_heavy_library(argv):
    probe = (
        "import sys\n"
        f"sys.argv = ['dplaunch', *{argv!r}]\n"
        "from dplaunch.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_environment(),
        check=True,
    )
    assert "HEAVY []" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_dry_run_prints_plan_files_and_launch_line_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    result = run_dplaunch(
        "train", TINY_LLAMA, "--cpu", "--gpus", "2", "--zero", "2", "--dry-run", "-o", run
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "world size 2" in out and "mesh: dp 2 × tp 1 × pp 1" in out and "ZeRO stage 2" in out
    assert "micro batch 4 × grad-accum 1 × dp 2 = global batch 8" in out
    assert "accelerate.yaml" in out and "deepspeed.json" in out and '"train_batch_size": 8' in out
    assert "launch: " in out and "--config_file" in out
    assert not run.exists()


def test_config_renders_a_16_gpu_cluster_layout_on_a_laptop(tmp_path):
    out = tmp_path / "cluster"
    result = run_dplaunch(
        "config",
        TINY_LLAMA,
        "--gpus",
        "16",
        "--nodes",
        "4",
        "--zero",
        "2",
        "--global-batch",
        "512",
        "--out",
        out,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "accelerate.yaml",
        "deepspeed.json",
        "launch.sh",
        "plan.json",
        "run.yaml",
    ]
    accelerate = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert (
        accelerate["distributed_type"],
        accelerate["num_processes"],
        accelerate["num_machines"],
    ) == ("DEEPSPEED", 16, 4)
    assert accelerate["use_cpu"] is False
    deepspeed = json.loads((out / "deepspeed.json").read_text())
    assert deepspeed["train_batch_size"] == 512 and deepspeed["zero_optimization"]["stage"] == 2
    assert yaml.safe_load((out / "run.yaml").read_text())["launch"]["gpus"] == 16
    subprocess.run(["bash", "-n", str(out / "launch.sh")], check=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", ["accelerate_script.py", "ddp_script.py"])
def test_launch_runs_a_users_script_on_two_cpu_ranks(tmp_path, script):
    result = run_dplaunch(
        "launch",
        REPO / "examples" / script,
        "--gpus",
        "2",
        "-o",
        tmp_path / "run",
        "--",
        "--flag",
        "x",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # two ranks share one stdout: their lines can run together
    reports = [json.loads(found) for found in re.findall(r"REPORT (\{[^}]*\})", result.stdout)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["world_size"] == 2 and r["ranks_counted_by_all_reduce"] == 2 for r in reports)


@pytest.mark.multiprocess
def test_the_embedded_default_fine_tunes_the_pretrained_model_on_two_ranks(tmp_path):
    run = tmp_path / "demo"
    result = run_dplaunch(
        "train",
        "--gpus",
        "2",
        "-o",
        run,
        "--max-steps",
        "4",
        "--set",
        "train.eval_every=2",
        "--set",
        "train.log_every=2",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = read_metrics(run)
    assert (
        records[0]["type"] == "header"
        and records[0]["world_size"] == 2
        and records[0]["parameters"] > 22_000_000
    )
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    assert (run / "tensorboard").is_dir() and (run / "launch.sh").is_file()
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(run / "model")
    assert model.config.num_labels == 2
    assert DEFAULT_CONFIG.resolve().name == "default.yaml"


@pytest.mark.parametrize("name", ["default", "ddp", "zero2", "zero3-offload", "tp", "pp"])
def test_every_shipped_run_file_plans_cleanly(tmp_path, name):
    result = run_dplaunch(
        "train",
        REPO / "configs" / f"{name}.yaml",
        "--cpu",
        "--gpus",
        "2",
        "--dry-run",
        "-o",
        tmp_path / "r",
    )
    assert result.returncode == 0, result.stderr
    assert "world size 2" in result.stdout


def test_parallel_auto_flag_runs_the_recommended_plan_and_says_why(tmp_path):
    out = tmp_path / "auto"
    result = run_dplaunch(
        "config",
        REPO / "examples" / "llama-1b.yaml",
        "--gpus",
        "16",
        "--nodes",
        "4",
        "--parallel",
        "auto",
        "--set",
        "launch.gpu_memory_gb=24",
        "--out",
        out,
    )
    assert result.returncode == 0, result.stderr
    assert "note: parallel: auto → ZeRO-1 fits in 24 GB" in result.stdout
    assert json.loads((out / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 1
    refused = run_dplaunch("train", TINY_LLAMA, "--parallel", "auto", "--zero", "2", "--dry-run")
    assert refused.returncode == 2 and "--parallel: auto picks" in refused.stderr
