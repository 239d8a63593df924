"""Preference pairs (model.task: dpo): their formats, their checks, and their tokens.

TRL's preference formats:

- explicit prompt: ``prompt``, ``chosen`` and ``rejected`` columns, three texts or three lists of
  messages (the prompt's turns, then each response's: an assistant turn);
- implicit prompt: ``chosen`` and ``rejected`` only, two texts or two conversations that start
  alike; their common start is the prompt (TRL's ``extract_prompt``: the longest common run of
  messages; of two texts, their common characters less a space they end with).

Each response with its prompt is an sft prompt-completion record, rendered and masked by the sft
pipeline (answer_spans, example_tokens), exactly as ``model.task: sft`` trains such a record: a
text prompt + response + EOS; messages through the chat template, the response being what follows
the prompt rendered with its generation prompt. Two rules are the pair's, as TRL's DPOTrainer
has them: both responses start at the same token (the earlier of the two: a response whose first
token takes the prompt's last space is compared with the other from the same place), and a pair
is trained on or left out whole.

Torch-free: the launch check, the ranks and ``dplaunch data`` call these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dplaunch.config.schema import DataConfig
from dplaunch.data.answer_spans import TEMPLATE_KWARGS_COLUMN, TOOLS_COLUMN, Example, Renderer
from dplaunch.data.conversations import (
    COMPLETION_COLUMN,
    FIX_RECORD,
    PROMPT_COLUMN,
    PROMPT_COMPLETION,
    messages_problem,
)
from dplaunch.data.example_tokens import (
    IGNORE_INDEX,
    Encoded,
    TokenizedExample,
    tokenize_example,
)
from dplaunch.data.sft_examples import TokenizerView, make_renderer

CHOSEN_COLUMN = "chosen"
REJECTED_COLUMN = "rejected"
RESPONSES = (CHOSEN_COLUMN, REJECTED_COLUMN)
# the tokenised pair, as the ranks store it (train/data.py) and the batches carry it
PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
# the reference model's summed log-probabilities of each response (train.precompute_ref)
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
FIX_COLUMNS = (
    "give every record a chosen and a rejected response, and a prompt (or write both as "
    "conversations that start with the same prompt)"
)


def is_preference_data(columns: Iterable[str]) -> bool:
    """Whether records with these columns are preference pairs."""
    present = set(columns)
    return CHOSEN_COLUMN in present and REJECTED_COLUMN in present


@dataclass(frozen=True)
class Pair:
    """A record's prompt and its two responses: three texts, or three lists of messages."""

    prompt: Any
    chosen: Any
    rejected: Any

    @property
    def conversational(self) -> bool:
        return not isinstance(self.chosen, str)

    def records(self, record: Mapping[str, Any]) -> tuple[dict, dict]:
        """The chosen and rejected responses as sft prompt-completion records (with the record's
        own tools and template variables)."""
        extra = {
            key: record[key] for key in (TOOLS_COLUMN, TEMPLATE_KWARGS_COLUMN) if key in record
        }
        return tuple(  # type: ignore[return-value]
            {PROMPT_COLUMN: self.prompt, COMPLETION_COLUMN: response, **extra}
            for response in (self.chosen, self.rejected)
        )


def split_pair(record: Mapping[str, Any]) -> Pair:
    """The record's prompt and responses; without a prompt column, the responses' common start
    is the prompt (pair_problem must have passed)."""
    chosen, rejected = record[CHOSEN_COLUMN], record[REJECTED_COLUMN]
    if record.get(PROMPT_COLUMN) is not None:
        return Pair(record[PROMPT_COLUMN], chosen, rejected)
    if isinstance(chosen, str):
        shared = len(os.path.commonprefix([chosen, rejected]))
        if shared and chosen[shared - 1] == " ":
            shared -= 1  # the space starts the responses, as TRL cuts it
    else:
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
    return Pair(chosen[:shared], chosen[shared:], rejected[shared:])


def pair_problem(record: Mapping[str, Any]) -> tuple[str, str] | None:
    """(problem, fix) of a record the ranks cannot train on, else None. The problem text follows
    the record's place ("line 3 of pairs.jsonl ")."""
    for column in RESPONSES:
        if record.get(column) is None:
            return f"has no {column!r}", FIX_COLUMNS
    columns = [c for c in (PROMPT_COLUMN, *RESPONSES) if record.get(c) is not None]
    for column in columns:
        if not isinstance(record[column], (str, list)):
            return (
                f"has {json.dumps(record[column], default=str)[:40]} as {column!r}, neither a "
                "text nor a list of messages",
                FIX_RECORD,
            )
    kinds = {
        column: "text" if isinstance(record[column], str) else "message-list" for column in columns
    }
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"a {kind} {column}" for column, kind in kinds.items())
        return f"has {described}", "make them all texts, or all lists of messages"
    if kinds[CHOSEN_COLUMN] == "message-list":
        for column in columns:
            # an implicit prompt's conversations hold their prompt and an answer each
            need_answer = column != PROMPT_COLUMN
            problem = messages_problem(record[column], column, need_answer=need_answer)
            if problem is not None:
                return problem
    pair = split_pair(record)
    if PROMPT_COLUMN not in columns and not pair.prompt:
        return (
            "has no 'prompt', and its chosen and rejected responses do not start alike",
            "give a prompt column, or start both conversations with the same prompt",
        )
    if pair.chosen == pair.rejected:
        return "has the same chosen and rejected response: nothing to prefer", FIX_RECORD
    for column, response in zip(RESPONSES, (pair.chosen, pair.rejected), strict=True):
        if _empty(response):
            return f"has an empty {column} response", FIX_RECORD
        if pair.conversational:
            problem = messages_problem(response, column, need_answer=True)
            if problem is not None:  # what follows the shared start has no assistant turn
                return problem
    return None


