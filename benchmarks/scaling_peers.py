"""Optional comparison (not in the default `make bench`): does a peer scale better than dplaunch?

`make bench BENCH_ARGS="--only scaling_peers"` runs the scaling measurement (1 and 2 CPU ranks
× 1 thread, micro batch 8 per rank, no accumulation, benchmarks/configs/llama-3m.yaml) for
`dplaunch train` and for the minimal hand-written Accelerate loop under `accelerate launch` with
the same rendered files, the four runs alternating. It reports each one's efficiency
(tokens/s(2) / (2 × tokens/s(1))) and dplaunch's against the hand loop's, per repetition.

If the hand loop's efficiency is no better than dplaunch's, what the scaling comparison loses on a
machine is the machine's (two processes in lockstep on shared cores), not dplaunch's loop. It is
left out of the default run to keep `make bench` under 15 minutes (about 1 min per repetition,
4 min with the default 4).
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    RESULTS,
    Options,
    alternate,
    bar_chart,
    bench_environment,
    fresh,
    paired_ratios,
    print_ratios,
    ratio_entry,
    render_run,
    tokens_payload,
    write_result,
)
from benchmarks.scaling import CONFIG, MICRO_BATCH, SEQ_LEN, dplaunch_tokens_per_s, ranks_flags
from benchmarks.throughput import (
    HAND_LOOP,
    prepare_blocks,
    run_peer,
    steady_tokens_per_s,
    tokens_per_step,
    window,
)

NAME = "scaling_peers"


def run(options: Options) -> dict[str, Any]:
    reps = options.repetitions(full=4, quick=1)
    work = options.folder(NAME)
    warmup, steps = window(options)
    print(
        f"\n[{NAME}] 1 vs 2 CPU ranks × 1 thread, dplaunch and the hand-written loop, "
        f"micro batch {MICRO_BATCH} per rank, {reps} reps"
    )
    renders = {}
    for count in (1, 2):
        render = work / f"rendered-{count}"
        launch = render_run(CONFIG, render, *ranks_flags(count, steps))
        renders[count] = (render, bench_environment(**launch["env"]))
    blocks = prepare_blocks(renders[2][0], work, renders[2][1])

    def dplaunch(count: int) -> Any:
        def measure(rep: int) -> float:
            run_dir = work / fresh(work, f"dplaunch{count}-{rep}")
            return dplaunch_tokens_per_s(run_dir, count, warmup, steps)

        return measure

    def hand(count: int) -> Any:
        def measure(rep: int) -> float:
            render, env = renders[count]
            stem = work / fresh(work, f"hand{count}-{rep}")
            at, _ = run_peer(HAND_LOOP, render, blocks, stem, env)
            return steady_tokens_per_s(at, warmup, steps, tokens_per_step(render))

        return measure

    retried: list[str] = []
    samples = alternate(
        {
            "dplaunch, 1 rank": dplaunch(1),
            "hand loop, 1 rank": hand(1),
            "dplaunch, 2 ranks": dplaunch(2),
            "hand loop, 2 ranks": hand(2),
        },
        reps,
        retried=retried,
    )
    goals = {"dplaunch": 0.9, "hand loop": None}
    ideal = {who: [2 * x for x in samples[f"{who}, 1 rank"]] for who in goals}
    ratios = {
        f"{who} efficiency: tokens/s(2) / (2 × tokens/s(1))": ratio_entry(
            samples[f"{who}, 2 ranks"],
            ideal[who],
            goal=goal,
            higher_is_better=True,
            meaning=f"data-parallel scaling efficiency of the {who} on CPU ranks; 1.0 is perfect",
        )
        for who, goal in goals.items()
    }
    efficiency = {who: paired_ratios(samples[f"{who}, 2 ranks"], ideal[who]) for who in goals}
    ratios["dplaunch efficiency / hand-loop efficiency"] = ratio_entry(
        efficiency["dplaunch"],
        efficiency["hand loop"],
        goal=None,
        higher_is_better=True,
        meaning="above 1: dplaunch scales better than the hand-written loop on this machine",
    )
    print_ratios("Data-parallel scaling next to the hand-written Accelerate loop (CPU)", ratios)
    payload = tokens_payload(
        f"steady-state tokens/s (median step of steps {warmup + 1}..{steps}), micro batch "
        f"{MICRO_BATCH} × {SEQ_LEN} tokens per rank, no gradient accumulation, 1 and 2 CPU ranks",
        CONFIG,
        reps,
        samples,
        ratios,
        retried,
    )
    write_result(NAME, payload, options)
    if options.write:
        values = [entry["value"] for entry in ratios.values()]
        bar_chart(
            RESULTS / f"{NAME}.png",
            "Data-parallel scaling, dplaunch and the hand-written loop (higher is better)",
            {"tokens/s": samples},
            ylabel="tokens/s (median; dots = repetitions)",
            subtitle=f"efficiency: dplaunch {values[0]:.3f}, hand loop {values[1]:.3f}",
        )
    return payload
