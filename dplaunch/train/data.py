"""Data: load with `datasets`, tokenise (pack for causal LM), and cut deterministic batches.

Batch order does not depend on the GPU count: each epoch is a seeded permutation, each optimizer
step takes the next `global_batch_size` samples, and micro-batch j of a step is always the same
samples. A data-parallel rank takes its own contiguous run of micro-batches; tensor-parallel
ranks of one group take the same ones. So a 2-rank run computes exactly the micro-batches a
1-rank run does, and a resumed run continues with exactly the next batch.

Speed: packed causal-LM blocks are stored as one int32 column of equal-length rows, and a
micro-batch is one gather from zero-copy [samples, length] views of that Arrow column's chunks
(no Python int per token, no copy of the corpus), so cutting batches costs microseconds next to a
training step.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import socket
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dplaunch.config.schema import DataConfig
from dplaunch.data import answer_spans, conversations, example_tokens, preference, sft_examples
from dplaunch.data.answer_spans import Renderer, TemplateError
from dplaunch.data.arrow_datasets import hub_layout_folder, saved_folder
from dplaunch.data.conversations import TEXT
from dplaunch.data.example_tokens import IGNORE_INDEX, leading_special_ids, pack_runs
from dplaunch.data.formats import class_number, expand_files, is_local, label_ids, local_format
from dplaunch.data.preference import REFERENCE_COLUMNS, RESPONSES
from dplaunch.data.sft_examples import SftExamples, TokenizerView, make_renderer
from dplaunch.tasks import task_of


def load_splits(data: DataConfig, seed: int) -> tuple[Any | None, Any | None]:
    """(train, eval or None) as `datasets.Dataset`s; train is None with data.streaming (read
    while training: dplaunch/train/streaming.py), whose evaluation set is read whole here."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    def load(source: str | list[str], split: str) -> Any:
        folder = saved_folder(source)
        if folder is not None:  # written by save_to_disk: a Dataset, or a DatasetDict's split
            saved = load_from_disk(str(folder))
            return saved[split] if isinstance(saved, DatasetDict) else saved
        if is_local(source) and not hub_layout_folder(source):
            files = [str(Path(item).expanduser()) for item in expand_files(source, "data.dataset")]
            return load_dataset(
                local_format(files, "data.dataset"), data_files=files, split="train"
            )
        return load_dataset(source, data.dataset_config, split=split)

    train = None if data.streaming else load(data.dataset, data.split)
    evaluation = None
    if data.eval_dataset is not None:
        evaluation = load(data.eval_dataset, "train")
    elif data.eval_split is not None:
        evaluation = load(data.dataset, data.eval_split)
    elif data.eval_fraction is not None:
        parts = train.train_test_split(test_size=data.eval_fraction, seed=seed, shuffle=True)
        train, evaluation = parts["train"], parts["test"]
    return train, evaluation


# tokenised datasets are cached next to the `datasets` cache of their source, under this prefix
TOKENIZED_PREFIX = "dplaunch-tokenized-"


