"""LoRA fine-tuning throughput and memory: `dplaunch train --lora 16` against HF Trainer + PEFT.

The model, data, batch, optimizer and schedule of the throughput comparison
(benchmarks/configs/llama-3m.yaml, 2 CPU ranks, DDP), with r-16 adapters on every linear layer but
the head (alpha 32, no dropout) and the base frozen:

- `dplaunch train --lora 16` (the product, end to end);
- HF Trainer with the same adapters added by PEFT's get_peft_model
  (benchmarks/contenders/hf_trainer.py reads model.lora from the rendered run), twice: the ratio of
  its two copies is the session's noise floor;
- `dplaunch train` without LoRA (full fine-tuning), for the memory and speed LoRA saves.

Interleaved by turns as the throughput comparison (benchmarks/interleave.py). Memory per rank: the
peak resident memory rank 0 reports at its last step (metrics.jsonl `memory_gb`, CPU ranks: the
process's whole RSS, the Python and torch runtime included, which hides a 3.3 M model's states),
and the model states (weights, gradients, Adam) `dplaunch plan` estimates for each run, the
estimate tests/test_estimate.py checks against the bytes a rank holds (within 10 %).
Goal: dplaunch / Trainer + PEFT ≥ 1.0×.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    Options,
    bar_chart,
    bench_environment,
    fresh,
    print_ratios,
    ratio_entry,
    read_jsonl,
    render_run,
    summarize,
    write_result,
)
from benchmarks.interleave import Contender, interleave_retrying
from benchmarks.throughput import (
    CONFIG,
    TRAINER,
    WARMUP,
    clock_step,
    dplaunch_contender,
    peer_argv,
    prepare_blocks,
    run_steps,
    tokens_per_step,
    turn_steps,
)
from dplaunch.run_directory.layout import METRICS_FILE

NAME = "lora"
RANK = "16"
DPLAUNCH_LORA = "dplaunch train --lora 16"
TRAINER_PEFT = "HF Trainer + PEFT"
TRAINER_PEFT_AGAIN = "HF Trainer + PEFT, second copy"
DPLAUNCH_FULL = "dplaunch train, full fine-tuning"


def model_states_mb(render: Path) -> dict[str, float]:
    """The model states of one rank (MiB) that the plan estimates for the LoRA and the full run."""
    from dplaunch.config.schema import RunConfig
    from dplaunch.planning.auto import run_workload, workload_memory
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.rules import ParallelDims
    from dplaunch.run_directory.files import read_run_file

    config = RunConfig.model_validate(read_run_file(render))
    facts = ModelFacts.from_config_dict(config.model.config or {})
    lora = run_workload(config)
    full = replace(lora, lora=None)
    two_ranks = ParallelDims(2, 2)
    return {
        name: round(workload_memory(facts, two_ranks, workload).model_states_gb * 1024, 2)
        for name, workload in ((DPLAUNCH_LORA, lora), (DPLAUNCH_FULL, full))
    }


def peak_memory_gb(run_dir: Path) -> float | None:
    """Rank 0's peak memory at the last train line of a dplaunch run (None if it logged none)."""
    peaks = [
        record["memory_gb"]
        for record in read_jsonl(run_dir / METRICS_FILE)
        if record.get("type") == "train" and "memory_gb" in record
    ]
    return peaks[-1] if peaks else None


