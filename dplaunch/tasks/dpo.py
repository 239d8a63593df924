"""`model.task: dpo`: preference tuning on chosen/rejected pairs (DPO, IPO, ORPO, SimPO:
train.preference), against a reference model where the loss needs one (docs/preference.md)."""

from __future__ import annotations

from dplaunch.tasks.base import EXAMPLE_MAX_LENGTH, Task

DPO = Task(
    name="dpo",
    summary="preference tuning of a causal LM on chosen/rejected pairs",
    examples=True,
    pairs=True,
    preference=True,
    model_parallel=False,
    eval_metrics=("loss", "rewards/accuracies"),
    keys=(
        "data.chat_template",
        "data.truncation",
        "data.tools",
        "train.preference",
        "train.precompute_ref",
        "train.sample_prompts",
    ),
    purpose="preference tuning",
    max_length=EXAMPLE_MAX_LENGTH,
    objective="dplaunch.train.preference:start_preference",
)
