"""The GPU smoke matrix: every engine and feature one GPU can run, a few steps each, in one call.

    python -m benchmarks.gpu_smoke WORK OUT [--cpu] [--only NAME,NAME] [--budget-s S]

Each case is one `dplaunch train` of a small Llama (GPU: benchmarks/configs/llama-3m.yaml in bf16;
`--cpu`: examples/tiny-llama.yaml on CPU ranks) for STEPS steps on one rank, cut at CASE_LIMIT_S.
OUT/gpu-smoke.json gets, per case: pass/fail/skipped and why, the first error line, steps/s of
the steps after the first, the peak memory the ranks logged and the plan's estimate of it
(planning/estimate.py, as benchmarks/gpu_report.py reads a run), and the seconds it took. It is
written after each case ("finished": false, the cases not reached "not run"), so a call cut
short still returns what ran. A case's launches share its limit (the resume case: two).
benchmarks/gpu.sh runs it first, on whatever GPU it gets.

`--cpu` is the smoke mode of the script itself (tests/test_gpu_benchmark.py): the cases that
need a GPU are skipped unless named with --only (where they are expected to fail before launch),
and the peak is a process's resident memory, not what the GPU estimate counts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
GPU_CONFIG = REPO / "benchmarks" / "configs" / "llama-3m.yaml"
CPU_CONFIG = REPO / "examples" / "tiny-llama.yaml"
SFT_CONFIG = REPO / "configs" / "sft.yaml"
STEPS = 4
# a case's seconds, all its launches together (the resume case: the saved run and the resumed one)
CASE_LIMIT_S = 150
# a launch given less would not get through its imports: the case (or the resumed run) says so
MIN_LAUNCH_S = 20
# the whole matrix on one H200 (benchmarks/gpu.sh leaves the rest of its 8 minutes to the MFU runs)
BUDGET_S = 400
# a resumed run continues the saved one: its losses against the uninterrupted run's
RESUME_TOLERANCE = 1e-3
RESULT_FILE = "gpu-smoke.json"


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: `dplaunch train BASE --gpus 1 FLAGS`, and what must hold after it."""

    name: str
    what: str
    flags: tuple[str, ...] = ()
    # the run file: "causal" (the base config), "sft" (packed chat examples), "qlora" (a
    # pretrained base saved first, 4-bit)
    base: str = "causal"
    # modules the case needs (the GPU image may lack them: the case is skipped, saying so)
    needs: tuple[str, ...] = ()
    # files the run must leave in its directory
    outputs: tuple[str, ...] = ()
    # runs on CPU ranks in the smoke mode
    on_cpu: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


# in the order they run: the engines and the branches a GPU alone takes first, the slow ones
# (DeepSpeed's CPU Adam build, inductor) last, so a short budget cuts those
CASES = (
    Case("zero2", "DeepSpeed ZeRO-2", ("--zero", "2")),
    Case("zero3", "DeepSpeed ZeRO-3", ("--zero", "3")),
    Case("fsdp", "FSDP2 full shard", ("--fsdp", "full")),
    Case("fsdp-offload", "FSDP2 with CPUOffloadPolicy (gloo beside NCCL)",
         ("--fsdp", "full", "--offload", "all")),
    Case("lora-zero3-export", "LoRA under ZeRO-3, its adapter and merged exports",
         ("--zero", "3", "--lora", "8"),
         outputs=("adapter/adapter_model.safetensors", "model/model.safetensors")),
    Case("qlora-ddp", "QLoRA 4-bit base under DDP",
         ("--lora", "8", "--set", "model.lora.quantize=4bit"), base="qlora", needs=("bitsandbytes",)),
    Case("qlora-zero3", "QLoRA under ZeRO-3 (no device_map, 4-bit weights stored in bf16)",
         ("--zero", "3", "--lora", "8", "--set", "model.lora.quantize=4bit"), base="qlora",
         needs=("bitsandbytes",)),
    Case("resume", "a checkpoint of step 2 resumed: steps 3-4 as the uninterrupted run's",
         ("--set", "train.checkpoint_every=2")),
    Case("fp16", "fp16 with the loss scaler", ("--mixed-precision", "fp16"), on_cpu=False),
    Case("flash-packed-sft", "flash_attention_2 on packed SFT examples",
         ("--set", "data.packing=true", "--set", "model.attn_implementation=flash_attention_2"),
         base="sft", needs=("flash_attn",), on_cpu=False),
    Case("checkpointing", "activation checkpointing",
         ("--set", "model.gradient_checkpointing=true")),
    Case("zero1", "DeepSpeed ZeRO-1", ("--zero", "1")),
    Case("zero3-offload-all", "ZeRO-3, parameters and optimizer on the CPU",
         ("--zero", "3", "--offload", "all")),
    Case("zero2-offload-optimizer", "ZeRO-2, optimizer on the CPU (DeepSpeed's CPU Adam)",
         ("--zero", "2", "--offload", "optimizer")),
    Case("compile", "train.compile (inductor)", ("--set", "train.compile=true"), on_cpu=False),
)  # fmt: skip


