"""Rendered examples as tokens: which tokens are trained, what data.max_length cuts, what packing
puts together, and the pitfalls worth a warning.

A token is trained when any of its characters lies in an answer span (transformers'
``return_assistant_tokens_mask`` rule, which TRL trains with): with a BPE tokenizer the answer
``positive`` after ``Sentiment:`` is often the one token `` positive``, whose space belongs to
the prompt; it is trained, and counted (``straddling``). Per example and torch-free: the launch
check (the `tokenizers` core), the ranks and ``dplaunch data`` (the HF tokenizer) call these.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dplaunch.data.answer_spans import Example

IGNORE_INDEX = -100
KEPT, TRUNCATED, TOO_LONG, NO_ANSWER = (
    "kept",
    "truncated",
    "dropped: too long",
    "dropped: no answer",
)


def answer_mask(
    offsets: Sequence[tuple[int, int]], answers: Iterable[tuple[int, int]]
) -> tuple[list[bool], int]:
    """Per token (by its character offsets): whether any of its characters lies in an answer
    span; and how many trained tokens begin before their span (straddling its start)."""
    spans = sorted(answers)
    mask, straddling, index = [], 0, 0
    for start, end in offsets:
        while index < len(spans) and spans[index][1] <= start:
            index += 1
        trained = index < len(spans) and end > spans[index][0]
        mask.append(trained)
        straddling += trained and start < spans[index][0]
    return mask, straddling


def leading_special_ids(with_specials: Sequence[int], without: Sequence[int]) -> list[int]:
    """The special tokens a tokenizer puts before a text (Llama's and Gemma's BOS), from one
    text's ids encoded with and without them; the ones it puts after (an EOS) are left out: a
    completion already ends with the EOS token."""
    for place in range(len(with_specials) - len(without) + 1):
        if list(with_specials[place : place + len(without)]) == list(without):
            return list(with_specials[:place])
    return []


@dataclass
class TokenizedExample:
    """One example as the ranks train on it (when kept): token ids, labels (IGNORE_INDEX where
    not trained), each token's characters in the text; its length before the cut, the trained
    tokens the cut removed, the trained tokens straddling an answer's start, and its fate."""

    input_ids: list[int]
    labels: list[int]
    offsets: list[tuple[int, int]]
    length: int
    trained_cut: int
    straddling: int
    fate: str

    @property
    def kept(self) -> bool:
        return self.fate in (KEPT, TRUNCATED)

    @property
    def cut(self) -> bool:
        """Cut to data.max_length (and trained on, unless no answer token is left)."""
        return self.fate != TOO_LONG and self.length > len(self.input_ids)

    @property
    def trained(self) -> list[bool]:
        return [label != IGNORE_INDEX for label in self.labels]


def tokenize_example(
    example: Example,
    ids: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    *,
    leading: Sequence[int] = (),
    max_length: int,
    truncation: str,
    loss_on: str,
) -> TokenizedExample:
    """EXAMPLE's tokens (IDS, OFFSETS: its text encoded without special tokens; LEADING: the
    tokenizer's own first tokens, given to an example with ``bos``) and labels.

    The first token is never a label (nothing in the example predicts it: a packed block must not
    learn it from the example before). Longer than MAX_LENGTH: cut (truncation "truncate") or left
    out ("drop"); no answer token left: left out."""
    if example.bos and leading:
        ids = [*leading, *ids]
        offsets = [(0, 0)] * len(leading) + list(offsets)
    ids, offsets = list(ids), [tuple(pair) for pair in offsets]
    if loss_on == "all":
        trained, straddling = [True] * len(ids), 0
    else:
        trained, straddling = answer_mask(offsets, example.answers)
    length = len(ids)
    fate, cut = KEPT, sum(trained[max_length:])
    if length > max_length:
        fate = TOO_LONG if truncation == "drop" else TRUNCATED
        ids, offsets, trained = ids[:max_length], offsets[:max_length], trained[:max_length]
    labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, trained, strict=True)]
    if labels:
        labels[0] = IGNORE_INDEX
    if fate != TOO_LONG and all(label == IGNORE_INDEX for label in labels):
        fate = NO_ANSWER
    return TokenizedExample(ids, labels, offsets, length, cut, straddling, fate)


@dataclass
class Encoded:
    """The kept examples' token ids and labels, and a count of everything worth saying."""

    input_ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)
    truncated: int = 0
    too_long_dropped: int = 0
    no_answer_dropped: int = 0
    # examples that lost answer tokens to the cut, and those tokens
    answers_cut: int = 0
    answer_tokens_cut: int = 0
    # trained tokens that begin before their answer (in the prompt), and examples with one
    straddling: int = 0
    straddling_examples: int = 0
    # answers that end with no end-of-turn token; message prompts rendered differently alone
    unclosed: int = 0
    prompt_differs: int = 0
    # the first example (its index among those encoded) of each pitfall above
    first: dict[str, int] = field(default_factory=dict)
    # False: count only (`dplaunch data` reads a dataset in chunks and keeps no tokens)
    keep_tokens: bool = True

    def add(self, index: int, example: Example, tokens: TokenizedExample) -> None:
        """Count example INDEX and keep its tokens when it is trained on."""
        counts = {
            "truncated": tokens.cut,
            "too_long_dropped": tokens.fate == TOO_LONG,
            "no_answer_dropped": tokens.fate == NO_ANSWER,
            "answers_cut": tokens.trained_cut > 0 and tokens.fate != TOO_LONG,
            "straddling_examples": tokens.straddling > 0,
            "unclosed": example.unclosed,
            "prompt_differs": example.prompt_differs,
        }
        for name, count in counts.items():
            if count:
                setattr(self, name, getattr(self, name) + int(count))
                self.first.setdefault(name, index)
        if counts["answers_cut"]:
            self.answer_tokens_cut += tokens.trained_cut
        self.straddling += tokens.straddling
        if tokens.kept and self.keep_tokens:
            self.input_ids.append(tokens.input_ids)
            self.labels.append(tokens.labels)

    def absorb(self, other: Encoded, first_index: int) -> None:
        """Add OTHER's counts, its examples numbered from FIRST_INDEX on (no tokens)."""
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, index in other.first.items():
            self.first.setdefault(name, first_index + index)


