"""The forecast against the clock: every layout's forecast step time beside the one it measured.

`dplaunch calibrate --cpu --gpus 2 --out PROFILE` first, then `dplaunch train --profile PROFILE` of
DDP, ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-2 + offload, FSDP2, TP 2, PP 2, SP 2 and LoRA on 2 CPU ranks of
benchmarks/configs/llama-13m.yaml (13.1 M parameters); then a second size (llama-29m.yaml, 28.7 M)
and a second micro-batch (4 instead of 2) on some of them, to see the model extrapolate rather
than fit. Each run reports at its end (metrics.jsonl's summary) its median step after two warm-up
steps, the forecast of plan.json and their ratio; the benchmark also times the steps itself from
the train lines' clocks (the same median) as a check.

Then, ahead of the peers and not only right: `dplaunch train --parallel auto` (the layout, micro
batch and activation checkpointing tuned on the profile, no trial run) against HF Trainer's and a
plain `accelerate launch` loop's default run (DDP, the batch's share in one micro-batch) of the
same model and global batch on the same ranks: tokens/s ratios, goal ≥ 1.2× where auto's forecast
saw a better choice than the default (5 % faster), never below 1.0×.

Goal: the median |forecast / measured − 1| ≤ 10 %, every layout within ±20 % and the layouts ranked right
(Spearman's rank correlation of forecast and measured ≥ 0.9). Results: benchmarks/results/
forecast.json and forecast.png (forecast against measured, one point per run), with the machine's
load (`uptime`) before and after: on a shared machine a busy neighbour slows some runs and not
their forecast, which was calibrated under another load.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CONFIGS,
    PYTHON,
    RESULTS,
    Options,
    RunFailed,
    bench_environment,
    dplaunch_train_argv,
    failure_note,
    fresh,
    median,
    read_jsonl,
    render_run,
    run_checked,
    write_result,
)
from dplaunch.run_directory.files import read_plan_file
from dplaunch.run_directory.layout import METRICS_FILE

NAME = "forecast"
CONFIG = CONFIGS / "llama-13m.yaml"
SECOND_SIZE = CONFIGS / "llama-29m.yaml"
LAYOUTS: dict[str, tuple[str, ...]] = {
    "DDP": (),
    "ZeRO-1": ("--zero", "1"),
    "ZeRO-2": ("--zero", "2"),
    "ZeRO-3": ("--zero", "3"),
    "ZeRO-2 + offload": ("--zero", "2", "--offload", "optimizer"),
    "FSDP2": ("--fsdp", "full"),
    "TP 2": ("--tp", "2"),
    "PP 2": ("--pp", "2"),
    "SP 2": ("--sp", "2"),
    "LoRA": ("--lora", "16"),
}
# the runs of the extrapolation checks: another model size, another micro-batch
SETS = (
    ("llama-13m, micro-batch 2", CONFIG, tuple(LAYOUTS), ()),
    (
        "llama-29m, micro-batch 2",
        SECOND_SIZE,
        ("DDP", "ZeRO-3", "FSDP2", "TP 2", "PP 2", "SP 2"),
        (),
    ),
    ("llama-13m, micro-batch 4", CONFIG, ("DDP", "ZeRO-2", "SP 2", "LoRA"), ("--micro-batch", "4")),
)
WITHIN = 0.2
# the median |forecast / measured − 1| over every run
MEDIAN_GOAL = 0.1
SPEARMAN_GOAL = 0.9


def uptime() -> str:
    """`uptime`'s line (load averages), or the load averages alone."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def measured_median(run_dir: Path, warmup: int = 2) -> float:
    """The median step after WARMUP, from the train lines' clocks (log_every 1)."""
    clocks = {
        r["step"]: r["elapsed_s"]
        for r in read_jsonl(run_dir / METRICS_FILE)
        if r.get("type") == "train"
    }
    steps = sorted(clocks)
    durations = [clocks[s] - clocks[s - 1] for s in steps if s - 1 in clocks and s > warmup]
    return median(durations)


def one_run(
    config: Path, label: str, flags: tuple[str, ...], profile: Path, work: Path, steps: int
) -> dict[str, Any]:
    run_dir = work / fresh(work, label.replace(" ", "-").replace("+", "plus"))
    load = round(os.getloadavg()[0], 2)
    argv = dplaunch_train_argv(
        config, run_dir, "--cpu", "--gpus", "2", "--max-steps", str(steps),
        "--set", "train.log_every=1", "--profile", str(profile), *flags,
    )  # fmt: skip
    run_checked(argv, work / f"{run_dir.name}.log", bench_environment())
    summary = next(r for r in read_jsonl(run_dir / METRICS_FILE) if r.get("type") == "summary")
    forecast = read_plan_file(run_dir)["forecast"]
    measured = summary["step_time_s"]
    error = forecast["step_time_s"] / measured - 1
    return {
        "layout": label,
        "flags": " ".join(flags),
        "forecast_s": forecast["step_time_s"],
        "measured_s": measured,
        "measured_from_train_lines_s": round(measured_median(run_dir), 6),
        "forecast_over_measured": round(forecast["step_time_s"] / measured, 4),
        "within_20_percent": abs(error) <= WITHIN,
        "most_wrong_term": summary.get("forecast_most_wrong"),
        "note": summary.get("forecast_note"),
        "terms_s": forecast["terms_s"],
        "mfu_measured": summary.get("mfu"),
        "phases_measured_s": summary.get("phases_s"),
        "load_average_at_start": load,
    }


