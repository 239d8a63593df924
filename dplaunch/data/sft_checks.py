"""Check supervised fine-tuning examples before launch: every record, rendered and counted.

checks.py has already found the files readable (and the rows enough for a global batch);
here each record of the training and evaluation data is checked as the ranks will use it
(conversations.py): its messages, roles and contents, an assistant turn, the prompt and the
completion, the chat template rendering it. Then, with the tokenizer (the `tokenizers` core of
tokenizer.json, or the built-in byte-level one; no torch), the training examples are tokenised
to say how many exceed data.max_length and are cut or left out, and how many have no answer
token left, and whether what is left fills one global batch. Reads within the data check's
budget (DPLAUNCH_DATA_CHECK_MB); the first problem found is the one line shown.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dplaunch.config.schema import BYTE_LEVEL, RunConfig
from dplaunch.data import conversations
from dplaunch.data.answer_spans import Example, Renderer, TemplateError
from dplaunch.data.arrow_datasets import (
    check_hub_dataset,
    hub_layout_folder,
    saved_dataset,
    saved_folder,
)
from dplaunch.data.checks import STREAM_FILE_BYTES, STREAM_FILE_MIN_BYTES, _check_budget
from dplaunch.data.conversations import CONVERSATIONAL, PROMPT_COMPLETION, TEXT
from dplaunch.data.example_tokens import Encoded, leading_special_ids, pack_runs, pitfalls
from dplaunch.data.formats import (
    eval_fraction_split,
    expand_files,
    is_local,
    local_format,
    open_text,
)
from dplaunch.data.sft_examples import SftExamples, TokenizerView, chat_templates
from dplaunch.errors import UserError
from dplaunch.hub import find_model_file
from dplaunch.tasks import task_of

# the built-in tokenizer's special tokens, as train/tokenizer.py names them
_BYTE_LEVEL_SPECIAL = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def data_task_of(config: RunConfig) -> str:
    """The task checks.py checks the data for: model.task, or (Task.texts_train_as) what its
    records train as when they are plain texts (sft's: causal-lm packing). The format is
    data.format, or the first record's columns."""
    task = task_of(config.model.task)
    if task.texts_train_as is None:
        return task.name
    data = config.data
    columns = () if data.format else first_columns(config)
    if columns is None:
        return task.name  # unreadable: checks.py names the problem
    fmt = conversations.resolve_format(data.format, columns, data.text_column)
    return task.texts_train_as if fmt == TEXT else task.name


def check_sft_examples(config: RunConfig, *, fill_a_batch: bool = True) -> list[str]:
    """Refuse a record the ranks cannot train on, and (FILL_A_BATCH) examples too few for one
    global batch; the plan notes on examples cut or left out."""
    data = config.data
    if config.parallel.pp > 1 and data.packing:
        raise UserError(
            "data.packing",
            "packed examples need their position ids, which the pipeline stages do not carry "
            f"(parallel.pp {config.parallel.pp})",
            "set data.packing: false, or use --pp 1",
        )
    columns = first_columns(config)
    if data.format and columns is not None:
        conversations.check_declared_format(data.format, columns, data)
    if data.format:
        columns = ()
    elif columns is None:
        return []  # a hub dataset the ranks will download: its records are checked there
    tokenizer = launch_tokenizer(config)
    pipeline = SftExamples.of(data, columns, tokenizer)
    renderer = pipeline.renderer
    if renderer.template is None and pipeline.fmt == CONVERSATIONAL:
        raise _no_template(tokenizer, f"the conversations of {data.dataset}")
    if config.train.sample_prompts:
        check_sample_prompts(config, renderer)
    budget = [_check_budget()]
    examples: list[Example] = []
    places: list[str] = []
    for field, where, (record, example) in rendered_records(
        config,
        budget,
        tokenizer,
        lambda record: conversations.record_problem(record, pipeline.fmt),
        lambda record: renderer.template is None and _needs_template(record, pipeline.fmt),
        lambda record: (record, renderer.example(record, pipeline.fmt)),
    ):
        if not example.answers and _needs_template(record, pipeline.fmt) and data.loss_on != "all":
            # the record has an answer (record_problem checked): the template dropped it
            raise UserError(
                "data.chat_template",
                f"the chat template renders no assistant turn of {where}: the loss is on "
                "the answers, so no token of it would be trained",
                "make the template write each assistant message's content",
            )
        if field == "data.dataset":
            examples.append(example)
            places.append(where)
    if tokenizer.encode is None or not examples:
        return []
    encoded = pipeline.tokens(examples)
    noun = "conversations" if pipeline.fmt == CONVERSATIONAL else "examples"
    if budget[0] > 0 and fill_a_batch:
        _check_one_global_batch(config, encoded, noun)
    found = pitfalls(encoded, len(examples), noun, data.max_length, data.truncation)
    return [f"{pitfall.text} (e.g. {places[pitfall.first]})" for pitfall in found]


def rendered_records(
    config: RunConfig,
    budget: list[int],
    tokenizer: TokenizerView,
    problem_of: Callable[[dict], tuple[str, str] | None],
    lacks_template: Callable[[dict], bool],
    render: Callable[[dict], Any],
) -> Iterator[tuple[str, str, Any]]:
    """(field, where, RENDER(record)) of every record of the training and evaluation data within
    the BUDGET; refuses the first whose PROBLEM_OF is not None, that LACKS_TEMPLATE, or that the
    chat template fails to render."""
    data = config.data
    for field, source in (("data.dataset", data.dataset), ("data.eval_dataset", data.eval_dataset)):
        if source is None:
            continue
        split = data.split if field == "data.dataset" else ""
        for where, record in _records(source, split, data, budget):
            problem = problem_of(record)
            if problem is not None:
                raise UserError(field, f"{where} {problem[0]}", problem[1])
            if lacks_template(record):
                raise _no_template(tokenizer, f"the messages of {where}")
            try:
                rendered = render(record)
            except TemplateError as error:
                raise UserError(
                    "data.chat_template",
                    f"{error} ({where})",
                    "fix the template (data.chat_template) or that record",
                ) from None
            yield field, where, rendered


def check_sample_prompts(config: RunConfig, renderer: Renderer) -> None:
    """Refuse train.sample_prompts the ranks cannot read or render."""
    field, path = "train.sample_prompts", config.train.sample_prompts
    if config.parallel.pp > 1:
        raise UserError(
            field,
            f"the pipeline engine cannot generate (parallel.pp {config.parallel.pp})",
            "drop train.sample_prompts, or use --pp 1",
        )
    if not Path(path).is_file():
        raise UserError(field, f"{path} does not exist", "give a JSON-lines file of prompts")
    try:
        prompts = conversations.read_sample_prompts(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(field, f"cannot read {path}: {exc}", "fix the file") from None
    except ValueError as exc:
        raise UserError(
            field,
            str(exc),
            'write one {"prompt": TEXT or [messages…]} per line, or one text per line',
        ) from None
    for number, prompt in enumerate(prompts, 1):
        if isinstance(prompt, str):
            continue
        if renderer.template is None:
            raise UserError(
                "data.chat_template",
                f"there is no chat template to render the messages of prompt {number} of {path}",
                "set data.chat_template, or give the prompts as texts",
            )
        try:
            renderer.render(conversations.normalized_messages(prompt), add_generation_prompt=True)
        except TemplateError as error:
            raise UserError(
                "data.chat_template", f"{error} (prompt {number} of {path})", "fix the template"
            ) from None


def _no_template(tokenizer: TokenizerView, what: str) -> UserError:
    return UserError(
        "data.chat_template",
        f"the tokenizer {tokenizer.name} has no chat template to render {what}",
        "set data.chat_template to a Jinja template (its text, or a .jinja file)",
    )


def _needs_template(record: dict, fmt: str) -> bool:
    return fmt == CONVERSATIONAL or (
        fmt == PROMPT_COMPLETION and not isinstance(record.get("prompt"), str)
    )


def _check_one_global_batch(config: RunConfig, encoded: Encoded, noun: str) -> None:
    lengths = [len(ids) for ids in encoded.input_ids] if config.data.packing else None
    left_out = encoded.too_long_dropped + encoded.no_answer_dropped
    check_kept_fill_a_batch(config, len(encoded.input_ids), left_out, noun, lengths)


def check_kept_fill_a_batch(
    config: RunConfig, kept: int, left_out: int, noun: str, packed: list[int] | None = None
) -> None:
    """Refuse training data whose KEPT examples (LEFT_OUT others) fill no global batch; PACKED:
    their token lengths, when packed into blocks."""
    data, wanted = config.data, config.train.global_batch_size
    if packed is not None:
        if data.eval_fraction is not None:
            return  # which examples share blocks depends on the split the ranks make
        samples = len(pack_runs(packed, data.max_length))
        what = f"{kept:,} {noun} kept pack into {samples:,} blocks"
    else:
        samples = kept
        if data.eval_fraction is not None:
            samples, _ = eval_fraction_split(kept, data.eval_fraction)
        what = f"{samples:,} training {noun} are kept"
    if samples >= wanted:
        return
    raise UserError(
        "train.global_batch_size",
        f"{what} ({left_out:,} left out), fewer than one global batch of {wanted}",
        f"use a global batch of {samples} or less, a larger data.max_length, or more data"
        if samples
        else "use a larger data.max_length, or more data",
    )


def launch_tokenizer(config: RunConfig) -> TokenizerView:
    """The run's tokenizer as the check needs it, without torch: its chat template, its special
    tokens, and an encoder from the `tokenizers` core when tokenizer.json is there."""
    model = config.model
    name = model.tokenizer or model.name_or_path or ""
    if name == BYTE_LEVEL:
        from dplaunch.data.byte_level import SPECIAL_TOKENS, byte_level_core

        return _core_view(name, None, dict(_BYTE_LEVEL_SPECIAL), byte_level_core(), SPECIAL_TOKENS)
    settings_file = find_model_file(
        name, ("tokenizer_config.json",), "model.tokenizer", what="tokenizer"
    )
    folder = settings_file.parent
    settings = _json_object(settings_file)
    template = settings.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    default, tool_use = chat_templates(template)
    template = {"default": default, "tool_use": tool_use} if tool_use else default
    special = conversations.special_tokens_of(settings)
    # the special tokens tokenizer_config.json adds beside tokenizer.json's
    texts = [
        added.get("content")
        for added in (settings.get("added_tokens_decoder") or {}).values()
        if isinstance(added, dict) and added.get("special")
    ]
    if not (folder / "tokenizer.json").is_file():
        return TokenizerView(name, template, special, [*special.values(), *texts], None)
    from tokenizers import Tokenizer

    core = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return _core_view(name, template, special, core, texts)


def _core_view(
    name: str, template: Any, special: dict[str, str], core: Any, texts: Any
) -> TokenizerView:
    def encode(batch: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        return [(e.ids, e.offsets) for e in core.encode_batch(batch, add_special_tokens=False)]

    added = [token.content for token in core.get_added_tokens_decoder().values() if token.special]
    leading = leading_special_ids(
        core.encode("a", add_special_tokens=True).ids,
        core.encode("a", add_special_tokens=False).ids,
    )
    return TokenizerView(name, template, special, [*added, *texts], encode, tuple(leading))


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError("model.tokenizer", f"cannot read {path}: {exc}", "fix the file") from None
    return value if isinstance(value, dict) else {}


def first_columns(config: RunConfig) -> tuple[str, ...] | None:
    """The columns of the training data's first record, None when it cannot be read here."""
    try:
        for _, record in _records(config.data.dataset, config.data.split, config.data, [1]):
            return tuple(record)
    except (UserError, OSError, ValueError):
        return None
    return None


def _records(
    source: str | list[str], split: str, data: Any, budget: list[int]
) -> Iterator[tuple[str, dict]]:
    """(where, record) of a dataset, as far as the budget (BUDGET[0] bytes, shared) goes. A
    stream's training data (data.streaming) is read on the first records of each file (each its
    own share of the budget), and the budget then counts as spent: what was read is a sample."""
    streamed = data.streaming and source == data.dataset
    folder = saved_folder(source)
    prepared = None
    if streamed and hub_layout_folder(source):
        yield from _stream_folder_records(source, data, split)
        budget[0] = 0
        return
    if folder is not None:
        prepared = saved_dataset(folder, "data.dataset")
    elif not is_local(source):
        prepared = check_hub_dataset(source, data.dataset_config, "data.dataset")
        if prepared is None:
            return
    if prepared is not None:
        yield from _prepared_records(prepared, split, budget)
        return
    files = [Path(item).expanduser() for item in expand_files(source, "data.dataset")]
    fmt = local_format([str(f) for f in files], "data.dataset")
    shared = budget
    for path in files:
        if streamed:
            budget = [max(STREAM_FILE_MIN_BYTES, min(STREAM_FILE_BYTES, shared[0] // len(files)))]
        if fmt == "arrow":
            yield from _arrow_records(path, budget)
        elif fmt == "json":
            yield from _json_records(path, budget)
        elif fmt == "parquet":
            yield from _parquet_records(path, budget)
        elif fmt == "csv":
            with open_text(path, encoding="utf-8-sig", newline="") as handle:
                reader = csv.DictReader(handle)
                for record in reader:
                    yield f"line {reader.line_num} of {path}", record
                    budget[0] -= sum(len(str(v)) for v in record.values())
                    if budget[0] <= 0:
                        return
        else:
            with open_text(path) as handle:
                for number, line in enumerate(handle, 1):
                    yield f"line {number} of {path}", {"text": line.rstrip("\n")}
                    budget[0] -= len(line)
                    if budget[0] <= 0:
                        break
            if budget[0] <= 0 and not streamed:
                return
    if streamed:
        shared[0] = 0


def _arrow_records(path: Path, budget: list[int]) -> Iterator[tuple[str, dict]]:
    from dplaunch.data.streams import Shard, parse_raw, read_raw

    shard = Shard(str(path), "arrow")
    for number, (raw, _) in enumerate(read_raw(shard, 0, 0)):
        record = parse_raw(shard, raw, number)
        yield f"row {number + 1} of {path}", record
        budget[0] -= len(json.dumps(record, default=str))
        if budget[0] <= 0:
            return


def _stream_folder_records(folder: str, data: Any, split: str) -> Iterator[tuple[str, dict]]:
    """The first records of each shard of a hub-layout folder, as `datasets` streams them."""
    from dplaunch.data.checks import STREAM_SHARD_RECORDS, STREAM_SHARDS_CHECKED
    from dplaunch.data.streams import hub_shards, parse_raw, read_raw

    for shard in hub_shards(folder, data.dataset_config, split)[:STREAM_SHARDS_CHECKED]:
        for number, (raw, _) in enumerate(read_raw(shard, 0, 0)):
            if number == STREAM_SHARD_RECORDS:
                break
            yield f"record {number + 1} of {shard.name}", parse_raw(shard, raw, number)


def _json_records(path: Path, budget: list[int]) -> Iterator[tuple[str, dict]]:
    with open_text(path, encoding="utf-8-sig") as handle:
        first = handle.readline()
        try:
            record = json.loads(first) if first.strip() else None
        except ValueError:
            record = None
        if not isinstance(record, dict):  # one JSON document (an array of records)
            handle.seek(0)
            try:
                document = json.load(handle)
            except ValueError:
                return  # checks.py has named what is wrong with it
            for number, item in enumerate(document if isinstance(document, list) else [], 1):
                if isinstance(item, dict):
                    yield f"record {number} of {path}", item
            return
        yield f"line 1 of {path}", record
        budget[0] -= len(first)
        for number, line in enumerate(handle, 2):
            if budget[0] <= 0:
                return
            budget[0] -= len(line)
            if line.strip():
                yield f"line {number} of {path}", json.loads(line)


def _parquet_records(path: Path, budget: list[int]) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    row = 1
    for group in range(parquet.metadata.num_row_groups):
        table = parquet.read_row_group(group)
        for record in table.to_pylist():
            yield f"row {row} of {path}", record
            row += 1
        budget[0] -= table.nbytes
        if budget[0] <= 0:
            return


def _prepared_records(prepared: Any, split: str, budget: list[int]) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa

    files = prepared.split(split, "data.split").files
    row = 0
    for path in files:
        with pa.memory_map(str(path)) as source:
            for batch in pa.ipc.open_stream(source):
                for record in batch.to_pylist():
                    yield prepared.row(split, row), record
                    row += 1
                budget[0] -= batch.nbytes
                if budget[0] <= 0:
                    return
