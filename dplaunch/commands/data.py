"""`dplaunch data RUN.yaml`: the run's data as the ranks will train on it, before any GPU hour.

Runs the ranks' own data pipeline in this process and starts nothing: the tokenizer
(train/modeling.py's load_tokenizer), the splits (train/data.py's load_splits), the records →
rendered text → tokens and labels of sft (data/sft_examples.py, as the row pass of the ranks), the
cut at data.max_length and the packing into blocks (train/data.py's pack_rows). Prints the
statistics a user checks (examples kept, cut, dropped; tokens per example; trained tokens and
their share; packing efficiency; global batches per epoch), each pitfall once with its count and
an example, `--show N` examples with their trained tokens highlighted (colours on a terminal,
[[…]] otherwise), and the first packed blocks with the examples they hold, kept apart by their
position ids. `--json` prints {"stats": …, "examples": [{index, tokens, trained}…]}. A dpo run
(data/preference.py) shows each pair's chosen and rejected responses, tokens and masks
({"index", "chosen": {tokens, trained}, "rejected": {…}} in JSON).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from dplaunch.commands.options import command
from dplaunch.config.flags import RunFlags
from dplaunch.errors import UserError

IGNORE_INDEX = -100
# records of a stream (data.streaming) the report reads, from its first files
STREAM_SAMPLE = 2000


@command()
def data_command(
    flags: RunFlags,
    show: Annotated[
        int,
        typer.Option("--show", min=0, help="Examples to print, with their trained tokens marked."),
    ] = 3,
    start: Annotated[
        int, typer.Option("--start", min=0, help="Index of the first example printed.")
    ] = 0,
    blocks: Annotated[
        int,
        typer.Option(
            "--blocks", min=0, help="Packed blocks to print (data.packing), with their examples."
        ),
    ] = 1,
    boundaries: Annotated[
        bool, typer.Option("--boundaries", help="Show where each token begins (| between tokens).")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Print JSON: the statistics and the examples' tokens and mask."
        ),
    ] = False,
) -> int:
    """Run the run file's data pipeline as the ranks will (tokenizer, chat template, truncation, packing) and show what is trained; start nothing."""
    return run_data(
        flags, show=show, start=start, blocks=blocks, boundaries=boundaries, as_json=as_json
    )


def run_data(
    flags: RunFlags, *, show: int, start: int, blocks: int, boundaries: bool, as_json: bool
) -> int:
    """Build the run's training data as the ranks do; print its statistics and examples."""
    from dplaunch.config.load import load_run_config
    from dplaunch.planning.model_facts import check_tokenizer
    from dplaunch.tasks import task_of

    config = load_run_config(
        flags.config, overrides=flags.overrides(), assignments=flags.assignments
    )
    task = config.model.task
    if task_of(task).classifies:
        raise UserError(
            "model.task",
            f"{task} trains a label per text, not tokens: nothing to show",
            "use dplaunch data with a causal-lm or sft run",
        )
    check_tokenizer(config.model)
    if config.data.mixture is not None:  # each source's report, and what each trains
        from dplaunch.commands.data_mixture import mixture_data

        return mixture_data(
            config,
            lambda sourced: _report(sourced, show, start, blocks, as_json),
            as_json,
            _Printer(boundaries),
        )
    report = _report(config, show, start, blocks, as_json)
    if as_json:
        typer.echo(json.dumps(report.as_json(), indent=1, ensure_ascii=False))
    else:
        report.print(_Printer(boundaries))
    return 0


def _report(config: Any, show: int, start: int, blocks: int, as_json: bool) -> Any:
    """The report of CONFIG's training data (one dataset): checked as `dplaunch train` checks it,
    read and tokenised as the ranks do."""
    from dplaunch.data.checks import check_data
    from dplaunch.data.sft_checks import data_task_of

    task = config.model.task
    data_task = data_task_of(config)
    check_data(config.data, data_task)  # one line for missing files, broken records, columns
    report_class = _report_class(data_task)
    # `dplaunch train`'s check of every record, in its words (file and line), before `datasets`
    # reads them (its reading may turn a text "1" into a number)
    report_class.check(config)
    with _library_progress(as_json):
        training, tokenizer = _training_data(config, task, as_json)
        report = report_class.build(config, tokenizer, training, range(start, start + show), blocks)
    if show and start >= report.count:
        raise UserError(
            "--start",
            f"{start:,} is past the end: the data has {report.count:,} {report.noun} "
            f"(0–{max(report.count - 1, 0):,})",
            f"use a --start below {report.count:,}",
        )
    return report


