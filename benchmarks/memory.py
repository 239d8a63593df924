"""Optional comparison (not in the default `make bench`): the memory levers of issue 55.

`make bench BENCH_ARGS="--only memory"` on 2 CPU ranks, one rank's peak resident memory (the
metrics' memory_gb, ru_maxrss; the peer's step clock records the same) and its steady tokens/s:

1. The chunked loss: benchmarks/configs/llama-bigvocab.yaml (a 65,536-token vocabulary, hidden
   size 64, 512 tokens a row, micro-batch 4: the full logits, 4 × 512 × 65,536 × 12 bytes =
   1.6 GB, outweigh the rest of the step), run by dplaunch with train.loss_chunk off (the full
   logits, as HF's loss holds them), with `auto` (which the plan turns on here), and by HF
   Trainer on the same model, blocks and batch. Goals: the chunked run's peak ≤ 0.6× the full
   logits' and HF Trainer's, its tokens/s ≥ 0.95× theirs. Beside each dplaunch run, the
   planner's estimate of what a step adds to the built model (gradients, Adam's states and the
   forward/backward's peak, or the step's: MemoryEstimate) against the measured peak less the
   run's own memory_at_start_gb (goal: within 10 %).
2. Selective checkpointing: benchmarks/configs/llama-long.yaml (2,048 tokens a row, 4 blocks)
   with model.gradient_checkpointing off, every-4, every-2 and true (every block): activation
   memory (peak less the start) and tokens/s, beside the estimate's activations and the share of
   recomputed FLOPs the forecast counts.

Runs go one after the other (REPS rounds, in alternating order); absolute numbers are this
machine's, the ratios are the result.

Every process runs with glibc's mmap threshold at 64 KiB (LIVE_MEMORY, dplaunch's ranks and HF
Trainer's alike): a freed tensor's memory then goes back to the system at once, so the peak
resident memory follows the peak of the tensors alive, as a GPU's max_memory_allocated does.
With glibc's default (a threshold that grows to 32 MiB) a step's freed activations stay in the
heap and the peak counts them again: 2026-12-07, the chunked run added 0.305 GB to its start by
default against 0.247 GB so, the full logits 1.797 against 1.772 GB, at the same tokens/s within
noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    RESULTS,
    Options,
    bar_chart,
    bench_environment,
    dplaunch_train_argv,
    fresh,
    median,
    print_ratios,
    ratio_entry,
    read_jsonl,
    render_run,
    run_checked,
    write_result,
)
from benchmarks.throughput import (
    TRAINER,
    clock_step_times,
    dplaunch_step_times,
    peer_argv,
    prepare_blocks,
    steady_tokens_per_s,
    tokens_per_step,
)
from dplaunch.run_directory.layout import METRICS_FILE

NAME = "memory"
# glibc's mmap threshold (see the docstring): what a process frees goes back at once
LIVE_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
BIG_VOCAB = REPO / "benchmarks" / "configs" / "llama-bigvocab.yaml"
LONG = REPO / "benchmarks" / "configs" / "llama-long.yaml"
LOSS_VARIANTS = {
    "chunked": ("--set", "train.loss_chunk=auto"),
    "full": ("--set", "train.loss_chunk=off"),
}
CHECKPOINTING = ("false", "every-4", "every-2", "true")


def _records(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    records = read_jsonl(run_dir / METRICS_FILE)
    header = next(r for r in records if r["type"] == "header")
    return header, [r for r in records if r["type"] == "train"]


def _dplaunch_run(config: Path, run_dir: Path, steps: int, *flags: str) -> dict[str, float]:
    argv = dplaunch_train_argv(
        config, run_dir, "--cpu", "--gpus", "2", "--max-steps", str(steps), *flags
    )
    run_checked(argv, run_dir.with_name(f"{run_dir.name}.log"), bench_environment(**LIVE_MEMORY))
    header, steps_seen = _records(run_dir)
    peak = max(r["memory_gb"] for r in steps_seen)
    tokens = steady_tokens_per_s(dplaunch_step_times(run_dir), 1, steps, tokens_per_step(run_dir))
    return {"peak_gb": peak, "start_gb": header["memory_at_start_gb"], "tokens_per_s": tokens}


def _estimate(config: Path, *assignments: str) -> dict[str, Any]:
    """The planner's view of the run on 2 ranks: the memory a step adds to the built model
    (gradients + Adam + the larger of the forward/backward's and the step's peaks), the logits
    and activations, the chunk; and the recomputed share of the FLOPs."""
    from dplaunch.config.load import load_run_config
    from dplaunch.launching.prepare import model_facts
    from dplaunch.planning.auto import run_workload
    from dplaunch.planning.candidates import workload_memory
    from dplaunch.planning.forecast import micro_batch_flops
    from dplaunch.planning.rules import ParallelDims

    config = load_run_config(config, assignments=list(assignments))
    facts, work = model_facts(config.model), run_workload(config)
    memory = workload_memory(facts, ParallelDims(2, 2), work)
    flops = micro_batch_flops(
        facts, micro_batch=work.micro_batch, seq_len=work.seq_len,
        activation_checkpointing=work.checkpoint_every if work.activation_checkpointing else 0,
    )  # fmt: skip
    added = (
        memory.gradients_gb
        + memory.optimizer_gb
        + max(memory.forward_backward_gb - memory.buckets_gb, memory.step_gb)
    )
    return {
        "added_gb": round(added * 1.073741824, 4),  # GiB → GB, as memory_gb
        "logits_gb": round(memory.logits_gb * 1.073741824, 4),
        "activations_gb": round(memory.activations_gb * 1.073741824, 4),
        "loss_chunk": memory.loss_chunk,
        "recomputed_share": round(flops.dense_recompute / max(flops.total, 1.0), 4),
    }


def _trainer_run(render: Path, blocks: Path, stem: Path, steps: int) -> dict[str, float]:
    times = stem.with_name(f"{stem.name}.times.jsonl")
    run_checked(
        peer_argv(TRAINER, render, blocks, times), stem.with_name(f"{stem.name}.log"),
        bench_environment(**LIVE_MEMORY),
    )  # fmt: skip
    clock = read_jsonl(times)
    return {
        "peak_gb": max(r["memory_gb"] for r in clock),
        "tokens_per_s": steady_tokens_per_s(
            clock_step_times(times), 1, steps, tokens_per_step(render)
        ),
    }


def _loss_runs(options: Options, work: Path, reps: int, steps: int) -> dict[str, Any]:
    render = work / "rendered-bigvocab"
    render_run(BIG_VOCAB, render, "--cpu", "--gpus", "2", "--set", f"train.max_steps={steps}")
    blocks = prepare_blocks(render, work, bench_environment())
    seen: dict[str, list[dict[str, float]]] = {"chunked": [], "full": [], TRAINER: []}
    for rep in range(reps):
        order = list(LOSS_VARIANTS) if rep % 2 == 0 else list(reversed(LOSS_VARIANTS))
        for name in order:
            run_dir = work / fresh(work, f"{name}-{rep}")
            seen[name].append(_dplaunch_run(BIG_VOCAB, run_dir, steps, *LOSS_VARIANTS[name]))
        seen[TRAINER].append(_trainer_run(render, blocks, work / f"trainer-{rep}", steps))
        print(f"  rep {rep}: " + ", ".join(f"{k} {v[-1]}" for k, v in seen.items()))
    estimates = {name: _estimate(BIG_VOCAB, flags[-1]) for name, flags in LOSS_VARIANTS.items()}

    def values(name: str, key: str) -> list[float]:
        return [run[key] for run in seen[name]]

    ratios = {
        "peak chunked / full logits": ratio_entry(
            values("chunked", "peak_gb"), values("full", "peak_gb"), goal=0.6,
            higher_is_better=False, meaning="rank 0's peak resident memory",
        ),
        "peak chunked / HF Trainer": ratio_entry(
            values("chunked", "peak_gb"), values(TRAINER, "peak_gb"), goal=0.6,
            higher_is_better=False, meaning="rank 0's peak resident memory",
        ),
        "tokens/s chunked / full logits": ratio_entry(
            values("chunked", "tokens_per_s"), values("full", "tokens_per_s"), goal=0.95,
            higher_is_better=True, meaning="steady tokens/s",
        ),
        "tokens/s chunked / HF Trainer": ratio_entry(
            values("chunked", "tokens_per_s"), values(TRAINER, "tokens_per_s"), goal=0.95,
            higher_is_better=True, meaning="steady tokens/s",
        ),
    }  # fmt: skip
    for name in LOSS_VARIANTS:
        measured = median([r["peak_gb"] - r["start_gb"] for r in seen[name]])
        estimated = estimates[name]["added_gb"]
        estimates[name]["measured_added_gb"] = round(measured, 4)
        estimates[name]["estimate_over_measured"] = round(estimated / measured, 4)
        estimates[name]["within_10_percent"] = abs(estimated / measured - 1) <= 0.10
    return {"runs": seen, "ratios": ratios, "estimates": estimates}


def _checkpointing_runs(work: Path, steps: int) -> list[dict[str, Any]]:
    curve = []
    for value in CHECKPOINTING:
        run_dir = work / fresh(work, f"checkpointing-{value}")
        flags = ("--set", f"model.gradient_checkpointing={value}")
        measured = _dplaunch_run(LONG, run_dir, steps, *flags)
        estimate = _estimate(LONG, f"model.gradient_checkpointing={value}")
        curve.append(
            {
                "gradient_checkpointing": value,
                "activation_gb": round(measured["peak_gb"] - measured["start_gb"], 4),
                "tokens_per_s": round(measured["tokens_per_s"], 2),
                "estimated_activations_gb": estimate["activations_gb"],
                "estimated_added_gb": estimate["added_gb"],
                "forecast_recomputed_share": estimate["recomputed_share"],
            }
        )
        print(f"  checkpointing {value}: {curve[-1]}")
    return curve


def run(options: Options) -> dict[str, Any]:
    reps = options.repetitions(full=3, quick=1)
    steps = 4 if options.quick else 6
    work = options.folder(NAME)
    print(f"\n[{NAME}] chunked loss and selective checkpointing on 2 CPU ranks, {reps} rep(s)")
    loss = _loss_runs(options, work, reps, steps)
    print_ratios(NAME, loss["ratios"])
    for name, estimate in loss["estimates"].items():
        print(f"  estimate {name}: {estimate}")
    curve = _checkpointing_runs(work, 3)
    payload = {
        "ratios": loss["ratios"],
        "loss": loss,
        "checkpointing": curve,
        "reps": reps,
        "steps": steps,
    }
    write_result(NAME, payload, options)
    if options.write:
        chart(payload)
    return payload


def chart(payload: dict[str, Any]) -> None:
    """benchmarks/results/memory.png: rank 0's peak memory of each contender."""
    runs = payload["loss"]["runs"]
    bar_chart(
        RESULTS / f"{NAME}.png",
        "Peak memory, vocabulary 65,536, 2 CPU ranks (lower is better)",
        {"rank 0's peak RSS": {name: [r["peak_gb"] for r in reps] for name, reps in runs.items()}},
        ylabel="GB (median; dots = repetitions)",
    )
