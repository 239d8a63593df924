"""`dplaunch calibrate`: one CPU rank (the one-GPU box) and two loopback nodes of two ranks each
calibrate within their time budget and write a profile that `plan` and `train` use; what a
device cannot run is left out (a V100's bf16, flash-attention that raises when called, eager
attention larger than the free memory), decided on a faked device; --out a folder is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from dplaunch.planning.profiles import CALIBRATED, read_profile
from dplaunch.train import calibrate_ranks
from dplaunch.train.calibrate_ranks import (
    GPU_DENSE,
    SHARES,
    Clock,
    attention_plan,
    device_limits,
    flash_kernel,
    runnable_dense,
)
from tests.helpers import (
    TINY_LLAMA,
    child_environment,
    free_port,
    refusal_line,
    run_cli,
    run_dplaunch,
)

# what the tests' calibrations may measure for: enough for one point of each series
BUDGET = ("--quick", "--budget", "2")
# two loopback nodes of two ranks: a broken calibration hangs; this bounds it
NODES_BOUND_S = 120


def profiles(cache) -> list:
    return sorted((cache / "dplaunch" / "profiles").glob("*.json"))


@pytest.mark.multiprocess
def test_one_cpu_rank_calibrates_and_plans_for_two_ranks_take_the_links_it_lacks(tmp_path):
    # one rank: Accelerate starts it without torchrun (no RANK): before, two tracebacks and FAIL
    cache = tmp_path / "cache"
    env = child_environment(XDG_CACHE_HOME=str(cache))
    # a process, as a user starts it: supervising ranks from pytest's own process would stop the
    # suite's fork servers with them (the supervisor stops every child it has)
    calibrated = run_dplaunch("calibrate", "--cpu", "--gpus", "1", *BUDGET, env=env, cwd=tmp_path)
    out = calibrated.stdout + calibrated.stderr
    assert calibrated.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "FutureWarning" not in out
    assert "the ranks measure for at most 2 s once started" in out
    [written] = profiles(cache)
    assert f"wrote {written}" in calibrated.stdout
    # nothing in the working directory: the launch files and the ranks' log are in the cache
    assert list(tmp_path.iterdir()) == [cache]
    assert (cache / "dplaunch" / "calibrate" / "ranks.log").is_file()
    profile = read_profile(written)
    assert profile.source == CALIBRATED and profile.devices_per_node == 1
    assert profile.dense and profile.attention and profile.collectives == {}
    assert "note: one rank: no collectives measured" in calibrated.stdout

    # a plan for 2 ranks: the cache's 1-rank profile, with the links it lacks assumed, said so
    # (before: "profile: the profile has no broadcast timing")
    flags = (TINY_LLAMA, "--cpu", "--gpus", "2", "--gpu-memory", "4")
    plan = run_cli("plan", *flags, env=env)
    assert plan.returncode == 0, plan.stderr
    assert "profile note: no collectives measured inside a node (calibrated on 1 device(s)" in (
        plan.stdout
    )
    rows = json.loads(run_cli("plan", *flags, "--json", env=env).stdout)
    assert all(row["profile"] == profile.label and row["step_time_s"] > 0 for row in rows)
    dry_run = run_cli("train", TINY_LLAMA, "--cpu", "--gpus", "2", "--dry-run", env=env)
    assert dry_run.returncode == 0, dry_run.stderr


def calibrate_node(rank: int, port: int, run_dir, cache) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable, "-m", "dplaunch", "calibrate", "--cpu", "--gpus", "4", "--nodes",
            "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port",
            str(port), *BUDGET, "-o", str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_environment(XDG_CACHE_HOME=str(cache)),
    )  # fmt: skip


@pytest.mark.multiprocess
def test_two_loopback_nodes_of_two_ranks_calibrate_inside_and_across_nodes(tmp_path):
    # before, node 1's ranks skipped the timing that node 0's ran on the whole world: a hang
    port = free_port()
    cache = tmp_path / "cache"
    nodes = [calibrate_node(rank, port, tmp_path / f"node{rank}", cache) for rank in (0, 1)]
    try:
        head, other = (node.communicate(timeout=NODES_BOUND_S)[0] for node in nodes)
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], head[-3000:] + other[-3000:]
    assert "node 1: ranks finished; node 0 writes the profile" in other
    [written] = profiles(cache)
    profile = read_profile(written)
    assert (profile.devices_per_node, profile.nodes) == (2, 2)
    # every op on both scopes: the largest size of each is measured whatever the budget
    for scope in ("intra", "inter"):
        assert set(profile.collectives[scope]) == set(calibrate_ranks.COLLECTIVES), scope
        assert all(link.bus_bytes_per_s > 0 for link in profile.collectives[scope].values())


def test_calibrate_out_a_folder_is_refused_before_anything_is_measured(tmp_path):
    cache = tmp_path / "cache"
    result = run_cli(
        "calibrate", "--cpu", "--gpus", "1", "--out", tmp_path,
        env=child_environment(XDG_CACHE_HOME=str(cache)),
    )  # fmt: skip
    refusal_line(result, f"--out: {tmp_path} is a directory", "profile.json")
    assert not cache.exists()


def test_the_clock_keeps_to_the_budget_and_measures_each_series_first_point():
    now = [0.0]
    clock = Clock(10.0, point_s=0.4, now=lambda: now[0])
    clock.start("collectives", 6)  # its share of the 10 s (0.2: until 2 s), 6 points
    end = 10.0 * SHARES["collectives"] / sum(SHARES.values())
    assert clock.section_end == pytest.approx(end)
    assert clock.target(None, essential=True) == pytest.approx(min(0.4, end / 6))
    # a point whose warm-up and first run (2 × 1 s foreseen) do not fit in what is left
    now[0] = end - 1.5
    assert clock.target(1.0, essential=False) == 0.0
    assert clock.target(0.5, essential=False) > 0
    # the section's time is spent: only a series' first point still runs (once)
    now[0] = end + 0.5
    assert clock.target(None, essential=False) == 0.0
    assert 0 < clock.target(None, essential=True) < 1e-6
    # dense's share of the shares left, of the seconds left: what a section leaves passes on
    clock.start("dense", 10)
    left = sum(SHARES.values()) - SHARES["collectives"]
    assert clock.section_end == pytest.approx(now[0] + (10.0 - now[0]) * SHARES["dense"] / left)


def fake_gpu(monkeypatch, capability, free_gib):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib * 2**30, 0))
    # flash-attention not installed
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    limits = device_limits(torch.device("cuda", 0))
    ranks = types.SimpleNamespace(
        device=torch.device("cuda", 0), quick=False, limits=limits, agree=lambda yes: yes
    )
    return limits, ranks


def test_a_v100_times_no_bf16_and_its_attention_in_fp16(monkeypatch):
    limits, ranks = fake_gpu(monkeypatch, (7, 0), 31)
    assert not limits.bf16
    shapes = runnable_dense(GPU_DENSE, limits)
    assert shapes and {dtype for dtype, _, _ in shapes} == {"fp16", "fp32"}
    assert shapes[0] == ("fp16", 1024, 2048)  # the cheapest of the first dtype first
    dtype, _, points = attention_plan(ranks)
    assert dtype == "fp16" and points
    assert "bf16 (compute capability (7, 0) has none)" in limits.skipped
    assert "flash-attention (not installed)" in limits.skipped


@pytest.mark.parametrize(("free_gib", "eager_8192"), [(39, False), (79, True)])
def test_eager_attention_at_8192_tokens_runs_only_where_it_fits(monkeypatch, free_gib, eager_8192):
    limits, ranks = fake_gpu(monkeypatch, (8, 0), free_gib)
    dtype, _, points = attention_plan(ranks)
    kept = {(kernel, length) for kernel, _, length in points}
    assert dtype == "bf16" and ("sdpa", 8192) in kept and ("eager", 2048) in kept
    assert (("eager", 8192) in kept) is eager_8192
    left_out = [line for line in limits.skipped if line.startswith("eager attention at 8192")]
    assert bool(left_out) is not eager_8192, limits.skipped


def test_flash_attention_that_raises_when_called_is_left_out(monkeypatch):
    def pre_ampere(*_args, **_kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    meta = torch.device("meta")
    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=pre_ampere)
    )
    kernel, why = flash_kernel(meta, torch.bfloat16)
    assert kernel is None
    assert why == "flash-attention (FlashAttention only supports Ampere GPUs or newer.)"
    works = types.SimpleNamespace(flash_attn_func=lambda q, k, v, causal: q)
    monkeypatch.setitem(sys.modules, "flash_attn", works)
    kernel, why = flash_kernel(meta, torch.bfloat16)
    assert kernel is not None and why is None
