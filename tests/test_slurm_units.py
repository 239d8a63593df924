"""SLURM without SLURM: hostlists, allocations read from SLURM_* variables, batch scripts."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import replace

import pytest

from dplaunch.cluster import hostlist
from dplaunch.cluster.hostlist import expand_hostlist, parse_hostlist
from dplaunch.cluster.slurm import (
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    SlurmAllocation,
    check_allocation,
    detect_allocation,
    gpus_per_node,
    parse_tasks_per_node,
)
from dplaunch.errors import UserError
from dplaunch.rendering.sbatch import SbatchSpec, quote_for_sbatch, render_sbatch

# ---------------------------------------------------------------- hostlists


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("jean-zay-1", ["jean-zay-1"]),
        (
            "jean-zay-[1-3,7],gpu[01-02]",
            ["jean-zay-1", "jean-zay-2", "jean-zay-3", "jean-zay-7", "gpu01", "gpu02"],
        ),
        (
            "jean-zay-iam[08-11]",
            ["jean-zay-iam08", "jean-zay-iam09", "jean-zay-iam10", "jean-zay-iam11"],
        ),
        ("x[8-010]", ["x8", "x9", "x10"]),
        ("n[1-2]-ib[3-4]", ["n1-ib3", "n1-ib4", "n2-ib3", "n2-ib4"]),
        ("r[1-2]i0n[0-1]", ["r1i0n0", "r1i0n1", "r2i0n0", "r2i0n1"]),
        ("a, b[9-11]", ["a", "b9", "b10", "b11"]),
        ("node[3]", ["node3"]),
        ("", []),
    ],
)
def test_a_slurm_node_list_expands_to_host_names_in_order(nodelist, hosts):
    assert parse_hostlist(nodelist) == hosts


@pytest.mark.parametrize("broken", ["n[1-", "n1]", "n[3-1]", "n[a-b]", "n[[1]]"])
def test_a_malformed_node_list_is_refused_rather_than_guessed(broken):
    with pytest.raises(ValueError):
        parse_hostlist(broken)


def test_without_scontrol_the_python_expander_answers(monkeypatch):
    monkeypatch.setattr(hostlist.shutil, "which", lambda name: None)
    assert expand_hostlist("gpu[01-02]") == ["gpu01", "gpu02"]


def test_when_scontrol_cannot_answer_the_python_expander_answers(monkeypatch, tmp_path):
    # a login node with scontrol but no slurm.conf prints "Could not establish a config source"
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'fatal: no config' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(hostlist.shutil, "which", lambda name: str(fake))
    assert expand_hostlist("gpu[01-02]") == ["gpu01", "gpu02"]


def test_when_scontrol_answers_its_expansion_is_used(monkeypatch, tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "alpha\\nbeta\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(hostlist.shutil, "which", lambda name: str(fake))
    assert expand_hostlist("whatever[1-2]") == ["alpha", "beta"]


# ---------------------------------------------------------------- allocations

JEAN_ZAY_NODE_2_OF_4 = {
    # what `srun` shows the launcher on the third node of `sbatch --nodes=4 --gres=gpu:4`
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "jean-zay-iam[01-03],jean-zay-iam07",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1(x4)",
    "SLURM_CPUS_PER_TASK": "40",
    "SLURM_STEP_ID": "0",
}


def test_node_2_of_a_4_node_allocation_with_4_gpus_each():
    alloc = detect_allocation(JEAN_ZAY_NODE_2_OF_4)
    assert alloc.node_rank == 2
    assert alloc.num_nodes == 4
    assert alloc.head_node == "jean-zay-iam01"
    assert alloc.hostnames[-1] == "jean-zay-iam07"
    assert alloc.gpus_per_node == 4
    assert alloc.total_gpus == 16
    assert alloc.ntasks_per_node == 1
    assert alloc.cpus_per_task == 40
    assert alloc.inside_step
    assert check_allocation(alloc, requested_gpus=16) == []


def test_outside_slurm_there_is_no_allocation():
    assert detect_allocation({"HOME": "/home/me"}) is None
    assert detect_allocation(os.environ | {"SLURM_JOB_ID": ""}) is None


def test_every_node_of_one_job_agrees_on_the_master_port_and_another_job_gets_another():
    node_0 = detect_allocation(JEAN_ZAY_NODE_2_OF_4 | {"SLURM_NODEID": "0"})
    node_3 = detect_allocation(JEAN_ZAY_NODE_2_OF_4 | {"SLURM_NODEID": "3"})
    next_job = detect_allocation(JEAN_ZAY_NODE_2_OF_4 | {"SLURM_JOB_ID": "123457"})
    assert node_0.master_port == node_3.master_port
    assert next_job.master_port != node_0.master_port
    for job_id in ("1", "123456", "999999999", "42_7", "42+1"):
        port = detect_allocation(JEAN_ZAY_NODE_2_OF_4 | {"SLURM_JOB_ID": job_id}).master_port
        assert MASTER_PORT_BASE <= port < MASTER_PORT_BASE + MASTER_PORT_SPAN < 32768


@pytest.mark.parametrize(
    ("variables", "gpus"),
    [
        ({"SLURM_GPUS_ON_NODE": "8"}, 8),
        ({"SLURM_GPUS_PER_NODE": "4"}, 4),
        ({"SLURM_GPUS_PER_NODE": "gpu:4"}, 4),
        ({"SLURM_GPUS_PER_NODE": "h100:4"}, 4),
        ({"SLURM_GPUS_PER_NODE": "a100:2,v100:2"}, 4),
        ({"SLURM_JOB_GPUS": "0,1,2,3"}, 4),
        ({"SLURM_STEP_GPUS": "2,3"}, 2),
        ({"SLURM_JOB_GPUS": "0-3"}, 4),
        ({"SLURM_TRES_PER_NODE": "gres/gpu:4"}, 4),
        ({"SLURM_TRES_PER_NODE": "gres:gpu:h100:2"}, 2),
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_GPUS": "0"}, 4),
        ({}, None),
    ],
)
def test_gpus_per_node_is_read_from_whichever_variable_slurm_set(variables, gpus):
    assert gpus_per_node(variables) == gpus


@pytest.mark.parametrize(
    ("value", "counts"),
    [("1", [1]), ("1(x4)", [1, 1, 1, 1]), ("2(x2),1", [2, 2, 1]), ("4,4", [4, 4])],
)
def test_compressed_task_counts_expand_per_node(value, counts):
    assert parse_tasks_per_node(value) == counts


def test_a_cpu_job_in_the_batch_script_has_no_gpus_and_is_not_a_step():
    alloc = detect_allocation(
        {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "1"}
    )
    assert alloc.gpus_per_node is None
    assert alloc.num_nodes == 1
    assert not alloc.inside_step
    assert check_allocation(alloc, requested_gpus=None) == []
    assert check_allocation(alloc, requested_gpus=0) == []


def test_four_tasks_per_node_is_refused_with_the_fix():
    env = JEAN_ZAY_NODE_2_OF_4 | {"SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x4)"}
    with pytest.raises(UserError) as error:
        check_allocation(detect_allocation(env), requested_gpus=16)
    assert error.value.field == "--ntasks-per-node"
    assert "use --ntasks-per-node=1" in error.value.line()


def test_uneven_task_counts_are_refused_too():
    env = dict(JEAN_ZAY_NODE_2_OF_4)
    del env["SLURM_NTASKS_PER_NODE"]
    env["SLURM_TASKS_PER_NODE"] = "2,1(x3)"  # `sbatch --ntasks=5 --nodes=4`
    with pytest.raises(UserError, match="2 tasks per node"):
        check_allocation(detect_allocation(env), requested_gpus=None)


def test_asking_8_gpus_from_a_16_gpu_allocation_names_both_numbers():
    with pytest.raises(UserError) as error:
        check_allocation(detect_allocation(JEAN_ZAY_NODE_2_OF_4), requested_gpus=8)
    line = error.value.line()
    assert error.value.field == "--gpus"
    assert "8 GPUs requested" in line and "holds 16" in line and "4 nodes × 4 GPUs" in line


def test_asking_gpus_from_an_allocation_without_gpu_variables_warns_that_it_cannot_check():
    alloc = detect_allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "vm"})
    (warning,) = check_allocation(alloc, requested_gpus=4)
    assert "--gres=gpu:N" in warning


def test_a_multi_node_job_outside_srun_warns_that_only_one_node_would_start():
    env = dict(JEAN_ZAY_NODE_2_OF_4)
    del env["SLURM_STEP_ID"]
    (warning,) = check_allocation(detect_allocation(env), requested_gpus=None)
    assert "srun --ntasks-per-node=1" in warning


def test_a_node_list_that_disagrees_with_the_node_count_is_an_error():
    with pytest.raises(ValueError, match="has 2 hosts"):
        detect_allocation(JEAN_ZAY_NODE_2_OF_4 | {"SLURM_JOB_NODELIST": "a,b"})


def test_the_allocation_is_a_frozen_value():
    alloc = detect_allocation(JEAN_ZAY_NODE_2_OF_4)
    assert isinstance(alloc, SlurmAllocation)
    with pytest.raises(AttributeError):
        alloc.node_rank = 0  # type: ignore[misc]


# ---------------------------------------------------------------- batch scripts

JEAN_ZAY_SPEC = SbatchSpec(
    job_name="llama-zero2",
    command=["dplaunch", "train", "runs/llama.yaml", "--set", "train.lr=3e-4"],
    nodes=4,
    gpus_per_node=4,
    cpus_per_task=40,
    time="20:00:00",
    account="abc@h100",
    constraint="h100",
    qos="qos_gpu_h100-t3",
    modules=["arch/h100", "pytorch-gpu/py3/2.4.0"],
    setup_lines=["source $WORK/venv/bin/activate"],
    log_dir="runs/llama/slurm",
    requeue=True,
    signal_seconds=120,
    env={"HF_HOME": "$WORK/hf cache", "TOKENIZERS_PARALLELISM": "false"},
)


def sbatch_options(script: str) -> dict[str, str | None]:
    """The #SBATCH options of a script, parsed like sbatch does for these simple cases."""
    options = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            name, _, value = line[len("#SBATCH --") :].partition("=")
            options[name] = value or None
    return options


