"""Several nodes without SLURM: one command per node (torchrun-style), or a DeepSpeed hostfile.

Two "nodes" on one machine meet on loopback; they share one run directory, as nodes of a
cluster share one filesystem.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dplaunch.cluster.hostfile import launch_for_hostfile, parse_hostfile
from dplaunch.config.schema import LaunchConfig
from dplaunch.errors import UserError
from tests.conftest import COMPARISON_FLAGS
from tests.helpers import (
    TINY_LLAMA,
    child_environment,
    free_port,
    max_relative_gap,
    read_metrics,
    run_dplaunch,
    run_loopback_nodes,
    train,
    train_losses,
)


@pytest.mark.multiprocess
def test_two_nodes_on_loopback_train_like_two_ranks_on_one_node(tmp_path, dp_reference):
    run_dir = tmp_path / "shared-run"  # both nodes write here, like a cluster's shared disk
    port = free_port()
    outputs = run_loopback_nodes(TINY_LLAMA, run_dir, *COMPARISON_FLAGS, port=port)
    assert "world size 2 (2 node(s) × 1 CPU rank(s), backend gloo)" in outputs[1]
    # each node ran its own accelerate config: same rendezvous, its own machine_rank
    for rank, name in ((0, "accelerate.yaml"), (1, "accelerate-node1.yaml")):
        config = yaml.safe_load((run_dir / name).read_text())
        assert (config["machine_rank"], config["num_machines"], config["num_processes"]) == (
            rank,
            2,
            2,
        )
        assert (config["main_process_ip"], config["main_process_port"]) == ("127.0.0.1", port)
    assert (run_dir / "launch.sh").is_file() and (run_dir / "launch-node1.sh").is_file()
    # rank 0 (on node 0) writes the metrics: one file, the world of both nodes
    header = read_metrics(run_dir)[0]
    assert (header["world_size"], header["num_nodes"]) == (2, 2)
    losses = train_losses(run_dir)
    assert len(losses) == 6
    assert max_relative_gap(losses, train_losses(dp_reference)) < 1e-6


def test_a_node_rank_beyond_the_nodes_is_refused(tmp_path):
    result = run_dplaunch(
        "train", TINY_LLAMA, "--cpu", "--gpus", "2", "--nodes", "2", "--node-rank", "2",
        "-o", tmp_path / "run",
    )  # fmt: skip
    assert result.returncode == 2 and "launch.node_rank" in result.stderr


# ---------------------------------------------------------------- DeepSpeed hostfiles


@pytest.mark.multiprocess
def test_a_one_host_hostfile_runs_here_through_deepspeeds_runner_without_ssh(
    tmp_path, dp_reference
):
    # DeepSpeed's runner starts a single host locally, with no pdsh and no ssh
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one box\nlocalhost slots=2\n")
    run_dir = tmp_path / "run"
    result = train(run_dir, "--cpu", "--hostfile", hostfile, *COMPARISON_FLAGS)
    assert "-m deepspeed.launcher.runner --hostfile" in result.stdout
    assert read_metrics(run_dir)[0]["world_size"] == 2
    assert max_relative_gap(train_losses(run_dir), train_losses(dp_reference)) < 1e-6


def two_host_hostfile(tmp_path: Path) -> Path:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("gpu-a slots=4\ngpu-b slots=4\n")
    return hostfile


def test_a_two_host_hostfile_renders_a_runner_line_deepspeed_accepts(tmp_path):
    out = tmp_path / "cfg"
    result = run_dplaunch(
        "config", TINY_LLAMA, "--hostfile", two_host_hostfile(tmp_path), "--zero", "2", "--out", out
    )
    assert result.returncode == 0, result.stderr
    assert "world size 8 (2 node(s) × 4 GPU(s), backend nccl)" in result.stdout
    script = (out / "launch.sh").read_text()
    subprocess.run(["bash", "-n", str(out / "launch.sh")], check=True)
    argv = shlex.split(script.splitlines()[-1].removeprefix("exec "))
    assert argv[1:4] == ["-u", "-m", "deepspeed.launcher.runner"]
    # the ranks' variables travel on the command line: pdsh forwards only a few of ours
    rank = argv[argv.index("env") :]
    assert "TOKENIZERS_PARALLELISM=false" in rank
    assert rank[-4:] == ["-u", "-m", "dplaunch.train", str(out)]
    # DeepSpeed's own parser takes the line as we wrote it
    probe = (
        "import sys\nfrom deepspeed.launcher.runner import parse_args\n"
        "args = parse_args(sys.argv[1:])\n"
        "print('PARSED', args.hostfile, args.launcher, args.master_addr, args.master_port, args.no_python,"
        " args.no_local_rank, args.user_script, args.user_args[-1])\n"
    )
    parsed = subprocess.run(
        [sys.executable, "-c", probe, *argv[4:]],
        capture_output=True,
        text=True,
        env=child_environment(),
        check=True,
    ).stdout
    parsed = next(line for line in parsed.splitlines() if line.startswith("PARSED ")).split()[1:]
    assert parsed == [
        str(tmp_path / "hostfile"),
        "pdsh",
        "gpu-a",
        "29500",
        "True",
        "True",
        "env",
        str(out),
    ]


def test_several_hosts_without_pdsh_are_refused_before_anything_starts(tmp_path):
    empty = tmp_path / "bin"  # a PATH where pdsh cannot be found
    empty.mkdir()
    result = run_dplaunch(
        "train",
        TINY_LLAMA,
        "--hostfile",
        two_host_hostfile(tmp_path),
        "-o",
        tmp_path / "run",
        env=child_environment(PATH=str(empty)),
    )
    assert result.returncode == 2
    assert "launch.hostfile: 2 hosts need DeepSpeed's multi-node launcher" in result.stderr
    assert "apt install pdsh" in result.stderr
    assert not (tmp_path / "run").exists()


def hostfile_launch(text: str, **launch):
    return launch_for_hostfile(LaunchConfig.model_validate(launch), parse_hostfile(text))


def test_the_hostfile_decides_nodes_gpus_per_node_and_the_head_node():
    resolved, notes = hostfile_launch("gpu-a slots=8\n\ngpu-b slots=8 # spare\n")
    assert (resolved.nodes, resolved.gpus_per_node, resolved.gpus) == (2, 8, 16)
    assert resolved.master_addr == "gpu-a"
    assert "over pdsh/ssh" in notes[0]
    local, _ = hostfile_launch("localhost slots=2\n")
    assert (local.nodes, local.master_addr) == (1, "127.0.0.1")


@pytest.mark.parametrize(
    ("text", "launch", "expected"),
    [
        ("a slots=4\nb slots=8\n", {}, "different slot counts (a:4, b:8)"),
        ("a slots=4\na slots=4\n", {}, "lists a twice"),
        ("a 4\n", {}, "line 1 is not 'host slots=N'"),
        ("# nothing\n", {}, "lists no host"),
        ("a slots=4\nb slots=4\n", {"gpus": 4}, "4 requested but the hostfile holds 8"),
        ("a slots=4\nb slots=4\n", {"nodes": 3}, "3 node(s) planned but the hostfile lists 2"),
        ("a slots=4\nb slots=4\n", {"node_rank": 1}, "--node-rank with --hostfile"),
        ("gpu-far slots=4\n", {}, "its only host gpu-far is not this machine"),
    ],
)
def test_hostfile_mistakes_are_one_line(text, launch, expected):
    with pytest.raises(UserError) as error:
        hostfile_launch(text, **launch)
    assert expected in error.value.line()
