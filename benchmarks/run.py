"""`make bench` = `python -m benchmarks.run`: every comparison, side by side, medians and ratios.

    python -m benchmarks.run                     # all comparisons (13–19 minutes on 2 cores)
    python -m benchmarks.run --quick             # one repetition, shorter windows (a smoke run)
    python -m benchmarks.run --only throughput   # some of: startup, launch_overhead, throughput, lora, scaling, flags, fsdp
    python -m benchmarks.run --only scaling_peers  # optional: scaling of dplaunch and of the hand loop
    python -m benchmarks.run --only long_context   # optional: activation memory and longest sequence, sp 1 vs 2
    python -m benchmarks.run --only streaming      # optional: data.streaming vs tokenise-and-cache on a 2 GB corpus
    python -m benchmarks.run --only forecast       # optional: forecast vs measured step time of 10 layouts (~15 min)
    python -m benchmarks.run --only memory         # optional: chunked loss and selective checkpointing vs full logits and HF Trainer
    python -m benchmarks.run --reps 5 --no-write # more repetitions (throughput: rounds), keep results/ untouched

Results go to benchmarks/results/NAME.json (with date, machine, versions) and NAME.png. The GPU
benchmark is benchmarks/gpu.sh (it needs a GPU and is not run here).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import (
    flags,
    forecast,
    fsdp,
    launch_overhead,
    long_context,
    lora,
    memory,
    scaling,
    scaling_peers,
    startup,
    streaming,
    throughput,
)
from benchmarks.common import RESULTS, Options, machine_facts, verdict

# what `make bench` runs without --only; the optional ones would take it past 20 minutes
DEFAULT = (startup, launch_overhead, throughput, lora, scaling, flags, fsdp)
OPTIONAL = (scaling_peers, long_context, streaming, forecast, memory)
COMPARISONS = {module.NAME: module for module in (*DEFAULT, *OPTIONAL)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="one repetition, shorter windows")
    parser.add_argument(
        "--only",
        action="append",
        choices=list(COMPARISONS),
        help="run only this comparison (repeatable)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        help="repetitions per contender (default per comparison; throughput: rounds of turns)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="last step of the flags and scaling_peers runs (at least 7; default 16, quick 10)",
    )
    parser.add_argument(
        "--no-write", action="store_true", help="print only; leave benchmarks/results/ as it is"
    )
    parser.add_argument(
        "--keep", type=Path, help="keep run directories and logs here (default: a deleted temp dir)"
    )
    args = parser.parse_args(argv)

    facts = machine_facts()
    machine = facts["machine"]
    print(
        f"dplaunch benchmarks, {facts['date']}: {machine['nproc']} CPU(s) {machine['cpu_model']}, "
        f"load {machine['load_average_at_start']}; "
        + ", ".join(f"{k} {v}" for k, v in facts["versions"].items())
    )
    print(facts["note"])
    work = args.keep or Path(tempfile.mkdtemp(prefix="dplaunch-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    options = Options(
        quick=args.quick, reps=args.reps, steps=args.steps, work_dir=work, write=not args.no_write
    )
    chosen = args.only or [module.NAME for module in DEFAULT]
    started = time.perf_counter()
    summary: dict[str, dict] = {}
    minutes: dict[str, float] = {}
    failed: list[str] = []
    try:
        for name in chosen:
            options.load_at_start = os.getloadavg()
            began = time.perf_counter()
            try:
                summary[name] = COMPARISONS[name].run(options)["ratios"]
            except Exception as error:  # noqa: BLE001 — one broken comparison must not hide the others
                print(f"\n[{name}] FAILED: {error}", file=sys.stderr)
                failed.append(name)
            minutes[name] = (time.perf_counter() - began) / 60
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n== all ratios ({(time.perf_counter() - started) / 60:.1f} min: "
        + ", ".join(f"{name} {spent:.1f}" for name, spent in minutes.items())
        + ")"
    )
    for name, ratios in summary.items():
        for label, entry in ratios.items():
            print(f"  {name:<16} {label:<60} {entry['value']:7.3f}×  {verdict(entry)}")
    if options.write and summary:
        print(f"results: {RESULTS}/*.json and *.png")
    if failed:
        print(f"failed comparisons: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
