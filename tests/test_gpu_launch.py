"""The GPU side of launching, checked on a machine without GPUs: rendered GPU plans and faked probes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from dplaunch.config.flags import RunFlags
from dplaunch.launching import deepspeed_ops, devices, ports
from dplaunch.launching.prepare import hang_dump_environment, prepare_training_run
from tests.helpers import TINY_LLAMA, child_environment, fake_nvidia_smi, refusal_line, run_dplaunch

CORES = len(os.sched_getaffinity(0))
V100S = 'echo "0, GPU-0a, 32768, 7.0, Tesla V100-SXM2-32GB"; echo "1, GPU-1b, 32768, 7.0, Tesla V100-SXM2-32GB"'


EIGHT_H100S = "; ".join(
    f'echo "{index}, GPU-h100-{index}, 81559, 9.0, NVIDIA H100 80GB HBM3"' for index in range(8)
)


def environment_with_gpus(folder: Path, nvidia_smi_body: str) -> dict[str, str]:
    """The test environment on a machine whose (fake) nvidia-smi lists GPUs, none hidden."""
    env = child_environment(PATH=fake_nvidia_smi(folder, nvidia_smi_body))
    del env["CUDA_VISIBLE_DEVICES"]
    return env


def render_gpu_plan(out: Path, *flags: str) -> subprocess.CompletedProcess:
    """`dplaunch config` for GPUs on this GPU-less machine, with dplaunch deciding the threads."""
    env = child_environment()
    del env["OMP_NUM_THREADS"]
    result = run_dplaunch("config", TINY_LLAMA, *flags, "-o", out, env=env)
    assert result.returncode == 0, result.stderr
    return result


def test_zero_offload_on_two_gpus_gets_the_cores_of_the_node_for_cpu_adam(tmp_path):
    # accelerate launch and torchrun export OMP_NUM_THREADS=1 when it is unset: DeepSpeed's CPU
    # Adam (OpenMP) would step the whole offloaded optimizer on one core
    result = render_gpu_plan(tmp_path, "--gpus", "2", "--zero", "2", "--offload", "optimizer")
    # rendered here for a GPU node: launch.sh counts that node's cores when it runs there (before,
    # this machine's count was written in)
    script = (tmp_path / "launch.sh").read_text()
    (export,) = [line for line in script.splitlines() if "OMP_NUM_THREADS" in line]
    node = tmp_path / "node"  # the GPU node: 64 cores
    node.mkdir()
    path = f"{node}{os.pathsep}{os.environ['PATH']}"
    (node / "nproc").write_text("#!/bin/sh\necho 64\n")
    (node / "nproc").chmod(0o755)
    counted = subprocess.run(
        ["bash", "-c", f"{export}; echo $OMP_NUM_THREADS"],
        capture_output=True, text=True, check=True, env={**os.environ, "PATH": path},
    )  # fmt: skip
    assert counted.stdout.strip() == "32"
    assert (
        "note: offload: DeepSpeed's CPU Adam steps on OpenMP threads per rank (OMP_NUM_THREADS: "
        "the cores of the node that runs launch.sh ÷ 2 ranks)"
    ) in result.stdout


def test_gpu_ranks_without_offload_keep_the_launchers_one_thread(tmp_path):
    render_gpu_plan(tmp_path, "--gpus", "2", "--zero", "2")
    assert "OMP_NUM_THREADS" not in (tmp_path / "launch.sh").read_text()


def test_bf16_on_v100s_is_refused_before_launch_with_fp16_as_the_fix(tmp_path):
    env = environment_with_gpus(tmp_path, V100S)
    result = run_dplaunch(
        "train", TINY_LLAMA, "--gpus", "2", "--mixed-precision", "bf16", "--dry-run", env=env
    )
    refusal_line(
        result,
        "train.mixed_precision: bf16 needs GPUs of compute capability 8.0 (Ampere) or newer",
        "Tesla V100-SXM2-32GB has 7.0",
        "--mixed-precision fp16",
    )
    fp16 = run_dplaunch(
        "train", TINY_LLAMA, "--gpus", "2", "--mixed-precision", "fp16", "--dry-run", env=env
    )
    assert fp16.returncode == 0, fp16.stderr
    assert "mixed precision: fp16" in fp16.stdout and "backend nccl" in fp16.stdout


def test_the_probe_reads_compute_capability_and_copes_with_an_older_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, V100S))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = devices.visible_gpus()
    assert [(gpu.index, gpu.compute_capability, gpu.memory_mib) for gpu in gpus] == [
        (0, 7.0, 32768),
        (1, 7.0, 32768),
    ]
    assert devices.oldest_compute_capability(gpus) == (7.0, "Tesla V100-SXM2-32GB")
    # CUDA_VISIBLE_DEVICES by index or UUID prefix picks from the same list
    assert [gpu.index for gpu in devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1"})] == [1]
    # drivers before 510 do not know compute_cap: asked again without it
    old_driver = (
        'case "$*" in *compute_cap*) echo "Field \\"compute_cap\\" is not a valid field to query."; '
        'exit 2;; esac; echo "0, GPU-0a, 16384, Tesla P100-PCIE-16GB"'
    )
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, old_driver))
    (gpu,) = devices.visible_gpus()
    assert (gpu.name, gpu.memory_mib, gpu.compute_capability) == (
        "Tesla P100-PCIE-16GB",
        16384,
        None,
    )


def test_two_runs_of_four_gpus_on_an_eight_gpu_machine_take_different_gpus(tmp_path, monkeypatch):
    # run A is prepared in this process and holds its claims; B and C are other dplaunch processes
    env = environment_with_gpus(tmp_path, EIGHT_H100S)
    env["TMPDIR"] = str(tmp_path)  # where the claims live, for B and C as for A
    monkeypatch.setattr(ports, "GPU_CLAIMS_DIR", tmp_path / "dplaunch-gpus", raising=False)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    held_before = len(ports._claims)
    try:
        first = prepare_training_run(RunFlags(config=TINY_LLAMA, gpus=4))
        assert first.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert "GPUs 0,1,2,3 claimed for this run (CUDA_VISIBLE_DEVICES)" in first.plan.notes
        assert "export CUDA_VISIBLE_DEVICES=0,1,2,3\n" in first.files["launch.sh"]
        # nvidia-smi's indices, which CUDA reads in the same (PCI bus) order only when told
        assert first.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID\n" in first.files["launch.sh"]

        second = run_dplaunch("train", TINY_LLAMA, "--gpus", "4", "--dry-run", env=env)
        assert second.returncode == 0, second.stderr
        assert (
            "note: GPUs 4,5,6,7 claimed for this run (CUDA_VISIBLE_DEVICES); "
            "0,1,2,3 are held by another dplaunch run"
        ) in second.stdout

        # a CUDA_VISIBLE_DEVICES of the user's is the list dplaunch claims from
        narrowed = {**env, "CUDA_VISIBLE_DEVICES": "2,3,4,5"}
        third = run_dplaunch("train", TINY_LLAMA, "--gpus", "2", "--dry-run", env=narrowed)
        assert "note: GPUs 4,5 claimed for this run (CUDA_VISIBLE_DEVICES); 2,3 are" in third.stdout

        crowded = run_dplaunch(
            "train", TINY_LLAMA, "--gpus", "5", "--global-batch", "10", "--dry-run", env=env
        )
        refusal_line(
            crowded,
            "launch.gpus: 5 GPU(s) wanted here, but GPU(s) 0,1,2,3 of this machine's 8 are held",
            "wait for that run to end",
        )
    finally:
        for handle in ports._claims[held_before:]:
            os.close(handle)
        del ports._claims[held_before:]


def test_a_hostfile_run_carries_gloo_socket_ifname_to_every_host(tmp_path):
    # DeepSpeed's runner forwards NCCL_* over pdsh, not GLOO_*: the gloo side group of the remote
    # ranks would bind the host name's address, perhaps a network the other nodes cannot reach
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("gpu-a slots=2\ngpu-b slots=2\n")
    env = {**child_environment(), "GLOO_SOCKET_IFNAME": "ib0"}
    result = run_dplaunch(
        "config", TINY_LLAMA, "--hostfile", hostfile, "-o", tmp_path / "run", env=env
    )
    assert result.returncode == 0, result.stderr
    launch = (tmp_path / "run" / "launch.sh").read_text()
    assert "deepspeed.launcher.runner" in launch and " env " in launch
    assert " GLOO_SOCKET_IFNAME=ib0 " in launch.splitlines()[-1]


def test_nodes_reuse_nccls_interface_for_gloo_when_it_names_one_they_have(tmp_path):
    flags = ("--gpus", "4", "--nodes", "2", "--master-addr", "10.0.0.1")
    env = {**child_environment(), "NCCL_SOCKET_IFNAME": "lo"}
    result = run_dplaunch("config", TINY_LLAMA, *flags, "-o", tmp_path / "lo", env=env)
    assert result.returncode == 0, result.stderr
    assert "export GLOO_SOCKET_IFNAME=lo\n" in (tmp_path / "lo" / "launch.sh").read_text()
    assert "note: GLOO_SOCKET_IFNAME=lo (NCCL_SOCKET_IFNAME's)" in result.stdout
    # a prefix or an exclusion is NCCL's language only: said, not guessed
    env["NCCL_SOCKET_IFNAME"] = "^docker,lo"
    result = run_dplaunch("config", TINY_LLAMA, *flags, "-o", tmp_path / "ex", env=env)
    assert "GLOO_SOCKET_IFNAME" not in (tmp_path / "ex" / "launch.sh").read_text()
    assert "set GLOO_SOCKET_IFNAME to the interface's exact name" in result.stdout


def test_an_offload_plan_on_a_machine_without_a_compiler_is_refused_in_one_line(tmp_path):
    # every rank would fail minutes in, JIT-building DeepSpeed's CPU Adam
    bare = tmp_path / "bin"  # a PATH without ninja and c++
    bare.mkdir()
    extensions = tmp_path / "extensions"  # nothing built there yet
    env = child_environment(PATH=str(bare), TORCH_EXTENSIONS_DIR=str(extensions))
    offload = ("--cpu", "--gpus", "2", "--zero", "2", "--offload", "optimizer", "--dry-run")
    result = run_dplaunch("train", TINY_LLAMA, *offload, env=env)
    refusal_line(
        result,
        "parallel.offload: this plan needs DeepSpeed's cpu_adam op",
        "lacks what building it takes: ninja, a C++ compiler (c++)",
        "pip install ninja; apt install g++",
        "DS_BUILD_CPU_ADAM=1 pip install deepspeed",
    )
    # a plan that builds nothing is not asked for a compiler
    assert (
        run_dplaunch("train", TINY_LLAMA, "--cpu", "--gpus", "2", "--dry-run", env=env).returncode
        == 0
    )
    # nor is one whose ops this machine built before
    for name in ("cpu_adam", "deepspeed_shm_comm"):
        (extensions / name).mkdir(parents=True)
        (extensions / name / f"{name}.so").touch()
    assert run_dplaunch("train", TINY_LLAMA, *offload, env=env).returncode == 0


def test_the_extensions_folder_is_one_per_python_environment_and_cpu_type():
    avx512 = deepspeed_ops.cpu_architecture_key("x86_64", "fpu sse2 avx2 avx512f")
    avx2 = deepspeed_ops.cpu_architecture_key("x86_64", "fpu sse2 avx2")
    assert avx512 != avx2 and avx512.startswith("x86_64-")
    assert deepspeed_ops.cpu_architecture_key("x86_64", "avx2 sse2 fpu") == avx2  # order-free
    assert deepspeed_ops.torch_extensions_dir(avx512) != deepspeed_ops.torch_extensions_dir(avx2)
    here = deepspeed_ops.torch_extensions_dir()
    assert (
        here.name.endswith(deepspeed_ops.cpu_architecture_key())
        and here.parent.name == "torch_extensions"
    )


def test_dplaunch_env_says_whether_deepspeed_ops_can_be_built_here(tmp_path, monkeypatch):
    from dplaunch.environment_report import deepspeed_ops

    monkeypatch.setenv("PATH", str(tmp_path))
    missing = deepspeed_ops(("cpu_adam",))["build_tools_missing"]
    assert missing[:2] == ["ninja", "a C++ compiler (c++)"]


def test_a_gpu_plan_runs_the_nccl_flight_recorder_into_the_run_directory(tmp_path):
    # on a collective timeout NCCL dumps every rank's last collectives next to the Python stacks
    render_gpu_plan(tmp_path / "gpu", "--gpus", "2", "--zero", "2")
    launch = (tmp_path / "gpu" / "launch.sh").read_text()
    errors = (tmp_path / "gpu").absolute() / "errors"
    for line in (
        "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000\n",
        "export TORCH_NCCL_DUMP_ON_TIMEOUT=1\n",
        f"export TORCH_NCCL_DEBUG_INFO_TEMP_FILE={errors}/nccl-trace-rank-\n",
        f"export DPLAUNCH_ERRORS_DIR={errors}\n",
    ):
        assert line in launch, launch
    render_gpu_plan(tmp_path / "cpu", "--cpu", "--gpus", "2")
    cpu_launch = (tmp_path / "cpu" / "launch.sh").read_text()
    assert "TORCH_NCCL" not in cpu_launch and "DPLAUNCH_ERRORS_DIR" in cpu_launch
    # a value of the user's is kept (the ranks inherit it)
    plan = prepare_training_run(RunFlags(config=TINY_LLAMA, gpus=2), render_only=True).plan
    mine = hang_dump_environment(plan, errors, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000"})
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine and mine["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_cpu_ranks_on_a_gpu_machine_see_no_gpu(tmp_path, monkeypatch):
    # --cpu plans gloo ranks: a quantized base under ZeRO-3 (no device_map) would otherwise
    # load onto the GPU transformers finds
    env = environment_with_gpus(tmp_path, EIGHT_H100S)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    prepared = prepare_training_run(RunFlags(config=TINY_LLAMA, gpus=2, cpu=True))
    assert prepared.plan.target == "cpu" and prepared.env["CUDA_VISIBLE_DEVICES"] == ""
    assert "export CUDA_VISIBLE_DEVICES=''\n" in prepared.files["launch.sh"]
