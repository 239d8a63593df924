"""Check the records of a task whose records are examples (Task.examples) before launch, each
kind by its own module: pairs (preference_checks.py), prompts (prompt_checks.py), answers
(sft_checks.py). They build on checks.py (files, budget, columns); this module picks among them
and sits above all of them, so none imports back.
"""

from __future__ import annotations

from dplaunch.config.schema import RunConfig
from dplaunch.tasks import task_of


def check_examples(config: RunConfig, data_task: str, *, fill_a_batch: bool = True) -> list[str]:
    """Every record of a task whose records are examples (Task.examples), checked as its ranks
    render them: pairs, prompts or answers; the plan's notes. []
    for a task of plain texts or labels, which check_data checks."""
    task = task_of(data_task)
    if not task.examples:
        return []
    if task.pairs:
        from dplaunch.data.preference_checks import check_preference_examples as check
    elif task.prompts:
        from dplaunch.data.prompt_checks import check_prompt_examples as check
    else:
        from dplaunch.data.sft_checks import check_sft_examples as check
    return check(config, fill_a_batch=fill_a_batch)
