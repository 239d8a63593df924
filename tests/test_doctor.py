"""`dplaunch doctor`: two "nodes" on loopback pass with a bandwidth row per size; a node that
cannot reach the rendezvous port, or a head node name that does not resolve, fails naming it.

Each node is its own `dplaunch doctor` process (as on a cluster); they share one run directory.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dplaunch.commands.doctor import NodeReport, gpu_health
from dplaunch.train.doctor_ranks import CPU_SIZES, bus_bandwidth
from tests.helpers import TINY_LLAMA, child_environment, fake_nvidia_smi, free_port, run_dplaunch

# the doctor's own deadline is 60 s; this only keeps a broken doctor from hanging the suite
BOUND_S = 180


def doctor_node(rank: int, port: int, run_dir, master: str = "127.0.0.1") -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable, "-m", "dplaunch", "doctor", "--cpu", "--gpus", "2", "--nodes", "2",
            "--node-rank", str(rank), "--master-addr", master, "--master-port", str(port),
            "-o", str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_environment(),
    )  # fmt: skip


@pytest.mark.multiprocess
def test_two_nodes_on_loopback_pass_with_a_bus_bandwidth_row_per_size(tmp_path):
    port = free_port()
    nodes = [doctor_node(rank, port, tmp_path / "run") for rank in (0, 1)]
    head, other = (node.communicate(timeout=BOUND_S)[0] for node in nodes)
    assert [node.returncode for node in nodes] == [0, 0], head + other
    assert "doctor: PASS" in head and "doctor: PASS" in other
    # node 0 lists what every node found, including the interface towards the head node
    for rank in (0, 1):
        line = next(x for x in head.splitlines() if x.startswith(f"node {rank} ("))
        assert "head node 127.0.0.1 is 127.0.0.1" in line and "interface lo" in line, line
        assert re.search(r"run directory writes \d+ MB/s", line), line
    assert "all-reduce over 2 rank(s) (gloo):" in head
    rows = [x.split() for x in head.splitlines() if re.match(r"\s+\d+ (KiB|MiB)\s", x)]
    assert len(rows) == len(CPU_SIZES)
    assert all(float(row[-1]) > 0 for row in rows)  # busbw, GB/s


@pytest.mark.multiprocess
def test_the_doctor_without_flags_passes_on_one_cpu_rank(tmp_path):
    # one rank: Accelerate starts it without torchrun (no RANK): before, two tracebacks and FAIL
    result = run_dplaunch("doctor", "-o", tmp_path / "run", timeout=BOUND_S)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "doctor: PASS" in out, out[-3000:]
    assert "Traceback" not in out and "all-reduce over 1 rank(s) (gloo):" in out


@pytest.mark.multiprocess
def test_preflight_of_a_node_that_cannot_reach_the_rendezvous_port_fails_naming_it(tmp_path):
    # node 1 of a 2-node training run with launch.preflight; node 0 never starts, so nothing
    # answers on the port, as behind a firewall that refuses it
    port = free_port()
    result = run_dplaunch(
        "train", TINY_LLAMA, "--cpu", "--gpus", "2", "--nodes", "2", "--node-rank", "1",
        "--master-port", port, "--set", "launch.preflight=true", "-o", tmp_path / "run",
        timeout=BOUND_S,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "doctor: FAIL: node 1 (" in out, out
    assert f"cannot reach the head node's rendezvous port 127.0.0.1:{port} within 20 s" in out
    assert "the preflight check failed (above): no rank was started" in out
    assert "all-reduce over" not in out and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_head_node_name_that_does_not_resolve_fails_naming_it(tmp_path):
    result = run_dplaunch(
        "doctor", "--cpu", "--gpus", "2", "--nodes", "2", "--node-rank", "1",
        "--master-addr", "no-such-host.invalid", "-o", tmp_path / "run",
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "doctor: FAIL: node 1 (" in out
    assert "cannot resolve 'no-such-host.invalid'" in out


def test_uncorrected_ecc_errors_fail_the_gpu_and_busy_memory_warns(tmp_path, monkeypatch):
    # index, uuid, memory.total, compute_cap, ECC, memory.used, SM clock, max SM clock, °C, name
    rows = "0, GPU-0a, 81559, 9.0, 0, 3, 1980, 1980, 35, NVIDIA H100\\n1, GPU-1b, 81559, 9.0, 2, 40000, 345, 1980, 80, NVIDIA H100"
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, f'printf "{rows}\\n"'))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    report = NodeReport(0, "gpu-a")
    gpu_health(report)
    assert report.facts[0] == (
        "GPU 0 NVIDIA H100: ECC uncorrected 0, memory used 3/81559 MiB, SM clock 1980/1980 MHz, 35 °C"
    )
    assert report.failures == [
        "GPU 1 (GPU-1b) has 2 uncorrected ECC errors: drain the node or reset the GPU"
    ]
    assert report.warnings == ["GPU 1 has 40000 MiB in use by another process"]


def test_bus_bandwidth_is_counted_as_nccl_tests_count_it():
    # 1 GB all-reduced by 8 ranks in 0.1 s: algbw 10 GB/s, busbw 10 × 2·7/8 = 17.5 GB/s
    assert bus_bandwidth(10**9, 0.1, 8) == pytest.approx((10.0, 17.5))


def test_a_process_may_claim_its_own_port_again_as_preflight_then_training_do():
    from dplaunch.launching.ports import claim_port

    port = free_port()
    assert claim_port(port) is None and claim_port(port) is None
