"""Comparison 4, data-parallel scaling on CPU: 2 ranks × 1 thread against 1 rank × 1 thread.

Both run `dplaunch train` on benchmarks/configs/llama-3m.yaml with the same per-rank work (micro
batch 8, no accumulation), so the 2-rank run's global batch is twice the 1-rank one. Efficiency =
tokens/s(2 ranks) / (2 × tokens/s(1 rank)), steady state as in the throughput comparison. Goal:
≥ 90%. On a 2-core machine the 2-rank run needs both cores; anything else running at the same time
(other engineers' tests) takes from it and not from the 1-rank run, so the figure is a lower bound.

A third contender measures what the machine itself allows: two independent 1-rank runs at the
same time (no communication at all). Two processes on two cores already lose to shared caches,
memory bandwidth and the hypervisor; tokens/s(2 ranks) / tokens/s(two 1-rank runs together) is
then what data parallelism itself costs (gradient all-reduce, launcher, stop-signal exchange).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from benchmarks.common import (
    PYTHON,
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
    tokens_payload,
    write_result,
)
from benchmarks.throughput import CONFIG, dplaunch_step_times, steady_tokens_per_s, window

NAME = "scaling"
MICRO_BATCH = 8
APART = "two 1-rank runs at once"
SEQ_LEN = 128


def ranks_flags(count: int, steps: int) -> list[str]:
    """`dplaunch train`/`config` flags of the scaling runs: COUNT CPU ranks, MICRO_BATCH each."""
    flags = ["--cpu", "--gpus", str(count), "--max-steps", str(steps)]
    flags += ["--global-batch", str(MICRO_BATCH * count), "--micro-batch", str(MICRO_BATCH)]
    return [*flags, "--set", "train.log_every=1"]


def dplaunch_tokens_per_s(run_dir: Path, count: int, warmup: int, steps: int) -> float:
    """Steady-state tokens/s of one `dplaunch train` scaling run on COUNT ranks (log RUN_DIR.log)."""
    argv = [PYTHON, "-m", "dplaunch", "train", str(CONFIG), *ranks_flags(count, steps)]
    argv += ["--master-port", str(free_port()), "-o", str(run_dir)]
    run_checked(argv, run_dir.with_name(f"{run_dir.name}.log"), bench_environment())
    tokens = MICRO_BATCH * count * SEQ_LEN
    return steady_tokens_per_s(dplaunch_step_times(run_dir), warmup, steps, tokens)


def run(options: Options) -> dict[str, Any]:
    reps = options.repetitions(full=3, quick=1)
    work = options.folder(NAME)
    warmup, steps = window(options)
    print(
        f"\n[{NAME}] 1 vs 2 CPU ranks × 1 thread, micro batch {MICRO_BATCH} per rank, {reps} reps"
    )

    def ranks(count: int) -> Any:
        return lambda rep: dplaunch_tokens_per_s(
            work / fresh(work, f"ranks{count}-{rep}"), count, warmup, steps
        )

    def two_apart(rep: int) -> float:
        names = [fresh(work, f"apart{i}-{rep}") for i in (1, 2)]
        results: dict[str, float] = {}
        errors: list[BaseException] = []

        def run_one(name: str) -> None:
            try:
                results[name] = dplaunch_tokens_per_s(work / name, 1, warmup, steps)
            except BaseException as error:  # noqa: BLE001 — re-raised below, in this thread
                errors.append(error)

        threads = [threading.Thread(target=run_one, args=(name,)) for name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return sum(results.values())

    retried: list[str] = []
    samples = alternate(
        {"1 rank": ranks(1), "2 ranks": ranks(2), APART: two_apart}, reps, retried=retried
    )
    ideal = [2 * x for x in samples["1 rank"]]
    ratios = {
        "2-rank efficiency: tokens/s(2) / (2 × tokens/s(1))": ratio_entry(
            samples["2 ranks"],
            ideal,
            goal=0.9,
            higher_is_better=True,
            meaning="data-parallel scaling efficiency on CPU ranks; 1.0 is perfect",
        ),
        "machine ceiling: tokens/s(two 1-rank runs at once) / (2 × tokens/s(1))": ratio_entry(
            samples[APART],
            ideal,
            goal=None,
            higher_is_better=True,
            meaning="what two processes on this machine get without any communication",
        ),
        "cost of data parallelism: tokens/s(2 ranks) / tokens/s(two 1-rank runs at once)": (
            ratio_entry(
                samples["2 ranks"],
                samples[APART],
                goal=None,
                higher_is_better=True,
                meaning="the 2-rank run against the same two processes without all-reduce",
            )
        ),
    }
    print_ratios("Data-parallel scaling (CPU)", ratios)
    payload = tokens_payload(
        f"steady-state tokens/s (median step of steps {warmup + 1}..{steps}) of `dplaunch train`, "
        f"micro batch {MICRO_BATCH} × {SEQ_LEN} tokens per rank, no gradient accumulation",
        CONFIG,
        reps,
        samples,
        ratios,
        retried,
    )
    write_result(NAME, payload, options)
    if options.write:
        efficiency, ceiling, cost = (entry["value"] for entry in ratios.values())
        bar_chart(
            RESULTS / f"{NAME}.png",
            "Data-parallel scaling on CPU ranks (higher is better)",
            {"tokens/s": {**samples, "2 × 1 rank (ideal)": ideal}},
            ylabel="tokens/s (median; dots = repetitions)",
            subtitle=f"efficiency {efficiency:.3f} (goal ≥ 0.9), ceiling {ceiling:.3f}, "
            f"2 ranks / apart {cost:.3f}",
        )
    return payload
