"""data.streaming on real gloo ranks: the same per-step losses as the cached path on the same
data and order (1 and 2 ranks), and a stream stopped mid-way continues exactly, on the same and
on another rank count (2 → 1: each lane restarts where the checkpoint's position file says).

Three sets of runs, each shared by its tests (a launch costs ~10 s): causal-LM texts one a
sample in file order (cached and streamed on 2 ranks, a 1-rank resume of the stream, a stream
on 2 tensor-parallel ranks), packed texts shuffled over 4 gzip files (2 ranks and a 2-rank resume), and sft
conversations (cached and streamed, 2 ranks; packed and shuffled, 2 ranks and a 1-rank resume).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import (
    REPO,
    SFT_CONFIG,
    max_relative_gap,
    read_metrics,
    train,
    write_config,
)

pytestmark = pytest.mark.multiprocess

STEPS = ("--max-steps", "6", "--global-batch", "8", "--micro-batch", "2")
STREAM = ("--set", "data.streaming=true")
# every launch of a stream checkpoints at step 3, where the resumed launches start
AT_3 = ("--set", "train.checkpoint_every=3")


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["type"] == "train"}


def resumed(source: Path, run_dir: Path, run_file: Path, *flags: str) -> Path:
    """A new run continuing SOURCE's step-3 checkpoint."""
    train(run_dir, *flags, "--resume", source / "checkpoints" / "step-3", config=run_file)
    return run_dir


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory) -> dict[str, Path]:
    """Reviews, one text a sample, in file order: cached on 2 ranks; streamed on 2 (one data
    loader worker each); the 2-rank stream resumed at step 3 on 1 rank (steps 4-6); streamed on
    2 tensor-parallel ranks."""
    folder = tmp_path_factory.mktemp("texts")
    data = folder / "reviews.jsonl"
    data.write_text(
        "\n".join((REPO / "dplaunch/resources/data/reviews.jsonl").read_text().splitlines()[:200])
        + "\n"
    )
    keys = {"dataset": str(data), "eval_fraction": None, "packing": False, "shuffle": False}
    run_file = write_config(folder / "texts.yaml", data=keys)
    two = ("--cpu", "--gpus", "2", *STEPS)
    runs = {name: folder / name for name in ("cached", "stream-2", "resumed-1", "stream-tp2")}
    train(runs["cached"], *two, config=run_file)
    result = train(
        runs["stream-2"], *two, *STREAM, *AT_3, "--set", "data.num_workers=1", config=run_file
    )
    (folder / "stream-2.log").write_text(result.stdout)
    resumed(runs["stream-2"], runs["resumed-1"], run_file, "--cpu", "--gpus", "1", *STEPS, *STREAM)
    # tensor-parallel peers must read the same rows (DeepSpeed checks it at the first forward)
    train(runs["stream-tp2"], "--cpu", "--gpus", "2", "--tp", "2", *STEPS, *STREAM, config=run_file)
    return runs


def test_a_stream_trains_with_the_cached_paths_losses_on_2_ranks(text_runs):
    cached = losses(text_runs["cached"])
    assert sorted(cached) == [1, 2, 3, 4, 5, 6]
    assert losses(text_runs["stream-2"]) == cached  # the same batches, bit for bit


def test_tensor_parallel_peers_read_the_same_stream_and_count_its_tokens_once(text_runs):
    # dp 1 × tp 2: one lane set for both ranks; the loss weights count the rows once
    tp, cached = losses(text_runs["stream-tp2"]), losses(text_runs["cached"])
    assert sorted(tp) == sorted(cached)
    assert max_relative_gap(list(tp.values()), list(cached.values())) < 1e-3  # as tp vs DP


def test_a_stream_stopped_on_2_ranks_continues_on_1_rank_with_the_straight_losses(text_runs):
    checkpoint = text_runs["stream-2"] / "checkpoints" / "step-3"
    # each data-parallel rank wrote where its lanes stand
    positions = sorted(path.name for path in checkpoint.glob("data-position-*.json"))
    assert positions == ["data-position-0.json", "data-position-1.json"]
    assert json.loads((checkpoint / "data-position-1.json").read_text())["step"] == 3
    # steps 4-6 streamed on 1 rank: the 2-rank stream's, and so the cached path's, losses
    after, straight = losses(text_runs["resumed-1"]), losses(text_runs["cached"])
    assert sorted(after) == [4, 5, 6]
    assert max_relative_gap([after[s] for s in (4, 5, 6)], [straight[s] for s in (4, 5, 6)]) < 1e-5


