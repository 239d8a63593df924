"""Mixtures of datasets (data.mixture): a user mixes a large source of plain reviews with a small
one of shouted "ZZ" texts, 0.8 to 0.2, and each trains its share, on any rank count, after a
resume, streamed or cached; `dplaunch data` says what the first steps train of each; a bad row
is one line naming its source. In-process: the ranks' batchers on 1 and 2 data-parallel shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.helpers import TINY_LLAMA, refusal_line, run_cli, run_config

# a global batch of 8 rows: 130 steps are 1,040 trained samples
GLOBAL_BATCH, STEPS = 8, 130
# the byte-level tokenizer's id of "Z" (its symbols sorted after 3 special tokens)
Z = 60


def _sources(folder: Path, bad_line: int | None = None) -> tuple[Path, Path]:
    """300 plain reviews (text) and 40 texts of Z's (in column `body`); BAD_LINE: that line of
    the small one has no body."""
    rng = np.random.default_rng(0)
    big, small = folder / "reviews.jsonl", folder / "shouts.jsonl"
    big.write_text(
        "".join(
            json.dumps({"text": "nice one " * int(rng.integers(1, 5))}) + "\n" for _ in range(300)
        )
    )
    lines = [json.dumps({"body": "ZZ " * int(rng.integers(1, 5)) + str(i)}) for i in range(40)]
    if bad_line is not None:
        lines[bad_line - 1] = json.dumps({"title": "no body here"})
    small.write_text("\n".join(lines) + "\n")
    return big, small


def _run_file(folder: Path, **data: object) -> Path:
    big, small = _sources(folder, data.pop("bad_line", None))  # type: ignore[arg-type]
    spec = yaml.safe_load(TINY_LLAMA.read_text())
    spec["data"] = {
        "mixture": [
            {"dataset": str(big), "weight": 0.8},
            {"dataset": str(small), "weight": 0.2, "text_column": "body"},
        ],
        "max_length": 32,
        "packing": False,
        **data,
    }
    spec["train"].update(global_batch_size=GLOBAL_BATCH, max_steps=STEPS)
    path = folder / "mix.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _cached_batcher(config, dp_rank: int = 0, dp: int = 1):
    from dplaunch.data.mixture import source_data
    from dplaunch.train.data import Sharding, load_splits, tokenize
    from dplaunch.train.mixture import MixtureBatcher, joined
    from dplaunch.train.modeling import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    parts = []
    for source in config.data.mixture:
        data = source_data(config.data, source)
        parts.append(tokenize(load_splits(data, 7)[0], tokenizer, data, "causal-lm"))
    sharding = Sharding(dp_rank, dp, 2, GLOBAL_BATCH // dp // 2)
    weights = [source.weight for source in config.data.mixture]
    return MixtureBatcher(
        joined(parts),
        sharding,
        [len(p) for p in parts],
        weights,
        pad_id=0,
        task="causal-lm",
        seed=7,
    )


def _stream_batcher(config, dp_rank: int = 0, dp: int = 1, resume_from=None):
    from dplaunch.train.data import Sharding
    from dplaunch.train.mixture_stream import MixedLanes
    from dplaunch.train.modeling import load_tokenizer
    from dplaunch.train.streaming import StreamBatcher

    tokenizer = load_tokenizer(config.model)
    lanes = MixedLanes(config.data, "causal-lm", tokenizer, GLOBAL_BATCH, 7)
    return StreamBatcher(
        lanes,
        config.data,
        tokenizer,
        Sharding(dp_rank, dp, 2, GLOBAL_BATCH // dp // 2),
        total_over_ranks=lambda tokens: tokens,
        writes_position=True,
        resume_from=resume_from,
    )


def _rows(batchers, steps: range) -> list[list[tuple[int, ...]]]:
    """Each step's rows over every data-parallel shard, in rank order: their tokens."""
    out = []
    for step in steps:
        rows = []
        for batcher in batchers:
            for batch in batcher.micro_batches(step):
                ids, mask = batch["input_ids"], batch["attention_mask"]
                rows += [tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask, strict=True)]
        out.append(rows)
    return out


def _shouted_share(steps: list[list[tuple[int, ...]]]) -> float:
    rows = [row for step in steps for row in step]
    return sum(Z in row for row in rows) / len(rows)


