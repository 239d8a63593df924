"""SLURM without SLURM: hostlists, allocations read from SLURM_* variables, batch scripts."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest

from dplaunch.cluster import hostlist
from dplaunch.cluster.hostlist import expand_hostlist, parse_hostlist
from dplaunch.cluster.slurm import (
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    SinfoRow,
    SlurmAllocation,
    check_allocation,
    detect_allocation,
    gpus_per_node,
    launch_for_allocation,
    node_shape,
    parse_sinfo_nodes,
    parse_tasks_per_node,
    rank_threads,
    srun_argv,
)
from dplaunch.config.schema import LaunchConfig
from dplaunch.errors import UserError
from dplaunch.rendering.sbatch import (
    NODE_LAUNCHER,
    REQUEUE_EXIT_STATUS,
    SbatchSpec,
    quote_for_sbatch,
    render_sbatch,
    time_limit_seconds,
)
from tests.helpers import sbatch_options

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


def test_in_the_batch_script_the_jobs_task_count_does_not_matter_dplaunch_starts_its_own_step():
    # `sbatch --ntasks-per-node=4` then `dplaunch train` in the batch shell: dplaunch runs
    # `srun --ntasks-per-node=1` itself, so the job's 4 tasks per node are no mistake
    env = JEAN_ZAY_NODE_2_OF_4 | {"SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "0"}
    del env["SLURM_STEP_ID"]
    alloc = detect_allocation(env)
    assert not alloc.inside_step
    assert check_allocation(alloc, requested_gpus=16) == []


def test_inside_a_step_the_steps_own_task_count_is_what_counts():
    # `srun --ntasks-per-node=1` inside a job submitted with --ntasks-per-node=4
    env = JEAN_ZAY_NODE_2_OF_4 | {
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    }
    assert detect_allocation(env).ntasks_per_node == 1
    two = detect_allocation(env | {"SLURM_STEP_TASKS_PER_NODE": "2(x4)"})
    with pytest.raises(UserError, match="2 tasks per node"):
        check_allocation(two, requested_gpus=16)


def test_dplaunch_starts_one_task_per_node_with_every_count_spelled_out():
    env = dict(JEAN_ZAY_NODE_2_OF_4)
    del env["SLURM_STEP_ID"]
    argv = srun_argv(detect_allocation(env), ["python", "-m", "dplaunch", "train", "x.yaml"])
    assert argv == [
        "srun",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=40",
        "python",
        "-m",
        "dplaunch",
        "train",
        "x.yaml",
    ]
    # a job of one task per GPU (4 per node, 10 CPUs each): the node's launcher gets all 40
    env |= {"SLURM_CPUS_PER_TASK": "10", "SLURM_CPUS_ON_NODE": "40", "SLURM_NTASKS_PER_NODE": "4"}
    assert "--cpus-per-task=40" in srun_argv(detect_allocation(env), ["dplaunch"])


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
        # a requeued job must not truncate its first run's log
        "open-mode": "append",
    }
    assert "set -euo pipefail" in script
    assert "module purge\nmodule load arch/h100\nmodule load pytorch-gpu/py3/2.4.0\n" in script
    assert "source $WORK/venv/bin/activate" in script
    # values we export are data, not shell: $WORK stays literal
    assert "export HF_HOME='$WORK/hf cache'" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert srun == (
        "srun --nodes=4 --ntasks=4 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=40 "
        # the step keeps the job's one thread per core: srun's explicit --cpus-per-task would not
        "--hint=nomultithread "
        'bash -c "$node_launcher" dplaunch-node '
        "dplaunch train runs/llama.yaml --set train.lr=3e-4 || status=$?"
    )
    bash_syntax_ok(script, tmp_path)


def test_status_75_of_a_launcher_requeues_the_job_and_any_other_status_is_the_jobs(tmp_path):
    script = render_sbatch(JEAN_ZAY_SPEC)
    tail = script[script.index("srun ") :].splitlines()[1:]
    assert tail == [
        'if [ "$status" -eq 0 ] && [ -e "$DPLAUNCH_REQUEUE_MARK" ]; then',
        '    rm -f "$DPLAUNCH_REQUEUE_MARK"',
        '    echo "dplaunch: checkpoint saved before the time limit: requeueing job $SLURM_JOB_ID" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]
    assert 'export DPLAUNCH_REQUEUE_MARK=runs/llama/slurm/.requeue-"$SLURM_JOB_ID"' in script
    assert f"node_launcher={shlex.quote(NODE_LAUNCHER)}" in script


@pytest.mark.parametrize(
    ("status", "exit_code", "marked"), [(75, 0, True), (0, 0, False), (3, 3, False)]
)
def test_the_node_launcher_turns_75_into_a_marker_and_passes_other_statuses_on(
    tmp_path, status, exit_code, marked
):
    # what srun runs on every node: srun --kill-on-bad-exit would take 75 for a failure
    mark = tmp_path / "mark"
    result = subprocess.run(
        ["bash", "-c", NODE_LAUNCHER, "dplaunch-node", "bash", "-c", f"exit {status}"],
        env={"PATH": os.environ["PATH"], "DPLAUNCH_REQUEUE_MARK": str(mark)},
    )
    assert (result.returncode, mark.exists()) == (exit_code, marked)


def test_the_node_launcher_survives_the_time_limit_signal_its_child_handles_it(tmp_path):
    # SLURM sends USR1 to every process of the step, the node launcher's bash included
    child = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\n"
        "os.kill(os.getppid(), signal.SIGUSR1)\n"  # the bash in between
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(30)\n"
    )
    mark = tmp_path / "mark"
    result = subprocess.run(
        ["bash", "-c", NODE_LAUNCHER, "dplaunch-node", sys.executable, "-c", child],
        env={"PATH": os.environ["PATH"], "DPLAUNCH_REQUEUE_MARK": str(mark)},
        timeout=60,
    )
    assert result.returncode == 0 and mark.exists()


def test_the_requeue_status_is_the_one_dplaunch_train_exits_with_after_a_signal_checkpoint():
    checkpoint = pytest.importorskip("dplaunch.stop_signals")
    assert checkpoint.EXIT_CHECKPOINTED == REQUEUE_EXIT_STATUS == 75


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
    # sbatch takes ' for a quote as well: "l'exp" unescaped is "Unmatched `'`", fatal
    assert quote_for_sbatch("/work/l'exp") == '"/work/l\\\'exp"'


@pytest.mark.parametrize(
    ("limit", "seconds"),
    [
        ("30", 30 * 60),  # minutes
        ("30:15", 30 * 60 + 15),  # minutes:seconds
        ("20:00:00", 20 * 3600),
        ("2-3", (2 * 24 + 3) * 3600),  # days-hours
        ("2-3:04", (2 * 24 + 3) * 3600 + 4 * 60),
        ("1-00:00:05", 24 * 3600 + 5),
        ("UNLIMITED", None),
    ],
)
def test_slurm_time_limits_in_seconds(limit, seconds):
    assert time_limit_seconds(limit) == seconds


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


# ---------------------------------------------------------------- planning inside an allocation


def launch(**values) -> LaunchConfig:
    """A launch section as the run file and flags would give it (only the keys set)."""
    return LaunchConfig.model_validate(values)


def test_the_allocation_decides_nodes_rank_head_port_and_gpus_per_node():
    alloc = detect_allocation(JEAN_ZAY_NODE_2_OF_4)
    resolved, notes = launch_for_allocation(launch(), alloc)
    assert (resolved.nodes, resolved.node_rank, resolved.gpus, resolved.gpus_per_node) == (
        4,
        2,
        16,
        4,
    )
    assert resolved.master_addr == "jean-zay-iam01"
    assert resolved.master_port == alloc.master_port
    assert "node 2 of 4 (jean-zay-iam03)" in notes[-1]


def test_asking_8_gpus_in_a_16_gpu_allocation_is_refused_before_launch():
    with pytest.raises(UserError) as error:
        launch_for_allocation(launch(gpus=8), detect_allocation(JEAN_ZAY_NODE_2_OF_4))
    assert error.value.field == "--gpus" and "holds 16" in error.value.line()


def test_gpus_per_node_that_differ_from_the_plan_are_a_named_error():
    with pytest.raises(UserError) as error:
        launch_for_allocation(
            launch(gpus=16, gpus_per_node=8), detect_allocation(JEAN_ZAY_NODE_2_OF_4)
        )
    assert error.value.field == "launch.gpus_per_node"
    assert "8 GPUs on each node" in error.value.line() and "4 per node" in error.value.line()


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"nodes": 2}, "launch.nodes"),
        ({"node_rank": 1}, "launch.node_rank"),
        ({"hostfile": "hosts"}, "launch.hostfile"),
    ],
)
def test_values_slurm_decides_must_agree_with_it(values, field):
    with pytest.raises(UserError) as error:
        launch_for_allocation(launch(**values), detect_allocation(JEAN_ZAY_NODE_2_OF_4))
    assert error.value.field == field


def test_stated_values_that_agree_with_slurm_and_an_explicit_head_address_are_kept():
    resolved, _ = launch_for_allocation(
        launch(nodes=4, node_rank=2, master_addr="jean-zay-iam01-ib0", master_port=29555),
        detect_allocation(JEAN_ZAY_NODE_2_OF_4),
    )
    assert (resolved.master_addr, resolved.master_port) == ("jean-zay-iam01-ib0", 29555)


def test_a_cpu_allocation_runs_the_cpu_ranks_asked_for():
    # what the one-host test cluster gives a `dplaunch train --cpu --gpus 2` job
    env = {
        "SLURM_JOB_ID": "9",
        "SLURM_JOB_NODELIST": "vm",
        "SLURM_NODEID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURM_CPUS_PER_TASK": "2",
    }
    alloc = detect_allocation(env)
    resolved, notes = launch_for_allocation(launch(cpu=True, gpus=2), alloc)
    assert (resolved.nodes, resolved.gpus, resolved.master_addr) == (1, 2, "127.0.0.1")
    assert resolved.master_port == alloc.master_port
    assert rank_threads(alloc, 2) == 1
    # without a GPU count, one CPU rank per node
    resolved, _ = launch_for_allocation(launch(cpu=True), alloc)
    assert resolved.gpus == 1


def test_in_the_batch_shell_the_node_is_the_first_one():
    env = dict(JEAN_ZAY_NODE_2_OF_4)
    del env["SLURM_NODEID"], env["SLURM_STEP_ID"]
    resolved, _ = launch_for_allocation(launch(), detect_allocation(env))
    assert resolved.node_rank == 0


# ---------------------------------------------------------------- what sinfo says about nodes

SINFO = """\
debug*|(null)|2|1|(null)
gpu_p5|gpu:8(S:0-1)|128|2|a100,amd
gpu_p6|gpu:h100:4(S:0-1)|96|1|h100
gpu_p6|gpu:h100:4(S:0-1)|96|1|h100
mixed|gpu:4|40|1|v100,v100-32g
mixed|gpu:8|64|1|a100
"""


def test_sinfo_rows_give_gpus_physical_cores_and_features_per_node():
    rows = parse_sinfo_nodes(SINFO)
    assert rows[0] == SinfoRow("debug*", None, 2, frozenset())
    assert rows[1] == SinfoRow("gpu_p5", 8, 64, frozenset({"a100", "amd"}))  # 2 threads/core
    assert rows[2] == SinfoRow("gpu_p6", 4, 96, frozenset({"h100"}))
    # the four columns of older dplaunch versions' format still parse
    assert parse_sinfo_nodes("gpu_p6|gpu:4|96|1\n") == [SinfoRow("gpu_p6", 4, 96)]


@pytest.mark.parametrize(
    ("partition", "constraint", "shape"),
    [
        # Jean-Zay routes a job by -C and the account, not the partition: every partition counts
        (None, "h100", (4, 96)),
        (None, "a100", (8, 64)),
        (None, "v100-32g", (4, 40)),
        (None, "a100&amd", (8, 64)),
        (None, "v100|h100", (4, None)),  # 4 GPUs, but 40 or 96 cores
        ("mixed", "a100", (8, 64)),
        (None, "mi250", (None, None)),
        # a form dplaunch does not read selects as if it were not there: the default partition
        (None, "[h100*2]", (None, 2)),
    ],
)
def test_the_node_shape_of_a_constraint(partition, constraint, shape):
    assert node_shape(parse_sinfo_nodes(SINFO), partition, constraint)[:2] == shape


@pytest.mark.parametrize(
    ("partition", "shape"),
    [
        (None, (None, 2)),  # the default partition, marked '*'
        ("gpu_p6", (4, 96)),
        ("gpu_p5", (8, 64)),
        ("mixed", (None, None)),  # nodes disagree: the caller falls back and says so
        ("absent", (None, None)),
    ],
)
def test_a_partitions_node_shape(partition, shape):
    assert node_shape(parse_sinfo_nodes(SINFO), partition)[:2] == shape
