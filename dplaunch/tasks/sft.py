"""`model.task: sft`: supervised fine-tuning on conversations or prompt–completion pairs rendered
by a chat template, the loss on their answers (docs/sft.md); plain texts train as causal-lm."""

from __future__ import annotations

from dplaunch.tasks.base import EXAMPLE_MAX_LENGTH, Task

SFT = Task(
    name="sft",
    summary="a causal LM on chat examples, the loss on their answers",
    examples=True,
    pipeline=True,
    sequence_parallel=True,
    packs_when_asked=True,
    own_labels=True,
    packs_evaluation=False,
    texts_train_as="causal-lm",
    keys=("data.", "train.sample_prompts"),
    purpose="supervised fine-tuning",
    max_length=EXAMPLE_MAX_LENGTH,
)
