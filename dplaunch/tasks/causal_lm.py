"""`model.task: causal-lm`: next-token prediction on plain texts, packed into blocks."""

from __future__ import annotations

from dplaunch.tasks.base import Task

CAUSAL_LM = Task(
    name="causal-lm",
    summary="a causal LM on plain texts (next-token loss), packed into blocks",
    pipeline=True,
    sequence_parallel=True,
    packs_by_default=True,
)
