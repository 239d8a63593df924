"""Comparison 5, the optional speed/memory flags against plain eager training, on 2 CPU ranks.

`dplaunch train benchmarks/configs/llama-3m.yaml --cpu --gpus 2` (DDP, the throughput comparison's
setting) three ways: as is, with `train.compile=true` (torch.compile, inductor) and with
`model.gradient_checkpointing=true` (activations recomputed in the backward pass). Reported:
steady-state tokens/s relative to eager (the same median-step window as the throughput
comparison, so compilation is outside it) and the seconds from the command to the first step's
log line, which is where compiling shows. Each compiled run starts from an empty inductor cache
(its own TORCHINDUCTOR_CACHE_DIR): what a user's first run pays, not a cached rerun.
No goals: docs/performance.md reports the effect of each flag.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    RESULTS,
    Options,
    alternate,
    bar_chart,
    bench_environment,
    dplaunch_train_argv,
    fresh,
    median,
    print_ratios,
    ratio_entry,
    summarize,
    time_to_lines,
    tokens_payload,
    write_result,
)
from benchmarks.throughput import (
    CONFIG,
    dplaunch_step_times,
    steady_tokens_per_s,
    tokens_per_step,
    window,
)

NAME = "flags"
EAGER = "eager"
VARIANTS = {
    EAGER: (),
    "train.compile": ("--set", "train.compile=true"),
    "gradient checkpointing": ("--set", "model.gradient_checkpointing=true"),
}
FIRST_STEP = "step 1/"


def run(options: Options) -> dict[str, Any]:
    reps = options.repetitions(full=1, quick=1)
    work = options.folder(NAME)
    warmup, steps = window(options)
    first_step: dict[str, list[float]] = {name: [] for name in VARIANTS}
    print(
        f"\n[{NAME}] eager vs train.compile vs gradient checkpointing, DDP on 2 CPU ranks, {reps} reps"
    )

    def variant(label: str, flags: tuple[str, ...]) -> Any:
        def measure(rep: int) -> float:
            name = fresh(work, f"{label.replace(' ', '-')}-{rep}")
            run_dir = work / name
            argv = dplaunch_train_argv(
                CONFIG, run_dir, "--cpu", "--gpus", "2", "--max-steps", str(steps),
                "--set", "train.log_every=1", *flags,
            )  # fmt: skip
            env = bench_environment(TORCHINDUCTOR_CACHE_DIR=str(work / f"{name}.inductor"))
            seen = time_to_lines(argv, [FIRST_STEP], work / f"{name}.log", env)
            first_step[label].append(seen[FIRST_STEP])
            return steady_tokens_per_s(
                dplaunch_step_times(run_dir), warmup, steps, tokens_per_step(run_dir)
            )

        return measure

    retried: list[str] = []
    samples = alternate(
        {label: variant(label, flags) for label, flags in VARIANTS.items()}, reps, retried=retried
    )
    ratios: dict[str, dict[str, Any]] = {}
    for label in VARIANTS:
        if label == EAGER:
            continue
        ratios[f"{label} / eager (tokens/s)"] = ratio_entry(
            samples[label],
            samples[EAGER],
            goal=None,
            higher_is_better=True,
            meaning="steady-state tokens/s with the flag relative to without; higher is faster",
        )
        ratios[f"{label} / eager (command → first step)"] = ratio_entry(
            first_step[label],
            first_step[EAGER],
            goal=None,
            higher_is_better=False,
            meaning="seconds from the command to the first step; compiling happens here",
        )
    print_ratios("Optional flags (2 CPU ranks, DDP)", ratios)
    payload = tokens_payload(
        f"steady-state tokens/s (median step of steps {warmup + 1}..{steps}) and seconds to "
        "the first step of `dplaunch train` with each flag; compiled runs start from an empty "
        "inductor cache",
        CONFIG,
        reps,
        samples,
        ratios,
        retried,
        to_first_step=summarize(first_step, "s"),
    )
    write_result(NAME, payload, options)
    if options.write:
        bar_chart(
            RESULTS / f"{NAME}.png",
            "Optional flags, DDP on 2 CPU ranks",
            {"tokens/s": samples},
            ylabel="tokens/s (median; dots = repetitions)",
            subtitle="command → first step: "
            + ", ".join(f"{label} {median(values):.0f} s" for label, values in first_step.items()),
        )
    return payload
