"""Comparison 3, training throughput: steady-state tokens/s on 2 CPU ranks, DDP and ZeRO-2.

Contenders, all on the model, data, micro batch × gradient accumulation × ranks, fp32, AdamW, linear
schedule and clipping of benchmarks/configs/llama-3m.yaml as rendered by `dplaunch config`:

- `dplaunch train` (the product, end to end);
- HF `Trainer` (benchmarks/contenders/hf_trainer.py) under `accelerate launch` with the rendered
  accelerate.yaml; ZeRO-2 through `TrainingArguments(deepspeed=RUN/deepspeed.json)`;
- a minimal hand-written Accelerate loop (benchmarks/contenders/hand_loop.py), the ceiling; ZeRO-2
  through Accelerate's DeepSpeed plugin with the gloo handler.

Every contender logs its loss every step and timestamps its optimizer steps (dplaunch: `elapsed_s`
of its metrics.jsonl lines; the peers: a file written by rank 0 after each step). They run
interleaved (benchmarks/interleave.py), with a second copy of the hand loop whose ratio to the first
is the session's noise floor: each starts alone and takes its first WARMUP steps (start-up, data
loading, allocator warm-up), then they train by turns of a few steps, the others frozen. A round's
tokens/s = tokens of one step / the median of the contender's clean steps in its turn; a ratio is
the median of the per-round ratios. Goals: ≥ 1.0× Trainer, ≥ 0.97× the hand loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import (
    CONFIGS,
    PYTHON,
    REPO,
    RESULTS,
    Options,
    bar_chart,
    bench_environment,
    dplaunch_train_argv,
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
from benchmarks.interleave import Contender, interleave_retrying
from dplaunch.run_directory.files import read_plan_file, read_run_file
from dplaunch.run_directory.layout import ACCELERATE_FILE, METRICS_FILE

NAME = "throughput"
CONFIG = CONFIGS / "llama-3m.yaml"
DPLAUNCH = "dplaunch train"
TRAINER = "HF Trainer"
HAND_LOOP = "hand-written Accelerate loop"
# the hand loop once more, interleaved like the others: the ratio of two copies of one program is
# this method's noise floor, measured in the same session as the ratios it qualifies
HAND_LOOP_AGAIN = "hand-written loop, second copy"
LAYOUTS = {"DDP": (), "ZeRO-2": ("--zero", "2")}
# what each peer prints (rank 0, stdout) once its first optimizer step is done
FIRST_LINE = {TRAINER: "{'loss'", HAND_LOOP: "step 1/"}
# the peers' programs, run under `accelerate launch`
PEER_MODULES = {
    TRAINER: "benchmarks.contenders.hf_trainer",
    HAND_LOOP: "benchmarks.contenders.hand_loop",
}


# the first steps of a run (start-up, allocator warm-up) are never timed
WARMUP = 4


def window(options: Options) -> tuple[int, int]:
    """(warm-up steps excluded, last step) of one run on its own (the flags and scaling_peers
    comparisons): the steady state is steps warmup+1 .. last."""
    warmup = WARMUP
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


def turn_steps(options: Options) -> int:
    """Steps of one turn of an interleaved contender; the first straddles the freeze."""
    return 3 if options.quick else 4


def run_steps(rounds: int, turn: int) -> int:
    """--max-steps of an interleaved run: warm-up, every round's turn and one turn to spare (a
    step that ends as its turn is frozen counts in that turn)."""
    return WARMUP + (rounds + 1) * turn


def metrics_step(record: dict[str, Any]) -> tuple[int, float] | None:
    """A train line of dplaunch's metrics.jsonl → (step, its elapsed_s)."""
    return (record["step"], record["elapsed_s"]) if record.get("type") == "train" else None


def clock_step(record: dict[str, Any]) -> tuple[int, float]:
    """A line of a peer's step clock → (step, its time)."""
    return record["step"], record["time"]


