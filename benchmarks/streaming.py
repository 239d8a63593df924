"""Optional comparison (not in the default `make bench`): data.streaming against today's
tokenise-and-cache, on a generated corpus of JSON lines.

`make bench BENCH_ARGS="--only streaming"` writes a corpus of CORPUS_GB (two files of half each;
--quick: QUICK_GB) into the work folder, then trains benchmarks/configs/llama-3m.yaml on 2 CPU
ranks for STEPS steps three times, each with a datasets cache of its own (deleted with the
corpus at the end):

- cached, on the whole corpus: `datasets` reads the JSON into Arrow, tokenises every text (in 2
  processes: data.num_workers 2), packs and caches the blocks, and only then trains (today's path);
- streamed (data.streaming, one data loader worker a rank), on the whole corpus;
- streamed on its first half (one file), to see the ranks' memory stay flat as the data doubles.

Each run reports the seconds from `dplaunch train` to its first step, its tokens/s over the steps
after the first 4 (median of metrics.jsonl's logged steps), and the peak proportional set size
(PSS: shared pages counted once) of its rank processes and their data loader workers together,
sampled every SAMPLE_S seconds. The disk the cached run takes is reported too.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CONFIGS,
    REPO,
    Options,
    RunFailed,
    bench_environment,
    dplaunch_train_argv,
    fresh,
    ratio_entry,
    read_jsonl,
    time_to_lines,
    write_result,
)

NAME = "streaming"
CONFIG = CONFIGS / "llama-3m.yaml"
CORPUS_GB = 2.0
QUICK_GB = 0.2
STEPS = 24
SAMPLE_S = 0.5
# the cached run tokenises the whole corpus before its first step: minutes, not the usual limit
CACHED_LIMIT_S = 14400


def write_corpus(folder: Path, total_bytes: int, files: int = 2) -> list[Path]:
    """FILES JSON-lines files of TOTAL_BYTES together: reviews-like texts of 200-3000 bytes."""
    words = (
        "the a tour class phone coffee concert hotel staff food room view was is felt seemed "
        "great poor superb dull friendly slow quick clean noisy and but so very not quite "
        "really honestly overall sadly again would say recommend it this time"
    ).split()
    rng = random.Random(7)
    pool = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 600))) for _ in range(4000)]
    paths = []
    for number in range(files):
        path = folder / f"corpus-{number}.jsonl"
        written, line = 0, 0
        with path.open("w") as out:
            while written < total_bytes // files:
                chunk = "".join(
                    json.dumps({"text": f"{line + i}. {pool[rng.randrange(len(pool))]}"}) + "\n"
                    for i in range(1000)
                )
                out.write(chunk)
                written += len(chunk)
                line += 1000
        paths.append(path)
    return paths


class PssSampler:
    """The peak PSS of a run's rank processes (and their data loader workers, which carry the
    rank's command line), summed, sampled in a thread while the run goes on."""

    def __init__(self, run_dir: Path):
        self.marker = str(run_dir)
        self.peak_bytes = 0
        self.peak_one_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            for process in psutil.process_iter(["cmdline"]):
                argv = process.info["cmdline"] or []
                if "dplaunch.train" not in argv or self.marker not in " ".join(argv):
                    continue
                try:
                    pss = process.memory_full_info().pss
                except psutil.Error:
                    continue
                total += pss
                self.peak_one_bytes = max(self.peak_one_bytes, pss)
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(SAMPLE_S)