def _training_data(config: Any, task: str, as_json: bool) -> tuple[Any, Any]:
    """(the training records as the ranks read them, the run's tokenizer); a stream's first
    records only."""
    from dplaunch.train.data import attach_chat_template, load_splits
    from dplaunch.train.modeling import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    attach_chat_template(tokenizer, config.data, task)
    if not config.data.streaming:
        training, _ = load_splits(config.data, config.train.seed)
        return training, tokenizer
    from datasets import Dataset

    from dplaunch.data.streams import first_records

    training = Dataset.from_list(first_records(config.data, STREAM_SAMPLE))  # never read whole
    if not as_json:
        typer.echo(f"data.streaming: the first {len(training):,} records of the stream")
    return training, tokenizer


@contextlib.contextmanager
def _library_progress(as_json: bool) -> Iterator[None]:
    """`datasets`' progress bars (generating the split, tokenising) on a terminal only: piped
    or as JSON, the report is all that is printed."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    if shown and (as_json or not sys.stderr.isatty()):
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


class _Printer:
    """Tokens on a terminal in colour (trained bold green, the rest dim; token boundaries by
    alternating backgrounds), elsewhere as plain text with [[…]] around trained tokens."""

    def __init__(self, boundaries: bool):
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)
        self.colour = self.console.is_terminal and not self.console.no_color
        self.boundaries = boundaries

    def line(self, text: str = "", style: str | None = None) -> None:
        if self.colour:
            self.console.print(text, style=style, markup=False)
        else:
            typer.echo(text)

    def tokens(self, pieces: list[str], trained: list[bool]) -> None:
        from dplaunch.data.preview import marked_text

        if not self.colour:
            typer.echo(marked_text(pieces, trained, self.boundaries))
            return
        from rich.text import Text

        text = Text()
        for index, (piece, keep) in enumerate(zip(pieces, trained, strict=True)):
            style = "bold green" if keep else "dim"
            if self.boundaries:
                shade = "on grey19" if index % 2 else "on grey30"
                style = f"{'bold bright_green' if keep else 'grey70'} {shade}"
            text.append(piece, style=style)
        self.console.print(text)


class _SftReport:
    """sft examples through the ranks' pipeline: statistics, pitfalls, shown examples and blocks."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}
        self.lines: list[str] = []
        self.shown: list[dict[str, Any]] = []
        self.blocks: list[dict[str, Any]] = []
        self.count, self.noun = 0, "examples"

    @staticmethod
    def check(config: Any) -> None:
        """`dplaunch train`'s refusals of the records (not of a global batch left unfilled:
        the report counts the batches)."""
        from dplaunch.data.sft_checks import check_sft_examples

        check_sft_examples(config, fill_a_batch=False)

    @classmethod
    def build(
        cls, config: Any, tokenizer: Any, dataset: Any, wanted: range, block_count: int
    ) -> _SftReport:
        from dplaunch.data.answer_spans import TemplateError
        from dplaunch.data.conversations import CONVERSATIONAL
        from dplaunch.data.example_tokens import Encoded, pack_runs, pitfalls
        from dplaunch.data.preview import ExampleFacts, sft_stats, summary_lines, token_texts
        from dplaunch.train.data import sft_examples_of

        data = config.data
        pipeline = sft_examples_of(tokenizer, data, dataset.column_names)

        def tokens_of(indices: list[int], encoded: Encoded | None = None) -> list:
            examples = []
            for index in indices:
                try:
                    examples.append(pipeline.example(dataset[index]))
                except TemplateError as error:  # past the launch check's budget
                    raise UserError(
                        "data.dataset",
                        f"example {index} {error.problem}",
                        error.fix or "fix that record, or the template (data.chat_template)",
                    ) from None
            details: list = []
            counted = pipeline.tokens(examples, details)
            if encoded is not None:
                encoded.absorb(counted, indices[0] if indices else 0)
            return list(zip(examples, details, strict=True))

        report, encoded, facts = cls(), Encoded(keep_tokens=False), []
        chunk = 1000
        for first in range(0, len(dataset), chunk):
            indices = list(range(first, min(first + chunk, len(dataset))))
            for index, (example, tokens) in zip(indices, tokens_of(indices, encoded), strict=True):
                facts.append(ExampleFacts.of(tokens))
                if index in wanted:
                    names = tokenizer.convert_ids_to_tokens(tokens.input_ids)
                    report.shown.append(
                        {
                            "index": index,
                            "tokens": token_texts(example.text, tokens, names),
                            "trained": tokens.trained,
                            "fate": tokens.fate,
                            "length": tokens.length,
                        }
                    )
        kept = [index for index, fact in enumerate(facts) if fact.kept]
        packed = None
        if data.packing:
            packed = [
                [kept[i] for i in block]
                for block in pack_runs([facts[i].tokens for i in kept], data.max_length)
            ]
        noun = "conversations" if pipeline.fmt == CONVERSATIONAL else "examples"
        report.count, report.noun = len(dataset), noun
        found = pitfalls(encoded, len(dataset), noun, data.max_length, data.truncation)
        report.stats = sft_stats(
            facts,
            fmt=pipeline.fmt,
            max_length=data.max_length,
            truncation=data.truncation,
            blocks=packed,
            global_batch_size=config.train.global_batch_size,
            found=found,
        )
        report.stats["task"] = "sft"
        report.lines = [
            f"data: {_source(data.dataset)} ({pipeline.fmt}), tokenizer "
            f"{config.model.tokenizer or config.model.name_or_path}"
            + (", chat template from data.chat_template" if data.chat_template else ""),
            *summary_lines(report.stats, noun),
        ]
        report._add_blocks(packed or [], block_count, tokens_of, tokenizer, data.max_length)
        return report

    def _add_blocks(
        self,
        packed: list[list[int]],
        block_count: int,
        tokens_of: Any,
        tokenizer: Any,
        max_length: int,
    ) -> None:
        """The first BLOCK_COUNT packed blocks, those that hold several examples first: how the
        examples in them are kept apart (TOKENS_OF: the examples of indices, with their tokens)."""
        from dplaunch.data.preview import token_texts
        from dplaunch.train.data import pack_rows

        several = [n for n, block in enumerate(packed) if len(block) > 1]
        for number in (several or list(range(len(packed))))[:block_count]:
            block_members = packed[number]
            pairs = tokens_of(block_members)
            ids = [tokens.input_ids for _, tokens in pairs]
            labels = [tokens.labels for _, tokens in pairs]
            (block, _) = pack_rows(ids, labels, max_length)
            pieces, spans, at = [], [], 0
            for index, (example, tokens) in zip(block_members, pairs, strict=True):
                names = tokenizer.convert_ids_to_tokens(tokens.input_ids)
                pieces += token_texts(example.text, tokens, names)
                spans.append({"example": index, "tokens": [at, at + len(tokens.input_ids)]})
                at += len(tokens.input_ids)
            positions = block["position_ids"][0]
            self.blocks.append(
                {
                    "block": number,
                    "examples": spans,
                    "tokens": len(positions),
                    "capacity": max_length,
                    # every example starts its own run of position ids: the attention keeps it apart
                    "isolated": sum(p == 0 for p in positions) == len(spans),
                    "pieces": pieces,
                    "trained": [label != IGNORE_INDEX for label in block["labels"][0]],
                }
            )

    def as_json(self) -> dict[str, Any]:
        stats = dict(self.stats)
        if self.blocks:
            stats["blocks_shown"] = [
                {key: block[key] for key in ("block", "examples", "tokens", "capacity", "isolated")}
                for block in self.blocks
            ]
        examples = [
            {"index": e["index"], "tokens": e["tokens"], "trained": e["trained"]}
            for e in self.shown
        ]
        return {"stats": stats, "examples": examples}

    def print(self, out: _Printer) -> None:
        for line in self.lines:
            out.line(line)
        for warning in self.stats["warnings"]:
            out.line(
                f"warning: {warning['text']} (e.g. example {warning['example']})", "bold yellow"
            )
        for example in self.shown:
            trained = sum(example["trained"])
            out.line()
            out.line(
                f"example {example['index']}: {example['length']:,} tokens, {trained:,} trained"
                + ("" if example["fate"] == "kept" else f" ({example['fate']})"),
                "bold",
            )
            out.tokens(example["tokens"], example["trained"])
        for block in self.blocks:
            members = ", ".join(
                f"example {span['example']} (tokens {span['tokens'][0]}–{span['tokens'][1] - 1})"
                for span in block["examples"]
            )
            out.line()
            out.line(
                f"block {block['block']}: {block['tokens']:,} of {block['capacity']:,} tokens: "
                f"{members}",
                "bold",
            )
            out.line(
                "  position ids restart at 0 at each example"
                + (
                    ": each attends only to itself (SDPA/eager: a block-diagonal mask; "
                    "flash-attention: one sequence each)"
                    if block["isolated"]
                    else ": NOT isolated"
                )
            )
            out.tokens(block["pieces"], block["trained"])


