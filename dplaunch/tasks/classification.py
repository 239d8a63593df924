"""`model.task: sequence-classification`: a classifier head over the pooled sequence, trained on
labelled texts (data.label_column, data.label_names, model.num_labels)."""

from __future__ import annotations

from dplaunch.tasks.base import Task

SEQUENCE_CLASSIFICATION = Task(
    name="sequence-classification",
    summary="a sequence classifier on labelled texts (cross-entropy over the classes)",
    head="classification",
    eval_metrics=("loss", "accuracy"),
)