def test_the_progress_line_shows_the_tokens_read_and_the_data_loaders_share(text_runs):
    records = [r for r in read_metrics(text_runs["stream-2"]) if r["type"] == "train"]
    assert [r["tokens"] for r in records] == sorted(r["tokens"] for r in records)
    assert all(0 <= r["data_share"] <= 1 for r in records)
    log = (text_runs["stream-2"].parent / "stream-2.log").read_text()
    assert "step 6/6" in log and " tokens " in log and " data " in log
    assert "streaming one file in 1 group(s) of 8 lane(s) (in file order)" in log


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory) -> dict[str, Path]:
    """Packed blocks of reviews shuffled in windows of 40 records, from 4 gzip files (4 groups
    of 2 lanes: each rank reads 2 files): 2 ranks, and its step-3 checkpoint resumed on 2."""
    folder = tmp_path_factory.mktemp("packed")
    lines = (REPO / "dplaunch/resources/data/reviews.jsonl").read_text().splitlines()[:400]
    for part in range(4):
        with gzip.open(folder / f"part-{part}.jsonl.gz", "wt") as out:
            out.write("\n".join(lines[part::4]) + "\n")
    keys = {"dataset": str(folder / "part-*.jsonl.gz"), "eval_fraction": None, "shuffle_buffer": 40}
    run_file = write_config(folder / "packed.yaml", data=keys)
    flags = ("--cpu", "--gpus", "2", *STEPS, *STREAM)
    runs = {"stream-2": folder / "stream-2", "resumed-2": folder / "resumed-2"}
    result = train(runs["stream-2"], *flags, *AT_3, config=run_file)
    (folder / "stream-2.log").write_text(result.stdout)
    resumed(runs["stream-2"], runs["resumed-2"], run_file, *flags)
    return runs


def test_a_packed_shuffled_stream_resumes_on_the_same_rank_count_bit_for_bit(packed_runs):
    after, straight = losses(packed_runs["resumed-2"]), losses(packed_runs["stream-2"])
    assert sorted(after) == [4, 5, 6]
    assert all(after[step] == straight[step] for step in after), (after, straight)
    log = (packed_runs["stream-2"].parent / "stream-2.log").read_text()
    assert "streaming 4 files in 4 group(s) of 2 lane(s) (shuffled in windows of 40 records)" in log


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory) -> dict[str, Path]:
    """Conversations, the loss on the answers: cached and streamed on 2 ranks one example a
    sample in file order; packed and shuffled streamed on 2 ranks, resumed at step 3 on 1."""
    folder = tmp_path_factory.mktemp("sft")
    chats = (REPO / "dplaunch/resources/data/chat-train.jsonl").read_text().splitlines()
    (folder / "chats.jsonl").write_text("\n".join(chats[:120]) + "\n")
    (folder / "eval.jsonl").write_text("\n".join(chats[-8:]) + "\n")
    base = yaml.safe_load(SFT_CONFIG.read_text())
    keys = {"dataset": str(folder / "chats.jsonl"), "eval_dataset": str(folder / "eval.jsonl")}
    train_keys = {"sample_prompts": None, "eval_every": None, "log_every": 1}
    plain = write_config(
        folder / "plain.yaml",
        SFT_CONFIG,
        data={**keys, "packing": False, "shuffle": False},
        train=train_keys,
    )
    packed = write_config(
        folder / "packed.yaml", SFT_CONFIG, data={**keys, "shuffle_buffer": 24}, train=train_keys
    )
    assert base["data"]["packing"] is True
    two = ("--cpu", "--gpus", "2", *STEPS)
    runs = {name: folder / name for name in ("cached", "stream", "packed-2", "packed-resumed-1")}
    train(runs["cached"], *two, config=plain)
    train(runs["stream"], *two, *STREAM, config=plain)
    train(runs["packed-2"], *two, *STREAM, *AT_3, config=packed)
    resumed(
        runs["packed-2"], runs["packed-resumed-1"], packed, "--cpu", "--gpus", "1", *STEPS, *STREAM
    )
    return runs


def test_streamed_sft_examples_train_as_cached_ones_with_the_loss_over_the_global_batchs_answers(
    sft_runs,
):
    # the loss of each micro-batch is weighted by its answer tokens over the whole global
    # batch's, which a rank of a stream learns from the others (one all-reduce a step)
    assert losses(sft_runs["stream"]) == losses(sft_runs["cached"])
    evaluations = [r for r in read_metrics(sft_runs["stream"]) if r["type"] == "eval"]
    assert len(evaluations) == 1 and evaluations[0]["step"] == 6  # the bounded set, read whole


def test_packed_sft_examples_stream_and_resume_on_another_rank_count(sft_runs):
    after, straight = losses(sft_runs["packed-resumed-1"]), losses(sft_runs["packed-2"])
    assert sorted(after) == [4, 5, 6]
    assert max_relative_gap([after[s] for s in (4, 5, 6)], [straight[s] for s in (4, 5, 6)]) < 1e-5