@pytest.mark.parametrize(
    "streamed, packed",
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["cached", "streamed", "cached-packed", "streamed-packed"],
)
def test_a_mixture_trains_each_source_at_its_weight_on_1_or_2_ranks_and_after_a_resume(
    tmp_path, streamed, packed
):
    # packed: a row is a block of one source's texts (never two sources' in one block)
    keys = [*(["data.streaming=true"] if streamed else []), f"data.packing={str(packed).lower()}"]
    config = run_config(_run_file(tmp_path), *keys)
    make = _stream_batcher if streamed else _cached_batcher
    one = _rows([make(config)], range(STEPS))
    # 1,040 samples: the small source (40 texts) trains 20 %, repeated over 5 of its epochs
    assert sum(len(step) for step in one) == STEPS * GLOBAL_BATCH
    assert abs(_shouted_share(one) - 0.2) <= 0.02
    if packed:  # a block holds Z's throughout or none: one source's texts
        blocks = [row for step in one for row in step]
        assert all(Z in row[:8] and Z in row[-8:] for row in blocks if Z in row)
    assert all(0 < sum(Z in row for row in step) < GLOBAL_BATCH for step in one[:20])
    # 2 data-parallel ranks train the same rows, each its contiguous half of every step
    two = _rows([make(config, 0, 2), make(config, 1, 2)], range(STEPS))
    assert two == one
    if not streamed:  # the position is the step: a new batcher from step 70 goes on the same
        assert _rows([make(config)], range(70, STEPS)) == one[70:]
        return
    # a stream: rank r's checkpoint holds its lanes' position; 1 rank resumes 2 ranks' step 70
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    ranks = [make(config, 0, 2), make(config, 1, 2)]
    _rows(ranks, range(70))
    for batcher in ranks:
        batcher.save_position(checkpoint)
    resumed = make(config, resume_from=(checkpoint, 70))
    assert _rows([resumed], range(70, STEPS)) == one[70:]


def test_the_schedule_gives_each_source_its_share_within_a_sample_a_lane():
    from dplaunch.data.mixture import MixtureSchedule

    schedule = MixtureSchedule((5.0, 3.0, 2.0), 16, seed=1)
    for steps in (1, 7, 100, 1001):
        draws = schedule.draws_before(steps)
        assert (draws.sum(axis=0) == steps).all()  # every lane drew one source a step
        expected = np.array([0.5, 0.3, 0.2])[:, None] * steps
        assert np.abs(draws - expected).max() < 2
    # the lanes are out of step: each global batch holds about its share of each source
    per_step = [np.bincount(schedule.step_sources(step)[0], minlength=3) for step in range(50)]
    assert all(abs(counts[0] - 8) <= 2 for counts in per_step), per_step


def test_dplaunch_data_says_what_the_first_steps_train_of_each_source(tmp_path):
    run_file = _run_file(tmp_path)
    result = run_cli("data", run_file, "--json", "--show", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    mixture = report["mixture"]
    assert report["steps"] == STEPS and len(report["sources"]) == 2
    assert [entry["weight"] for entry in mixture] == [0.8, 0.2]
    assert sum(entry["examples"] for entry in mixture) == STEPS * GLOBAL_BATCH
    # what the ranks' batcher trains in those steps, source by source (EOS counted: the text's)
    rows = [
        row for step in _rows([_cached_batcher(run_config(run_file))], range(STEPS)) for row in step
    ]
    shouted = [row for row in rows if Z in row]
    assert mixture[1]["examples"] == len(shouted)
    assert mixture[1]["tokens"] == sum(map(len, shouted))
    assert mixture[0]["tokens"] == sum(map(len, rows)) - mixture[1]["tokens"]
    assert mixture[1]["epochs"] == pytest.approx(len(shouted) / 40, abs=1e-4)


def test_a_bad_row_of_a_source_is_one_line_naming_the_source_and_its_line(tmp_path):
    run_file = _run_file(tmp_path, bad_line=7)
    result = run_cli("train", run_file, "--cpu", "--dry-run")
    line = refusal_line(result, "data.mixture[1].text_column", "line 7 of ")
    assert str(tmp_path / "shouts.jsonl") in line and "'body'" in line, line


@pytest.mark.parametrize(
    "assignments, field, words",
    [
        (["data.dataset=x.jsonl"], "data.mixture", "is set beside data.dataset"),
        (["data.mixture=null"], "data.dataset", "is unset, and so is data.mixture"),
        (
            ["data.eval_fraction=0.1", "data.eval_dataset=x.jsonl"],
            "data",
            "set only one of data.eval_split, data.eval_dataset, data.eval_fraction and data.eval_datasets",
        ),
        (["train.early_stopping={}"], "train.early_stopping", "this run has no evaluation set"),
        (
            [
                "data.eval_fraction=0.1",
                "train.eval_every=2",
                "train.early_stopping.metric=eval_acc",
            ],
            "train.early_stopping.metric",
            "'eval_acc' is not logged by this run's evaluations — use one of eval_loss, ",
        ),
        (["train.export_last=true"], "train.export_last", "without train.keep_best"),
        (["data.eval_split=test"], "data.eval_split", "a mixture has several datasets"),
    ],
    ids=[
        "dataset-and-mixture",
        "neither",
        "two-eval-keys",
        "no-eval",
        "unlogged-metric",
        "export-last-alone",
        "mixture-eval-split",
    ],  # fmt: skip
)
def test_what_cannot_work_together_is_refused_in_one_line(tmp_path, assignments, field, words):
    run_file = _run_file(tmp_path)
    sets = [item for assignment in assignments for item in ("--set", assignment)]
    result = run_cli("plan", run_file, "--gpus", "1", *sets)
    refusal_line(result, field, words)