def bash_syntax_ok(script: str, tmp_path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_4_node_h100_job_on_jean_zay(tmp_path):
    script = render_sbatch(JEAN_ZAY_SPEC)
    options = sbatch_options(script)
    assert script.startswith("#!/bin/bash\n")
    assert options == {
        "job-name": "llama-zero2",
        "nodes": "4",
        "ntasks-per-node": "1",
        "gres": "gpu:4",
        "cpus-per-task": "40",
        "hint": "nomultithread",
        "time": "20:00:00",
        "account": "abc@h100",
        "qos": "qos_gpu_h100-t3",
        "constraint": "h100",
        "output": "runs/llama/slurm/%x-%j.out",
        "error": "runs/llama/slurm/%x-%j.err",
        "signal": "USR1@120",
        "requeue": None,
    }
    assert "set -euo pipefail" in script
    assert "module purge\nmodule load arch/h100\nmodule load pytorch-gpu/py3/2.4.0\n" in script
    assert "source $WORK/venv/bin/activate" in script
    # values we export are data, not shell: $WORK stays literal
    assert "export HF_HOME='$WORK/hf cache'" in script
    last = script.rstrip("\n").splitlines()[-1]
    assert last == (
        "srun --kill-on-bad-exit=1 --cpus-per-task=40 "
        "dplaunch train runs/llama.yaml --set train.lr=3e-4"
    )
    bash_syntax_ok(script, tmp_path)


def test_the_directives_come_before_any_shell_line():
    # sbatch stops reading #SBATCH at the first non-comment line
    lines = render_sbatch(JEAN_ZAY_SPEC).splitlines()
    first_shell = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_shell:])