class _PairReport:
    """dpo pairs through the ranks' pipeline: statistics, pitfalls, and the shown pairs' chosen
    and rejected responses with their trained tokens."""

    noun = "pairs"

    def __init__(self, stats: dict[str, Any], shown: list[dict[str, Any]], lines: list[str]):
        self.stats, self.shown, self.lines = stats, shown, lines
        self.count = stats["pairs"]

    @staticmethod
    def check(config: Any) -> None:
        """`dplaunch train`'s refusals of the pairs (not of a global batch left unfilled)."""
        from dplaunch.data.preference_checks import check_preference_examples

        check_preference_examples(config, fill_a_batch=False)

    @classmethod
    def build(
        cls, config: Any, tokenizer: Any, dataset: Any, wanted: range, _blocks: int
    ) -> _PairReport:
        from dplaunch.data.example_tokens import Encoded, pitfalls
        from dplaunch.data.preference import RESPONSES
        from dplaunch.data.preview import percentile, token_texts
        from dplaunch.train.data import preference_examples_of

        data = config.data
        pipeline = preference_examples_of(tokenizer, data)
        responses, shown = Encoded(keep_tokens=False), []
        kept = dropped = tokens = trained = 0
        lengths: list[int] = []
        for first in range(0, len(dataset), 1000):
            indices = list(range(first, min(first + 1000, len(dataset))))
            pairs = [_rendered_pair(pipeline, dataset[index], index) for index in indices]
            details: list = []
            encoded = pipeline.tokens(pairs, details)
            responses.absorb(encoded.responses, 2 * first)
            kept, dropped = kept + encoded.kept, dropped + encoded.pairs_dropped
            for index, pair, both in zip(indices, pairs, details, strict=True):
                lengths += [side.length for side in both]
                if all(side.kept for side in both):
                    tokens += sum(len(side.input_ids) for side in both)
                    trained += sum(sum(side.trained) for side in both)
                if index in wanted:
                    entry: dict[str, Any] = {"index": index}
                    for name, example, side in zip(RESPONSES, pair, both, strict=True):
                        names = tokenizer.convert_ids_to_tokens(side.input_ids)
                        entry[name] = {
                            "tokens": token_texts(example.text, side, names),
                            "trained": side.trained,
                            "fate": side.fate,
                        }
                    shown.append(entry)
        found = pitfalls(responses, 2 * len(dataset), "responses", data.max_length, data.truncation)
        global_batch = config.train.global_batch_size
        stats = {
            "task": "dpo",
            "pairs": len(dataset),
            "kept": kept,
            "dropped": dropped,
            "max_length": data.max_length,
            "truncation": data.truncation,
            "tokens_per_response": {
                "p50": percentile(lengths, 50),
                "p90": percentile(lengths, 90),
                "max": max(lengths, default=0),
            },
            "tokens": tokens,
            "trained_tokens": trained,
            "trained_share": round(trained / tokens, 4) if tokens else 0.0,
            "global_batch_size": global_batch,
            "global_batches_per_epoch": kept // global_batch,
            "warnings": [
                {"name": p.name, "count": p.count, "example": p.first // 2, "text": p.text}
                for p in found
            ],
        }
        return cls(stats, shown, _pair_lines(config, stats))

    def as_json(self) -> dict[str, Any]:
        examples = [
            {
                "index": e["index"],
                **{
                    side: {key: e[side][key] for key in ("tokens", "trained")}
                    for side in ("chosen", "rejected")
                },
            }
            for e in self.shown
        ]
        return {"stats": self.stats, "examples": examples}

    def print(self, out: _Printer) -> None:
        for line in self.lines:
            out.line(line)
        for warning in self.stats["warnings"]:
            out.line(f"warning: {warning['text']} (e.g. pair {warning['example']})", "bold yellow")
        for pair in self.shown:
            for side in ("chosen", "rejected"):
                response = pair[side]
                out.line()
                out.line(
                    f"pair {pair['index']}, {side}: {len(response['tokens']):,} tokens, "
                    f"{sum(response['trained']):,} trained"
                    + ("" if response["fate"] == "kept" else f" ({response['fate']})"),
                    "bold",
                )
                out.tokens(response["tokens"], response["trained"])


class _PromptReport:
    """grpo prompts through the ranks' pipeline: how many, their token lengths and those
    data.max_length cuts, and the shown prompts as the policy reads them (nothing in them is
    trained: the completions the policy samples are)."""

    noun = "prompts"

    def __init__(self, stats: dict[str, Any], shown: list[dict[str, Any]], lines: list[str]):
        self.stats, self.shown, self.lines = stats, shown, lines
        self.count = stats["prompts"]

    @staticmethod
    def check(config: Any) -> None:
        """`dplaunch train`'s refusals of the prompts and the reward functions."""
        from dplaunch.data.prompt_checks import check_prompt_examples

        check_prompt_examples(config, fill_a_batch=False)

    @classmethod
    def build(
        cls, config: Any, tokenizer: Any, dataset: Any, wanted: range, _blocks: int
    ) -> _PromptReport:
        from dplaunch.data.preview import percentile
        from dplaunch.data.prompts import PromptExamples
        from dplaunch.train.data import tokenizer_view

        data, settings = config.data, config.train.grpo
        pipeline = PromptExamples.of(data, tokenizer_view(tokenizer))
        lengths, cut, shown = [], 0, []
        for index in range(len(dataset)):
            record = dataset[index]
            ids, dropped = pipeline.ids(record)
            lengths.append(len(ids))
            cut += dropped > 0
            if index in wanted:
                extra = {k: v for k, v in record.items() if k != "prompt"}
                shown.append(
                    {"index": index, "tokens": tokenizer.convert_ids_to_tokens(ids),
                     "text": tokenizer.decode(ids), "columns": extra}
                )  # fmt: skip
        per_step = config.train.global_batch_size // settings.num_generations
        stats = {
            "task": "grpo",
            "prompts": len(dataset),
            "cut": cut,
            "max_length": data.max_length,
            "tokens_per_prompt": {
                "p50": percentile(lengths, 50),
                "p90": percentile(lengths, 90),
                "max": max(lengths, default=0),
            },
            "prompts_per_step": per_step,
            "num_generations": settings.num_generations,
            "max_completion_length": settings.max_completion_length,
            "steps_per_epoch": len(dataset) // per_step * settings.num_iterations,
        }
        lines = [
            f"data: {_source(data.dataset)} ({len(dataset):,} prompts, grpo), tokenizer "
            f"{config.model.tokenizer or config.model.name_or_path}",
            f"tokens per prompt: p50 {stats['tokens_per_prompt']['p50']:,}, p90 "
            f"{stats['tokens_per_prompt']['p90']:,}, max {stats['tokens_per_prompt']['max']:,}; "
            f"{cut:,} longer than data.max_length {data.max_length} keep their last tokens",
            f"a step: {per_step:,} prompts × {settings.num_generations} completions of up to "
            f"{settings.max_completion_length} tokens; {stats['steps_per_epoch']:,} steps an epoch",
        ]
        return cls(stats, shown, lines)

    def as_json(self) -> dict[str, Any]:
        return {"stats": self.stats, "examples": self.shown}

    def print(self, out: _Printer) -> None:
        for line in self.lines:
            out.line(line)
        for prompt in self.shown:
            out.line()
            out.line(f"prompt {prompt['index']}: {len(prompt['tokens']):,} tokens", "bold")
            out.line(prompt["text"])
            if prompt["columns"]:
                out.line("  for the rewards: " + json.dumps(prompt["columns"], default=str))


def _rendered_pair(pipeline: Any, record: dict, index: int) -> Any:
    """RECORD's two responses rendered; refused naming pair INDEX when the ranks cannot train
    on it (a record past the launch check's budget: that check names the others' lines)."""
    from dplaunch.data.answer_spans import TemplateError
    from dplaunch.data.preference import pair_problem

    problem = pair_problem(record)
    if problem is not None:
        raise UserError("data.dataset", f"pair {index} {problem[0]}", problem[1])
    try:
        return pipeline.examples(record)
    except TemplateError as error:
        raise UserError(
            "data.dataset",
            f"pair {index} {error}",
            "fix that record, or the template (data.chat_template)",
        ) from None


def _pair_lines(config: Any, stats: dict[str, Any]) -> list[str]:
    """The summary lines of a dpo report (STATS: _PairReport's)."""
    data, lengths = config.data, stats["tokens_per_response"]
    kept, tokens = stats["kept"], stats["tokens"]
    return [
        f"data: {_source(data.dataset)} (preference pairs), tokenizer "
        f"{config.model.tokenizer or config.model.name_or_path}"
        + (", chat template from data.chat_template" if data.chat_template else ""),
        f"pairs: {stats['pairs']:,} — {kept:,} kept, {stats['dropped']:,} left out whole (a "
        f"response too long for data.max_length {data.max_length:,}, or without a trained token)",
        f"tokens per response with its prompt: median {lengths['p50']:,}, p90 "
        f"{lengths['p90']:,}, max {lengths['max']:,} (before the cut)",
        f"trained tokens (the responses): {stats['trained_tokens']:,} of {tokens:,} "
        f"({stats['trained_share']:.1%})",
        f"global batches per epoch: {stats['global_batches_per_epoch']:,} ({kept:,} pairs ÷ "
        f"global batch {stats['global_batch_size']:,})",
    ]


class _CausalReport:
    """causal-LM texts as the ranks' tokenize() makes them: concatenated into full blocks
    (data.packing, the default), or a row per text cut at data.max_length; every token but a
    row's first is trained."""

    def __init__(self, stats: dict[str, Any], shown: list[dict[str, Any]], lines: list[str]):
        self.stats, self.shown, self.lines = stats, shown, lines
        self.noun = "blocks" if stats["packing"] else "rows"
        self.count = stats[self.noun]

    @staticmethod
    def check(config: Any) -> None:
        """Nothing more: check_data has read every text the ranks will."""

    @classmethod
    def build(
        cls, config: Any, tokenizer: Any, dataset: Any, wanted: range, _blocks: int
    ) -> _CausalReport:
        from dplaunch.data.preview import percentile
        from dplaunch.train.data import data_task, packs_texts, tokenize

        data = config.data
        rows = tokenize(dataset, tokenizer, data, config.model.task)
        packed = packs_texts(data_task(config.model.task, data, dataset.column_names), data)
        shown = []
        for index in wanted:
            if index >= len(rows):
                break
            ids = rows[index]["input_ids"]
            shown.append(
                {
                    "index": index,
                    "tokens": [tokenizer.decode([token]) for token in ids],
                    # the first token of a row is predicted by nothing in it
                    "trained": [position > 0 for position in range(len(ids))],
                }
            )
        # packed blocks are all full: their column is not read whole
        lengths = (
            [data.max_length] * len(rows) if packed else [len(ids) for ids in rows["input_ids"]]
        )
        global_batch = config.train.global_batch_size
        noun = "blocks" if packed else "rows"
        stats = {
            "task": "causal-lm",
            "texts": len(dataset),
            "packing": packed,
            noun: len(rows),
            ("block_tokens" if packed else "max_length"): data.max_length,
            "tokens": sum(lengths),
            "trained_tokens": sum(max(length - 1, 0) for length in lengths),
            "global_batch_size": global_batch,
            "global_batches_per_epoch": len(rows) // global_batch,
            "warnings": [],
        }
        if packed:
            layout = (
                f"packing: every text and its EOS token concatenated into {len(rows):,} blocks "
                f"of {data.max_length:,} tokens; every token is trained"
            )
        else:
            layout = (
                f"no packing (data.packing: false): a row per text with its EOS token, cut at "
                f"{data.max_length:,} tokens: {len(rows):,} rows, {stats['tokens']:,} tokens "
                f"(median {percentile(lengths, 50):,} a row, max {max(lengths, default=0):,}); "
                "every token but a row's first is trained"
            )
        lines = [
            f"data: {_source(data.dataset)} ({len(dataset):,} texts, causal LM), tokenizer "
            f"{config.model.tokenizer or config.model.name_or_path}",
            layout,
            f"global batches per epoch: {stats['global_batches_per_epoch']:,} ({len(rows):,} "
            f"{noun} ÷ global batch {global_batch:,})",
        ]
        return cls(stats, shown, lines)

    def as_json(self) -> dict[str, Any]:
        return {"stats": self.stats, "examples": self.shown}

    def print(self, out: _Printer) -> None:
        for line in self.lines:
            out.line(line)
        for example in self.shown:
            out.line()
            out.line(
                f"{self.noun[:-1]} {example['index']}: {len(example['tokens']):,} tokens", "bold"
            )
            out.tokens(example["tokens"], example["trained"])


def _report_class(data_task: str) -> Any:
    """The report of a data task: pairs, examples with their answers, or causal-LM texts."""
    from dplaunch.tasks import task_of

    task = task_of(data_task)
    if task.pairs:
        return _PairReport
    if task.prompts:
        return _PromptReport
    return _SftReport if task.own_labels else _CausalReport


def _source(dataset: Any) -> str:
    return ", ".join(dataset) if isinstance(dataset, list) else str(dataset)
