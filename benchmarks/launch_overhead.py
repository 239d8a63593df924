"""Comparison 2, launch overhead: seconds from the command to the first optimizer step.

`dplaunch train` (CLI, plan, rendering, run directory, supervised launch) against `accelerate
launch` of the same loop with the same rendered files and environment (`dplaunch config --out`,
then the `exec` line of its launch.sh), i.e. the loop without dplaunch's own work. The first step
is the moment rank 0 prints `step 1/`. Goal: ≤ 1.05×.

Start-up on a shared 2-core machine varies by seconds between runs, far more than dplaunch's own
part, so the result also reports that part alone: the seconds until dplaunch has planned, checked
and printed everything and is about to start the (identical) launcher.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    EXIT,
    REPO,
    RESULTS,
    Options,
    alternate,
    bar_chart,
    bench_environment,
    dplaunch_train_argv,
    free_port,
    fresh,
    median,
    print_ratios,
    ratio_entry,
    render_run,
    summarize,
    time_to_lines,
    write_result,
)

NAME = "launch_overhead"
CONFIG = REPO / "examples" / "tiny-llama.yaml"
FLAGS = ("--cpu", "--gpus", "2", "--max-steps", "1", "--set", "train.log_every=1")
FIRST_STEP = "step 1/"
# dplaunch prints this line after planning and checking, right before it starts the launcher
BEFORE_LAUNCH = "run directory:"
DPLAUNCH = "dplaunch train"
ACCELERATE = "accelerate launch (same loop)"


def run(options: Options) -> dict[str, Any]:
    reps = options.repetitions(full=4, quick=2)
    work = options.folder(NAME)
    print(f"\n[{NAME}] command → first optimizer step, 2 CPU ranks, tiny Llama, {reps} repetitions")
    own: list[float] = []
    to_exit: dict[str, list[float]] = {DPLAUNCH: [], ACCELERATE: []}

    def dplaunch_train(rep: int | str) -> float:
        name = fresh(work, f"dplaunch-{rep}")
        run_dir = work / name
        argv = dplaunch_train_argv(CONFIG, run_dir, *FLAGS)
        seen = time_to_lines(
            argv, [BEFORE_LAUNCH, FIRST_STEP], work / f"{name}.log", bench_environment()
        )
        own.append(seen[BEFORE_LAUNCH])
        to_exit[DPLAUNCH].append(seen[EXIT])
        return seen[FIRST_STEP]

    def accelerate_launch(rep: int | str) -> float:
        # rendered before the clock starts: this contender pays for none of dplaunch's work
        name = fresh(work, f"accelerate-{rep}")
        run_dir = work / name
        launch = render_run(CONFIG, run_dir, *FLAGS, "--master-port", str(free_port()))
        env = bench_environment(**launch["env"])
        seen = time_to_lines(launch["argv"], [FIRST_STEP], work / f"{name}.log", env)
        to_exit[ACCELERATE].append(seen[EXIT])
        return seen[FIRST_STEP]

    # one untimed run of each first: the first training run after an install pays for cold page
    # caches, .pyc files and the tokenised-data cache, and would land on whoever goes first
    print(f"  warm-up: one untimed run of each ({DPLAUNCH}, {ACCELERATE})")
    dplaunch_train("warm-up")
    accelerate_launch("warm-up")
    own.clear()
    for values in to_exit.values():
        values.clear()
    retried: list[str] = []
    samples = alternate(
        {DPLAUNCH: dplaunch_train, ACCELERATE: accelerate_launch}, reps, retried=retried
    )
    ratios = {
        "dplaunch train / accelerate launch (to first step)": ratio_entry(
            samples[DPLAUNCH],
            samples[ACCELERATE],
            goal=1.05,
            higher_is_better=False,
            meaning="time from the command to the first optimizer step; lower is better",
        ),
        "(accelerate launch + dplaunch's own part) / accelerate launch": ratio_entry(
            [a + b for a, b in zip(samples[ACCELERATE], own, strict=True)],
            samples[ACCELERATE],
            goal=1.05,
            higher_is_better=False,
            meaning="the same ratio built from dplaunch's own seconds before it starts the "
            "launcher, which vary far less than the ranks' start-up",
        ),
        "dplaunch train / accelerate launch (to exit)": ratio_entry(
            to_exit[DPLAUNCH],
            to_exit[ACCELERATE],
            goal=None,
            higher_is_better=False,
            meaning="whole 1-step job, command to exit (evaluation, export, shutdown included)",
        ),
    }
    print_ratios("Launch overhead", ratios)
    payload = {
        "what": "seconds from starting the command to rank 0 printing the first step line",
        "config": str(CONFIG.relative_to(REPO)),
        "flags": list(FLAGS),
        "repetitions": reps,
        "warm_up": "one untimed run of each contender before the repetitions",
        "contenders": summarize(samples, "s"),
        "dplaunch_own_part": summarize({"before the launcher starts": own}, "s"),
        "to_exit": summarize(to_exit, "s"),
        "ratios": ratios,
        "repeated_runs": retried,
    }
    write_result(NAME, payload, options)
    if options.write:
        headline = ratios["dplaunch train / accelerate launch (to first step)"]["value"]
        bar_chart(
            RESULTS / f"{NAME}.png",
            "Launch overhead, 2 CPU ranks, tiny Llama (lower is better)",
            {"command → first step": samples, "command → exit": to_exit},
            ylabel="seconds (median; dots = repetitions)",
            subtitle=f"dplaunch train / accelerate launch = {headline:.3f}× to the first step "
            f"(goal ≤ 1.05)\ndplaunch's own part {median(own):.2f} s",
        )
    return payload
