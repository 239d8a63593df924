"""Check prompt-only records (model.task: grpo) and the reward functions before launch.

checks.py has already found the files readable. Here the first record must hold a ``prompt``
column; the reward functions of train.grpo.rewards must import, take TRL's arguments and find
the columns they read (tasks/grpo_rewards.py); and each record of the training and evaluation
data is rendered as the ranks will (data/prompts.py): a text or a conversation the chat
template renders. With the tokenizer (no torch), the training prompts are tokenised to say how
many data.max_length cuts, and whether they fill one global batch's prompts (global batch ÷
num_generations). Reads within the data check's budget (DPLAUNCH_DATA_CHECK_MB); the first
problem found is the one line shown.
"""

from __future__ import annotations

from pathlib import Path

from dplaunch.config.schema import RunConfig
from dplaunch.data.checks import _check_budget
from dplaunch.data.conversations import PROMPT_COLUMN
from dplaunch.data.prompts import FIX_PROMPT, PromptExamples, is_conversation, prompt_problem
from dplaunch.data.sft_checks import first_columns, launch_tokenizer, rendered_records
from dplaunch.errors import UserError
from dplaunch.tasks.grpo_rewards import check_rewards


def check_prompt_examples(config: RunConfig, *, fill_a_batch: bool = True) -> list[str]:
    """Refuse a record or a reward function the ranks cannot use, and (FILL_A_BATCH) prompts
    too few for one step; the plan's note on prompts cut."""
    data, settings = config.data, config.train.grpo
    assert settings is not None
    columns = first_columns(config)
    check_rewards(
        settings.rewards, settings.reward_weights, set(columns) if columns else None, Path.cwd()
    )
    if columns is None:
        return []  # a hub dataset the ranks will download: its records are checked there
    if PROMPT_COLUMN not in columns:
        listed = ", ".join(columns) or "none"
        raise UserError(
            "data.dataset",
            f"the records of {data.dataset} have no {PROMPT_COLUMN!r} column (the first one's: "
            f"{listed}), which model.task grpo samples completions of",
            FIX_PROMPT,
        )
    tokenizer = launch_tokenizer(config)
    pipeline = PromptExamples.of(data, tokenizer)
    budget = [_check_budget()]
    texts: list[tuple[str, str, bool]] = []
    for field, where, text in rendered_records(
        config,
        budget,
        tokenizer,
        prompt_problem,
        lambda record: pipeline.renderer.template is None and is_conversation(record),
        pipeline.text,
    ):
        if field == "data.dataset":
            texts.append((where, text, True))
    if tokenizer.encode is None or not texts:
        return []
    per_step = config.train.global_batch_size // settings.num_generations
    if budget[0] > 0 and fill_a_batch and len(texts) < per_step:
        raise UserError(
            "data.dataset",
            f"has {len(texts):,} prompts, fewer than one step's {per_step:,} (train."
            f"global_batch_size {config.train.global_batch_size} completions ÷ num_generations "
            f"{settings.num_generations})",
            "use more prompts, or a smaller train.global_batch_size",
        )
    cut = [
        where for where, text, _ in texts if len(tokenizer.encode([text])[0][0]) > data.max_length
    ]
    if not cut:
        return []
    return [
        f"{len(cut):,} of {len(texts):,} prompts are longer than data.max_length "
        f"{data.max_length} tokens and keep their last ones (e.g. {cut[0]})"
    ]
