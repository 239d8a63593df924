"""The launch checks of data.mixture's and data.eval_datasets' sources: each is checked as a run
of its own dataset is (data/checks.py, and sft's or dpo's records), and a refusal names the
source (`data.mixture[1].text_column: line 3 of b.jsonl has no 'body'`). A source smaller than
a global batch is fine: it repeats."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dplaunch.config.schema import SOURCE_KEYS, DataSource, RunConfig
from dplaunch.data.checks import check_data
from dplaunch.data.example_checks import check_examples
from dplaunch.data.mixture import evaluation_data, source_data, source_name
from dplaunch.errors import UserError
from dplaunch.tasks import task_of


def check_mixture(config: RunConfig, notes: list[str]) -> str:
    """Check every source of data.mixture; the data task they share (sft's plain texts train as
    causal-lm packing: a mixture's sources are all texts or all examples)."""
    assert config.data.mixture is not None
    tasks: list[str] = []
    for index, source in enumerate(config.data.mixture):
        sourced = config.model_copy(update={"data": source_data(config.data, source)})
        with naming(f"data.mixture[{index}]", source_name(source)):
            tasks.append(check_source(sourced, notes))
        if tasks[-1] != tasks[0]:
            raise UserError(
                f"data.mixture[{index}]",
                f"{source_name(source)} holds {_kind(tasks[-1])}, and data.mixture[0] "
                f"{_kind(tasks[0])}: the sources of a mixture are one kind of sample",
                "give each source the same format (data.format: conversational or "
                "prompt-completion for all, or text for all)",
            )
    return tasks[0]


def _kind(data_task: str) -> str:
    return "examples" if task_of(data_task).examples else "plain texts"


def check_evaluation_sets(config: RunConfig, notes: list[str]) -> None:
    """Check every set of data.eval_datasets (and a mixture's data.eval_dataset), as a training
    set of its own."""
    data = config.data
    sets = {
        f"data.eval_datasets.{name}": source for name, source in (data.eval_datasets or {}).items()
    }
    if data.mixture is not None and data.eval_dataset is not None:
        sets["data.eval_dataset"] = DataSource(dataset=data.eval_dataset)
    for where, source in sets.items():
        sourced = config.model_copy(update={"data": evaluation_data(data, source)})
        with naming(where, source_name(source)):
            check_source(sourced, notes)


def check_source(config: RunConfig, notes: list[str]) -> str:
    """Check CONFIG's one dataset (records, columns, labels; sft's and dpo's examples), with no
    global batch to fill; its data task."""
    from dplaunch.data.sft_checks import data_task_of

    task = data_task_of(config)
    check_data(config.data, task, num_labels=config.model.num_labels, notes=notes)
    notes.extend(check_examples(config, task, fill_a_batch=False))
    return task


@contextmanager
def naming(where: str, name: str) -> Iterator[None]:
    """A refusal of one source names it: a key it sets (or data.dataset) as its own key, any
    other with the source before it."""
    try:
        yield
    except UserError as error:
        key = error.field.removeprefix("data.")
        if key in ("dataset", *SOURCE_KEYS):
            # a mixture's data.eval_dataset is its own key
            field = where if where == "data.eval_dataset" and key == "dataset" else f"{where}.{key}"
            raise UserError(field, _with_name(error.problem, name), error.fix) from None
        raise UserError(
            where, f"{_with_name(error.problem, name)} ({error.field})", error.fix
        ) from None


def _with_name(problem: str, name: str) -> str:
    # a problem that names no file of the source says which source it is about
    return problem if name in problem or "line " in problem else f"{name}: {problem}"


def mixture_task_note(data: Any) -> str | None:
    """The plan's note on a mixture: its sources and shares."""
    if not data.mixture:
        return None
    total = sum(source.weight for source in data.mixture)
    parts = [f"{source_name(s)} {s.weight / total:.0%}" for s in data.mixture]
    return "data.mixture: " + ", ".join(parts) + " of the trained samples"
