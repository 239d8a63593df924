"""Tokens/s, MFU and peak memory against the plan's estimate for the runs of benchmarks/gpu.sh.

`python -m benchmarks.gpu_report WORK OUT` reads WORK/<run>/metrics.jsonl (dplaunch runs) and
WORK/hand/times.jsonl (the hand-written loop), writes OUT/gpu.json and OUT/gpu.png, and prints the
ratios. MFU = model FLOPs / time / peak, with model FLOPs per token = 6·N + 12·L·h·s (PaLM, appendix
B: N = parameters that take part in matrix products, i.e. all but the input embedding table; the
attention term counts the full s×s score matrix, forward and backward). The headline peak is the
H200's datasheet dense bf16 rate, 989 TFLOP/s, as MFU is quoted elsewhere (PaLM, Megatron,
torchtitan); beside it, MFU of the dense bf16 matmul rate gpu.sh measured on the same GPU
(OUT/matmul_peak.json; about 790 TFLOP/s on an H200).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import bar_chart, machine_facts, read_jsonl
from dplaunch.config.load import build_run_config
from dplaunch.launching.prepare import model_facts
from dplaunch.planning.auto import run_workload, workload_memory
from dplaunch.planning.estimate import GIB, MemoryEstimate, count_parameters
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.rules import ParallelDims
from dplaunch.run_directory.files import read_run_file
from dplaunch.run_directory.layout import METRICS_FILE

# NVIDIA H200 SXM datasheet, dense (no sparsity) bf16 tensor-core FLOP/s
DATASHEET_PEAK_FLOPS = 989e12
MATMUL_PEAK_FILE = "matmul_peak.json"
MFU_GOAL = 0.45
# steady state: the steps after WARMUP up to the last one (both are log steps of the run file)
WARMUP = 10
# the dplaunch runs gpu.sh makes: directory → label (each run's run.yaml says its layout)
RUNS = {
    "ddp1": "dplaunch DDP-1",
    "zero2": "dplaunch ZeRO-2",
    "ddp1-checkpointing": "dplaunch DDP-1 + activation checkpointing",
}
HAND = ("hand", "hand-written Accelerate loop DDP-1")


def flops_per_token(run: dict[str, Any]) -> tuple[float, int, int]:
    """(model FLOPs per trained token, N in matrix products, all parameters)."""
    facts = ModelFacts.from_config_dict(run["model"]["config"])
    count = count_parameters(facts, run["model"]["task"])
    matmul_params = count.total - count.embedding
    layers, hidden = count.num_layers, count.hidden_size
    seq = run["data"]["max_length"]
    return 6 * matmul_params + 12 * layers * hidden * seq, matmul_params, count.total


def utilisation(
    tokens_per_s: float, per_token: float, measured_peak: float | None
) -> dict[str, float]:
    """MFU of the datasheet peak, and (when measured) of the matmul rate the GPU reached."""
    achieved = tokens_per_s * per_token
    result = {"mfu": round(achieved / DATASHEET_PEAK_FLOPS, 4)}
    if measured_peak:
        result["mfu_of_measured_matmul_peak"] = round(achieved / measured_peak, 4)
    return result


def measured_matmul_peak(out: Path) -> float | None:
    """The dense bf16 matmul FLOP/s gpu.sh measured (None without a GPU)."""
    path = out / MATMUL_PEAK_FILE
    return json.loads(path.read_text())["matmul_bf16_flops"] if path.exists() else None


def run_estimate(run: dict[str, Any]) -> MemoryEstimate:
    """The planner's estimate for a run's resolved run.yaml (one GPU): the workload as
    `parallel: auto` reads it (run_workload: micro batch, sequence, precision, checkpointing,
    model.attn_implementation or transformers' pick, LoRA, packed rows) and the run's own engine
    (ZeRO stage and offload, or FSDP: ZeRO-3's states and FSDP2's transients)."""
    config = build_run_config(run)
    one_gpu = ParallelDims(
        1,
        1,
        zero_stage=config.parallel.zero_stage,
        offload=config.parallel.offload,
        fsdp=config.parallel.fsdp,
    )
    return workload_memory(model_facts(config.model), one_gpu, run_workload(config))


def steady_tokens_per_s(times: dict[int, float], tokens_per_step: int) -> float:
    last = max(times)
    return (last - WARMUP) * tokens_per_step / (times[last] - times[WARMUP])


def main(work: Path, out: Path) -> int:
    run = read_run_file(work / "ddp1")
    per_token, matmul_params, total_params = flops_per_token(run)
    tokens_per_step = run["train"]["global_batch_size"] * run["data"]["max_length"]
    measured_peak = measured_matmul_peak(out)
    results: dict[str, dict[str, Any]] = {}
    for directory, label in RUNS.items():
        metrics = work / directory / METRICS_FILE
        if not metrics.exists():
            print(f"{label}: no metrics (the run failed or was skipped; see its log)")
            continue
        records = [r for r in read_jsonl(metrics) if r["type"] == "train"]
        times = {r["step"]: r["elapsed_s"] for r in records}
        tokens_per_s = steady_tokens_per_s(times, tokens_per_step)
        estimate = run_estimate(read_run_file(work / directory))
        # max_memory_allocated sees neither the CUDA context nor NCCL's buffers
        allocated = estimate.total_gb - estimate.cuda_context_gb - estimate.nccl_gb
        peak_gib = max(r["memory_gb"] for r in records) * 1e9 / GIB
        results[label] = {
            "tokens_per_s": round(tokens_per_s, 1),
            **utilisation(tokens_per_s, per_token, measured_peak),
            "peak_memory_gib": round(peak_gib, 2),
            "estimated_memory_gib": round(allocated, 2),
            "estimated_total_gib": round(estimate.total_gb, 2),
            "attn_implementation": estimate.attn_implementation,
            "measured_over_estimate": round(peak_gib / allocated, 3),
        }
    hand_times = work / HAND[0] / "times.jsonl"
    if hand_times.exists():
        times = {r["step"]: r["time"] for r in read_jsonl(hand_times)}
        tokens_per_s = steady_tokens_per_s(times, tokens_per_step)
        results[HAND[1]] = {
            "tokens_per_s": round(tokens_per_s, 1),
            **utilisation(tokens_per_s, per_token, measured_peak),
        }

    ratios: dict[str, float] = {}
    ddp = results.get(RUNS["ddp1"])
    if ddp and HAND[1] in results:
        ratios["dplaunch DDP-1 / hand-written loop (tokens/s)"] = round(
            ddp["tokens_per_s"] / results[HAND[1]]["tokens_per_s"], 4
        )
    for label, entry in results.items():
        ratios[f"{label}: MFU / {MFU_GOAL:.0%} goal"] = round(entry["mfu"] / MFU_GOAL, 4)
        if ddp and label != RUNS["ddp1"] and label.startswith("dplaunch"):
            ratios[f"{label} / DDP-1 (tokens/s)"] = round(
                entry["tokens_per_s"] / ddp["tokens_per_s"], 4
            )
        if "measured_over_estimate" in entry:
            ratios[f"{label}: peak memory / plan estimate"] = entry["measured_over_estimate"]

    facts_now = machine_facts()
    facts_now["note"] = "one H200 lent to the session; nothing else ran on the GPU"
    payload = {
        "comparison": "gpu",
        **facts_now,
        "gpu": (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else None,
        "config": "benchmarks/configs/llama-1b.yaml",
        "parameters": total_params,
        "matmul_parameters": matmul_params,
        "flops_per_token": per_token,
        "peak_flops": DATASHEET_PEAK_FLOPS,
        "peak": "H200 SXM datasheet, dense bf16",
        "measured_matmul_peak_flops": measured_peak,
        "tokens_per_step": tokens_per_step,
        "window": f"optimizer steps {WARMUP + 1}..{run['train']['max_steps']}",
        "runs": results,
        "ratios": ratios,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    precision = run["train"]["mixed_precision"]
    print(
        f"\n== GPU: Llama {total_params / 1e6:.0f}M, {precision}, {tokens_per_step} tokens a step"
    )
    measured = f"{measured_peak / 1e12:.0f}" if measured_peak else "not measured"
    print(
        f"   MFU of the datasheet dense bf16 peak, {DATASHEET_PEAK_FLOPS / 1e12:.0f} TFLOP/s "
        f"(beside it: of the measured matmul peak, {measured} TFLOP/s)"
    )
    for label, entry in results.items():
        print(f"  {label:<46} " + "  ".join(f"{k} {v}" for k, v in entry.items()))
    for label, value in ratios.items():
        print(f"  {label:<64} {value:7.3f}×")
    if results:
        bar_chart(
            out / "gpu.png",
            f"One GPU, Llama {total_params / 1e6:.0f}M {precision}: MFU of the "
            f"{DATASHEET_PEAK_FLOPS / 1e12:.0f} TFLOP/s datasheet peak (higher is better)",
            {"MFU": {label: [entry["mfu"]] for label, entry in results.items()}},
            ylabel="model FLOPs utilisation",
            goal_line=(MFU_GOAL, f"goal {MFU_GOAL:.0%}"),
        )
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