def tokenized_cache_file(dataset: Any, tokenizer: Any, data: DataConfig, task: str) -> Path | None:
    """Where the tokenised form of DATASET is cached, or None when it cannot be cached safely.

    The name is a digest of everything the tokens depend on: the source dataset's `datasets`
    fingerprint (changes with the files' contents, the split, the eval_fraction cut), the
    tokenizer's full definition, the data fields that shape the tokens, the task and the source of
    tokenize() itself, so a change to any of them is a new file, never a stale one. No cache for
    datasets held only in memory, tokenizers without a serialisable definition (slow, Python
    ones), when `datasets` caching is off, or when the cache folder is not writable.
    """
    import datasets

    fingerprint = getattr(dataset, "_fingerprint", None)
    files = getattr(dataset, "cache_files", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not (datasets.is_caching_enabled() and fingerprint and files and backend is not None):
        return None
    folder = Path(files[0]["filename"]).parent
    if not os.access(folder, os.W_OK):
        return None
    definition = json.loads(backend.to_str())
    # transformers sets these per call (truncation=True, max_length…): not part of the tokenizer
    definition.pop("truncation", None)
    definition.pop("padding", None)
    key = {
        "dataset": fingerprint,
        "tokenizer": definition,
        "tokenizer_class": type(tokenizer).__name__,
        "eos": tokenizer.eos_token_id,
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "data": data.model_dump(
            include={
                "text_column",
                "text_pair_column",
                "label_column",
                "label_names",
                "max_length",
                "packing",
                "format",
                "loss_on",
                "truncation",
                "tools",
                "chat_template_kwargs",
            }
        ),
        # the template's text, not its file's name
        "chat_template": sft_renderer(tokenizer, data).template if task_of(task).examples else None,
        "task": task,
        "code": _tokenize_source(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{TOKENIZED_PREFIX}{digest}.arrow"


def _tokenize_source() -> str:
    # the code that makes the tokens and labels; an install without sources falls back to the
    # version
    try:
        return (
            inspect.getsource(tokenize)
            + inspect.getsource(row_encoder)
            + inspect.getsource(class_number)
            + inspect.getsource(_sft_rows)
            + inspect.getsource(_pair_rows)
            + inspect.getsource(tokenizer_view)
            + "".join(
                inspect.getsource(module)
                for module in (
                    conversations,
                    answer_spans,
                    example_tokens,
                    sft_examples,
                    preference,
                )
            )
        )
    except OSError:
        from dplaunch import __version__

        return __version__


def tokenize(
    dataset: Any, tokenizer: Any, data: DataConfig, task: str, cache_file: Path | None = None
) -> Any:
    """Token ids (and labels) ready for batching; causal-LM texts are packed into full blocks.

    Two passes. Rows are tokenised one by one, in `data.num_workers` processes when set; then one
    process assembles the result (packing cuts each run of 10,000 rows into blocks), so the tokens
    do not depend on the worker count. With CACHE_FILE (see tokenized_cache_file) the result is
    read from it when it exists, else written there (the row pass goes to a temporary file beside
    it, removed afterwards); without, everything stays in memory."""
    from datasets import Dataset

    if cache_file is not None and cache_file.is_file():
        return Dataset.from_file(str(cache_file))
    workers = data.num_workers if data.num_workers > 1 else None
    task = data_task(task, data, dataset.column_names)
    packing = packs_texts(task, data)
    packing_examples = task_of(task).examples and task_of(task).packs(data.packing)
    encode = row_encoder(tokenizer, data, task, dataset.column_names)

    def pack(batch: Any) -> dict[str, Any]:
        # one flat int32 array of the rows' tokens cut into full blocks (no Python int per token)
        column = batch.column("input_ids").combine_chunks()
        offsets = column.offsets.to_numpy()
        flat = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        usable = (len(flat) // data.max_length) * data.max_length
        return {"input_ids": flat[:usable].astype(np.int32).reshape(-1, data.max_length)}

    def store(name: Path | None) -> dict[str, Any]:
        if name is None:
            return {"keep_in_memory": True}
        return {
            "keep_in_memory": False,
            "cache_file_name": str(name),
            "load_from_cache_file": False,
            "new_fingerprint": hashlib.sha256(str(name).encode()).hexdigest()[:32],
        }

    # the row pass's file is this process's own: ranks of several nodes may share the folder
    rows_file = (
        cache_file.with_name(f"{cache_file.stem}-rows-{socket.gethostname()}-{os.getpid()}.arrow")
        if cache_file is not None
        else None
    )
    rows = dataset.map(
        encode,
        batched=True,
        remove_columns=dataset.column_names,
        num_proc=workers,
        desc="tokenising",
        **store(rows_file),
    )
    try:
        if packing:
            # packing concatenates across rows: 10,000-row runs lose little at block edges
            assembled = rows.with_format("arrow").map(
                pack, batched=True, batch_size=10_000, desc="packing", **store(cache_file)
            )
        elif packing_examples:
            # whole examples into blocks of at most max_length, chosen within 10,000-row runs
            assembled = rows.with_format("arrow").map(
                lambda batch: pack_examples(batch, data.max_length),
                batched=True,
                batch_size=example_tokens.PACKING_RUN,
                desc="packing examples",
                **store(cache_file),
            )
        else:
            assembled = rows.map(batched=True, desc="storing", **store(cache_file))
        return assembled.with_format(None)
    finally:
        if rows_file is not None:
            # only the row pass's own files (one per worker): an empty map hands back its source's
            for entry in rows.cache_files:
                path = Path(entry["filename"])
                if path.name.startswith(rows_file.stem):
                    path.unlink(missing_ok=True)


def packs_texts(task: str, data: DataConfig) -> bool:
    """Whether causal-LM texts are concatenated into full max_length blocks (unset: yes)."""
    facts = task_of(task)
    return facts.packs_by_default and facts.packs(data.packing)


def row_encoder(tokenizer: Any, data: DataConfig, task: str, columns: list[str]) -> Any:
    """The row pass: a batch of records (column → values, as `datasets.map` gives it) → their
    input_ids (and labels). sft leaves out the examples it drops; the other tasks keep one row
    per record. The cached path maps the whole dataset with it, a stream each worker's records."""
    task = data_task(task, data, columns)
    facts = task_of(task)
    if facts.own_labels:  # examples: their answers are the labels
        return _sft_rows(tokenizer, data, columns)
    if facts.pairs:
        return _pair_rows(tokenizer, data)
    if facts.prompts:
        return _prompt_rows(tokenizer, data)
    packing = packs_texts(task, data)
    eos = tokenizer.eos_token_id
    ids = label_ids(data.label_names)

    def label(value: Any) -> int:
        number = class_number(value, ids)
        if number is None:  # past the launch check's budget (DPLAUNCH_DATA_CHECK_MB)
            named = " nor one of data.label_names" if ids else ""
            raise ValueError(
                f"{value!r} in column {data.label_column!r} is not a class number{named}"
            )
        return number

    def encode(batch: dict[str, list]) -> dict[str, list]:
        if facts.classifies:
            pair = batch[data.text_pair_column] if data.text_pair_column else None
            out = tokenizer(
                batch[data.text_column], pair, truncation=True, max_length=data.max_length
            )
            return {
                "input_ids": out["input_ids"],
                "labels": [label(x) for x in batch[data.label_column]],
            }
        rows = tokenizer(batch[data.text_column], add_special_tokens=False)["input_ids"]
        rows = [row + [eos] if eos is not None else row for row in rows]
        return {"input_ids": rows if packing else [row[: data.max_length] for row in rows]}

    return encode


def data_task(task: str, data: DataConfig, columns: list[str]) -> str:
    """The task the data is made for: sft on plain texts is causal-LM packing, as today
    (Task.texts_train_as)."""
    plain = task_of(task).texts_train_as
    if plain and conversations.resolve_format(data.format, columns, data.text_column) == TEXT:
        return plain
    return task


def for_evaluation(data: DataConfig, task: str) -> DataConfig:
    """The data settings of the evaluation set: sft examples one per row (never packed), so the
    evaluation loss and the sample answers are per example on every attention backend."""
    return data if task_of(task).packs_evaluation else data.model_copy(update={"packing": False})


def tokenizer_view(tokenizer: Any) -> TokenizerView:
    """What the sft pipeline needs of an HF tokenizer (sft_examples.TokenizerView)."""
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
    named = {name: getattr(tokenizer, name, None) for name in names}
    named = {name: value for name, value in named.items() if isinstance(value, str)}
    special = [added.content for added in tokenizer.added_tokens_decoder.values() if added.special]

    def encode(texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(out["input_ids"], out["offset_mapping"], strict=True))

    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return TokenizerView(
        name, tokenizer.chat_template, named, special, encode, tuple(leading_ids(tokenizer))
    )


def leading_ids(tokenizer: Any) -> list[int]:
    """The special tokens `tokenizer(text)` puts before a text (a BOS), as a prompt given as text
    is read at inference."""
    return leading_special_ids(
        tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    )


def sft_renderer(tokenizer: Any, data: DataConfig) -> Renderer:
    """The run's chat template renderer (sft_examples.make_renderer) for an HF tokenizer."""
    return make_renderer(data, tokenizer_view(tokenizer))


def attach_chat_template(tokenizer: Any, data: DataConfig, task: str) -> None:
    """Give the tokenizer the run's chat template, so the exported tokenizer renders prompts as
    training did (apply_chat_template)."""
    if task_of(task).examples and data.chat_template:
        tokenizer.chat_template = conversations.read_chat_template(data.chat_template)


def sft_examples_of(tokenizer: Any, data: DataConfig, columns: list[str]) -> SftExamples:
    """The run's records → tokens pipeline (sft_examples.SftExamples) with an HF tokenizer."""
    return SftExamples.of(data, columns, tokenizer_view(tokenizer))


def sft_example(pipeline: SftExamples, record: dict) -> answer_spans.Example:
    """RECORD rendered; a ValueError naming it when the ranks cannot train on it (the launch
    check reads within its budget only)."""
    try:
        return pipeline.example(record)
    except TemplateError as error:
        raise ValueError(f"a record {error}: {json.dumps(record, default=str)[:200]}") from None


def _sft_rows(tokenizer: Any, data: DataConfig, columns: list[str]) -> Any:
    """The row pass of sft: records → input_ids and labels (IGNORE_INDEX where not trained)."""
    pipeline = sft_examples_of(tokenizer, data, columns)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        records = [
            dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)
        ]
        encoded = pipeline.tokens([sft_example(pipeline, record) for record in records])
        return {"input_ids": encoded.input_ids, "labels": encoded.labels}

    return encode


def preference_examples_of(tokenizer: Any, data: DataConfig) -> preference.PreferenceExamples:
    """The run's preference records → tokens pipeline (data/preference.py) with an HF tokenizer."""
    return preference.PreferenceExamples.of(data, tokenizer_view(tokenizer))


def preference_pair(
    pipeline: preference.PreferenceExamples, record: dict
) -> tuple[answer_spans.Example, answer_spans.Example]:
    """RECORD's two responses rendered; a ValueError naming it when the ranks cannot train on it
    (the launch check reads within its budget only)."""
    problem = preference.pair_problem(record)
    try:
        if problem is not None:
            raise TemplateError(" — ".join(part for part in problem if part))
        return pipeline.examples(record)
    except TemplateError as error:
        raise ValueError(f"a record {error}: {json.dumps(record, default=str)[:200]}") from None


def _pair_rows(tokenizer: Any, data: DataConfig) -> Any:
    """The row pass of dpo: preference records → each response's input_ids and labels
    (IGNORE_INDEX where not trained), a pair kept or left out whole (data/preference.py)."""
    pipeline = preference_examples_of(tokenizer, data)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        records = [
            dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)
        ]
        pairs = [preference_pair(pipeline, record) for record in records]
        return pipeline.tokens(pairs).columns

    return encode


def _prompt_rows(tokenizer: Any, data: DataConfig) -> Any:
    """The row pass of grpo: prompt records → the prompt's input_ids, with every column of the
    record kept as it is (the reward functions read the prompt and the others)."""
    from dplaunch.data.prompts import PromptExamples

    pipeline = PromptExamples.of(data, tokenizer_view(tokenizer))

    def encode(batch: dict[str, list]) -> dict[str, list]:
        records = [
            dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)
        ]
        try:
            ids = [pipeline.ids(record)[0] for record in records]
        except TemplateError as error:
            raise ValueError(f"a record's prompt {error}") from None
        return {**batch, "input_ids": ids}

    return encode


def pack_examples(batch: Any, max_length: int) -> dict[str, list]:
    """Whole examples of an Arrow BATCH into blocks of at most MAX_LENGTH tokens (pack_rows)."""
    ids = batch.column("input_ids").to_pylist()
    labels = batch.column("labels").to_pylist()
    blocks, _ = pack_rows(ids, labels, max_length)
    return blocks


def pack_rows(
    ids: list[list[int]], labels: list[list[int]], max_length: int
) -> tuple[dict[str, list], list[list[int]]]:
    """Whole examples into blocks of at most MAX_LENGTH tokens (example_tokens.pack_runs), with
    position ids that restart at each example: the attention of every backend keeps the examples
    apart from them (see Batcher.collate). Also each block's examples (indices into IDS)."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    members_of_blocks = pack_runs([len(row) for row in ids], max_length)
    for members in members_of_blocks:
        out["input_ids"].append([t for i in members for t in ids[i]])
        out["labels"].append([t for i in members for t in labels[i]])
        out["position_ids"].append([p for i in members for p in range(len(ids[i]))])
    return out, members_of_blocks


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The real (not padding) tokens of a micro-batch. Packed sft rows carry no attention mask:
    their padding has position 0 each, and a packed example has 2 tokens or more, so a row's
    tokens end at its last position above 0."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    positions = batch["position_ids"]
    width = positions.shape[-1]
    last = width - 1 - (positions > 0).flip(-1).int().argmax(-1)
    return int((last + 1).sum())


def set_loss_scales(
    batches: list[dict[str, torch.Tensor]],
    tokens: list[int],
    total: int,
    sharding: Sharding,
    key: str = "loss_scale",
) -> None:
    """Give each micro-batch its loss_scale (KEY) n·accum·dp / N: n its TOKENS, N the TOTAL of
    the whole step over every data-parallel rank (Batcher._weight_by_tokens says why)."""
    copies = sharding.gradient_accumulation_steps * sharding.data_parallel_size
    total = max(total, 1)
    for batch, count in zip(batches, tokens, strict=True):
        # integer numerator: exactly 1.0 when every micro-batch holds as many tokens
        batch[key] = torch.tensor(count * copies / total, dtype=torch.float32)


def collate_blocks(blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """Equal-length causal-LM blocks [rows, length]: no padding, every token a label."""
    input_ids = torch.from_numpy(np.ascontiguousarray(blocks).astype(np.int64))
    attention = torch.ones_like(input_ids)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": input_ids.clone()}


def collate_rows(
    rows: list[dict[str, Any]], *, pad_id: int, task: str, own_labels: bool, flatten_packed: bool
) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch of rows (input_ids, and labels/position_ids where they have them);
    causal-LM labels are the inputs with padding ignored."""
    if own_labels:
        return _collate_sft(rows, pad_id, flatten_packed)
    if task_of(task).pairs:
        return _collate_pairs(rows, pad_id)
    width = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        input_ids[r, : len(ids)] = ids
        attention[r, : len(ids)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention}
    if task_of(task).classifies:
        batch["labels"] = torch.tensor([int(row["labels"]) for row in rows], dtype=torch.long)
    else:
        batch["labels"] = input_ids.masked_fill(attention == 0, IGNORE_INDEX)
    return batch


def _collate_sft(
    rows: list[dict[str, Any]], pad_id: int, flatten_packed: bool
) -> dict[str, torch.Tensor]:
    """sft rows with their own labels. Packed rows (position ids) get no attention mask, so
    transformers isolates the examples: SDPA/eager build a block-diagonal causal mask from the
    restarting position ids; flash-attention goes varlen from them, which needs one row, so
    there the micro-batch is flattened into one row without padding."""
    packed = "position_ids" in rows[0]
    if packed and flatten_packed:
        rows = [{key: [v for row in rows for v in row[key]] for key in rows[0]}]
    width = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    # padding of packed rows: position 0 each (one-token segments that attend to themselves)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        length = len(row["input_ids"])
        input_ids[r, :length] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        labels[r, :length] = torch.as_tensor(row["labels"], dtype=torch.long)
        attention[r, :length] = 1
        if packed:
            positions[r, :length] = torch.as_tensor(row["position_ids"], dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": labels}
    if packed:
        batch["position_ids"] = positions
    else:
        batch["attention_mask"] = attention
    return batch


def _collate_pairs(rows: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Preference pairs as one batch (one forward): the chosen rows, then the rejected rows,
    right-padded to the longest; the reference's log-probabilities when precomputed."""
    sides = [
        (row[f"{side}_input_ids"], row[f"{side}_labels"]) for side in RESPONSES for row in rows
    ]
    width = max(len(ids) for ids, _ in sides)
    input_ids = torch.full((len(sides), width), pad_id, dtype=torch.long)
    labels = torch.full((len(sides), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(sides), width), dtype=torch.long)
    for r, (ids, row_labels) in enumerate(sides):
        input_ids[r, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        labels[r, : len(ids)] = torch.as_tensor(row_labels, dtype=torch.long)
        attention[r, : len(ids)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
    if REFERENCE_COLUMNS[0] in rows[0]:
        batch["reference_logps"] = torch.tensor(
            [row[column] for column in REFERENCE_COLUMNS for row in rows], dtype=torch.float32
        )
    return batch


@dataclass(frozen=True)
class Sharding:
    """This rank's place in the data: which data-parallel shard it reads."""

    data_parallel_rank: int
    data_parallel_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size


class PackedBlocks:
    """Equal-length rows of an Arrow list column as one [rows, length] view per chunk of it.

    A cached dataset's column is mapped from its file in chunks of 10,000 rows; joining them
    (`combine_chunks`) would copy the whole corpus into every rank's memory (11 GB a rank on a
    2 GB byte-level corpus). The views keep it in the page cache, shared by the node's ranks."""

    def __init__(self, views: list[np.ndarray]):
        self.views = views
        self.starts = np.cumsum([0] + [len(view) for view in views])

    @classmethod
    def of(cls, column: Any) -> PackedBlocks | None:
        """The views of COLUMN (a pyarrow ChunkedArray of int lists), or None when its rows are
        not all of one length."""
        views, width = [], None
        for chunk in column.chunks:
            if len(chunk) == 0:
                continue
            offsets = chunk.offsets.to_numpy()
            width = int(offsets[1] - offsets[0]) if width is None else width
            if width == 0 or chunk.null_count or not np.all(np.diff(offsets) == width):
                return None
            values = chunk.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
            views.append(values.reshape(len(chunk), width))
        return cls(views) if views else None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, indices: list[int]) -> np.ndarray:
        """The rows at INDICES, in that order, as one [len(indices), length] array."""
        chunks = np.searchsorted(self.starts, indices, side="right") - 1
        return np.stack(
            [self.views[c][i - self.starts[c]] for c, i in zip(chunks, indices, strict=True)]
        )


class Batcher:
    """Deterministic batches for training and evaluation on one rank."""

    def __init__(
        self,
        dataset: Any,
        sharding: Sharding,
        *,
        pad_id: int,
        task: str,
        seed: int,
        shuffle: bool = True,
    ):
        self.dataset = dataset
        self.sharding = sharding
        self.pad_id = pad_id
        self.task = task
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = len(dataset) // sharding.global_batch_size
        self._order_epoch, self._order = -1, np.arange(0)
        # sft examples carry their own labels (the answers); packed ones their position ids
        self.own_labels = task_of(task).own_labels and "labels" in (dataset.column_names or ())
        # flash-attention keeps packed examples apart only in one flattened row (varlen from the
        # position ids); set by the loop from the model's attention implementation
        self.flatten_packed = False

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of an epoch: a permutation seeded by (seed, epoch), as one int64
        array (8 bytes a sample; a list of Python ints would take about 36); the dataset's own
        order every epoch without data.shuffle."""
        if not self.shuffle:
            return np.arange(len(self.dataset), dtype=np.int64)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=generator).numpy()

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the optimizer step after STEP steps (any step, in any
        order: the position in the data is the step)."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        if epoch != self._order_epoch:
            self._order_epoch, self._order = epoch, self.epoch_order(epoch)
        return self.step_micro_batches(self._order, in_epoch)

    def epoch_at(self, step: int) -> float:
        """How many epochs STEP steps make (for the log)."""
        return round(step / self.steps_per_epoch, 4)

    def save_position(self, checkpoint: Path) -> None:
        """Nothing to write: the position in the data is the step (checkpoint.json has it)."""

    def step_micro_batches(
        self, order: np.ndarray, step_in_epoch: int
    ) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for one optimizer step."""
        shard = self.sharding
        start = step_in_epoch * shard.global_batch_size
        per_rank = shard.micro_batch_size * shard.gradient_accumulation_steps
        mine = order[
            start + shard.data_parallel_rank * per_rank : start
            + (shard.data_parallel_rank + 1) * per_rank
        ].tolist()
        batches = [
            self.collate(mine[i : i + shard.micro_batch_size])
            for i in range(0, per_rank, shard.micro_batch_size)
        ]
        if not task_of(self.task).classifies and self._packed_blocks is None:
            step = order[start : start + shard.global_batch_size]
            self._weight_by_tokens(batches, mine, step)
        return batches

    @property
    def pairs(self) -> bool:
        """Preference pairs (dpo): a micro-batch holds its pairs' chosen rows, then their
        rejected rows."""
        return task_of(self.task).pairs

    def _weight_by_tokens(
        self, batches: list[dict[str, torch.Tensor]], mine: list[int], step: np.ndarray
    ) -> None:
        """Give each micro-batch of rows of unequal length its loss_scale: n·accum·dp / N, with n
        its predicted tokens and N those of the whole step over every data-parallel rank.

        An HF causal-LM loss is a mean over its micro-batch's tokens. Scaled so, the backward's
        ÷accum (Accelerate, DeepSpeed) and the gradient average over dp ranks leave the mean over
        every token of the global batch, as one big batch would give: the same gradient on any
        rank count and micro-batch size (HF Trainer's num_items_in_batch). Equal-length rows
        (packed blocks) need none: every micro-batch then holds the same number of tokens.

        Preference pairs: the loss is a mean over pairs (every micro-batch holds as many), but
        ORPO's NLL term is a mean over the chosen responses' tokens: their ``nll_scale``."""
        tokens = self._trained_tokens if self.own_labels or self.pairs else self._predicted_tokens
        micro = self.sharding.micro_batch_size
        counts = [int(tokens[mine[i * micro : (i + 1) * micro]].sum()) for i in range(len(batches))]
        key = "nll_scale" if self.pairs else "loss_scale"
        set_loss_scales(batches, counts, int(tokens[step].sum()), self.sharding, key)

    @cached_property
    def _predicted_tokens(self) -> np.ndarray:
        """Tokens each sample's loss averages over (its length less the first, which nothing
        predicts), in dataset order."""
        import pyarrow.compute as pc

        column = self.dataset.with_format("arrow")["input_ids"]  # in select()/shuffle order too
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        return np.maximum(lengths - 1, 0)

    @cached_property
    def _trained_tokens(self) -> np.ndarray:
        """Labels each sft sample's loss averages over (the first is never one; of a pair, the
        chosen response's), in dataset order."""
        import pyarrow.compute as pc

        column = self.dataset.with_format("arrow")["chosen_labels" if self.pairs else "labels"]
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
        return np.bincount(parents[values != IGNORE_INDEX], minlength=len(column)).astype(np.int64)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch of these samples (collate_rows; equal-length blocks in one gather)."""
        blocks = None if self.own_labels else self._packed_blocks
        if blocks is not None:
            return collate_blocks(blocks[indices])
        return collate_rows(
            [self.dataset[i] for i in indices],
            pad_id=self.pad_id,
            task=self.task,
            own_labels=self.own_labels,
            flatten_packed=self.flatten_packed,
        )

    @cached_property
    def _packed_blocks(self) -> PackedBlocks | None:
        """The causal-LM blocks as zero-copy [samples, length] views of the Arrow column, when
        every row has the same length and the dataset is a plain in-order Arrow table; None
        otherwise (rows one by one). Built on first use: computing the epoch order needs none."""
        dataset = self.dataset
        if (
            task_of(self.task).classifies
            or self.own_labels
            or self.pairs
            or not hasattr(dataset, "data")
            or getattr(dataset, "_indices", None) is not None  # a select/shuffle mapping
            or len(dataset) == 0
        ):
            return None
        return PackedBlocks.of(dataset.data.column("input_ids"))

    def eval_rows(self, micro_batch_size: int) -> int:
        """The rows of an evaluation batch. Flash-attention keeps packed examples apart only in a
        batch of one row (transformers reads segments from the position ids only then); training
        flattens a micro-batch into that row, but evaluation sums per row (padded rows weigh
        0), so packed blocks are evaluated one row per forward there."""
        packed = "position_ids" in (self.dataset.column_names or ())
        return 1 if self.flatten_packed and packed else micro_batch_size

    def eval_micro_batches(self, batch_size: int) -> list[tuple[dict[str, torch.Tensor], int]]:
        """This rank's evaluation batches as (batch, real rows). Every rank gets the same number of
        batches (short shards repeat a sample with weight 0), since ZeRO-3 forwards are collective."""
        shard = self.sharding
        total = len(self.dataset)
        mine = list(range(shard.data_parallel_rank, total, shard.data_parallel_size))
        longest = -(-total // shard.data_parallel_size)
        batches = []
        for start in range(0, longest, batch_size):
            chunk = mine[start : start + batch_size]
            real = len(chunk)
            wanted = min(batch_size, longest - start)
            chunk = chunk + [0] * (wanted - real)
            batches.append((self.collate(chunk), real))
        return batches
