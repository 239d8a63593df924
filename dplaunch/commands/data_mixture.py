"""`dplaunch data` of a data.mixture: each source's report (commands/data.py's, with the source's
own keys), then what the run's first steps train of each: its samples, tokens and epochs by the
schedule the ranks follow (dplaunch/data/mixture.py). `--json` prints {"steps": N, "mixture":
[{"dataset", "weight", "share", "examples", "tokens", "epochs"}…], "sources": [each report]}.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import typer


def mixture_data(config: Any, report_of: Callable[[Any], Any], as_json: bool, out: Any) -> int:
    """Print each source's report (REPORT_OF a run file of that source alone) and the mixture's
    first steps (train.max_steps, else train.epochs of the sources' samples) per source."""
    from dplaunch.data.mixture import MixtureSchedule, mixture_report, source_data, source_name
    from dplaunch.data.mixture_checks import naming

    data, train = config.data, config.train
    reports, lengths = [], []
    for index, source in enumerate(data.mixture):
        sourced = config.model_copy(update={"data": source_data(data, source)})
        with naming(f"data.mixture[{index}]", source_name(source)):
            reports.append(report_of(sourced))
            lengths.append(None if data.streaming else sample_lengths(sourced))
    global_batch = train.global_batch_size
    steps = train.max_steps or math.ceil(
        (train.epochs or 1) * (sum(len(length) for length in lengths) // global_batch)
    )
    schedule = MixtureSchedule(tuple(s.weight for s in data.mixture), global_batch, train.seed)
    entries = mixture_report(data, schedule, steps, lengths, seed=train.seed)
    if as_json:
        whole = {"steps": steps, "mixture": entries, "sources": [r.as_json() for r in reports]}
        typer.echo(json.dumps(whole, indent=1, ensure_ascii=False))
        return 0
    for index, (source, report) in enumerate(zip(data.mixture, reports, strict=True)):
        out.line(f"data.mixture[{index}]: {source_name(source)}, weight {source.weight:g}", "bold")
        report.print(out)
        out.line()
    out.line(f"the first {steps:,} steps ({global_batch:,} samples each) train:", "bold")
    for entry in entries:
        tokens = f", {entry['tokens']:,} tokens" if entry["tokens"] is not None else ""
        epochs = f", {entry['epochs']:g} epoch(s) of it" if "epochs" in entry else ""
        out.line(
            f"  {entry['dataset']}: {entry['examples']:,} samples "
            f"({entry['examples'] / max(steps * global_batch, 1):.1%}, weight share "
            f"{entry['share']:.1%}){tokens}{epochs}"
        )
    return 0


def sample_lengths(config: Any) -> Any:
    """The tokens of each training sample of CONFIG's one dataset, as the ranks make them (a
    pair's: both responses), in the ranks' tokenised cache."""
    import numpy as np
    import pyarrow.compute as pc

    from dplaunch.train.data import attach_chat_template, load_splits, tokenize
    from dplaunch.train.data import tokenized_cache_file as cache_of
    from dplaunch.train.modeling import load_tokenizer

    task = config.model.task
    tokenizer = load_tokenizer(config.model)
    attach_chat_template(tokenizer, config.data, task)
    training, _ = load_splits(config.data, config.train.seed)
    samples = tokenize(
        training, tokenizer, config.data, task, cache_of(training, tokenizer, config.data, task)
    )
    table = samples.with_format("arrow")
    names = ("input_ids", "chosen_input_ids", "rejected_input_ids")
    columns = [c for c in names if c in samples.column_names]
    counts = [pc.list_value_length(table[c]).to_numpy(zero_copy_only=False) for c in columns]
    return np.sum(counts, axis=0).astype(np.int64)