_COUNTS = (
    "truncated",
    "too_long_dropped",
    "no_answer_dropped",
    "answers_cut",
    "answer_tokens_cut",
    "straddling",
    "straddling_examples",
    "unclosed",
    "prompt_differs",
)


def encode_examples(
    examples: list[Example],
    encode: Any,
    *,
    leading: Sequence[int] = (),
    max_length: int,
    truncation: str,
    loss_on: str,
    details: list[TokenizedExample] | None = None,
) -> Encoded:
    """Tokenise EXAMPLES with ENCODE (texts → list of (ids, offsets), no special tokens) as
    tokenize_example does; DETAILS, when given, receives every example's TokenizedExample."""
    out = Encoded()
    encoded = encode([example.text for example in examples])
    for index, (example, (ids, offsets)) in enumerate(zip(examples, encoded, strict=True)):
        tokens = tokenize_example(
            example,
            ids,
            offsets,
            leading=leading,
            max_length=max_length,
            truncation=truncation,
            loss_on=loss_on,
        )
        out.add(index, example, tokens)
        if details is not None:
            details.append(tokens)
    return out


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Examples of these token LENGTHS into blocks of at most CAPACITY tokens: best fit, longest
    first (as TRL's "bfd"); each block lists its examples' indices in their order. Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    blocks: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, block), sorted
    for index in order:
        size = lengths[index]
        place = bisect.bisect_left(free, (size, -1))
        if place == len(free):
            blocks.append([index])
            bisect.insort(free, (capacity - size, len(blocks) - 1))
            continue
        left, block = free.pop(place)
        blocks[block].append(index)
        bisect.insort(free, (left - size, block))
    return [sorted(block) for block in blocks]


# packing chooses blocks within runs of this many rows (train/data.py's pack_examples)
PACKING_RUN = 10_000


def pack_runs(lengths: list[int], capacity: int) -> list[list[int]]:
    """The blocks the ranks pack: pack_lengths within each run of PACKING_RUN examples (indices
    into LENGTHS)."""
    blocks = []
    for first in range(0, len(lengths), PACKING_RUN):
        run = lengths[first : first + PACKING_RUN]
        blocks += [[first + i for i in block] for block in pack_lengths(run, capacity)]
    return blocks


@dataclass(frozen=True)
class Pitfall:
    """A warning about the examples: its count, the first example it concerns, and what to say."""

    name: str
    count: int
    first: int
    text: str


def pitfalls(
    encoded: Encoded, total: int, noun: str, max_length: int, truncation: str
) -> list[Pitfall]:
    """What a user should hear about TOTAL examples before training, most serious first."""
    e, found = encoded, []

    def say(name: str, count: int, text: str) -> None:
        if count:
            found.append(Pitfall(name, count, e.first.get(name, 0), text))

    say(
        "answers_cut",
        e.answers_cut,
        f"ANSWERS CUT: {e.answers_cut:,} of {total:,} {noun} lose answer tokens to "
        f"data.max_length {max_length:,} ({e.answer_tokens_cut:,} answer tokens never trained)"
        " — raise data.max_length, or set data.truncation: drop",
    )
    say(
        "unclosed",
        e.unclosed,
        f"{e.unclosed:,} answers end with no end-of-turn token, so the model never learns to "
        "stop there (the chat template closes a turn with the next message's tag, or not at "
        "all) — set data.chat_template to one that ends each assistant turn with a token",
    )
    longer = e.truncated + e.too_long_dropped
    action = "truncated" if truncation == "truncate" else "dropped (data.truncation: drop)"
    say(
        "truncated" if e.truncated else "too_long_dropped",
        longer,
        f"{longer:,} of {total:,} {noun} exceed {max_length:,} tokens (data.max_length): {action}",
    )
    say(
        "no_answer_dropped",
        e.no_answer_dropped,
        f"{e.no_answer_dropped:,} of {total:,} {noun} have no answer token left after "
        "truncation: dropped (raise data.max_length to keep them)",
    )
    say(
        "straddling_examples",
        e.straddling_examples,
        f"{e.straddling:,} answer tokens of {e.straddling_examples:,} {noun} begin in the prompt "
        "(a token such as ' positive' takes the space before the answer): trained, as TRL does",
    )
    say(
        "prompt_differs",
        e.prompt_differs,
        f"{e.prompt_differs:,} of {total:,} {noun} have a prompt the chat template renders "
        "differently alone than followed by the completion: the completion starts where they "
        "part (as TRL)",
    )
    return found
