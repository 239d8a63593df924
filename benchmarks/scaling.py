"""Comparison 4, data-parallel scaling on CPU: 2 ranks × 1 thread against 1 rank × 1 thread.

Both run `dplaunch train` on benchmarks/configs/llama-3m.yaml with the same per-rank work (micro
batch 8, no accumulation), so the 2-rank run's global batch is twice the 1-rank one. Efficiency =
tokens/s(2 ranks) / (2 × tokens/s(1 rank)), steady state as in the throughput comparison. Goal:
≥ 90%. On a 2-core machine the 2-rank run needs both cores; anything else running at the same time
(other engineers' tests) takes from it and not from the 1-rank run, so the figure is a lower bound.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    PYTHON,
    REPO,
    RESULTS,
    Options,
    alternate,
    bar_chart,
    bench_environment,
    free_port,
    fresh,
    print_ratios,
    ratio_entry,
    run_checked,
    summarize,
    write_result,
)
from benchmarks.throughput import CONFIG, dplaunch_step_times, steady_tokens_per_s, window

NAME = "scaling"
MICRO_BATCH = 8
SEQ_LEN = 128


def run(options: Options) -> dict[str, Any]:
    reps = options.repetitions(full=3, quick=1)
    work = options.work_dir / NAME
    work.mkdir(parents=True, exist_ok=True)
    warmup, steps = window(options)
    print(
        f"\n[{NAME}] 1 vs 2 CPU ranks × 1 thread, micro batch {MICRO_BATCH} per rank, {reps} reps"
    )

    def ranks(count: int) -> Any:
        def measure(rep: int) -> float:
            name = fresh(work, f"ranks{count}-{rep}")
            run_dir = work / name
            argv = [PYTHON, "-m", "dplaunch", "train", str(CONFIG), "--cpu", "--gpus", str(count)]
            argv += ["--global-batch", str(MICRO_BATCH * count), "--micro-batch", str(MICRO_BATCH)]
            argv += ["--max-steps", str(steps), "--set", "train.log_every=1"]
            argv += ["--master-port", str(free_port()), "-o", str(run_dir)]
            run_checked(argv, work / f"{name}.log", bench_environment())
            tokens = MICRO_BATCH * count * SEQ_LEN
            return steady_tokens_per_s(dplaunch_step_times(run_dir), warmup, steps, tokens)

        return measure

    retried: list[str] = []
    samples = alternate({"1 rank": ranks(1), "2 ranks": ranks(2)}, reps, retried=retried)
    ideal = [2 * x for x in samples["1 rank"]]
    ratios = {
        "2-rank efficiency: tokens/s(2) / (2 × tokens/s(1))": ratio_entry(
            samples["2 ranks"],
            ideal,
            goal=0.9,
            higher_is_better=True,
            meaning="data-parallel scaling efficiency on CPU ranks; 1.0 is perfect",
        )
    }
    print_ratios("Data-parallel scaling (CPU)", ratios)
    payload = {
        "what": f"steady-state tokens/s (median step of steps {warmup + 1}..{steps}) of `dplaunch train`, "
        f"micro batch {MICRO_BATCH} × {SEQ_LEN} tokens per rank, no gradient accumulation",
        "config": str(CONFIG.relative_to(REPO)),
        "repetitions": reps,
        "contenders": summarize(samples, "tokens/s"),
        "ratios": ratios,
        "repeated_runs": retried,
    }
    write_result(NAME, payload, options)
    if options.write:
        entry = next(iter(ratios.values()))
        bar_chart(
            RESULTS / f"{NAME}.png",
            "Data-parallel scaling on CPU ranks (higher is better)",
            {"tokens/s": {**samples, "2 × 1 rank (ideal)": ideal}},
            ylabel="tokens/s (median; dots = repetitions)",
            subtitle=f"efficiency {entry['value']:.3f} (goal ≥ 0.9)",
        )
    return payload