def test_a_cpu_job_has_no_gres_and_no_module_lines(tmp_path):
    spec = SbatchSpec(job_name="cpu-smoke", command=["dplaunch", "train", "tiny.yaml"], cpu=True)
    script = render_sbatch(spec)
    options = sbatch_options(script)
    assert "gres" not in options
    assert "module" not in script
    assert "signal" not in options and "requeue" not in options
    assert options["ntasks-per-node"] == "1"
    bash_syntax_ok(script, tmp_path)


def test_a_hostile_job_name_is_data_for_sbatch_and_never_runs(tmp_path):
    # (touch, not rm -rf ~: if quoting were broken this test would really run it)
    evil = "$(touch canary) `touch canary` ; touch canary"
    spec = SbatchSpec(
        job_name=f'my job {evil} "quoted" #not-a-comment \\ end',
        command=["echo", evil, "'", '"'],
        cpu=True,
        account=evil,
        env={"X": evil},
        setup_lines=['echo "X=$X"'],
        log_dir=f"logs {evil}",
    )
    script = render_sbatch(spec)
    bash_syntax_ok(script, tmp_path)
    # outside the #SBATCH comments, "$(" and backticks only ever appear inside single quotes
    for line in script.splitlines():
        if line.startswith("#"):
            continue
        shlex.split(line, comments=True)  # balanced quotes, or this raises
        unquoted = re.sub(r"'[^']*'", "''", line)
        assert "$(" not in unquoted and "`" not in unquoted, line
    # run everything but srun itself (echoed instead): nothing may be created
    shell_part = script.replace("\nsrun ", "\necho srun ")
    result = subprocess.run(
        ["bash", "-c", shell_part], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "canary").exists()
    assert f"X={evil}" in result.stdout
    assert result.stdout.rstrip().endswith(f"echo {evil} ' \"")


