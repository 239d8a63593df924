"""`dplaunch env`: versions, GPUs, SLURM, ports and DeepSpeed ops."""

from __future__ import annotations

import importlib.metadata
import socket
import time

import pytest

from dplaunch.environment_report import collect_environment, format_environment
from dplaunch.launching import devices
from tests import helpers

KEYS = {
    "versions",
    "platform",
    "torch_cuda",
    "torch_hip",
    "nccl",
    "gpus",
    "gpu_query",
    "cuda_visible_devices",
    "slurm",
    "ports_free",
    "deepspeed_ops",
}


def fake_nvidia_smi(folder, body: str, monkeypatch) -> None:
    monkeypatch.setenv("PATH", helpers.fake_nvidia_smi(folder, body))


def test_keys_and_versions_match_package_metadata():
    report = collect_environment({}, probe_ops=False)
    assert set(report) == KEYS
    for package in ("torch", "accelerate", "deepspeed", "transformers", "datasets"):
        assert report["versions"][package] == importlib.metadata.version(package)
    assert report["versions"]["python"].count(".") == 2


def test_torch_build_is_read_without_importing_torch():
    import torch

    report = collect_environment({}, probe_ops=False)
    assert report["torch_cuda"] == torch.version.cuda
    assert report["nccl"] is None or torch.version.cuda is not None


def test_without_the_op_probe_it_takes_well_under_a_second():
    start = time.perf_counter()
    collect_environment({}, probe_ops=False)
    assert time.perf_counter() - start < 1.0


def test_gpus_come_from_nvidia_smi(tmp_path, monkeypatch):
    fake_nvidia_smi(
        tmp_path,
        'echo "0, GPU-0a, 81559, 9.0, NVIDIA H100 80GB HBM3"; '
        'echo "1, GPU-1b, 81559, 9.0, NVIDIA H100 80GB HBM3"',
        monkeypatch,
    )
    report = collect_environment({"CUDA_VISIBLE_DEVICES": "0,1"}, probe_ops=False)
    assert report["gpu_query"] == "ok"
    h100 = {"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "compute_capability": 9.0}
    assert report["gpus"] == [{"index": 0, **h100}, {"index": 1, **h100}]
    text = format_environment(report)
    assert "GPU 1                 NVIDIA H100 80GB HBM3, 80 GiB, compute capability 9.0" in text
    assert "'0,1'" in text


def test_a_hung_nvidia_smi_is_reported_not_waited_for(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, "sleep 5", monkeypatch)
    monkeypatch.setattr(devices, "NVIDIA_SMI_TIMEOUT_S", 0.5)
    start = time.perf_counter()
    report = collect_environment({}, probe_ops=False)
    assert time.perf_counter() - start < 3
    assert report["gpus"] == [] and "did not answer" in report["gpu_query"]


def test_no_nvidia_smi_means_no_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    report = collect_environment({}, probe_ops=False)
    assert report["gpus"] == [] and report["gpu_query"] == "nvidia-smi not found"
    assert "none (nvidia-smi not found)" in format_environment(report)


def test_slurm_allocation_is_summarised_from_its_variables():
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "llama-7b",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NTASKS": "4",
    }
    report = collect_environment(env, probe_ops=False)
    assert report["slurm"]["job_id"] == "4242"
    assert report["slurm"]["nodes"] == "4"
    assert report["slurm"]["nodelist"] == "gpu[01-04]"
    assert report["slurm"]["gpus_per_node"] == "4"
    assert report["slurm"]["tasks_per_node"] == "1"
    text = format_environment(report)
    assert "4242 (llama-7b)" in text and "gpu[01-04]" in text
    assert collect_environment({}, probe_ops=False)["slurm"] is None


def test_a_busy_master_port_is_reported():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        report = collect_environment({"MASTER_PORT": str(port)}, probe_ops=False)
    assert report["ports_free"][str(port)] is False
    assert "29500" in report["ports_free"]
    assert f"port {port}" in format_environment(report)


@pytest.mark.filterwarnings("ignore")
def test_deepspeed_ops_are_probed_like_ds_report():
    report = collect_environment({})
    ops = report["deepspeed_ops"]
    assert "error" not in ops, ops.get("error")
    assert ops["accelerator"] in ("cpu", "cuda")
    assert "cpu_adam" in ops["ops"]
    assert set(ops["ops"]["cpu_adam"]) == {"installed", "compatible"}
    assert "cpu_adam" in format_environment(report)
