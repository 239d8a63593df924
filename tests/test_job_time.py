"""The job's time from the forecast (planning/job_time.py): `dplaunch plan`'s hours count the
start-up, the evaluations and the checkpoints beside the steps, and `dplaunch slurm` without
--time asks for the forecast with its stated margin, or says why it keeps the default; a --time
shorter than the forecast says how many steps fit and that the job requeues."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from dplaunch.config.schema import TrainConfig
from dplaunch.planning.forecast import forecast_step
from dplaunch.planning.job_time import (
    MARGIN,
    READ_BYTES_PER_S,
    START_UP_S,
    WRITE_BYTES_PER_S,
    JobSetting,
    RunSchedule,
    steps_that_fit,
    time_limit,
)
from dplaunch.planning.rules import ParallelDims
from dplaunch.planning.workload import Workload
from tests.helpers import REPO, TINY_LLAMA, llama_facts, run_cli, synthetic_profile

LLAMA_1B = REPO / "examples" / "llama-1b.yaml"


def test_the_schedule_counts_each_evaluation_and_save_of_the_run():
    train = TrainConfig(max_steps=25, eval_every=10, checkpoint_every=10, keep_best=True)
    schedule = RunSchedule.of(train, evaluates=True, eval_samples=40, nodes=2)
    # evaluations at steps 0, 10, 20 and after the last (25); saves every 10 (2) and one at each
    # evaluation after step 0 for keep_best (3)
    assert (schedule.evaluations, schedule.saves) == (4, 5)
    at_end = RunSchedule.of(TrainConfig(max_steps=20), evaluates=True, eval_samples=40, nodes=1)
    assert (at_end.evaluations, at_end.saves) == (1, 0)
    assert RunSchedule.of(TrainConfig(max_steps=None, epochs=2), evaluates=False, eval_samples=0, nodes=1) is None  # fmt: skip


def test_the_job_is_its_steps_start_up_evaluations_and_checkpoints():
    facts = llama_facts(256, 4)
    work = Workload(micro_batch=2, seq_len=128, mixed_precision="no", global_batch_size=8)
    forecast = forecast_step(facts, ParallelDims(2, 2), work, synthetic_profile())
    schedule = RunSchedule(steps=1000, evaluations=3, eval_samples=20, saves=4, nodes=1)
    job = JobSetting.of(schedule, facts, work).time(forecast)
    params = sum(p.numel() for p in _model(facts).parameters())
    weights = 4 * params  # fp32
    assert job.start_up_s == pytest.approx(START_UP_S + weights / READ_BYTES_PER_S)
    assert job.steps_s == pytest.approx(1000 * forecast.step_time_s)
    # 20 samples are 3 global batches of 8, each a forward of the step
    assert job.evaluation_s == pytest.approx(3 * 3 * sum(forecast.phases["forward"].values()))
    # a checkpoint: the weights and their two AdamW moments; the export writes the weights
    assert job.checkpoint_s == pytest.approx((4 * 3 * weights + weights) / WRITE_BYTES_PER_S)
    assert job.total_s == pytest.approx(
        job.start_up_s + job.steps_s + job.evaluation_s + job.checkpoint_s
    )
    # slurm's limit: the job × 1.2 and the signal's lead, whole minutes
    assert time_limit(job, 120) == 60 * math.ceil((job.total_s * (1 + MARGIN) + 120) / 60)
    # a limit that leaves half the steps' (and their evaluations' and saves') time after the
    # start-up and the signal's lead holds half the steps
    half = job.start_up_s + 120 + (job.total_s - job.start_up_s) / 2
    assert 499 <= steps_that_fit(job, half, 120) <= 500


def _model(facts):
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**facts.raw))


def test_plan_hours_count_the_start_up_evaluations_and_checkpoints(tmp_path):
    spec = yaml.safe_load(TINY_LLAMA.read_text())
    spec["train"].update(max_steps=500, eval_every=100, checkpoint_every=100)
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(spec))
    result = run_cli("plan", run_file, "--gpus", "8", "--gpu-type", "H100", "--json")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)[0]
    job = row["job_s"]
    assert row["hours"] == pytest.approx(job["total_s"] / 3600, rel=1e-3)
    assert job["steps_s"] == pytest.approx(500 * row["step_time_s"], rel=1e-3)
    # evaluations at 0, 100, …, 500 over the held-out 5 % of the reviews, five checkpoints
    assert job["evaluation_s"] > 0 and job["checkpoint_s"] > 0
    assert job["start_up_s"] >= START_UP_S
    assert row["gpu_hours"] == pytest.approx(8 * row["hours"], rel=1e-3)


def _slurm(tmp_path, *args):
    out = tmp_path / "job.sbatch"
    result = run_cli(
        "slurm", LLAMA_1B, "--gpus", "8", "--gpus-per-node", "4", "--cpus-per-gpu", "8",
        "-o", tmp_path / "run", "--out", out, *args,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    limit = re.search(r"^#SBATCH --time=(\S+)$", out.read_text(), re.M)
    assert limit is not None
    return limit.group(1), result.stdout + result.stderr


def _seconds(text: str) -> int:
    from dplaunch.rendering.sbatch import time_limit_seconds

    seconds = time_limit_seconds(text)
    assert seconds is not None
    return seconds


def test_slurm_asks_for_the_forecast_with_its_margin_or_says_why_not(tmp_path):
    steps = ("--set", "train.max_steps=30000")
    limit, said = _slurm(tmp_path, "--gpu-type", "H100", *steps)
    forecast = re.search(r"time limit (\S+): the forecast (\S+) \(30,000 steps", said)
    assert forecast is not None and forecast.group(1) == limit, said
    # the forecast (whole seconds) × 1.2 and the 120 s signal, rounded up to a minute
    expected = 60 * math.ceil((_seconds(forecast.group(2)) * (1 + MARGIN) + 120) / 60)
    assert abs(_seconds(limit) - expected) <= 60, (limit, forecast.group(2))
    assert _seconds(limit) > 3600  # 30,000 steps of a 1B model: hours, not the default hour
    # no GPU type and no profile: the default, and why
    limit, said = _slurm(tmp_path / "2", *steps)
    assert limit == "01:00:00"
    assert "time limit 01:00:00 (the default: give --gpu-type (the job's GPUs) or launch.profile" in said  # fmt: skip


def test_a_time_limit_shorter_than_the_forecast_says_how_many_steps_fit(tmp_path):
    steps = ("--set", "train.max_steps=30000")
    limit, said = _slurm(tmp_path, "--gpu-type", "H100", "--time", "00:30:00", *steps)
    assert limit == "00:30:00"
    fit = re.search(r"--time 00:30:00 holds about ([\d,]+) of the run's 30,000 steps", said)
    assert fit is not None, said
    assert 0 < int(fit.group(1).replace(",", "")) < 30000
    assert "the job checkpoints and requeues itself to go on" in said
