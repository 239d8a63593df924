"""Comparison 3, training throughput: steady-state tokens/s on 2 CPU ranks, DDP and ZeRO-2.

Contenders, all on the model, data, micro batch × gradient accumulation × ranks, fp32, AdamW, linear
schedule and clipping of benchmarks/configs/llama-3m.yaml as rendered by `dplaunch config`:

- `dplaunch train` (the product, end to end);
- HF `Trainer` (benchmarks/contenders/hf_trainer.py) under `accelerate launch` with the rendered
  accelerate.yaml; ZeRO-2 through `TrainingArguments(deepspeed=RUN/deepspeed.json)`;
- a minimal hand-written Accelerate loop (benchmarks/contenders/hand_loop.py), the ceiling; ZeRO-2
  through Accelerate's DeepSpeed plugin with the gloo handler.

Every contender logs its loss every step and timestamps its optimizer steps (dplaunch: `elapsed_s`
of its metrics.jsonl lines; the peers: a file written by rank 0 after each step). Tokens/s = tokens
of one step / the median duration of the steps after the first WARMUP, so start-up, data loading
and the first steps (allocator warm-up) are excluded. Goals: ≥ 1.0× Trainer, ≥ 0.97× the hand loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import (
    CONFIGS,
    PYTHON,
    REPO,
    RESULTS,
    Options,
    alternate,
    bar_chart,
    bench_environment,
    free_port,
    fresh,
    median,
    print_ratios,
    ratio_entry,
    read_jsonl,
    render_run,
    run_checked,
    summarize,
    time_to_lines,
    write_result,
)

NAME = "throughput"
CONFIG = CONFIGS / "llama-3m.yaml"
DPLAUNCH = "dplaunch train"
TRAINER = "HF Trainer"
HAND_LOOP = "hand-written Accelerate loop"
LAYOUTS = {"DDP": (), "ZeRO-2": ("--zero", "2")}
# what each contender prints (rank 0, stdout) once its first optimizer step is done
FIRST_LINE = {DPLAUNCH: "step 1/", TRAINER: "{'loss'", HAND_LOOP: "step 1/"}
# the peers' programs, run under `accelerate launch`
PEER_MODULES = {
    TRAINER: "benchmarks.contenders.hf_trainer",
    HAND_LOOP: "benchmarks.contenders.hand_loop",
}


def window(options: Options) -> tuple[int, int]:
    """(warm-up steps excluded, last step): the steady state is steps warmup+1 .. last."""
    warmup = 4
    last = options.steps or (10 if options.quick else 16)
    if last < warmup + 3:
        raise ValueError(f"--steps {last}: use at least {warmup + 3}")
    return warmup, last


def steady_tokens_per_s(at: dict[int, float], warmup: int, steps: int, tokens: int) -> float:
    """Tokens/s of the median step among steps warmup+1 .. steps, from per-step wall clocks.

    The median step, not the mean over the window: on a shared machine a neighbour's burst
    stretches a few steps, and the median ignores them without favouring any contender.
    """
    durations = [at[step] - at[step - 1] for step in range(warmup + 1, steps + 1)]
    return tokens / median(durations)


def dplaunch_step_times(run_dir: Path) -> dict[int, float]:
    """Step → seconds, from the `elapsed_s` of every train line of a dplaunch run (log_every 1)."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    return {r["step"]: r["elapsed_s"] for r in records if r["type"] == "train"}


def clock_step_times(times: Path) -> dict[int, float]:
    """Step → seconds, from a peer's step clock."""
    return {r["step"]: r["time"] for r in read_jsonl(times)}


