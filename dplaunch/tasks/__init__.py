"""The training tasks (model.task), each a Task object in a module of its own: the registry.

Adding a task is a module here (its facts, tasks/base.py) and its line in TASKS; the code that
differs by task asks the facts (docs/development.md › Adding a training task). Torch- and
pydantic-free: `dplaunch --help` reads TASK_NAMES.
"""

from __future__ import annotations

from dplaunch.errors import UserError
from dplaunch.tasks.base import EXAMPLE_MAX_LENGTH, Task
from dplaunch.tasks.causal_lm import CAUSAL_LM
from dplaunch.tasks.classification import SEQUENCE_CLASSIFICATION
from dplaunch.tasks.dpo import DPO
from dplaunch.tasks.grpo import GRPO
from dplaunch.tasks.sft import SFT

TASKS: dict[str, Task] = {
    task.name: task for task in (CAUSAL_LM, SEQUENCE_CLASSIFICATION, SFT, DPO, GRPO)
}
TASK_NAMES = tuple(TASKS)


def key_owner(key: str) -> Task | None:
    """The task whose own run-file key KEY is (the first registered: sft's data keys before dpo's)."""
    return next((task for task in TASKS.values() if task.keys and key.startswith(task.keys)), None)


def task_of(name: str) -> Task:
    """The task named NAME (model.task); a UserError naming the known ones otherwise."""
    found = TASKS.get(name)
    if found is None:
        raise UserError("model.task", f"{name!r} is no task", f"use one of {', '.join(TASKS)}")
    return found


__all__ = [
    "CAUSAL_LM",
    "DPO",
    "EXAMPLE_MAX_LENGTH",
    "GRPO",
    "SEQUENCE_CLASSIFICATION",
    "SFT",
    "TASKS",
    "TASK_NAMES",
    "Task",
    "key_owner",
    "task_of",
]
