"""benchmarks/gpu.sh's parts that run without a GPU: the carried wheels and the MFU arithmetic."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from benchmarks import gpu_report, gpu_wheels
from tests.helpers import REPO, TINY_LLAMA


def test_the_carried_wheels_hold_every_requirement_of_deepspeed_and_datasets_at_the_tested_version():
    # the GPU machine cannot reach PyPI: a requirement neither carried nor in the image stops
    # `import deepspeed` (einops, msgpack, …) or `import datasets` (xxhash, dill, …) there
    pins = gpu_wheels.carried_pins()
    provided = {**pins}
    for name in (*gpu_wheels.FROM_THE_IMAGE, *gpu_wheels.BUILT_HERE):
        provided[canonicalize_name(name)] = importlib.metadata.version(name)
    for name in (*gpu_wheels.ROOTS, *pins):
        if canonicalize_name(name) in map(canonicalize_name, gpu_wheels.FROM_THE_IMAGE):
            continue
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker and not requirement.marker.evaluate(gpu_wheels.DEVICE_MARKERS):
                continue
            wanted = canonicalize_name(requirement.name)
            assert wanted in provided, f"{name} needs {requirement}, which gpu.sh does not carry"
            assert requirement.specifier.contains(provided[wanted], prereleases=True), requirement
    assert {"einops", "msgpack", "hjson", "py-cpuinfo", "xxhash", "dill", "multiprocess"} <= set(
        pins
    )
    # the versions CI tests (constraints.txt), not whatever PyPI has today
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if canonicalize_name(name) in pins:
            assert pins[canonicalize_name(name)] == version.strip(), line
    assert "benchmarks.gpu_wheels pins" in (REPO / "benchmarks" / "gpu.sh").read_text()


def test_mfu_is_of_the_datasheet_peak_with_the_measured_matmul_peak_beside_it(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    run = yaml.safe_load(TINY_LLAMA.read_text())
    run["train"].update(micro_batch_size=8, mixed_precision="bf16", max_steps=20)
    (work / "ddp1").mkdir(parents=True)
    (work / "ddp1" / "run.yaml").write_text(yaml.safe_dump(run))
    records = [
        {"type": "train", "step": step, "elapsed_s": 0.5 * step, "memory_gb": 1.0}
        for step in range(1, 21)
    ]
    (work / "ddp1" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out.mkdir()
    (out / "matmul_peak.json").write_text(json.dumps({"matmul_bf16_flops": 790e12}))

    assert gpu_report.main(work, out) == 0
    report = json.loads((out / "gpu.json").read_text())
    entry = report["runs"]["dplaunch DDP-1"]
    per_token, _, _ = gpu_report.flops_per_token(run)
    tokens_per_step = 8 * 64  # global batch × max_length
    assert entry["tokens_per_s"] == pytest.approx(2 * tokens_per_step)  # 10 steps in 5 s
    assert report["peak_flops"] == 989e12 and report["measured_matmul_peak_flops"] == 790e12
    assert entry["mfu"] == round(2 * tokens_per_step * per_token / 989e12, 4)
    assert entry["mfu_of_measured_matmul_peak"] == round(
        2 * tokens_per_step * per_token / 790e12, 4
    )
    assert gpu_report.utilisation(10_000, 6.6e9, None) == {"mfu": round(6.6e13 / 989e12, 4)}
