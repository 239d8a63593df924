"""The command line as a user meets it: fast help, dry runs, rendered files, launching scripts, the demo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from dplaunch.run_directory.environment import ERRORS_DIR_ENV
from tests.helpers import (
    DEFAULT_CONFIG,
    REPO,
    TINY_LLAMA,
    free_port,
    heavy_imports,
    one_rank_script,
    read_metrics,
    run_dplaunch,
    train,
)


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["train", "--help"], ["train", str(TINY_LLAMA), "--gpus", "16", "--dry-run"]],
)
def test_help_and_dry_run_import_no_heavy_library(argv):
    assert heavy_imports(*argv) == []


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


def test_config_takes_the_run_directory_flag_of_train_as_its_output(tmp_path):
    # `dplaunch train ... -o DIR` and `dplaunch config ... -o DIR`: the same flag, the same directory
    run = tmp_path / "run"
    result = run_dplaunch("config", TINY_LLAMA, "--cpu", "--gpus", "2", "-o", run)
    assert result.returncode == 0, result.stderr
    assert (run / "accelerate.yaml").is_file() and (run / "launch.sh").is_file()
    assert yaml.safe_load((run / "run.yaml").read_text())["output_dir"] == str(run)
    assert str(run) in (run / "launch.sh").read_text()


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
    # two ranks share one stdout, and every line arrives whole
    reports = [json.loads(line) for line in re.findall(r"^REPORT (.*)$", result.stdout, re.M)]
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
    # what the demo prints: dplaunch's lines only (before: transformers' LOAD REPORT table for
    # the new head, DeepSpeed's accelerator warning), and at the end the result in one line
    output = result.stdout + result.stderr
    ours = ("world size ", "mesh: ", "engine: ", "micro batch ", "mixed precision: ", "note: ",
            "launch: ", "run directory: ", "[dplaunch] ", "step ", "eval  ", "dplaunch: ")  # fmt: skip
    strays = [line for line in output.splitlines() if line.strip() and not line.startswith(ours)]
    assert not strays, strays
    assert "[dplaunch] newly initialised (not in " in result.stdout
    assert "classifier.bias, classifier.weight; this run trains them" in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("dplaunch: done: 4 steps in "), last
    assert "eval_accuracy" in last and last.endswith(f"the model: {run / 'model'}"), last
    records = read_metrics(run)
    assert (
        records[0]["type"] == "header"
        and records[0]["world_size"] == 2
        and records[0]["parameters"] > 22_000_000
    )
    # the rank's memory with the model built and no step taken: below every step's peak, above
    # the fp32 weights (22.7 M × 4 bytes)
    peak = max(r["memory_gb"] for r in records if r["type"] == "train")
    assert 0.09 < records[0]["memory_at_start_gb"] < peak
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    assert (run / "tensorboard").is_dir() and (run / "launch.sh").is_file()
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(run / "model")
    assert model.config.num_labels == 2
    # the run file's data.label_names name the exported model's classes
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert DEFAULT_CONFIG.resolve().name == "default.yaml"
    # the same classifier under FSDP2 (each BertLayer sharded): the same losses and evaluations
    fsdp = tmp_path / "fsdp"
    sharded = run_dplaunch(
        "train", "--gpus", "2", "-o", fsdp, "--max-steps", "4", "--fsdp", "full",
        "--set", "train.eval_every=2", "--set", "train.log_every=2",
    )  # fmt: skip
    assert sharded.returncode == 0, sharded.stdout[-2000:] + sharded.stderr[-3000:]
    assert read_metrics(fsdp)[0]["fsdp"] == "full"
    for kind, key in (("train", "loss"), ("eval", "eval_loss"), ("eval", "eval_accuracy")):
        ddp_values = [r[key] for r in records if r["type"] == kind]
        fsdp_values = [r[key] for r in read_metrics(fsdp) if r["type"] == kind]
        assert fsdp_values == pytest.approx(ddp_values, rel=1e-5), (kind, key)
    assert AutoModelForSequenceClassification.from_pretrained(fsdp / "model").config.num_labels == 2


@pytest.mark.parametrize(
    "name", ["default", "ddp", "zero2", "zero3-offload", "tp", "pp", "sft", "dpo"]
)
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


@pytest.mark.multiprocess
def test_a_script_leaving_collectives_in_flight_still_ends_cleanly_on_every_rank(tmp_path):
    probe = REPO / "tests" / "rank_exit_probe.py"
    result = run_dplaunch("launch", probe, "--gpus", "2", "-o", tmp_path / "run", "--", "a", "--b")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "terminate called" not in result.stderr
    # one line per print, even with both ranks writing to one pipe
    reports = [json.loads(line) for line in re.findall(r"^PROBE (.*)$", result.stdout, re.M)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["argv"] == [str(probe), "a", "--b"]
        assert report["name"] == "__main__" and report["path0"] == str(probe.parent)


def test_the_rank_entry_gives_a_scripts_exit_status_and_its_own_traceback(
    tmp_path, capsys, monkeypatch
):
    from dplaunch.train.script import main

    # main() sets sys.argv and sys.path[0] as `python SCRIPT` would: keep pytest's
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "user.py"
    script.write_text(
        "import sys\nif sys.argv[1] == 'exit':\n    sys.exit(3)\nraise ValueError('on purpose')\n"
    )
    assert main([str(script), "exit"]) == 3
    assert main([str(script), "raise"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f'Traceback (most recent call last):\n  File "{script}", line 4')
    assert err.rstrip().endswith("ValueError: on purpose")
    assert "runpy" not in err and "dplaunch" not in err


def test_a_rank_ends_like_a_normal_exit_with_thread_pools_threads_and_exit_handlers(tmp_path):
    # exit_rank skips only the interpreter's teardown: a thread pool left open (torch.compile's
    # is one) must not hang it, a running thread is waited for, atexit handlers run
    script = tmp_path / "ends.py"
    script.write_text(
        "import atexit, concurrent.futures, threading, time\n"
        "from dplaunch.train.rank_process import exit_rank\n"
        "concurrent.futures.ThreadPoolExecutor(2).submit(time.sleep, 0.1)\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "print('main done')\n"
        "exit_rank(4)\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 4, result.stderr
    assert result.stdout.splitlines() == ["main done", "thread done", "atexit ran"]


def test_a_rank_imports_deepspeed_without_its_autotuners_mlflow_and_mlflow_still_imports_later():
    # DeepSpeed's autotuner imports MLflow when it is installed (1.5 s of every rank's start);
    # a rank never autotunes. Without begin_rank the probe sees MLflow imported: the case is real
    pytest.importorskip("mlflow", reason="the [trackers] extra installs mlflow-skinny")
    probe = (
        "import json, sys\n{start}"
        "import deepspeed\n"
        "during = 'mlflow' in sys.modules\n"
        "import mlflow, deepspeed.autotuning.autotuner as tuner\n"
        "print(json.dumps([during, mlflow.__name__, tuner.has_mlflow]))\n"
    )
    begin = "from dplaunch.train.rank_process import begin_rank\nbegin_rank()\n"
    assert one_rank_script(probe.format(start="")) == [True, "mlflow", True]
    assert one_rank_script(probe.format(start=begin)) == [False, "mlflow", False]


def test_a_training_rank_starts_without_the_garbage_collector_and_trains_with_it(tmp_path):
    # start-up's imports run the cyclic collector ~20% of their time for nothing; the steps must
    # run with it again (cycles would pile up otherwise), start-up's objects frozen out of it;
    # the libraries' objects are frozen before the model is built (the one collection skips them)
    run_dir = tmp_path / "run"
    train(run_dir, "--gpus", "1", "--max-steps", "2")
    probe = (
        "import atexit, gc, json, os, runpy, sys\n"
        "from dplaunch.train import loop\n"
        "seen = {}\n"
        "def spy(name, real):\n"
        "    def call(*args, **kwargs):\n"
        "        seen.setdefault(name, [gc.isenabled(), gc.get_freeze_count() > 0])\n"
        "        return real(*args, **kwargs)\n"
        "    setattr(loop, name, call)\n"
        "spy('make_accelerator', loop.make_accelerator)\n"
        "spy('_build_model', loop._build_model)\n"
        "spy('_run_steps', loop._run_steps)\n"
        "atexit.register(lambda: print(json.dumps(seen), flush=True))  # the rank's last line\n"
        "os.environ.update(RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',\n"
        "                  MASTER_PORT=sys.argv[2])\n"
        "sys.argv = ['dplaunch.train', sys.argv[1]]\n"
        "runpy.run_module('dplaunch.train', run_name='__main__')\n"
    )
    seen = one_rank_script(probe, str(run_dir), str(free_port()))
    assert seen == {
        "make_accelerator": [False, False],
        "_build_model": [False, True],
        "_run_steps": [True, True],
    }


def test_a_stack_dump_request_arriving_as_a_rank_ends_does_not_change_its_status(tmp_path):
    # the supervisor sends SIGUSR2 when it reads a rank's timeout; that rank may be ending by
    # then. Sent here at the last moment (just before os._exit): the status stays the rank's own,
    # not 128 + SIGUSR2 (CI saw 140 from a TensorFlow rank that timed out)
    script = tmp_path / "ends.py"
    script.write_text(
        "import os, signal, time\n"
        "from dplaunch.train import rank_process\n"
        "rank_process.arm_stack_dump()\n"
        "real_exit = os._exit\n"
        "def signalled_exit(status):\n"
        "    os.kill(os.getpid(), signal.SIGUSR2)\n"
        "    time.sleep(0.2)\n"
        "    real_exit(status)\n"
        "os._exit = signalled_exit\n"
        "rank_process.exit_rank(1)\n"
    )
    env = {**os.environ, ERRORS_DIR_ENV: str(tmp_path / "errors"), "RANK": "0"}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO, env=env
    )
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert not (tmp_path / "errors").exists()  # nothing was dumped: no empty file left
