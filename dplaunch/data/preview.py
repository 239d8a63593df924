"""What `dplaunch data` says about a run's examples: token texts, the statistics a user checks
before training, and the trained tokens marked in plain text. Pure and torch-free; the command
(dplaunch/commands/data.py) runs the ranks' pipeline and prints these."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dplaunch.data.example_tokens import (
    KEPT,
    NO_ANSWER,
    TOO_LONG,
    TRUNCATED,
    Pitfall,
    TokenizedExample,
)

# the marks around trained tokens when the output is not a terminal (no colours)
TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"
BOUNDARY = "|"


def percentile(values: Sequence[int], share: float) -> int:
    """The nearest-rank percentile (SHARE in 0–100) of VALUES; 0 for none."""
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share / 100 * len(ordered)) - 1)]


def token_texts(text: str, tokens: TokenizedExample, names: Sequence[str]) -> list[str]:
    """Each token's characters of TEXT, so that they join into the text again (a token's share
    begins where the one before ended: a tokenizer that trims a token's leading space still
    shows it); a token with no characters of its own (a BOS the tokenizer adds) is its name
    from NAMES (the tokenizer's token strings)."""
    pieces, shown = [], 0
    for (start, end), name in zip(tokens.offsets, names, strict=True):
        if end <= start and start == 0 and shown == 0:
            pieces.append(name)  # added before the text
            continue
        piece = text[shown:end] if end > shown else ""
        pieces.append(piece)
        shown = max(shown, end)
    if pieces and shown < len(text) and tokens.fate not in (TRUNCATED, TOO_LONG):
        pieces[-1] += text[shown:]
    return pieces


def marked_text(pieces: Sequence[str], trained: Sequence[bool], boundaries: bool = False) -> str:
    """The tokens as plain text: trained runs inside [[…]], token boundaries as | on request."""
    out: list[str] = []
    inside = False
    for index, (piece, keep) in enumerate(zip(pieces, trained, strict=True)):
        if keep and not inside:
            out.append(TRAINED_OPEN)
        elif not keep and inside:
            out.append(TRAINED_CLOSE)
        elif boundaries and index:
            out.append(BOUNDARY)
        inside = keep
        out.append(piece)
    if inside:
        out.append(TRAINED_CLOSE)
    return "".join(out)


@dataclass(frozen=True)
class ExampleFacts:
    """What the statistics need of one example: its length before the cut, the tokens and trained
    tokens kept, its fate, its straddling tokens (a few ints, for datasets of any size)."""

    length: int
    tokens: int
    trained: int
    fate: str
    cut: bool
    straddling: int

    @property
    def kept(self) -> bool:
        return self.fate in (KEPT, TRUNCATED)

    @classmethod
    def of(cls, tokens: TokenizedExample) -> ExampleFacts:
        return cls(
            tokens.length,
            len(tokens.input_ids),
            sum(tokens.trained),
            tokens.fate,
            tokens.cut,
            tokens.straddling,
        )


def sft_stats(
    details: Sequence[ExampleFacts],
    *,
    fmt: str,
    max_length: int,
    truncation: str,
    blocks: Sequence[Sequence[int]] | None,
    global_batch_size: int,
    found: Sequence[Pitfall],
) -> dict[str, Any]:
    """The numbers of `dplaunch data` for sft examples: counts, lengths, trained share, packing,
    global batches per epoch, and the pitfalls (each once: count, first example, text)."""
    kept = [d for d in details if d.kept]
    tokens = sum(d.tokens for d in kept)
    trained = sum(d.trained for d in kept)
    lengths = [d.length for d in details]
    samples = len(blocks) if blocks is not None else len(kept)
    packing = None
    if blocks is not None:
        capacity = len(blocks) * max_length
        packing = {
            "blocks": len(blocks),
            "block_tokens": max_length,
            "efficiency": round(tokens / capacity, 4) if capacity else 0.0,
        }
    return {
        "format": fmt,
        "examples": len(details),
        "kept": len(kept),
        # kept, cut to max_length (those cut and then dropped for no answer count as dropped)
        "truncated": sum(d.cut and d.kept for d in details),
        "dropped_too_long": sum(d.fate == TOO_LONG for d in details),
        "dropped_no_answer": sum(d.fate == NO_ANSWER for d in details),
        "max_length": max_length,
        "truncation": truncation,
        "tokens_per_example": {
            "p50": percentile(lengths, 50),
            "p90": percentile(lengths, 90),
            "p99": percentile(lengths, 99),
            "max": max(lengths, default=0),
        },
        "tokens": tokens,
        "trained_tokens": trained,
        "trained_share": round(trained / tokens, 4) if tokens else 0.0,
        "straddling_tokens": sum(d.straddling for d in details),
        "packing": packing,
        "samples": samples,
        "global_batch_size": global_batch_size,
        "global_batches_per_epoch": samples // global_batch_size,
        "warnings": [
            {
                "name": p.name,
                "count": p.count,
                "example": p.first,
                "text": p.text,
            }
            for p in found
        ],
    }


def summary_lines(stats: dict[str, Any], noun: str) -> list[str]:
    """The statistics as the lines `dplaunch data` prints."""
    lengths = stats["tokens_per_example"]
    dropped = stats["dropped_too_long"] + stats["dropped_no_answer"]
    lines = [
        f"{noun}: {stats['examples']:,} — {stats['kept']:,} kept ({stats['truncated']:,} cut to "
        f"{stats['max_length']:,} tokens), {dropped:,} dropped "
        f"({stats['dropped_too_long']:,} too long, {stats['dropped_no_answer']:,} with no answer "
        "token left)",
        f"tokens per example: median {lengths['p50']:,}, p90 {lengths['p90']:,}, p99 "
        f"{lengths['p99']:,}, max {lengths['max']:,} (before the cut)",
        f"trained tokens: {stats['trained_tokens']:,} of {stats['tokens']:,} "
        f"({stats['trained_share']:.1%})",
    ]
    packing = stats["packing"]
    if packing is not None:
        lines.append(
            f"packing: {stats['kept']:,} {noun} into {packing['blocks']:,} blocks of ≤ "
            f"{packing['block_tokens']:,} tokens; real tokens {packing['efficiency']:.1%} of the "
            "block tokens"
        )
    what = "blocks" if packing is not None else noun
    lines.append(
        f"global batches per epoch: {stats['global_batches_per_epoch']:,} "
        f"({stats['samples']:,} {what} ÷ global batch {stats['global_batch_size']:,})"
    )
    return lines