def dplaunch_contender(name: str, run_dir: Path, *flags: str, config: Path = CONFIG) -> Contender:
    """`dplaunch train` of the benchmark config as an interleaved contender; its log RUN_DIR.log,
    its step clock RUN_DIR/metrics.jsonl."""
    return Contender(
        name,
        dplaunch_train_argv(config, run_dir, *flags),
        bench_environment(),
        run_dir.with_name(f"{run_dir.name}.log"),
        run_dir / METRICS_FILE,
        metrics_step,
    )


def dplaunch_step_times(run_dir: Path) -> dict[int, float]:
    """Step → seconds, from the `elapsed_s` of every train line of a dplaunch run (log_every 1)."""
    steps = map(metrics_step, read_jsonl(run_dir / METRICS_FILE))
    return dict(step for step in steps if step is not None)


def clock_step_times(times: Path) -> dict[int, float]:
    """Step → seconds, from a peer's step clock."""
    return dict(map(clock_step, read_jsonl(times)))


def measure_layout(
    layout: str,
    flags: tuple[str, ...],
    rounds: int,
    work: Path,
    options: Options,
    retried: list[str],
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """The four contenders on one layout, interleaved (benchmarks/interleave.py): (tokens/s of
    each round, seconds from the command to the first step)."""
    turn = turn_steps(options)
    # every contender logs (and so syncs its loss) every step: the same work, and per-step clocks
    common = ("--cpu", "--gpus", "2", *flags, "--max-steps", str(run_steps(rounds, turn)))
    common += ("--set", "train.log_every=1")
    render = work / f"rendered-{layout}"
    launch = render_run(CONFIG, render, *common)
    env = bench_environment(**launch["env"])
    blocks = prepare_blocks(render, work, env)
    step_tokens = tokens_per_step(render)

    def turns() -> dict[str, list[Contender]]:
        chosen = [dplaunch_contender(DPLAUNCH, work / fresh(work, f"dplaunch-{layout}"), *common)]
        peers = (
            (TRAINER, TRAINER, "trainer"),
            (HAND_LOOP, HAND_LOOP, "hand"),
            (HAND_LOOP_AGAIN, HAND_LOOP, "hand-again"),
        )
        for name, program, label in peers:
            stem = work / fresh(work, f"{label}-{layout}")
            times = stem.with_name(f"{stem.name}.times.jsonl")
            chosen.append(
                Contender(
                    name,
                    peer_argv(program, render, blocks, times),
                    env,
                    stem.with_name(f"{stem.name}.log"),
                    times,
                    clock_step,
                )
            )
        # one contender a turn
        return {contender.name: [contender] for contender in chosen}

    print(
        f"  {layout}: {rounds} rounds of {turn} steps by turns, {step_tokens} tokens a step "
        f"(median of steps 2..{turn} of each turn)"
    )
    measured = interleave_retrying(
        turns, layout, retried, warmup=WARMUP, rounds=rounds, turn_steps=turn
    )
    tokens = {
        name: [step_tokens / seconds for seconds in per_round]
        for name, per_round in measured.step_s.items()
    }
    return tokens, measured.to_first_step


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


def peer_argv(contender: str, render: Path, blocks: Path, times: Path) -> list[str]:
    """`accelerate launch` of a peer contender with the rendered accelerate.yaml; it writes its
    step clock to TIMES."""
    argv = [PYTHON, "-m", "accelerate.commands.launch"]
    argv += ["--config_file", str(render / ACCELERATE_FILE)]
    argv += ["--main_process_port", str(free_port())]
    return argv + ["-m", PEER_MODULES[contender], str(render), str(blocks), str(times)]


def run_peer(
    contender: str, render: Path, blocks: Path, stem: Path, env: dict[str, str]
) -> tuple[dict[int, float], float]:
    """One run of a peer contender on its own: (step → seconds from its step clock, seconds from
    the command to its first step's line). Its log is STEM.log, its clock STEM.times.jsonl."""
    times = stem.with_name(f"{stem.name}.times.jsonl")
    log = stem.with_name(f"{stem.name}.log")
    seen = time_to_lines(
        peer_argv(contender, render, blocks, times), [FIRST_LINE[contender]], log, env
    )
    return clock_step_times(times), seen[FIRST_LINE[contender]]


def tokens_per_step(render: Path) -> int:
    """Tokens of one optimizer step of a rendered or finished dplaunch run."""
    plan = read_plan_file(render)
    run = read_run_file(render)
    # packed causal-LM blocks are always full: every sample is max_length real tokens
    return plan["global_batch_size"] * run["data"]["max_length"]


def run(options: Options) -> dict[str, Any]:
    rounds = options.repetitions(full=20, quick=4)
    work = options.folder(NAME)
    print(
        f"\n[{NAME}] steady-state tokens/s, 2 CPU ranks × 1 thread, {CONFIG.name}, interleaved, "
        f"{rounds} rounds"
    )
    results: dict[str, dict[str, list[float]]] = {}
    starts: dict[str, dict[str, float]] = {}
    ratios: dict[str, dict[str, Any]] = {}
    retried: list[str] = []
    for layout, flags in LAYOUTS.items():
        samples, first_step = measure_layout(layout, flags, rounds, work, options, retried)
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
        ratios[f"{layout}: hand-written loop / its second copy (noise floor)"] = ratio_entry(
            samples[HAND_LOOP],
            samples[HAND_LOOP_AGAIN],
            goal=None,
            higher_is_better=True,
            meaning="one program against itself: how far from 1.0 this session's noise moves a "
            "ratio",
        )
    print_ratios("Training throughput (tokens/s, steady state, per round)", ratios)
    turn = turn_steps(options)
    payload = {
        "what": "steady-state training tokens/s, the contenders interleaved: each starts alone "
        f"and takes its first {WARMUP} steps, then {rounds} rounds in which each in turn trains "
        f"{turn} steps while the others are frozen (SIGSTOP); a round's tokens/s = tokens of one "
        f"step / the median of steps 2..{turn} of the turn, from the contender's own per-step "
        "clock (every contender logs its loss every step); ratios are medians of per-round ratios",
        "config": str(CONFIG.relative_to(REPO)),
        "setting": "2 CPU ranks × OMP_NUM_THREADS=1, gloo, fp32, torch AdamW (the kernel dplaunch "
        "picks), linear schedule, clipping 1.0, micro batch 4 × grad-accum 2 × 2 ranks = 16 "
        "samples × 128 tokens a step",
        "repetitions": rounds,
        "layouts": {layout: summarize(samples, "tokens/s") for layout, samples in results.items()},
        "to_first_step_s": {
            "what": "seconds from the command to the harness seeing step 1 on the contender's "
            "clock, started alone (the others frozen), one run each; dplaunch also plans, renders "
            "and tokenises, the peers read pre-tokenised blocks",
            **{
                layout: {name: round(seconds, 2) for name, seconds in first.items()}
                for layout, first in starts.items()
            },
        },
        "ratios": ratios,
        "repeated_runs": retried,
    }
    write_result(NAME, payload, options)
    if options.write:
        bar_chart(
            RESULTS / f"{NAME}.png",
            "Steady-state training throughput, 2 CPU ranks, interleaved (higher is better)",
            results,
            ylabel="tokens/s (median; dots = rounds)",
            subtitle=chart_subtitle(ratios),
        )
    return payload


def chart_subtitle(ratios: dict[str, dict[str, Any]]) -> str:
    """One line per layout: "DDP: dplaunch/Trainer 0.996×, dplaunch/hand loop …, noise floor …"."""
    short = {
        "dplaunch / HF Trainer": "dplaunch/Trainer",
        "dplaunch / hand-written loop": "dplaunch/hand loop",
        "hand-written loop / its second copy (noise floor)": "hand loop/its copy",
    }
    return "\n".join(
        f"{layout}: "
        + ", ".join(
            f"{short[name.split(': ', 1)[1]]} {entry['value']:.3f}×"
            for name, entry in ratios.items()
            if name.startswith(f"{layout}: ")
        )
        for layout in LAYOUTS
    )