def test_sbatch_quoting_escapes_what_sbatch_treats_specially():
    assert quote_for_sbatch("abc@h100") == "abc@h100"
    assert quote_for_sbatch("my job") == '"my job"'
    assert quote_for_sbatch('a"b') == '"a\\"b"'
    assert quote_for_sbatch("run#1") == '"run\\#1"'
    assert quote_for_sbatch("back\\slash") == '"back\\\\slash"'
    assert quote_for_sbatch("") == '""'


@pytest.mark.parametrize(
    "change",
    [
        {"job_name": "two\nlines"},
        {"job_name": "a/b"},
        {"job_name": ""},
        {"account": "abc\n#SBATCH --nodes=99"},
        {"command": ["dplaunch", "train\nrm -rf ~"]},
        {"env": {"BAD NAME": "x"}},
        {"env": {"X": "a\nb"}},
        {"modules": ["pytorch; rm -rf ~"]},
        {"time": "tomorrow"},
        {"time": "20:00:00\n"},
        {"nodes": 0},
        {"gpus_per_node": 0},
        {"cpus_per_task": -1},
        {"signal_seconds": 0},
        {"command": []},
        {"log_dir": "logs\nrm"},
    ],
)
def test_values_that_could_escape_their_line_or_are_not_slurm_values_are_refused(change):
    with pytest.raises(ValueError):
        render_sbatch(replace(JEAN_ZAY_SPEC, **change))


@pytest.mark.parametrize("time", ["30", "30:00", "20:00:00", "1-00", "2-12:00:00", "infinite"])
def test_every_slurm_time_format_is_accepted(time):
    assert f"#SBATCH --time={time}\n" in render_sbatch(replace(JEAN_ZAY_SPEC, time=time))


def test_a_percent_in_the_log_dir_is_not_a_filename_pattern():
    options = sbatch_options(render_sbatch(replace(JEAN_ZAY_SPEC, log_dir="logs/100%")))
    assert options["output"] == "logs/100%%/%x-%j.out"


def test_multi_line_setup_becomes_several_lines_under_relaxed_nounset(tmp_path):
    spec = replace(JEAN_ZAY_SPEC, modules=[], setup_lines=["export A=1\nexport B=2"])
    script = render_sbatch(spec)
    assert "set +u\nexport A=1\nexport B=2\nset -u\n" in script
    bash_syntax_ok(script, tmp_path)
