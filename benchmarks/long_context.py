"""Optional comparison (not in the default `make bench`): how long a sequence trains with sp 2.

`make bench BENCH_ARGS="--only long_context"` trains benchmarks/configs/llama-long.yaml on 2 CPU
ranks for 2 steps at each sequence length of LENGTHS, once as plain DDP (sp 1: each rank holds
whole sequences, 1 sequence per rank per step) and once with Ulysses sequence parallelism (sp 2:
both ranks share each sequence, 1 sequence per step). Each run's peak resident memory of rank 0
(metrics.jsonl memory_gb, ru_maxrss) is compared with a fixed per-process budget, BUDGET_GB: the
longest length under it is what a rank of that size trains. tokens/s is the second step's.

Per process, sp 2 keeps half of each sequence's activations; it also trains half as many sequences
per step on 2 ranks (dp 1), so its tokens/s is not DDP's: what it buys is length, not speed.
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
# the per-process memory a rank may take (peak RSS, GB = 1e9 bytes). Set after the first run
# (2026-12-05): the imports, model and optimizer take about 1.4 GB, and 3.0 GB holds sp 1's 4K
# tokens (2.3 GB) but not its 8K (3.3 GB); at 2.5 GB both sp 1 and sp 2 stop at 4K (sp 2's 8K: 2.7)
BUDGET_GB = 3.0
LENGTHS = (2048, 4096, 8192)
QUICK_LENGTHS = (2048, 4096)


def measure(work: Any, sp: int, length: int) -> dict[str, float]:
    """Train 2 steps on 2 ranks at this sequence length; rank 0's peak memory and tokens/s."""
    run_dir = work / fresh(work, f"sp{sp}-{length}")
    flags = ["--cpu", "--gpus", "2", "--sp", str(sp), "--global-batch", str(2 // sp)]
    flags += ["--set", f"data.max_length={length}"]
    argv = dplaunch_train_argv(CONFIG, run_dir, *flags)
    run_checked(argv, work / f"{run_dir.name}.log", bench_environment())
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("type") == "train"]
    return {
        "memory_gb": max(r["memory_gb"] for r in steps),
        "tokens_per_s": steps[-1]["tokens_per_s"],
    }


def run(options: Options) -> dict[str, Any]:
    work = options.folder(NAME)
    lengths = QUICK_LENGTHS if options.quick else LENGTHS
    print(f"\n[{NAME}] 2 CPU ranks, sp 1 vs sp 2, lengths {lengths}, budget {BUDGET_GB} GB a rank")
    results: dict[str, dict[str, Any]] = {}
    for sp in (1, 2):
        for length in lengths:
            try:
                numbers = measure(work, sp, length)
            except RunFailed as error:  # an out-of-memory kill is a result too
                numbers = {"failed": str(error).splitlines()[0]}
            results.setdefault(f"sp {sp}", {})[str(length)] = numbers
            print(f"  sp {sp}, {length:>6} tokens: {numbers}")
    longest = {
        name: max(
            (int(length) for length, n in runs.items() if n.get("memory_gb", 1e9) <= BUDGET_GB),
            default=0,
        )
        for name, runs in results.items()
    }
    print(f"  longest sequence under {BUDGET_GB} GB a rank: {longest}")
    ratios = {}
    if longest["sp 1"]:
        ratios["longest sequence under the budget, sp 2 / sp 1"] = ratio_entry(
            [longest["sp 2"]],
            [longest["sp 1"]],
            goal=2.0,
            higher_is_better=True,
            meaning="how much longer a sequence the same per-process memory trains with sp 2",
        )
    payload = {
        "what": "peak RSS of rank 0 and tokens/s, 2 CPU ranks, 2 steps per run",
        "config": str(CONFIG.relative_to(REPO)),
        "budget_gb": BUDGET_GB,
        "runs": results,
        "longest_under_budget": longest,
        "ratios": ratios,
    }
    write_result(NAME, payload, options)
    return payload
