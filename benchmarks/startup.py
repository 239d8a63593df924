"""Comparison 1, CLI start-up: `dplaunch --help` against `accelerate launch --help` and
`torchrun --help`, the console scripts a user types. Goal: dplaunch ≤ 0.3 s."""

from __future__ import annotations

import subprocess
import time
from typing import Any

from benchmarks.common import (
    BIN,
    RESULTS,
    Options,
    alternate,
    bar_chart,
    bench_environment,
    median,
    print_ratios,
    ratio_entry,
    summarize,
    write_result,
)

NAME = "startup"
BUDGET_S = 0.3
COMMANDS = {
    "dplaunch --help": [str(BIN / "dplaunch"), "--help"],
    "accelerate launch --help": [str(BIN / "accelerate"), "launch", "--help"],
    "torchrun --help": [str(BIN / "torchrun"), "--help"],
}


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=bench_environment(),
        check=True,
    )
    return time.perf_counter() - start


def run(options: Options) -> dict[str, Any]:
    reps = options.repetitions(full=5, quick=3)
    print(f"\n[{NAME}] wall time of each --help, {reps} repetitions, alternating")
    for argv in COMMANDS.values():  # one untimed call each: the page cache holds every file
        _wall(argv)
    samples = alternate(
        {name: (lambda _rep, a=argv: _wall(a)) for name, argv in COMMANDS.items()}, reps
    )
    dplaunch = samples["dplaunch --help"]
    ratios = {
        "dplaunch / accelerate launch (--help)": ratio_entry(
            dplaunch,
            samples["accelerate launch --help"],
            goal=1.0,
            higher_is_better=False,
            meaning="start-up time relative to accelerate launch; lower is better",
        ),
        "dplaunch / torchrun (--help)": ratio_entry(
            dplaunch,
            samples["torchrun --help"],
            goal=1.0,
            higher_is_better=False,
            meaning="start-up time relative to torchrun; lower is better",
        ),
        f"dplaunch / {BUDGET_S} s budget": ratio_entry(
            dplaunch,
            [BUDGET_S] * len(dplaunch),
            goal=1.0,
            higher_is_better=False,
            meaning=f"dplaunch --help against the issue's {BUDGET_S} s goal; ≤ 1 meets it",
        ),
    }
    print_ratios("CLI start-up", ratios)
    payload = {
        "what": "wall time of `--help` of each console script, started as a subprocess",
        "repetitions": reps,
        "contenders": summarize(samples, "s"),
        "ratios": ratios,
    }
    write_result(NAME, payload, options)
    if options.write:
        bar_chart(
            RESULTS / f"{NAME}.png",
            "CLI start-up: wall time of --help (lower is better)",
            {"--help": samples},
            ylabel="seconds (median; dots = repetitions)",
            subtitle=f"dplaunch / accelerate launch = {ratios['dplaunch / accelerate launch (--help)']['value']:.3f}×, "
            f"dplaunch / torchrun = {ratios['dplaunch / torchrun (--help)']['value']:.3f}×\n"
            f"dplaunch median {median(dplaunch):.2f} s",
            goal_line=(BUDGET_S, f"goal {BUDGET_S} s"),
        )
    return payload