def run(options: Options) -> dict[str, Any]:
    work = options.folder(NAME)
    steps = 5 if options.quick else 8
    before = uptime()
    print(f"\n[{NAME}] forecast against measured step times, 2 CPU ranks ({before})")
    profile = work / "profile.json"
    calibrate = [
        PYTHON,
        "-m",
        "dplaunch",
        "calibrate",
        "--cpu",
        "--gpus",
        "2",
        "--out",
        str(profile),
    ]
    calibrate += ["-o", str(work / "calibrate"), *(["--quick"] if options.quick else [])]
    seconds = run_checked(calibrate, work / "calibrate.log", bench_environment())
    print(f"  calibrated in {seconds:.0f} s: {profile}")
    sets: dict[str, list[dict[str, Any]]] = {}
    failed: list[str] = []
    for title, config, layouts, extra in SETS:
        rows = []
        for label in layouts:
            flags = (*LAYOUTS[label], *extra)
            try:
                row = one_run(config, label, flags, profile, work, steps)
            except RunFailed as error:  # once more: a neighbour's job may have held the machine
                print(f"  {title:<26} {label:<18} failed, running it again")
                try:
                    row = one_run(config, label, flags, profile, work, steps)
                except RunFailed as again:
                    failed.append(f"{title}: {label}: {failure_note(again)}")
                    print(f"  {title:<26} {label:<18} FAILED twice: {failure_note(error)}")
                    continue
            rows.append(row)
            print(
                f"  {title:<26} {label:<18} forecast {row['forecast_s']:7.3f} s  measured "
                f"{row['measured_s']:7.3f} s  ×{row['forecast_over_measured']:.2f}"
                + (f"  ({row['most_wrong_term']} most wrong)" if row["most_wrong_term"] else "")
            )
        sets[title] = rows
    after = uptime()
    ratios: dict[str, dict[str, Any]] = {}
    for title, rows in sets.items():
        for row in rows:
            ratios[f"{title}: {row['layout']} forecast / measured"] = _entry(
                row["forecast_over_measured"],
                abs(row["forecast_over_measured"] - 1) <= WITHIN,
                f"within ±{WITHIN:.0%}",
                "forecast step time over the measured median step",
            )
        if len(rows) < 2:
            continue
        rho = spearman([r["forecast_s"] for r in rows], [r["measured_s"] for r in rows])
        ratios[f"{title}: Spearman rank correlation"] = _entry(
            round(rho, 4), rho >= SPEARMAN_GOAL, f"≥ {SPEARMAN_GOAL}", "layouts ranked as measured"
        )
    errors = sorted(
        abs(row["forecast_over_measured"] - 1) for rows in sets.values() for row in rows
    )
    if errors:
        middle = median(errors)
        ratios["median |forecast / measured - 1|"] = _entry(
            round(middle, 4),
            middle <= MEDIAN_GOAL,
            f"≤ {MEDIAN_GOAL:.0%}",
            "the median relative error of the forecast step over every run",
        )
    against_peers = auto_against_defaults(profile, work, options)
    ratios.update(against_peers.pop("ratios"))
    payload = {
        "auto_against_defaults": against_peers,
        "what": "forecast step time (plan.json, on the profile `dplaunch calibrate` measured "
        "just before) against the run's median step after two warm-up steps",
        "steps_per_run": steps,
        "uptime_before": before,
        "uptime_after": after,
        "sets": sets,
        "ratios": ratios,
        "failed_runs": failed,
    }
    write_result(NAME, payload, options)
    if options.write:
        plot(
            RESULTS / f"{NAME}.png",
            sets,
            f"{before.split('load average: ')[-1]} → {after.split('load average: ')[-1]}",
        )
    return payload


# the peers' default run of the benchmark's model and global batch (8) on 2 ranks: DDP, the whole
# share of the batch a rank (4) in one micro-batch, no activation checkpointing
DEFAULT_RUN = ("--cpu", "--gpus", "2", "--micro-batch", "4", "--set", "train.log_every=1")
# a better choice than the default exists when auto's forecast is this much faster than its own
BETTER_BY = 0.05
AUTO_GOALS = (1.0, 1.2)  # tokens/s of auto ÷ a peer's default: never below; where better exists