def measure(work: Path, name: str, files: list[Path], streaming: bool) -> dict[str, Any]:
    """One 2-rank run: seconds to its first step, tokens/s, peak PSS, the cache's size."""
    run_dir = work / fresh(work, name)
    cache = work / f"{run_dir.name}-datasets-cache"
    flags = ["--cpu", "--gpus", "2", "--max-steps", str(STEPS)]
    flags += ["--set", f"data.dataset={json.dumps([str(f) for f in files])}"]
    flags += ["--set", "train.log_every=1", "--set", "train.report_to=[]"]
    # the cached path's other ranks wait in a collective while the node's first rank tokenises:
    # past launch.timeout_minutes (30) that wait fails the run (seen at 2 GB on a busy machine)
    flags += ["--set", f"launch.timeout_minutes={CACHED_LIMIT_S // 60}"]
    # two processes tokenise either way: the cached path's map (num_proc 2), or one data
    # loader worker in each of the 2 ranks
    if streaming:
        flags += ["--set", "data.streaming=true", "--set", "data.num_workers=1"]
    else:
        flags += ["--set", "data.num_workers=2"]
    argv = dplaunch_train_argv(CONFIG, run_dir, *flags)
    env = bench_environment(HF_DATASETS_CACHE=str(cache))
    sampler = PssSampler(run_dir)
    try:
        times = time_to_lines(
            argv,
            ["step 1/"],
            work / f"{run_dir.name}.log",
            env,
            timeout=900 if streaming else CACHED_LIMIT_S,
        )
    finally:
        sampler.stop()
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("type") == "train"]
    steady = [r["tokens_per_s"] for r in steps if r["step"] > 4]
    cache_bytes = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    shutil.rmtree(cache, ignore_errors=True)
    return {
        "first_step_s": round(times["step 1/"], 1),
        "tokens_per_s": round(statistics.median(steady), 1),
        "peak_pss_gb": round(sampler.peak_bytes / 1e9, 3),
        "peak_process_pss_gb": round(sampler.peak_one_bytes / 1e9, 3),
        "datasets_cache_gb": round(cache_bytes / 1e9, 2),
        "data_share": round(statistics.median(r.get("data_share", 0.0) for r in steps[4:]), 4),
    }


def run(options: Options) -> dict[str, Any]:
    work = options.folder(NAME)
    size = QUICK_GB if options.quick else CORPUS_GB
    print(f"\n[{NAME}] corpus of {size} GB (2 files), 2 CPU ranks, {STEPS} steps, {CONFIG.name}")
    corpus = work / "corpus"
    corpus.mkdir(exist_ok=True)
    try:
        began = time.perf_counter()
        files = write_corpus(corpus, int(size * 1e9))
        written = sum(f.stat().st_size for f in files)
        print(f"  wrote {written / 1e9:.2f} GB in {time.perf_counter() - began:.0f} s")
        results: dict[str, Any] = {}
        for name, chosen, streaming in (
            ("streamed, half the corpus", files[:1], True),
            ("streamed, whole corpus", files, True),
            ("cached, whole corpus", files, False),
        ):
            try:
                results[name] = measure(
                    work, name.split(",")[0] + f"-{len(chosen)}", chosen, streaming
                )
            except RunFailed as error:
                results[name] = {"failed": str(error).splitlines()[0]}
            print(f"  {name}: {results[name]}")
    finally:
        shutil.rmtree(corpus, ignore_errors=True)
    stream, half, cached = (
        results["streamed, whole corpus"],
        results["streamed, half the corpus"],
        results["cached, whole corpus"],
    )
    ratios = {}
    if "first_step_s" in stream and "first_step_s" in cached:
        ratios["time to the first step, cached / streamed"] = ratio_entry(
            [cached["first_step_s"]],
            [stream["first_step_s"]],
            goal=10.0,
            higher_is_better=True,
            meaning="how much sooner a stream starts training than tokenise-and-cache",
        )
        ratios["tokens/s once training, streamed / cached"] = ratio_entry(
            [stream["tokens_per_s"]],
            [cached["tokens_per_s"]],
            goal=0.9,
            higher_is_better=True,
            meaning="a stream keeps the ranks as busy as cached blocks do (1 within noise)",
        )
    if "peak_pss_gb" in stream and "peak_pss_gb" in half:
        ratios["ranks' peak memory, corpus doubled / halved (streamed)"] = ratio_entry(
            [stream["peak_pss_gb"]],
            [half["peak_pss_gb"]],
            goal=1.1,
            higher_is_better=False,
            meaning="memory stays flat whatever the size of the data (1 within noise)",
        )
    payload = {
        "what": "2 CPU ranks: seconds to the first step, tokens/s after step 4, peak PSS of the "
        "ranks and their data loader workers",
        "config": str(CONFIG.relative_to(REPO)),
        "corpus_gb": round(written / 1e9, 2),
        "steps": STEPS,
        "runs": results,
        "ratios": ratios,
    }
    write_result(NAME, payload, options)
    return payload