def measure_layout(
    layout: str,
    flags: tuple[str, ...],
    reps: int,
    work: Path,
    options: Options,
    retried: list[str] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Alternating repetitions of the three contenders on one layout: (tokens/s samples, seconds
    from the command to the first step's log line)."""
    warmup, steps = window(options)
    # every contender logs (and so syncs its loss) every step: the same work, and per-step clocks
    common = ("--cpu", "--gpus", "2", *flags, "--max-steps", str(steps))
    common += ("--set", "train.log_every=1")
    render = work / f"rendered-{layout}"
    launch = render_run(CONFIG, render, *common)
    env = bench_environment(**launch["env"])
    blocks = prepare_blocks(render, work, env)
    step_tokens = tokens_per_step(render)
    first_step: dict[str, list[float]] = {DPLAUNCH: [], TRAINER: [], HAND_LOOP: []}

    def dplaunch(rep: int) -> float:
        name = fresh(work, f"dplaunch-{layout}-{rep}")
        run_dir = work / name
        argv = [PYTHON, "-m", "dplaunch", "train", str(CONFIG), *common]
        argv += ["--master-port", str(free_port()), "-o", str(run_dir)]
        log = work / f"{name}.log"
        seen = time_to_lines(argv, [FIRST_LINE[DPLAUNCH]], log, bench_environment())
        first_step[DPLAUNCH].append(seen[FIRST_LINE[DPLAUNCH]])
        return steady_tokens_per_s(dplaunch_step_times(run_dir), warmup, steps, step_tokens)

    def peer(contender: str, label: str) -> Any:
        def measure(rep: int) -> float:
            name = fresh(work, f"{label}-{layout}-{rep}")
            at, first = run_peer(contender, render, blocks, work / name, env)
            first_step[contender].append(first)
            return steady_tokens_per_s(at, warmup, steps, step_tokens)

        return measure

    print(
        f"  {layout}: tokens/s of the median step of {warmup + 1}..{steps}, {step_tokens} tokens a step"
    )
    samples = alternate(
        {
            DPLAUNCH: dplaunch,
            TRAINER: peer(TRAINER, "trainer"),
            HAND_LOOP: peer(HAND_LOOP, "hand"),
        },
        reps,
        retried=retried,
    )
    return samples, first_step


def prepare_blocks(render: Path, work: Path, env: dict[str, str]) -> Path:
    """WORK/blocks.pt: the rendered run's training blocks, tokenised once for the peers."""
    blocks = work / "blocks.pt"
    if not blocks.exists():
        log = work / "blocks.log"
        run_checked(
            [PYTHON, "-m", "benchmarks.contenders.prepare_blocks", str(render), str(blocks)],
            log,
            env,
        )
        print("  " + log.read_text().strip().splitlines()[-1])
    return blocks


def run_peer(
    contender: str, render: Path, blocks: Path, stem: Path, env: dict[str, str]
) -> tuple[dict[int, float], float]:
    """One run of a peer contender under `accelerate launch` with the rendered accelerate.yaml:
    (step → seconds from its step clock, seconds from the command to its first step's line).
    Its log is STEM.log, its clock STEM.times.jsonl."""
    times = stem.with_name(f"{stem.name}.times.jsonl")
    argv = [PYTHON, "-m", "accelerate.commands.launch"]
    argv += ["--config_file", str(render / "accelerate.yaml")]
    argv += ["--main_process_port", str(free_port())]
    argv += ["-m", PEER_MODULES[contender], str(render), str(blocks), str(times)]
    log = stem.with_name(f"{stem.name}.log")
    seen = time_to_lines(argv, [FIRST_LINE[contender]], log, env)
    return clock_step_times(times), seen[FIRST_LINE[contender]]


def tokens_per_step(render: Path) -> int:
    """Tokens of one optimizer step of a rendered or finished dplaunch run."""
    plan = json.loads((render / "plan.json").read_text())
    run = yaml.safe_load((render / "run.yaml").read_text())
    # packed causal-LM blocks are always full: every sample is max_length real tokens
    return plan["global_batch_size"] * run["data"]["max_length"]


def run(options: Options) -> dict[str, Any]:
    reps = options.repetitions(full=3, quick=1)
    work = options.folder(NAME)
    print(f"\n[{NAME}] steady-state tokens/s, 2 CPU ranks × 1 thread, {CONFIG.name}, {reps} reps")
    results: dict[str, dict[str, list[float]]] = {}
    starts: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, dict[str, Any]] = {}
    retried: list[str] = []
    for layout, flags in LAYOUTS.items():
        samples, first_step = measure_layout(layout, flags, reps, work, options, retried)
        results[layout], starts[layout] = samples, first_step
        ratios[f"{layout}: dplaunch / HF Trainer"] = ratio_entry(
            samples[DPLAUNCH],
            samples[TRAINER],
            goal=1.0,
            higher_is_better=True,
            meaning="tokens/s relative to HF Trainer; higher is better",
        )
        ratios[f"{layout}: dplaunch / hand-written loop"] = ratio_entry(
            samples[DPLAUNCH],
            samples[HAND_LOOP],
            goal=0.97,
            higher_is_better=True,
            meaning="tokens/s relative to the minimal Accelerate loop (the ceiling); higher is better",
        )
        for peer in (TRAINER, HAND_LOOP):
            ratios[f"{layout}: start-up, dplaunch / {peer}"] = ratio_entry(
                first_step[DPLAUNCH],
                first_step[peer],
                goal=None,
                higher_is_better=False,
                meaning="seconds from the command to the first step's log line (dplaunch also "
                "plans, renders and tokenises; the peers read pre-tokenised blocks)",
            )
    print_ratios("Training throughput (tokens/s, steady state) and start-up", ratios)
    warmup, steps = window(options)
    payload = {
        "what": "steady-state training tokens/s: tokens of one optimizer step / the median "
        f"duration of steps {warmup + 1}..{steps}, from each contender's own per-step clock "
        "(every contender logs its loss every step); and seconds from the command to the first "
        "step's log line",
        "config": str(CONFIG.relative_to(REPO)),
        "setting": "2 CPU ranks × OMP_NUM_THREADS=1, gloo, fp32, torch AdamW (the kernel dplaunch "
        "picks), linear schedule, clipping 1.0, micro batch 4 × grad-accum 2 × 2 ranks = 16 "
        "samples × 128 tokens a step",
        "repetitions": reps,
        "layouts": {layout: summarize(samples, "tokens/s") for layout, samples in results.items()},
        "to_first_step": {layout: summarize(first, "s") for layout, first in starts.items()},
        "ratios": ratios,
        "repeated_runs": retried,
    }
    write_result(NAME, payload, options)
    if options.write:
        subtitle = "; ".join(
            f"{name.replace('dplaunch / ', 'dplaunch/')} {entry['value']:.3f}×"
            for name, entry in ratios.items()
            if "start-up" not in name
        )
        bar_chart(
            RESULTS / f"{NAME}.png",
            "Steady-state training throughput, 2 CPU ranks (higher is better)",
            results,
            ylabel="tokens/s (median; dots = repetitions)",
            subtitle=_wrap(subtitle),
        )
    return payload


def _wrap(text: str) -> str:
    parts = text.split("; ")
    return "; ".join(parts[:2]) + ("\n" + "; ".join(parts[2:]) if len(parts) > 2 else "")
