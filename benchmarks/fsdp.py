"""Comparison 6, FSDP2 against DeepSpeed ZeRO-3 (the same layout: every state sharded), 2 CPU ranks.

`dplaunch train benchmarks/configs/llama-3m.yaml --cpu --gpus 2` with `--fsdp full` and with
`--zero 3`, run by run, alternating who goes first. Reported: steady-state tokens/s (the same
median-step window as the flags comparison) and rank 0's peak resident memory (metrics.jsonl's
memory_gb: on CPU ranks the process's peak RSS, libraries and data included). HF Trainer with FSDP
is not a contender: on CPU ranks Accelerate's FSDP plugin wraps the model in DDP (no sharding), so
it would measure DDP. No goal: docs/performance.md reports the ratio.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    Options,
    alternate,
    bench_environment,
    dplaunch_train_argv,
    fresh,
    print_ratios,
    ratio_entry,
    read_jsonl,
    run_checked,
    summarize,
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
from dplaunch.run_directory.layout import METRICS_FILE

NAME = "fsdp"
VARIANTS = {"FSDP2": ("--fsdp", "full"), "ZeRO-3": ("--zero", "3")}


def run(options: Options) -> dict[str, Any]:
    reps = options.repetitions(full=3, quick=1)
    work = options.folder(NAME)
    warmup, steps = window(options)
    memory: dict[str, list[float]] = {name: [] for name in VARIANTS}
    print(f"\n[{NAME}] FSDP2 vs DeepSpeed ZeRO-3 on 2 CPU ranks, {reps} reps")

    def variant(label: str, flags: tuple[str, ...]) -> Any:
        def measure(rep: int) -> float:
            run_dir = work / fresh(work, f"{label}-{rep}")
            argv = dplaunch_train_argv(
                CONFIG, run_dir, "--cpu", "--gpus", "2", "--max-steps", str(steps),
                "--set", "train.log_every=1", *flags,
            )  # fmt: skip
            run_checked(argv, work / f"{run_dir.name}.log", bench_environment())
            records = [r for r in read_jsonl(run_dir / METRICS_FILE) if r["type"] == "train"]
            memory[label].append(max(r["memory_gb"] for r in records))
            return steady_tokens_per_s(
                dplaunch_step_times(run_dir), warmup, steps, tokens_per_step(run_dir)
            )

        return measure

    retried: list[str] = []
    samples = alternate(
        {label: variant(label, flags) for label, flags in VARIANTS.items()}, reps, retried=retried
    )
    ratios = {
        "FSDP2 / ZeRO-3 (tokens/s)": ratio_entry(
            samples["FSDP2"],
            samples["ZeRO-3"],
            goal=None,
            higher_is_better=True,
            meaning="steady-state tokens/s of FSDP2 relative to ZeRO-3; higher is faster",
        ),
        "FSDP2 / ZeRO-3 (rank 0 peak memory)": ratio_entry(
            memory["FSDP2"],
            memory["ZeRO-3"],
            goal=None,
            higher_is_better=False,
            meaning="rank 0's peak resident memory (GB) of FSDP2 relative to ZeRO-3",
        ),
    }
    print_ratios("FSDP2 vs ZeRO-3 (2 CPU ranks)", ratios)
    payload = tokens_payload(
        f"steady-state tokens/s (median step of steps {warmup + 1}..{steps}) and rank 0's peak "
        "resident memory of `dplaunch train` with --fsdp full and with --zero 3",
        CONFIG,
        reps,
        samples,
        ratios,
        retried,
        rank0_peak_memory=summarize(memory, "GB"),
    )
    write_result(NAME, payload, options)
    return payload