def measure(rounds: int, work: Path, options: Options):
    """(tokens/s per round of each contender, command → first step, the dplaunch run folders)."""
    turn = turn_steps(options)
    common = ("--cpu", "--gpus", "2", "--max-steps", str(run_steps(rounds, turn)))
    common += ("--set", "train.log_every=1")
    render = work / "rendered-lora"
    launch = render_run(CONFIG, render, *common, "--lora", RANK)
    env = bench_environment(**launch["env"])
    blocks = prepare_blocks(render, work, env)
    step_tokens = tokens_per_step(render)
    runs: dict[str, Path] = {}

    def turns() -> dict[str, list[Contender]]:
        runs[DPLAUNCH_LORA] = work / fresh(work, "dplaunch-lora")
        runs[DPLAUNCH_FULL] = work / fresh(work, "dplaunch-full")
        chosen = [
            dplaunch_contender(DPLAUNCH_LORA, runs[DPLAUNCH_LORA], *common, "--lora", RANK),
            dplaunch_contender(DPLAUNCH_FULL, runs[DPLAUNCH_FULL], *common),
        ]
        for name, label in ((TRAINER_PEFT, "trainer-peft"), (TRAINER_PEFT_AGAIN, "trainer-peft-2")):
            stem = work / fresh(work, label)
            times = stem.with_name(f"{stem.name}.times.jsonl")
            argv = peer_argv(TRAINER, render, blocks, times)
            log = stem.with_name(f"{stem.name}.log")
            chosen.append(Contender(name, argv, env, log, times, clock_step))
        return {contender.name: [contender] for contender in chosen}

    print(f"  {rounds} rounds of {turn} steps by turns, {step_tokens} tokens a step")
    measured = interleave_retrying(turns, "LoRA", [], warmup=WARMUP, rounds=rounds, turn_steps=turn)
    tokens = {
        name: [step_tokens / seconds for seconds in per_round]
        for name, per_round in measured.step_s.items()
    }
    return tokens, measured.to_first_step, runs, model_states_mb(render)


def run(options: Options) -> dict[str, Any]:
    rounds = options.repetitions(full=12, quick=3)
    work = options.folder(NAME)
    print(
        f"\n[{NAME}] LoRA r {RANK} tokens/s and memory, 2 CPU ranks × 1 thread, {CONFIG.name}, "
        f"interleaved, {rounds} rounds"
    )
    samples, first_step, runs, states = measure(rounds, work, options)
    ratios = {
        "LoRA: dplaunch / HF Trainer + PEFT": ratio_entry(
            samples[DPLAUNCH_LORA],
            samples[TRAINER_PEFT],
            goal=1.0,
            higher_is_better=True,
            meaning="tokens/s relative to HF Trainer with PEFT adapters; higher is better",
        ),
        "LoRA: Trainer + PEFT / its second copy (noise floor)": ratio_entry(
            samples[TRAINER_PEFT],
            samples[TRAINER_PEFT_AGAIN],
            goal=None,
            higher_is_better=True,
            meaning="one program against itself: how far from 1.0 this session's noise moves a "
            "ratio",
        ),
        "dplaunch: LoRA / full fine-tuning": ratio_entry(
            samples[DPLAUNCH_LORA],
            samples[DPLAUNCH_FULL],
            goal=None,
            higher_is_better=True,
            meaning="tokens/s of LoRA relative to training every weight (no backward into the "
            "frozen weights' gradients, no Adam on them)",
        ),
    }
    memory = {name: peak_memory_gb(folder) for name, folder in runs.items()}
    print_ratios("LoRA fine-tuning (tokens/s, steady state, per round)", ratios)
    print(
        "  rank 0 peak memory (RSS): "
        + ", ".join(f"{name} {gb:.3f} GB" for name, gb in memory.items() if gb is not None)
    )
    print(
        "  model states per rank (dplaunch plan's estimate): "
        + ", ".join(f"{name} {mb:.1f} MiB" for name, mb in states.items())
    )
    payload = {
        "what": "steady-state tokens/s of LoRA fine-tuning, interleaved as the throughput "
        "comparison; rank 0's peak resident memory of the dplaunch LoRA and full runs",
        "config": "benchmarks/configs/llama-3m.yaml with --lora 16 (alpha 32, all-linear)",
        "repetitions": rounds,
        "tokens_per_s": summarize(samples, "tokens/s"),
        "to_first_step_s": {name: round(seconds, 2) for name, seconds in first_step.items()},
        "rank0_peak_memory_gb": memory,
        "model_states_per_rank_mib_estimated": states,
        "ratios": ratios,
    }
    write_result(NAME, payload, options)
    if options.write:
        bar_chart(
            RESULTS / f"{NAME}.png",
            "LoRA fine-tuning throughput, 2 CPU ranks, interleaved (higher is better)",
            {"LoRA r 16": samples},
            ylabel="tokens/s (median; dots = rounds)",
        )
    return payload
