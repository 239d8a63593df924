"""benchmarks/gpu.sh's parts that run without a GPU: the carried wheels against the GPU image's
versions, the smoke matrix's bookkeeping and the MFU arithmetic."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import zipfile
from types import SimpleNamespace

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from benchmarks import gpu_report, gpu_smoke, gpu_wheels
from dplaunch.requirements import check_installed_versions, floors, release
from tests.helpers import REPO, TINY_LLAMA

# the GPU image's packages (the device's package list and one session's `pip list` there,
# 2026-11); None: in its package list, version not read
IMAGE = {
    "torch": "2.11.0+cu130", "accelerate": "1.15.0", "transformers": "5.17.0",
    "tokenizers": "0.23.2", "safetensors": "0.8.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2",
    "pandas": None, "pyyaml": None, "typer": None, "rich": None, "psutil": None,
    "matplotlib": None, "tensorboard": None, "pyarrow": None, "peft": None, "packaging": None,
}  # fmt: skip


def _printed(*argv: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gpu_wheels.main(list(argv)) == 0
    return out.getvalue().splitlines()


def on_the_device() -> dict[str, str | None]:
    """What the device's python holds once gpu.sh installed the carry: the image's packages, and
    the carried version of each package roots.txt asks for that the image misses (as the
    device's pip resolves it, keeping an image package that meets the requirement), then of the
    rest of the closure the image lacks."""
    carried = {**gpu_wheels.carried_pins()}
    for name in gpu_wheels.BUILT_HERE:
        carried[canonicalize_name(name)] = importlib.metadata.version(name)
    versions = dict(IMAGE)
    for line in _printed("roots"):
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        found = versions.get(name)
        if found is None or not requirement.specifier.contains(found, prereleases=True):
            versions[name] = carried[name]
    return {**carried, **versions}


def test_every_package_left_to_the_gpu_image_meets_dplaunchs_floors():
    # the image's transformers 5.17 was left to it, below dplaunch's floor of 5.24: every run of
    # the smoke matrix and the benchmark ended with dplaunch's refusal of it
    wanted = floors()
    for name in map(canonicalize_name, gpu_wheels.FROM_THE_IMAGE):
        assert name in IMAGE, f"{name} is left to the image, which does not list it"
        if name not in wanted:
            continue
        if IMAGE[name] is not None:
            assert release(IMAGE[name]) >= release(wanted[name]), (name, IMAGE[name], wanted[name])
        else:  # a version not read there: gpu.sh checks it first on the device
            assert name in gpu_wheels.CHECKED_ON_THE_DEVICE, f"{name}: no version of the image's"


def test_the_smoke_matrix_passes_dplaunchs_version_checks_on_the_image_with_the_carry():
    # each case is a `dplaunch train`, whose launch checks the versions (requirements.py): run
    # against what the device holds once the carry is installed, and each case's own modules
    device = on_the_device()

    def installed_version(name: str) -> str:
        version = device.get(canonicalize_name(name))
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    for case in gpu_smoke.CASES:
        check_installed_versions(installed_version)
        for module in case.needs:
            # flash-attn is not carried (a CUDA build): its case is skipped, saying so
            assert canonicalize_name(module) in device or module == "flash_attn", case.name
    # and every floor of dplaunch's is met, or left to gpu.sh's check on the device
    unknown = {name for name in floors() if device.get(canonicalize_name(name)) is None}
    assert unknown == set(gpu_wheels.CHECKED_ON_THE_DEVICE)
    for name, floor in floors().items():
        if name not in unknown:
            assert release(installed_version(name)) >= release(floor), name


def test_the_carried_wheels_hold_every_requirement_of_deepspeed_and_datasets_at_the_tested_version():
    # the GPU machine cannot reach PyPI: a requirement neither carried nor in the image stops
    # `import deepspeed` (einops, msgpack, …) or `import datasets` (xxhash, dill, …) there
    pins = gpu_wheels.carried_pins()
    provided: dict[str, str | None] = {**pins}
    for name in gpu_wheels.FROM_THE_IMAGE:
        provided[canonicalize_name(name)] = IMAGE[canonicalize_name(name)]
    for name in gpu_wheels.BUILT_HERE:
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
            if provided[wanted] is None:  # the image's, version not read: any must do
                assert not requirement.specifier, f"{name} needs {requirement} of the image"
                continue
            assert requirement.specifier.contains(provided[wanted], prereleases=True), requirement
    assert {"einops", "msgpack", "hjson", "py-cpuinfo", "xxhash", "dill", "multiprocess"} <= set(
        pins
    )
    # the smoke matrix's LoRA and QLoRA cases: peft and bitsandbytes (the image has no
    # bitsandbytes), whose wheel keeps only the device's CUDA libraries
    assert {"peft", "bitsandbytes"} <= set(pins)
    # transformers: the image's 5.17 is below dplaunch's floor
    assert pins["transformers"] == importlib.metadata.version("transformers")
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
    # the copies of libarrow_python a build links against; the extension modules load its
    # soname (readelf's NEEDED: libarrow_python.so.2600)
    assert kept("pyarrow", "pyarrow/libarrow_python.so.2600")
    for name in ("pyarrow/libarrow_python.so", "pyarrow/libarrow_python.so.2600.1.0"):
        assert not kept("pyarrow", name), name
    # torch 2.11+cu130 there: bitsandbytes loads the library of torch's CUDA, 13.0, by name
    assert kept("bitsandbytes", "bitsandbytes/libbitsandbytes_cuda130.so")
    assert kept("bitsandbytes", "bitsandbytes/libbitsandbytes_cpu.so")
    for other in ("cuda128", "cuda132"):
        assert not kept("bitsandbytes", f"bitsandbytes/libbitsandbytes_{other}.so"), other
    # transformers' modular_ and convert_ sources are never imported (its import structure
    # skips them); the generated modeling files stay
    assert kept("transformers", "transformers/models/llama/modeling_llama.py")
    assert kept("transformers", "transformers/models/llama/configuration_llama.py")
    for name in ("transformers/models/llama/modular_llama.py",
                 "transformers/models/llama/convert_llama_weights_to_hf.py"):  # fmt: skip
        assert not kept("transformers", name), name


def test_the_wheels_are_prepared_from_make_installs_venv_which_has_no_bitsandbytes(
    tmp_path, monkeypatch
):
    # `make install` installs no bitsandbytes (the [qlora] extra is `make test`'s): `gpu_wheels
    # roots` raised PackageNotFoundError there. Its version is constraints.txt's, its
    # requirements are read from its wheel, which gpu.sh downloads first (`absent`)
    expected_roots, expected_pins = _printed("roots"), gpu_wheels.carried_pins()
    installed = importlib.metadata.distribution("bitsandbytes")
    real = importlib.metadata.distribution

    def without_bitsandbytes(name):
        if canonicalize_name(name) == "bitsandbytes":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_bitsandbytes)
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: without_bitsandbytes(name).version
    )
    assert _printed("roots") == expected_roots
    assert _printed("absent") == [f"bitsandbytes=={installed.version}"]
    # what `pip download` leaves in .whl: a wheel with its dist-info
    wheel = tmp_path / f"bitsandbytes-{installed.version}-py3-none-manylinux_2_24_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        metadata = installed.read_text("METADATA")
        archive.writestr(f"bitsandbytes-{installed.version}.dist-info/METADATA", metadata)
    monkeypatch.setattr(gpu_wheels, "WHEELS", tmp_path)
    assert gpu_wheels.carried_pins() == expected_pins
    assert "benchmarks.gpu_wheels absent" in (REPO / "benchmarks" / "gpu.sh").read_text()


def test_gpu_sh_says_in_one_line_which_of_dplaunchs_floors_the_device_misses(capsys):
    found = {name: "99.0" for name in floors()} | {"transformers": "5.17.0"}
    del found["tensorboard"]

    def version(name):
        if name not in found:
            raise importlib.metadata.PackageNotFoundError(name)
        return found[name]

    line, met = gpu_wheels.floors_line(version)
    assert not met
    assert line == (
        f"dplaunch's floors missed here: transformers 5.17.0 (needs {floors()['transformers']}), "
        f"tensorboard not installed (needs {floors()['tensorboard']}); carry them as wheels "
        "(benchmarks/gpu_wheels.py)"
    )
    # this python meets them: one line with their versions, status 0; gpu.sh stops on a miss
    assert _printed("floors")[0].startswith("dplaunch's floors met: typer ")
    assert "benchmarks.gpu_wheels floors" in (REPO / "benchmarks" / "gpu.sh").read_text()


def test_the_smoke_matrix_writes_its_result_after_each_case(tmp_path, monkeypatch):
    # a call cut short (the device's time limit) still returns the cases that ran
    out = tmp_path / "out"
    ran: list[str] = []

    def run_case(case, *_):
        if ran:  # the call ends during the second case
            raise KeyboardInterrupt
        ran.append(case.name)
        return {"what": case.what, "status": "pass", "seconds": 1.0}

    monkeypatch.setattr(gpu_smoke, "run_case", run_case)
    monkeypatch.setattr(gpu_smoke, "_device", lambda: "no GPU")  # no torch import for that
    with pytest.raises(KeyboardInterrupt):
        gpu_smoke.main([str(tmp_path / "work"), str(out), "--cpu", "--only", "zero2,zero3"])
    result = json.loads((out / gpu_smoke.RESULT_FILE).read_text())
    assert result["cases"]["zero2"]["status"] == "pass" and result["pass"] == 1
    assert result["cases"]["zero3"]["status"] == "not run"
    assert result["finished"] is False


def test_the_resume_cases_two_launches_share_its_one_limit(tmp_path, monkeypatch):
    # the saved run and the resumed one each got the whole case limit: twice it in all
    clock = SimpleNamespace(now=0.0)
    limits: list[float] = []  # when each launch would be cut

    def train(config, run_dir, flags, limit):
        limits.append(clock.now + limit)
        clock.now += 0.6 * limit
        run_dir.mkdir(parents=True, exist_ok=True)
        steps = range(1, gpu_smoke.STEPS + 1)
        records = [{"type": "train", "step": s, "loss": 1.0 / s, "elapsed_s": s, "memory_gb": 1.0}
                   for s in steps if "--resume" not in flags or s > 2]  # fmt: skip
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return 0, ""

    monkeypatch.setattr(gpu_smoke, "train", train)
    monkeypatch.setattr(gpu_smoke, "time", SimpleNamespace(monotonic=lambda: clock.now))
    (case,) = [case for case in gpu_smoke.CASES if case.name == "resume"]
    entry = gpu_smoke.run_case(case, tmp_path, gpu_smoke.CPU_CONFIG, ["--cpu"], 100.0)
    assert len(limits) == 2 and max(limits) <= 100.0, limits
    assert entry["status"] == "pass", entry
    # too little left for the resumed run: the case says so instead of running past its limit
    limits.clear()
    entry = gpu_smoke.run_case(case, tmp_path, gpu_smoke.CPU_CONFIG, ["--cpu"], 20.0)
    assert len(limits) == 1 and entry["status"] == "fail"
    assert entry["why"] == "the resumed run not started: 8 s of the case's limit left", entry