def first_error(log: str) -> str | None:
    """The line that says why a run failed: dplaunch's summary ends with the first failing rank's
    error ("[rank 0] ValueError: …"), a refusal is one "dplaunch: error: …" line; else the last
    line that names an error."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^\[rank \d+\] ", line) or line.startswith("dplaunch: error:"):
            return line
    named = [line for line in lines if re.search(r"Error|error:|Traceback|Killed", line)]
    return named[-1] if named else (lines[-1] if lines else None)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_per_s(records: list[dict[str, Any]]) -> float | None:
    """Optimizer steps a second after the first logged step (compiling, warming up)."""
    steps = [r for r in records if r.get("type") == "train"]
    if len(steps) < 2 or steps[-1]["elapsed_s"] <= steps[0]["elapsed_s"]:
        return None
    return round(
        (steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]),
        3,
    )


def memory_against_estimate(run_dir: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The peak the ranks logged and the plan's estimate of it (GiB); GPU: max_memory_allocated,
    which sees neither the CUDA context nor NCCL's buffers, so those leave the estimate."""
    from benchmarks.gpu_report import run_estimate
    from dplaunch.planning.estimate import GIB
    from dplaunch.run_directory.files import read_run_file

    steps = [r for r in records if r.get("type") == "train"]
    if not steps:
        return {}
    peak = max(r["memory_gb"] for r in steps) * 1e9 / GIB
    entry: dict[str, Any] = {"peak_memory_gib": round(peak, 3)}
    try:
        estimate = run_estimate(read_run_file(run_dir))
    except Exception as error:  # noqa: BLE001 — the smoke result keeps the run's own numbers
        entry["estimate_error"] = str(error).splitlines()[0]
        return entry
    allocated = estimate.total_gb - estimate.cuda_context_gb - estimate.nccl_gb
    entry["estimated_memory_gib"] = round(allocated, 3)
    entry["measured_over_estimate"] = round(peak / allocated, 3) if allocated > 0 else None
    return entry


def write_qlora_base(work: Path, base: Path) -> Path:
    """A pretrained base for QLoRA (bitsandbytes quantizes weights as they load): the base
    config's model, saved once; returns the run file that fine-tunes it."""
    from dplaunch.config.schema import RunConfig
    from dplaunch.train.modeling import load_model, load_tokenizer

    run = yaml.safe_load(base.read_text())
    folder = work / "qlora-base"
    if not (folder / "config.json").exists():
        spec = RunConfig.model_validate(run).model
        tokenizer = load_tokenizer(spec)
        load_model(spec, tokenizer, seed=3).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    run["model"].update(config=None, name_or_path=str(folder), tokenizer=str(folder))
    path = work / "qlora.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def run_file(case: Case, work: Path, base: Path) -> Path:
    if case.base == "sft":
        return SFT_CONFIG
    if case.base == "qlora":
        return write_qlora_base(work, base)
    return base


def train(config: Path, run_dir: Path, flags: list[str], limit: float) -> tuple[int, str]:
    argv = [sys.executable, "-m", "dplaunch", "train", str(config), "-o", str(run_dir), *flags]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, cwd=REPO)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return 124, f"{out}\nKilled: the case ran past its {limit:g} s"
    return done.returncode, done.stdout + done.stderr


def run_case(case: Case, work: Path, base: Path, common: list[str], limit: float) -> dict:
    """One case: its runs, checks and numbers, in LIMIT seconds in all."""
    started = time.monotonic()
    deadline = started + limit
    config = run_file(case, work, base)
    run_dir = work / case.name
    flags = [*common, "--max-steps", str(STEPS), *case.flags]
    code, log = train(config, run_dir, flags, deadline - time.monotonic())
    (work / f"{case.name}.log").write_text(log)
    records = read_metrics(run_dir)
    trained = [r for r in records if r.get("type") == "train"]
    problems = []
    if code != 0:
        problems.append(f"exit status {code}")
    elif len(trained) != STEPS:
        problems.append(f"{len(trained)} of {STEPS} steps logged")
    problems += [
        f"no {name}" for name in case.outputs if code == 0 and not (run_dir / name).exists()
    ]
    entry: dict[str, Any] = {"what": case.what, "flags": flags}
    if code == 0 and case.name == "resume" and not problems:
        problems += _resume(config, run_dir, work, flags, deadline, entry)
    entry["status"] = "fail" if problems else "pass"
    if problems:
        entry["why"] = "; ".join(problems)
        entry["first_error"] = first_error(log) if code != 0 else None
    entry["steps_per_s"] = steps_per_s(records)
    entry.update(memory_against_estimate(run_dir, records))
    entry["seconds"] = round(time.monotonic() - started, 1)
    return entry