def auto_against_defaults(profile: Path, work: Path, options: Any) -> dict[str, Any]:
    """`dplaunch train --parallel auto` (layout, micro batch and checkpointing tuned on PROFILE,
    no trial run) against HF Trainer's and a plain `accelerate launch` loop's default run of the
    same model and global batch on the same 2 ranks, each run on its own: tokens/s of the median
    step after the warm-up, and whether auto's forecast saw a better choice than the default."""
    from benchmarks.throughput import (
        HAND_LOOP,
        TRAINER,
        WARMUP,
        dplaunch_step_times,
        prepare_blocks,
        run_peer,
        steady_tokens_per_s,
        tokens_per_step,
    )

    steps = 10 if options.quick else 16
    length = ("--max-steps", str(steps), "--profile", str(profile))
    render = work / "rendered-default"
    launch = render_run(CONFIG, render, *DEFAULT_RUN, *length)
    env = bench_environment(**launch["env"])
    blocks = prepare_blocks(render, work, env)
    tokens = tokens_per_step(render)
    auto = work / fresh(work, "auto")
    tuned = ("--parallel", "auto", "--set", "train.micro_batch_size=null")
    argv = dplaunch_train_argv(CONFIG, auto, "--cpu", "--gpus", "2", *tuned, *length)
    run_checked(
        argv + ["--set", "train.log_every=1"], work / f"{auto.name}.log", bench_environment()
    )
    rates = {
        "dplaunch --parallel auto": steady_tokens_per_s(
            dplaunch_step_times(auto), WARMUP, steps, tokens
        )
    }
    for peer, label in ((TRAINER, "trainer"), (HAND_LOOP, "hand")):
        times, _ = run_peer(peer, render, blocks, work / fresh(work, f"default-{label}"), env)
        rates[f"{peer} (default run)"] = steady_tokens_per_s(times, WARMUP, steps, tokens)
    chosen, default = read_plan_file(auto), read_plan_file(render)
    better = (
        chosen["forecast"]["step_time_s"] < (1 - BETTER_BY) * default["forecast"]["step_time_s"]
    )
    goal = AUTO_GOALS[1] if better else AUTO_GOALS[0]
    auto_rate = rates["dplaunch --parallel auto"]
    ratios = {
        f"auto / {name}": _entry(
            round(auto_rate / rate, 4),
            auto_rate / rate >= goal,
            f"≥ {goal}",
            "tokens/s of the tuned run over a peer's default run of the same global batch",
        )
        for name, rate in rates.items()
        if name != "dplaunch --parallel auto"
    }
    print(
        f"  auto chose {chosen['micro_batch_size']}×{chosen['gradient_accumulation_steps']} "
        f"(forecast {chosen['forecast']['step_time_s']:.3f} s/step against the default's "
        f"{default['forecast']['step_time_s']:.3f}): "
        + ", ".join(f"{name} {rate:,.0f} tokens/s" for name, rate in rates.items())
    )
    return {
        "tokens_per_s": {name: round(rate, 1) for name, rate in rates.items()},
        "auto_plan": {
            "micro_batch_size": chosen["micro_batch_size"],
            "gradient_accumulation_steps": chosen["gradient_accumulation_steps"],
            "zero_stage": chosen["zero_stage"],
            "forecast_step_s": chosen["forecast"]["step_time_s"],
        },
        "default_forecast_step_s": default["forecast"]["step_time_s"],
        "better_choice_forecast": better,
        "ratios": ratios,
    }


def _entry(value: float, met: bool, goal: str, meaning: str) -> dict[str, Any]:
    return {
        "value": value,
        "per_repetition": [value],
        "goal": goal,
        "met": met,
        "higher_is_better": None,
        "meaning": meaning,
    }


def plot(path: Path, sets: dict[str, list[dict[str, Any]]], load: str = "") -> None:
    """Forecast against measured, one point per run, the diagonal and the ±20 % band."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7.5, 6.5))
    values = [r[k] for rows in sets.values() for r in rows for k in ("forecast_s", "measured_s")]
    low, high = min(values) * 0.8, max(values) * 1.25
    line = [low, high]
    axis.plot(line, line, color="black", linewidth=1, label="forecast = measured")
    axis.fill_between(line, [x * 0.8 for x in line], [x * 1.2 for x in line], alpha=0.12,
                      color="green", label="±20 %")  # fmt: skip
    for (title, rows), marker in zip(sets.items(), ("o", "s", "^"), strict=False):
        axis.scatter([r["measured_s"] for r in rows], [r["forecast_s"] for r in rows],
                     marker=marker, label=title)  # fmt: skip
        for r in rows:
            axis.annotate(r["layout"], (r["measured_s"], r["forecast_s"]), fontsize=7,
                          xytext=(3, 3), textcoords="offset points")  # fmt: skip
    axis.set_xscale("log")
    axis.set_yscale("log")
    for which in (axis.xaxis, axis.yaxis):
        which.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        which.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axis.set_xlim(low, high)
    axis.set_ylim(low, high)
    axis.set_xlabel("measured median step (s)")
    axis.set_ylabel("forecast step (s)")
    axis.set_title(
        "dplaunch's step-time forecast, 2 CPU ranks (one point per run)"
        + (f"\nload {load}" if load else ""),
        fontsize=10,
    )
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
