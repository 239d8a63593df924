"""`dplaunch slurm` as a user meets it, without a cluster: the script it writes and what it refuses."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
import yaml

from dplaunch.cli import app
from dplaunch.commands.slurm import SlurmOptions, job_shape, train_command
from dplaunch.config.flags import RUN_FLAGS, RunFlags
from dplaunch.config.schema import LaunchConfig
from dplaunch.errors import UserError
from tests.helpers import (
    REPO,
    TINY_LLAMA,
    child_environment,
    heavy_imports,
    run_dplaunch,
    sbatch_options,
)

LLAMA_1B = REPO / "examples" / "llama-1b.yaml"


def srun_words(script: str) -> list[str]:
    """The srun line as bash splits it into words."""
    line = next(line for line in script.splitlines() if line.startswith("srun "))
    return shlex.split(line.removesuffix(" || status=$?"))


def write_script(tmp_path: Path, *args, config: Path = LLAMA_1B) -> tuple[str, str]:
    out = tmp_path / "job.sbatch"
    result = run_dplaunch("slurm", config, *args, "--out", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    subprocess.run(["bash", "-n", str(out)], check=True)
    return out.read_text(), result.stdout


def test_16_gpus_on_4_gpu_nodes_is_4_nodes_with_one_launcher_each(tmp_path):
    script, printed = write_script(
        tmp_path,
        "--gpus",
        "16",
        "--gpus-per-node",
        "4",
        "--cpus-per-gpu",
        "24",
        "--account",
        "abc@h100",
        "--time",
        "20:00:00",
        "--tp",
        "4",
        "--set",
        "train.lr=1e-4",
        "-o",
        "runs/tp4",
    )
    options = sbatch_options(script)
    assert (options["nodes"], options["ntasks-per-node"], options["gres"]) == ("4", "1", "gpu:4")
    assert (options["cpus-per-task"], options["hint"]) == ("96", "nomultithread")
    assert (options["account"], options["time"]) == ("abc@h100", "20:00:00")
    assert (options["signal"], options["requeue"]) == ("USR1@120", None)
    run_dir = tmp_path / "runs" / "tp4"
    assert options["output"] == f"{run_dir}/logs/%x-%j.out"
    assert options["chdir"] == str(tmp_path)
    words = srun_words(script)
    assert words[:6] == [
        "srun",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=96",
    ]
    # the job reruns `dplaunch train` with the same plan, absolute paths, and resumes when requeued
    train = words[words.index("dplaunch-node") + 1 :]
    assert train == [
        sys.executable,
        "-m",
        "dplaunch",
        "train",
        str(LLAMA_1B),
        "--gpus",
        "16",
        "--gpus-per-node",
        "4",
        "--tp",
        "4",
        "--set",
        "train.lr=1e-4",
        "--output-dir",
        str(run_dir),
        "--resume",
        "auto",
    ]
    assert "mesh: dp 4 × tp 4 × pp 1 = 16 ranks" in printed
    assert "world size 16 (4 node(s) × 4 GPU(s), backend nccl)" in script  # the plan, as comments
    # nothing is written there before the job runs but the log directory, which sbatch needs
    assert [path.name for path in run_dir.iterdir()] == ["logs"]


def test_without_a_submit_the_script_goes_to_the_run_directory_and_says_how_to_submit(tmp_path):
    result = run_dplaunch(
        "slurm", TINY_LLAMA, "--cpu", "--gpus", "2", "-o", tmp_path / "run", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    script = tmp_path / "run" / "job.sbatch"
    assert f"submit with: sbatch {script}" in result.stdout
    options = sbatch_options(script.read_text())
    assert "gres" not in options  # a CPU job
    # sbatch does not create the log directory: without it the job would fail, writing nothing
    assert Path(options["output"]).parent.is_dir()
    # the run file sets no periodic checkpoint: only the time-limit signal saves one
    assert "note: train.checkpoint_every is not set" in result.stdout


def test_the_checkpoint_signal_comes_as_long_before_the_limit_as_asked(tmp_path):
    script, printed = write_script(
        tmp_path,
        "--cpu",
        "--gpus",
        "2",
        "--time",
        "2-00:00:00",
        "--signal-seconds",
        "900",
        "--set",
        "train.checkpoint_every=500",
        config=TINY_LLAMA,
    )
    assert sbatch_options(script)["signal"] == "USR1@900"
    assert "checkpoint_every" not in printed


def test_out_dash_prints_the_script_alone_on_stdout(tmp_path):
    result = run_dplaunch(
        "slurm", TINY_LLAMA, "--cpu", "--gpus", "2", "--out", "-", "-o", tmp_path / "r"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash\n") and "world size 2" in result.stderr
    assert [path.name for path in (tmp_path / "r").iterdir()] == ["logs"]


def test_a_hostile_job_name_setup_and_override_stay_data_in_the_written_script(tmp_path):
    evil = "$(touch canary) `touch canary`; touch canary"
    script, _ = write_script(
        tmp_path,
        "--cpu",
        "--gpus",
        "2",
        "--job-name",
        f'my job {evil} "q" #1',
        "--account",
        evil,
        "--set",
        f"name={evil}",
        "-o",
        tmp_path / f"run {evil}",
        config=TINY_LLAMA,
    )
    # bash reads the script up to srun and splits that line: srun (a shell function here, not
    # SLURM) writes the words it got, one per line
    probe = tmp_path / "probe.sh"
    probe.write_text(
        "srun() { printf '%s\\n' \"$@\" > words.txt; }\nSLURM_JOB_ID=1\n" + script.split("\n", 1)[1]
    )
    result = subprocess.run(["bash", str(probe)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "canary").exists()
    words = (tmp_path / "words.txt").read_text().splitlines()
    assert words[words.index("--set") + 1] == f"name={evil}"
    assert words[words.index("--output-dir") + 1] == str(tmp_path / f"run {evil}")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--gpus", "6", "--gpus-per-node", "4"], "--gpus: 6 GPUs do not fill whole nodes of 4"),
        (["--gpus", "16", "--node-rank", "1"], "--node-rank: SLURM decides it"),
        (["--gpus", "16", "--master-port", "29400"], "--master-port: SLURM decides it"),
        (["--gpus", "16", "--time", "tomorrow"], "--time: 'tomorrow' is not a SLURM time"),
        # the checkpoint signal would come before the job starts
        (["--gpus", "16", "--time", "00:02:00"], "--time: 00:02:00 is not longer than the 120 s"),
        (["--gpus", "16", "--time", "10", "--signal-seconds", "600"], "than the 600 s before"),
        (["--gpus", "16", "--signal-seconds", "0"], "--signal-seconds: 0 is not in 1..65535"),
        (["--gpus", "16", "--job-name", "a/b"], "--job-name:"),
        # the plan is checked as `train` would: tensor parallelism stays inside a node
        (["--gpus", "16", "--gpus-per-node", "4", "--tp", "8"], "parallel.tp: tp 8 is larger"),
        (["--cpu"], "--gpus: dplaunch slurm needs the total GPU count"),
    ],
)
def test_mistakes_are_one_line_before_anything_is_written(tmp_path, args, expected):
    result = run_dplaunch("slurm", LLAMA_1B, *args, "--out", tmp_path / "job.sbatch")
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert not (tmp_path / "job.sbatch").exists()


def test_submit_without_sbatch_here_says_where_to_run_it(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    result = run_dplaunch(
        "slurm",
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "2",
        "--submit",
        "-o",
        tmp_path / "run",
        env=child_environment(PATH=str(empty)),
    )
    assert result.returncode == 2 and "--submit: sbatch is not on PATH" in result.stderr
    assert not (tmp_path / "run").exists()


def test_writing_a_script_imports_no_heavy_library(tmp_path):
    run_dir = tmp_path / "run"
    assert heavy_imports("slurm", TINY_LLAMA, "--gpus", "8", "--out", "-", "-o", run_dir) == []


# ---------------------------------------------------------------- the job's shape


def shape(sinfo_answer=(None, None, "no sinfo here"), **launch):
    return job_shape(
        LaunchConfig.model_validate(launch),
        SlurmOptions(),
        lambda partition, constraint: sinfo_answer,
    )


def test_gpus_per_node_come_from_sinfo_when_the_flags_do_not_say():
    result = shape((8, 64, "sinfo, partition gpu_p5"), gpus=16)
    assert (result.nodes, result.per_node, result.cpus_per_task) == (2, 8, 64)
    assert "8 GPUs per node (sinfo, partition gpu_p5)" in result.notes


def test_unknown_nodes_are_assumed_to_have_4_gpus_and_10_cores_each_with_a_note():
    result = shape(gpus=16)
    assert (result.nodes, result.per_node, result.cpus_per_task) == (4, 4, 40)
    assert any("assuming 4" in note for note in result.notes)
    assert any("--cpus-per-gpu" in note for note in result.notes)


def test_fewer_gpus_than_a_node_has_is_one_node_with_those_gpus():
    result = shape((4, 96, "sinfo"), gpus=2)
    assert (result.nodes, result.per_node, result.cpus_per_task) == (1, 2, 48)


def test_cpu_ranks_share_one_nodes_cores():
    result = shape((None, 2, "sinfo"), gpus=2, cpu=True)
    assert (result.nodes, result.per_node, result.cpus_per_task) == (1, 2, 2)


def test_nodes_given_split_the_gpus_evenly_or_refuse():
    assert shape(gpus=16, nodes=2).per_node == 8
    with pytest.raises(UserError, match="cannot be spread evenly"):
        shape(gpus=16, nodes=3)


def test_every_run_flag_the_job_repeats_is_an_option_of_dplaunch_train():
    flags = RunFlags(
        config=Path("run.yaml"),
        assignments=["train.lr=1e-4"],
        gpus=16,
        cpu=True,
        gpus_per_node=4,
        zero=2,
        offload="optimizer",
        tp=2,
        pp=1,
        global_batch=64,
        micro_batch=2,
        max_steps=10,
        mixed_precision="bf16",
        output_dir="/runs/x",
    )
    command = train_command(flags)
    train = typer.main.get_command(app).commands["train"]
    known = {opt for param in train.params for opt in param.opts}
    used = {word for word in command if word.startswith("--")}
    assert used <= known, used - known
    # the flags the job repeats, and those SLURM decides in it
    assert {"--gpus", "--cpu", "--zero", "--offload", "--tp", "--set", "--resume"} <= used
    assert not used & {"--nodes", "--node-rank", "--master-addr", "--master-port"}
    assert len(RUN_FLAGS) == len(RunFlags.__dataclass_fields__) - 2  # config, assignments


# ---------------------------------------------------------------- the committed examples


def test_the_committed_examples_are_what_the_generator_writes(tmp_path):
    runs = tmp_path / "runs"  # their log directories are made here, not in the checkout
    result = subprocess.run(
        ["bash", str(REPO / "slurm" / "generate.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=child_environment(PYTHON=sys.executable, RUNS=str(runs)),
    )
    assert result.returncode == 0, result.stderr
    generated = sorted(path.name for path in tmp_path.glob("*.sbatch"))
    committed = sorted(path.name for path in (REPO / "slurm").glob("*.sbatch"))
    assert (
        generated
        == committed
        == [
            "llama-1b-ddp-2x8.sbatch",
            "llama-1b-ddp-4x4.sbatch",
            "llama-1b-tp4-2x8.sbatch",
            "llama-1b-tp4-4x4.sbatch",
        ]
    )

    def portable(text: str) -> str:
        # the scripts name paths relative to the checkout (--relative-paths); RUNS and the
        # output folder of this run are elsewhere, so say them as the committed ones do
        text = text.replace(f"--output-dir {runs}/", "--output-dir runs/")
        text = text.replace(f"{os.path.relpath(runs, REPO)}/", "runs/")
        return text.replace(f"--out {os.path.relpath(tmp_path, REPO)}/", "--out slurm/")

    for name in generated:
        fresh = portable((tmp_path / name).read_text())
        kept = (REPO / "slurm" / name).read_text()
        assert fresh == kept, f"slurm/{name} is stale: run bash slurm/generate.sh"
        options = sbatch_options(fresh)
        nodes, per_node = name.removesuffix(".sbatch").split("-")[-1].split("x")
        assert (options["nodes"], options["gres"]) == (nodes, f"gpu:{per_node}")
        assert os.access(tmp_path / name, os.R_OK)
        assert (runs / name.removesuffix(".sbatch") / "logs").is_dir()


def test_no_committed_file_holds_this_checkouts_path():
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    checkout = str(REPO).encode()
    holding = [
        name.decode()
        for name in listed
        if name
        and (REPO / name.decode()).is_file()
        and checkout in (REPO / name.decode()).read_bytes()
    ]
    assert not holding, f"{holding} name {REPO}: use paths relative to the checkout"
    for script in (REPO / "slurm").glob("*.sbatch"):
        text = script.read_text()
        assert "--chdir" not in text
        assert not [word for word in srun_words(text) if word.startswith("/")], script.name
        assert not sbatch_options(text)["output"].startswith("/"), script.name


def test_relative_paths_name_the_run_file_run_and_logs_from_the_submit_directory(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text(TINY_LLAMA.read_text())
    result = run_dplaunch(
        "slurm", "configs/run.yaml", "--cpu", "--gpus", "2", "--relative-paths",
        "-o", "runs/tiny", "--out", "job.sbatch", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    script = (tmp_path / "job.sbatch").read_text()
    subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], check=True)
    assert str(tmp_path) not in script
    assert "--chdir" not in script  # the job starts where sbatch is run
    options = sbatch_options(script)
    assert options["output"] == "runs/tiny/logs/%x-%j.out"
    words = srun_words(script)
    launcher = words[words.index("dplaunch-node") + 1 :]
    assert launcher[:5] == ["python", "-m", "dplaunch", "train", "configs/run.yaml"]
    assert launcher[launcher.index("--output-dir") + 1] == "runs/tiny"
    assert (tmp_path / "runs" / "tiny" / "logs").is_dir()  # sbatch needs it, relative or not
    assert "relative to the directory it is submitted from" in result.stdout


# ---------------------------------------------------------------- inside an allocation

# what `srun` shows the launcher on the third node of `sbatch --nodes=4 --gres=gpu:4`
NODE_2_OF_4 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "jz[01-04]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    "SLURM_CPUS_PER_TASK": "40",
}


def test_dplaunch_config_on_node_2_of_a_4_node_job_renders_that_nodes_accelerate_config(
    tmp_path,
):
    out = tmp_path / "cfg"
    env = child_environment(**NODE_2_OF_4)
    del env["OMP_NUM_THREADS"]  # a value the user sets wins; here SLURM's CPUs decide
    result = run_dplaunch("config", TINY_LLAMA, "--global-batch", "64", "--out", out, env=env)
    assert result.returncode == 0, result.stderr
    # node 2 writes its own file names: nodes sharing a run directory keep their machine_rank
    assert sorted(p.name for p in out.iterdir()) == [
        "accelerate-node2.yaml",
        "launch-node2.sh",
        "plan.json",
        "run.yaml",
    ]
    accelerate = yaml.safe_load((out / "accelerate-node2.yaml").read_text())
    assert accelerate["machine_rank"] == 2
    assert accelerate["num_machines"] == 4
    assert accelerate["num_processes"] == 16  # the total, not per node
    assert accelerate["main_process_ip"] == "jz01"
    assert accelerate["main_process_port"] == 20000 + 4242 % 12000
    assert "SLURM job 4242: this is node 2 of 4 (jz03)" in result.stdout
    # the ranks' threads share the CPUs SLURM gave this node's launcher
    assert "export OMP_NUM_THREADS=10" in (out / "launch-node2.sh").read_text()


@pytest.mark.parametrize(
    ("args", "variables", "expected"),
    [
        (["--gpus", "8"], {}, "--gpus: 8 GPUs requested but SLURM job 4242 holds 16"),
        (["--gpus-per-node", "8"], {}, "launch.gpus_per_node: the plan puts 8 GPUs on each node"),
        ([], {"SLURM_STEP_TASKS_PER_NODE": "4(x4)"}, "--ntasks-per-node: SLURM job 4242 runs 4"),
        (["--nodes", "2"], {}, "launch.nodes: 2 node(s) planned but SLURM job 4242 holds 4"),
    ],
)
def test_a_plan_that_disagrees_with_the_allocation_is_refused_by_name(
    tmp_path, args, variables, expected
):
    result = run_dplaunch(
        "config",
        TINY_LLAMA,
        "--global-batch",
        "64",
        *args,
        "--out",
        tmp_path / "cfg",
        env=child_environment(**(NODE_2_OF_4 | variables)),
    )
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert not (tmp_path / "cfg").exists()


def test_outside_a_step_a_multi_node_job_shows_the_srun_it_would_start(tmp_path):
    batch_shell = {k: v for k, v in NODE_2_OF_4.items() if "STEP" not in k}
    batch_shell |= {"SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": "40"}
    result = run_dplaunch(
        "train",
        TINY_LLAMA,
        "--global-batch",
        "64",
        "--dry-run",
        "-o",
        tmp_path / "run",
        env=child_environment(**batch_shell),
    )
    assert result.returncode == 0, result.stderr
    line = result.stdout.split("starting one launcher per node with\n", 1)[1].splitlines()[0]
    words = shlex.split(line)
    assert words[:6] == [
        "srun",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=40",
    ]
    again = words[words.index("dplaunch-node") + 1 :]
    assert again[:4] == [sys.executable, "-m", "dplaunch", "train"]
    assert again[-2:] == ["--output-dir", str(tmp_path / "run")]
    assert not (tmp_path / "run").exists()


def test_a_script_for_the_clusters_paths_renders_where_they_cannot_be_created(tmp_path):
    # rendered on a laptop for /gpfswork/…: the log directory is the cluster's to create
    result = run_dplaunch(
        "slurm", TINY_LLAMA, "--gpus", "8", "--out", "-", "-o", "/proc/no-such-place/run"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash\n")
    assert "note: cannot create the log directory /proc/no-such-place/run/logs here" in (
        result.stderr
    )
    assert "mkdir -p /proc/no-such-place/run/logs" in result.stderr
