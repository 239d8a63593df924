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
    # the smoke matrix's LoRA and QLoRA cases: peft and bitsandbytes (the image has no
    # bitsandbytes), whose wheel keeps only the device's CUDA libraries
    assert {"peft", "bitsandbytes"} <= set(pins)
    assert "benchmarks.gpu_wheels slim" in (REPO / "benchmarks" / "gpu.sh").read_text()
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


def test_the_gpu_smoke_matrix_runs_in_its_cpu_mode_and_reports_each_case(tmp_path):
    # `gpu.sh smoke`, the matrix gpu.sh runs first on a GPU, here on CPU ranks: a resumed checkpoint (two
    # launches: the whole path of a case, its checks and numbers), and fp16, which CPU ranks
    # refuse before launch: a failure and its first error line. The cases that need a GPU are
    # skipped saying so; the rest of the matrix is not asked for (it is the same code: a few
    # minutes more on 2 cores, each)
    import subprocess
    import sys

    from benchmarks import gpu_smoke
    from tests.helpers import child_environment

    out = tmp_path / "out"
    smoke = {"PY": sys.executable, "OUT": str(out), "WORK": str(tmp_path / "work"),
             "SMOKE_FLAGS": "--cpu --only resume,fp16"}  # fmt: skip
    done = subprocess.run(
        ["bash", "benchmarks/gpu.sh", "smoke"],
        capture_output=True, text=True, timeout=400, cwd=REPO, env=child_environment(**smoke),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "smoke matrix: 1 passed, 1 failed" in done.stdout  # fp16 fails here, as it must
    assert "== dplaunch train ddp1" not in done.stdout  # `smoke`: the matrix only
    result = json.loads((out / gpu_smoke.RESULT_FILE).read_text())
    cases = result["cases"]
    assert list(cases) == [case.name for case in gpu_smoke.CASES]
    assert (result["mode"], result["pass"], result["fail"]) == ("cpu", 1, 1)
    resumed = cases["resume"]
    assert resumed["status"] == "pass" and resumed["resumed_loss_gap"] <= gpu_smoke.RESUME_TOLERANCE
    assert resumed["steps_per_s"] > 0 and resumed["peak_memory_gib"] > 0
    assert resumed["estimated_memory_gib"] > 0 and resumed["measured_over_estimate"] > 0
    assert cases["fp16"]["status"] == "fail"
    assert cases["fp16"]["first_error"].startswith("dplaunch: error: train.mixed_precision: fp16")
    for name in ("compile", "flash-packed-sft"):
        assert cases[name] == {**cases[name], "status": "skipped", "why": "needs a GPU"}
    assert cases["zero3"]["why"] == "not asked (--only)"


def test_the_smoke_matrix_names_the_first_error_a_failed_run_printed():
    from benchmarks.gpu_smoke import first_error

    summary = "step 1/4 …\ndplaunch: the job failed with status 1\n[rank 0] RuntimeError: CUDA error: out of memory"
    assert first_error(summary) == "[rank 0] RuntimeError: CUDA error: out of memory"
    # a library's noise at exit after dplaunch's summary line does not hide it
    noisy = f"{summary}\nException ignored in atexit callback: NCCL Error 3"
    assert first_error(noisy) == "[rank 0] RuntimeError: CUDA error: out of memory"
    assert first_error("a\nValueError: bad\nmore") == "ValueError: bad"


def test_the_slimmed_wheels_keep_what_the_device_loads():
    # pyarrow.lib links libarrow_substrait (leaving it out broke `import pyarrow`): only Flight,
    # S3 (linked by their own modules alone), headers and tests go; bitsandbytes keeps CUDA 13
    from benchmarks.gpu_wheels import kept

    for name in ("pyarrow/lib.cpython-312-x86_64-linux-gnu.so", "pyarrow/libarrow_substrait.so.2600",
                 "pyarrow/libarrow_python.so.2600", "pyarrow/_fs.cpython-312-x86_64-linux-gnu.so",
                 "pyarrow/libparquet.so.2600", "pyarrow-26.0.1.dist-info/RECORD"):  # fmt: skip
        assert kept("pyarrow", name), name
    for name in ("pyarrow/libarrow_flight.so.2600", "pyarrow/_s3fs.cpython-312-x86_64-linux-gnu.so",
                 "pyarrow/libarrow_s3.so.2600", "pyarrow/include/arrow/api.h"):  # fmt: skip
        assert not kept("pyarrow", name), name
    assert kept("bitsandbytes", "bitsandbytes/libbitsandbytes_cuda130.so")
    assert kept("bitsandbytes", "bitsandbytes/libbitsandbytes_cpu.so")
    assert not kept("bitsandbytes", "bitsandbytes/libbitsandbytes_cuda128.so")
