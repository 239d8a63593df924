"""Comparison 4, data-parallel scaling on CPU: 2 ranks × 1 thread against 1 rank × 1 thread.

Both run `dplaunch train` on benchmarks/configs/llama-3m.yaml with the same per-rank work (micro
batch 8, no accumulation), so the 2-rank run's global batch is twice the 1-rank one. Efficiency =
tokens/s(2 ranks) / (2 × tokens/s(1 rank)), steady state, the runs interleaved by turns as in the
throughput comparison (benchmarks/interleave.py). Goal: ≥ 90%. On a 2-core machine the 2-rank run
needs both cores while the 1-rank run leaves one idle, so anything else the machine does takes
from the 2-rank run first: the figure is a lower bound.

A third contender measures what the machine itself allows: two independent 1-rank runs trained
in the same turns (no communication at all). Two processes on two cores already lose to shared
caches, memory bandwidth and the hypervisor; tokens/s(2 ranks) / tokens/s(two 1-rank runs
together) is then what data parallelism itself costs (gradient all-reduce, lockstep, launcher).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    Options,
    bar_chart,
    bench_environment,
    dplaunch_train_argv,
    fresh,
    print_ratios,
    ratio_entry,
    run_checked,
    tokens_payload,
    write_result,
)
from benchmarks.interleave import Contender, interleave_retrying
from benchmarks.throughput import (
    CONFIG,
    WARMUP,
    dplaunch_contender,
    dplaunch_step_times,
    run_steps,
    steady_tokens_per_s,
    turn_steps,
)

NAME = "scaling"
MICRO_BATCH = 8
ONE = "1 rank"
TWO = "2 ranks"
APART = "two 1-rank runs at once"
SEQ_LEN = 128


def ranks_flags(count: int, steps: int) -> list[str]:
    """`dplaunch train`/`config` flags of the scaling runs: COUNT CPU ranks, MICRO_BATCH each."""
    flags = ["--cpu", "--gpus", str(count), "--max-steps", str(steps)]
    flags += ["--global-batch", str(MICRO_BATCH * count), "--micro-batch", str(MICRO_BATCH)]
    return [*flags, "--set", "train.log_every=1"]


def dplaunch_tokens_per_s(run_dir: Path, count: int, warmup: int, steps: int) -> float:
    """Steady-state tokens/s of one `dplaunch train` scaling run on COUNT ranks (log RUN_DIR.log)."""
    argv = dplaunch_train_argv(CONFIG, run_dir, *ranks_flags(count, steps))
    run_checked(argv, run_dir.with_name(f"{run_dir.name}.log"), bench_environment())
    tokens = MICRO_BATCH * count * SEQ_LEN
    return steady_tokens_per_s(dplaunch_step_times(run_dir), warmup, steps, tokens)


def run(options: Options) -> dict[str, Any]:
    rounds = options.repetitions(full=20, quick=4)
    turn = turn_steps(options)
    work = options.folder(NAME)
    print(
        f"\n[{NAME}] 1 vs 2 CPU ranks × 1 thread, micro batch {MICRO_BATCH} per rank, "
        f"interleaved, {rounds} rounds of {turn} steps"
    )

    def contender(name: str, count: int) -> Contender:
        run_dir = work / fresh(work, name.replace(" ", "-"))
        return dplaunch_contender(name, run_dir, *ranks_flags(count, run_steps(rounds, turn)))

    def turns() -> dict[str, list[Contender]]:
        return {
            ONE: [contender(ONE, 1)],
            TWO: [contender(TWO, 2)],
            # started together, trained in the same turns
            APART: [contender(f"{APART} ({i})", 1) for i in (1, 2)],
        }

    retried: list[str] = []
    step_s = interleave_retrying(
        turns, NAME, retried, warmup=WARMUP, rounds=rounds, turn_steps=turn
    ).step_s
    rank_tokens = MICRO_BATCH * SEQ_LEN
    samples = {
        ONE: [rank_tokens / s for s in step_s[ONE]],
        TWO: [2 * rank_tokens / s for s in step_s[TWO]],
        APART: [
            rank_tokens / a + rank_tokens / b
            for a, b in zip(step_s[f"{APART} (1)"], step_s[f"{APART} (2)"], strict=True)
        ],
    }
    ideal = [2 * x for x in samples[ONE]]
    ratios = {
        "2-rank efficiency: tokens/s(2) / (2 × tokens/s(1))": ratio_entry(
            samples[TWO],
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
                samples[TWO],
                samples[APART],
                goal=None,
                higher_is_better=True,
                meaning="the 2-rank run against the same two processes without all-reduce",
            )
        ),
    }
    print_ratios("Data-parallel scaling (CPU, per round)", ratios)
    payload = tokens_payload(
        f"steady-state tokens/s of `dplaunch train`, micro batch {MICRO_BATCH} × {SEQ_LEN} tokens "
        f"per rank, no gradient accumulation, interleaved: each contender starts alone and takes "
        f"its first {WARMUP} steps, then {rounds} rounds in which each in turn trains {turn} steps "
        f"while the others are frozen; a round's tokens/s = tokens of one step / the median of "
        f"steps 2..{turn} of the turn; ratios are medians of per-round ratios",
        CONFIG,
        rounds,
        samples,
        ratios,
        retried,
    )
    write_result(NAME, payload, options)
    if options.write:
        efficiency, ceiling, cost = (entry["value"] for entry in ratios.values())
        bar_chart(
            RESULTS / f"{NAME}.png",
            "Data-parallel scaling on CPU ranks, interleaved (higher is better)",
            {"tokens/s": {**samples, "2 × 1 rank (ideal)": ideal}},
            ylabel="tokens/s (median; dots = rounds)",
            subtitle=f"efficiency {efficiency:.3f} (goal ≥ 0.9), ceiling {ceiling:.3f}, "
            f"2 ranks / apart {cost:.3f}",
        )
    return payload
