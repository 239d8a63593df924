"""Check preference pairs (model.task: dpo) before launch: every record, rendered and counted.

checks.py has already found the files readable. Here the first record must carry the pairs'
columns, and each record of the training and evaluation data is checked as the ranks will use
it (data/preference.py): a chosen and a rejected response, of one kind with their prompt, that
differ and are not empty, their messages, the chat template rendering them. Then, with the
tokenizer (sft_checks.launch_tokenizer: no torch), the training pairs are tokenised to say how
many responses data.max_length cuts and how many pairs are left out, and whether the kept pairs
fill one global batch. Reads within the data check's budget (DPLAUNCH_DATA_CHECK_MB); the first
problem found is the one line shown.
"""

from __future__ import annotations

from dplaunch.config.schema import RunConfig
from dplaunch.data.answer_spans import Example
from dplaunch.data.checks import _check_budget
from dplaunch.data.example_tokens import pitfalls
from dplaunch.data.preference import (
    FIX_COLUMNS,
    RESPONSES,
    PreferenceExamples,
    is_preference_data,
    pair_problem,
)
from dplaunch.data.sft_checks import (
    check_kept_fill_a_batch,
    check_sample_prompts,
    first_columns,
    launch_tokenizer,
    rendered_records,
)
from dplaunch.errors import UserError


def check_preference_examples(config: RunConfig, *, fill_a_batch: bool = True) -> list[str]:
    """Refuse a record the ranks cannot train on, and (FILL_A_BATCH) pairs too few for one
    global batch; the plan notes on responses cut and pairs left out."""
    data = config.data
    columns = first_columns(config)
    if columns is None:
        return []  # a hub dataset the ranks will download: its records are checked there
    if not is_preference_data(columns):
        missing = " and ".join(repr(c) for c in RESPONSES if c not in columns)
        listed = ", ".join(columns) or "none"
        raise UserError(
            "data.dataset",
            f"the records of {data.dataset} have no {missing} column (the first one's: "
            f"{listed}), which model.task dpo trains on",
            FIX_COLUMNS,
        )
    tokenizer = launch_tokenizer(config)
    pipeline = PreferenceExamples.of(data, tokenizer)
    if config.train.sample_prompts:
        check_sample_prompts(config, pipeline.renderer)
    budget = [_check_budget()]
    pairs: list[tuple[Example, Example]] = []
    places: list[str] = []
    for field, where, pair in rendered_records(
        config,
        budget,
        tokenizer,
        pair_problem,
        lambda record: pipeline.renderer.template is None and not isinstance(record["chosen"], str),
        pipeline.examples,
    ):
        if field == "data.dataset":
            pairs.append(pair)
            places.append(where)
    if tokenizer.encode is None or not pairs:
        return []
    encoded = pipeline.tokens(pairs)
    if budget[0] > 0 and fill_a_batch:
        check_kept_fill_a_batch(config, encoded.kept, encoded.pairs_dropped, "pairs")
    found = pitfalls(
        encoded.responses, 2 * len(pairs), "responses", data.max_length, data.truncation
    )
    notes = [f"{pitfall.text} (e.g. {places[pitfall.first // 2]})" for pitfall in found]
    if encoded.pairs_dropped:
        assert encoded.first_dropped is not None
        notes.append(
            f"{encoded.pairs_dropped:,} of {len(pairs):,} pairs are left out whole (a response "
            f"too long or without an answer token) (e.g. {places[encoded.first_dropped]})"
        )
    return notes