def _resume(config: Path, saved: Path, work: Path, flags: list[str], deadline: float, entry: dict):
    """Resume SAVED's step-2 checkpoint in a run of its own, cut at the case's DEADLINE; its
    steps 3-4 against SAVED's."""
    left = deadline - time.monotonic()
    if left < MIN_LAUNCH_S:
        return [f"the resumed run not started: {left:.0f} s of the case's limit left"]
    resumed = work / "resume-continued"
    code, log = train(
        config, resumed, [*flags, "--resume", str(saved / "checkpoints" / "step-2")], left
    )
    (work / "resume-continued.log").write_text(log)
    if code != 0:
        entry["first_error"] = first_error(log)
        return [f"the resumed run: exit status {code}"]
    losses = {
        name: {r["step"]: r["loss"] for r in read_metrics(run) if r.get("type") == "train"}
        for name, run in (("saved", saved), ("resumed", resumed))
    }
    later = sorted(step for step in losses["resumed"] if step > 2)
    if later != list(range(3, STEPS + 1)):
        return [f"the resumed run logged steps {later}"]
    gap = max(
        abs(losses["resumed"][s] - losses["saved"][s]) / abs(losses["saved"][s]) for s in later
    )
    entry["resumed_loss_gap"] = gap
    return [] if gap <= RESUME_TOLERANCE else [f"resumed losses differ by {gap:.2e}"]


def missing(case: Case) -> list[str]:
    return [name for name in case.needs if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu", action="store_true", help="CPU ranks: the script's smoke mode")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--case-limit-s", type=float, default=CASE_LIMIT_S)
    args = parser.parse_args(argv)
    only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(only) - {case.name for case in CASES})
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    base = CPU_CONFIG if args.cpu else GPU_CONFIG
    common = ["--gpus", "1", *(["--cpu"] if args.cpu else ["--mixed-precision", "bf16"])]
    # every step logged, no evaluation or sample answers in a few steps
    common += ["--set", "train.log_every=1", "--set", "train.eval_every=null"]
    header = {
        "what": "the GPU smoke matrix (benchmarks/gpu_smoke.py): a few steps of each engine/feature",
        "mode": "cpu" if args.cpu else "gpu",
        "device": _device(),
        "config": str(base.relative_to(REPO)),
        "steps": STEPS,
        "memory": (
            "peak_memory_gib: the ranks' logged memory_gb (GPU: max_memory_allocated; CPU: peak "
            "RSS); estimated_memory_gib: the plan's estimate less CUDA context and NCCL buffers"
        ),
    }
    started = time.monotonic()
    cases: dict[str, dict[str, Any]] = {}
    write_result(args.out, header, cases, started)
    for case in CASES:
        left = args.budget_s - (time.monotonic() - started)
        skip = _skip_reason(case, args, only, left)
        if skip:
            cases[case.name] = {"what": case.what, "status": "skipped", "why": skip}
        else:
            limit = min(args.case_limit_s, left)
            cases[case.name] = run_case(case, args.work, base, common, limit)
        print(f"{case.name:<26} {json.dumps(cases[case.name])}", flush=True)
        write_result(args.out, header, cases, started)
    result = write_result(args.out, header, cases, started)
    print(f"smoke matrix: {result['pass']} passed, {result['fail']} failed, "
          f"{result['skipped']} skipped in {result['seconds']:.0f} s")  # fmt: skip
    return 0 if result["fail"] == 0 else 1


def _skip_reason(case: Case, args: argparse.Namespace, only: list[str], left: float) -> str | None:
    if args.cpu and not case.on_cpu and case.name not in only:
        return "needs a GPU"
    if only and case.name not in only:
        return "not asked (--only)"
    if missing(case):
        return f"{', '.join(missing(case))} not installed"
    if left < MIN_LAUNCH_S:
        return f"out of time: the matrix's {args.budget_s:g} s were spent"
    return None


def write_result(out: Path, header: dict[str, Any], cases: dict[str, Any], started: float) -> dict:
    """OUT/gpu-smoke.json as the matrix stands: the cases run so far, the others "not run".
    Written before the first case and after each (replacing the last), so that a call cut
    short still returns what ran. Returns what it wrote."""
    listed = {
        case.name: cases.get(case.name)
        or {"what": case.what, "status": "not run", "why": "the matrix ended before it"}
        for case in CASES
    }
    counts = {s: sum(c["status"] == s for c in cases.values()) for s in ("pass", "fail", "skipped")}
    result = {
        **header,
        **counts,
        "finished": len(cases) == len(CASES),
        "seconds": round(time.monotonic() - started, 1),
        "cases": listed,
    }
    partial = out / f"{RESULT_FILE}.partial"
    partial.write_text(json.dumps(result, indent=2) + "\n")
    partial.replace(out / RESULT_FILE)
    return result


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        return f"no GPU, torch {torch.__version__}"
    except ImportError:
        return "no torch"


if __name__ == "__main__":
    sys.exit(main())