def _empty(response: Any) -> bool:
    if isinstance(response, str):
        return not response.strip()
    return not any(
        (isinstance(m.get("content"), str) and m["content"].strip()) or m.get("tool_calls")
        for m in response
        if isinstance(m, Mapping)
    )


def first_trained(tokens: TokenizedExample) -> int | None:
    """The place of the first trained token, None without one."""
    return next((i for i, label in enumerate(tokens.labels) if label != IGNORE_INDEX), None)


def align_starts(chosen: TokenizedExample, rejected: TokenizedExample) -> None:
    """Start both responses at the earlier of their first trained tokens (TRL's DPOTrainer gives
    a pair one prompt length): the tokens between are the other's prompt, trained with it."""
    firsts = [first_trained(chosen), first_trained(rejected)]
    if None in firsts:
        return
    start = min(firsts)  # type: ignore[type-var]
    for tokens, first in zip((chosen, rejected), firsts, strict=True):
        for place in range(start, first):  # type: ignore[arg-type]
            tokens.labels[place] = tokens.input_ids[place]


@dataclass
class EncodedPairs:
    """The kept pairs' token ids and labels (PAIR_COLUMNS), every response counted in
    ``responses`` (example_tokens.Encoded: cuts, drops, straddling answers), and the pairs left
    out (with the first of them)."""

    columns: dict[str, list[list[int]]] = field(
        default_factory=lambda: {name: [] for name in PAIR_COLUMNS}
    )
    responses: Encoded = field(default_factory=lambda: Encoded(keep_tokens=False))
    pairs_dropped: int = 0
    first_dropped: int | None = None

    @property
    def kept(self) -> int:
        return len(self.columns["chosen_input_ids"])


@dataclass(frozen=True)
class PreferenceExamples:
    """Preference records → two sft Examples each → tokens, as every rank trains on them."""

    renderer: Renderer
    tokenizer: TokenizerView
    data: DataConfig

    @classmethod
    def of(cls, data: DataConfig, tokenizer: TokenizerView) -> PreferenceExamples:
        return cls(make_renderer(data, tokenizer), tokenizer, data)

    def examples(self, record: Mapping[str, Any]) -> tuple[Example, Example]:
        """The chosen and rejected responses rendered with their prompt (pair_problem must have
        passed); TemplateError when the chat template cannot render them."""
        chosen, rejected = split_pair(record).records(record)
        return (
            self.renderer.example(chosen, PROMPT_COMPLETION),
            self.renderer.example(rejected, PROMPT_COMPLETION),
        )

    def tokens(
        self,
        pairs: Sequence[tuple[Example, Example]],
        details: list[tuple[TokenizedExample, TokenizedExample]] | None = None,
    ) -> EncodedPairs:
        """PAIRS as token ids and labels; DETAILS receives each pair's two TokenizedExamples."""
        if self.tokenizer.encode is None:
            raise ValueError(f"the tokenizer {self.tokenizer.name} has no encoder here")
        data, out = self.data, EncodedPairs()
        texts = [example.text for pair in pairs for example in pair]
        encoded = self.tokenizer.encode(texts)
        for index, pair in enumerate(pairs):
            both = [
                tokenize_example(
                    example,
                    *encoded[2 * index + side],
                    leading=self.tokenizer.leading,
                    max_length=data.max_length,
                    truncation=data.truncation,
                    loss_on="answers",
                )
                for side, example in enumerate(pair)
            ]
            align_starts(*both)
            for side, (example, tokens) in enumerate(zip(pair, both, strict=True)):
                out.responses.add(2 * index + side, example, tokens)
            if details is not None:
                details.append((both[0], both[1]))
            if not (both[0].kept and both[1].kept):
                out.pairs_dropped += 1
                if out.first_dropped is None:
                    out.first_dropped = index
                continue
            for name, tokens in zip(RESPONSES, both, strict=True):
                out.columns[f"{name}_input_ids"].append(tokens.input_ids)
                out.columns[f"{name}_labels"].append(tokens.labels)
        return out
