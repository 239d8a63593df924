"""Optional comparison (not in the default `make bench`): what sequence parallelism divides.

`make bench BENCH_ARGS="--only long_context"` trains benchmarks/configs/llama-long.yaml on 2 CPU
ranks for 2 steps per run, as plain DDP (sp 1: each rank holds whole sequences, one a step) and with
Ulysses sequence parallelism (sp 2: both ranks share each sequence). sp divides the activations,
not the process (imports, model, optimizer), so each run's **activation memory** of rank 0 is its
peak resident memory (metrics.jsonl memory_gb, ru_maxrss) less the same run's baseline (the header's
memory_at_start_gb: model and engine built, no step taken). Reported:

- at a fixed length (FIXED_LENGTH), activation memory sp 2 / sp 1;
- the longest length on a grid of LENGTH_STEP tokens whose activation memory stays within
  ACTIVATION_BUDGET_GB, a budget fixed here before any run (not chosen from the results); each
  sp climbs the grid until a run goes over it;
- the slope: activation memory per 1K more tokens (least squares over the grid), sp 2 / sp 1.

Peak less baseline also holds what the first step adds whatever the length (Adam's states,
8 bytes × 13 M parameters, gradients, the all-reduce's buffers, libraries loaded on first use:
about 0.3 GB here, the same for sp 1 and sp 2): it is in the fixed-length ratio and the budget,
not in the slope. tokens/s is the second step's;
sp 2 trains half as many sequences per step on 2 ranks (dp 1), so it buys length, not speed.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    REPO,
    Options,
    RunFailed,
    bench_environment,
    dplaunch_train_argv,
    fresh,
    ratio_entry,
    read_jsonl,
    run_checked,
    write_result,
)

NAME = "long_context"
CONFIG = REPO / "benchmarks" / "configs" / "llama-long.yaml"
# the activation memory a rank may hold (GB = 1e9 bytes): a round figure fixed before any run of
# this method, never moved after one
ACTIVATION_BUDGET_GB = 1.0
FIXED_LENGTH = 4096
LENGTH_STEP = 1024
MAX_LENGTH = 16384  # the config's max_position_embeddings
QUICK_MAX_LENGTH = 4096


def measure(work: Any, sp: int, length: int) -> dict[str, float]:
    """Train 2 steps on 2 ranks at this sequence length: rank 0's peak, baseline, activation
    memory and tokens/s."""
    run_dir = work / fresh(work, f"sp{sp}-{length}")
    flags = ["--cpu", "--gpus", "2", "--sp", str(sp), "--global-batch", str(2 // sp)]
    flags += ["--set", f"data.max_length={length}"]
    argv = dplaunch_train_argv(CONFIG, run_dir, *flags)
    run_checked(argv, work / f"{run_dir.name}.log", bench_environment())
    return activation_memory(read_jsonl(run_dir / "metrics.jsonl"))


def activation_memory(records: list[dict[str, Any]]) -> dict[str, float]:
    """A run's metrics.jsonl as this comparison reads it: rank 0's peak, its baseline (the
    header's memory_at_start_gb), the activation memory between them, the last step's tokens/s."""
    header = next(r for r in records if r.get("type") == "header")
    steps = [r for r in records if r.get("type") == "train"]
    peak = max(r["memory_gb"] for r in steps)
    return {
        "memory_gb": peak,
        "baseline_gb": header["memory_at_start_gb"],
        "activation_gb": round(peak - header["memory_at_start_gb"], 3),
        "tokens_per_s": steps[-1]["tokens_per_s"],
    }


def longest_within_budget(runs: dict[str, dict[str, Any]], budget_gb: float) -> int:
    """The longest length (runs: numbers by length, in the order run) whose activation memory
    stays within BUDGET_GB, climbing the grid until a run goes over it; 0 when none does. A
    failed run (no activation_gb: an out-of-memory kill) is over the budget."""
    longest = 0
    for length, numbers in runs.items():
        if numbers.get("activation_gb", float("inf")) > budget_gb:
            break
        longest = int(length)
    return longest


def per_thousand_tokens(runs: dict[str, dict[str, float]]) -> float | None:
    """The activation memory one more 1K tokens adds (GB, least squares over the measured
    lengths): the slope leaves out what the first step adds whatever the length."""
    points = [
        (int(length) / 1000, n["activation_gb"])
        for length, n in runs.items()
        if "activation_gb" in n
    ]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return round(sum((x - mean_x) * (y - mean_y) for x, y in points) / spread, 4)


def run(options: Options) -> dict[str, Any]:
    work = options.folder(NAME)
    top = QUICK_MAX_LENGTH if options.quick else MAX_LENGTH
    grid = list(range(LENGTH_STEP, top + 1, LENGTH_STEP))
    print(
        f"\n[{NAME}] 2 CPU ranks, sp 1 vs sp 2, lengths {grid[0]}..{grid[-1]} by {LENGTH_STEP}, "
        f"activation budget {ACTIVATION_BUDGET_GB} GB a rank (fixed before the runs)"
    )
    results: dict[str, dict[str, Any]] = {}
    for sp in (1, 2):
        runs = results.setdefault(f"sp {sp}", {})
        for length in grid:
            try:
                numbers = measure(work, sp, length)
            except RunFailed as error:  # an out-of-memory kill is a result too
                numbers = {"failed": str(error).splitlines()[0]}
            runs[str(length)] = numbers
            print(f"  sp {sp}, {length:>6} tokens: {numbers}")
            within = numbers.get("activation_gb", float("inf")) <= ACTIVATION_BUDGET_GB
            # past the budget, and past the fixed length: longer runs only hold more
            if not within and length >= FIXED_LENGTH:
                break
    longest = {
        name: longest_within_budget(runs, ACTIVATION_BUDGET_GB) for name, runs in results.items()
    }
    print(f"  longest sequence within {ACTIVATION_BUDGET_GB} GB of activations a rank: {longest}")
    ratios = {}
    fixed = [results[f"sp {sp}"].get(str(FIXED_LENGTH), {}) for sp in (1, 2)]
    if all("activation_gb" in n for n in fixed):
        ratios[f"activation memory at {FIXED_LENGTH} tokens, sp 2 / sp 1"] = ratio_entry(
            [fixed[1]["activation_gb"]],
            [fixed[0]["activation_gb"]],
            goal=0.5,
            higher_is_better=False,
            meaning="the share of a rank's activations sp 2 keeps (Ulysses: half of each sequence)",
        )
    slopes = {name: per_thousand_tokens(runs) for name, runs in results.items()}
    print(f"  activation memory per 1K tokens (GB): {slopes}")
    if slopes["sp 1"] and slopes["sp 2"]:
        ratios["activation memory per token, sp 2 / sp 1"] = ratio_entry(
            [slopes["sp 2"]],
            [slopes["sp 1"]],
            goal=0.5,
            higher_is_better=False,
            meaning="the slope of activation memory in the sequence length: what sp divides",
        )
    if longest["sp 1"]:
        ratios["longest sequence within the activation budget, sp 2 / sp 1"] = ratio_entry(
            [longest["sp 2"]],
            [longest["sp 1"]],
            goal=2.0,
            higher_is_better=True,
            meaning="how much longer a sequence the same activation memory trains with sp 2",
        )
    payload = {
        "what": (
            "rank 0's activation memory (peak RSS less the run's own baseline at its header) "
            "and tokens/s, 2 CPU ranks, 2 steps per run"
        ),
        "config": str(CONFIG.relative_to(REPO)),
        "activation_budget_gb": ACTIVATION_BUDGET_GB,
        "fixed_length": FIXED_LENGTH,
        "length_step": LENGTH_STEP,
        "runs": results,
        "longest_within_budget": longest,
        "activation_gb_per_1k_tokens": slopes,
        "ratios": ratios,
    }
    write_result(NAME, payload, options)
    return payload
