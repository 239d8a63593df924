"""Hybrid parallelism by one flag: TP (DeepSpeed AutoTP) and PP (DeepSpeed pipeline) give the maths of DP.

Every layout trains the tiny Llama with the same seed, data and global batch as the 2-rank DP
reference, on real CPU ranks; per-step losses must stay within 1e-3 (relative) of DP at every step.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import yaml

from tests.conftest import COMPARISON_FLAGS
from tests.helpers import (
    TINY_GPT2_CONFIG,
    TINY_LLAMA,
    assert_forecast_collectives,
    max_relative_gap,
    read_metrics,
    run_dplaunch,
    spy_environment,
    train,
    train_losses,
    write_config,
)

pytestmark = pytest.mark.multiprocess
TOLERANCE = 1e-3


def exported_eval_loss(run_dir) -> float:
    """Eval loss of RUN/model on one process, over the run's own eval set, as the loop computes it."""
    from transformers import AutoModelForCausalLM

    from dplaunch.config.schema import RunConfig
    from dplaunch.train.data import Batcher, Sharding, load_splits, tokenize
    from dplaunch.train.engines import loss_sums
    from dplaunch.train.modeling import load_tokenizer

    config = RunConfig.model_validate(yaml.safe_load((run_dir / "run.yaml").read_text()))
    tokenizer = load_tokenizer(config.model)
    _, eval_raw = load_splits(config.data, config.train.seed)
    eval_set = tokenize(eval_raw, tokenizer, config.data, config.model.task)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model").eval()
    batcher = Batcher(
        eval_set,
        Sharding(0, 1, 8, 1),
        pad_id=tokenizer.pad_token_id,
        task=config.model.task,
        seed=0,
    )
    total = count = 0.0
    with torch.no_grad():
        for batch, real in batcher.eval_micro_batches(8):
            losses, counts, _ = loss_sums(model(**batch).logits, batch["labels"], config.model.task)
            total += float(losses[:real].sum())
            count += float(counts[:real].sum())
    return total / count


def planned_stage_blocks(stdout: str) -> list[list[int]]:
    """Blocks per stage as the plan printed them ('  stage 0: embeddings, blocks 0-1 (…)')."""
    stages = []
    for found in re.findall(r"^  stage \d+: (.*)$", stdout, flags=re.M):
        span = re.search(r"blocks? (\d+)(?:-(\d+))?", found)
        stages.append(list(range(int(span[1]), int(span[2] or span[1]) + 1)) if span else [])
    return stages


def engine_stage_blocks(stdout: str) -> list[list[int]]:
    """Blocks per stage as the pipeline engine reported them after partitioning."""
    lines = re.findall(r"pipeline stage \d+: [^(]*\((.*)\)", stdout)
    return [[int(b) for b in re.findall(r"block (\d+)", line)] for line in lines]


def final_eval_loss(run_dir) -> float:
    return [r for r in read_metrics(run_dir) if r["type"] == "eval"][-1]["eval_loss"]


@pytest.mark.parametrize(
    "layout,flags",
    [
        ("tp2", ["--gpus", "2", "--tp", "2"]),
        ("pp2", ["--gpus", "2", "--pp", "2"]),
        ("dp2xtp2", ["--gpus", "4", "--tp", "2"]),
        ("dp2xpp2-zero1", ["--gpus", "4", "--pp", "2", "--zero", "1"]),
        ("tp2-zero2", ["--gpus", "2", "--tp", "2", "--zero", "2"]),
    ],
)
def test_layout_matches_data_parallel_at_every_step(tmp_path, dp_reference, layout, flags):
    run = tmp_path / layout
    result = train(run, "--cpu", *flags, *COMPARISON_FLAGS, env=spy_environment(run))
    header = read_metrics(run)[0]
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    pp = int(flags[flags.index("--pp") + 1]) if "--pp" in flags else 1
    assert (header["tensor_parallel_size"], header["pipeline_parallel_size"]) == (tp, pp)
    assert header["data_parallel_size"] * tp * pp == header["world_size"]
    assert f"tp {tp} × pp {pp}" in result.stdout  # the mesh is shown
    gap = max_relative_gap(train_losses(run), train_losses(dp_reference))
    print(f"{layout}: largest relative loss gap vs DP {gap:.2e}")
    assert gap < TOLERANCE, gap
    if pp > 1:
        assert planned_stage_blocks(result.stdout) == engine_stage_blocks(result.stdout)
    if layout in ("tp2", "pp2"):
        # one consolidated HF model that reproduces the sharded model's numbers on one process
        assert math.isclose(exported_eval_loss(run), final_eval_loss(run), rel_tol=1e-4)
    # TP's per-layer all-reduces, the pipeline's sends, the data-parallel reductions of the 2-D
    # meshes: the collectives of a step are those the forecast counts (planning/forecast.py)
    assert_forecast_collectives(run)


def test_tied_embedding_gpt2_through_the_pipeline_matches_dp(tmp_path):
    config = write_config(tmp_path / "gpt2.yaml", model={"config": TINY_GPT2_CONFIG})
    dp, pp = tmp_path / "dp", tmp_path / "pp"
    train(dp, "--cpu", "--gpus", "2", *COMPARISON_FLAGS, config=config)
    result = train(pp, "--cpu", "--gpus", "2", "--pp", "2", *COMPARISON_FLAGS, config=config)
    assert "stage 1:" in result.stdout
    gap = max_relative_gap(train_losses(pp), train_losses(dp))
    print(f"gpt2 tied pp2: largest relative loss gap vs DP {gap:.2e}")
    assert gap < TOLERANCE, gap
    assert math.isclose(exported_eval_loss(pp), final_eval_loss(pp), rel_tol=1e-4)


@pytest.mark.parametrize(
    "flags,expected",
    [
        (
            ["--gpus", "4", "--tp", "2", "--pp", "2"],
            "AutoTP does not compose with its pipeline engine",
        ),
        (["--gpus", "2", "--pp", "2", "--zero", "2"], "ZeRO-2 cannot be combined with pipeline"),
        (["--gpus", "2", "--tp", "2", "--zero", "3"], "ZeRO-3 with tensor parallelism"),
        (["--gpus", "6", "--tp", "4"], "does not divide 6 GPUs"),
    ],
)
def test_unsupported_hybrid_layouts_are_refused_before_launch(tmp_path, flags, expected):
    result = run_dplaunch("train", TINY_LLAMA, "--cpu", *flags, "-o", tmp_path / "run")
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_dry_run_shows_the_mesh_groups_and_stage_layers(tmp_path):
    result = run_dplaunch(
        "config", TINY_LLAMA, "--gpus", "16", "--nodes", "4", "--pp", "2", "--out", tmp_path / "c"
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mesh: dp 8 × tp 1 × pp 2 = 16 ranks" in out
    assert "pipelines (stage 0 first): [[0, 8], [1, 9]" in out
    assert "stage 0: embeddings, blocks 0-1" in out and "stage 1: blocks 2-3, norm, lm_head" in out
    result = run_dplaunch(
        "config", TINY_LLAMA, "--gpus", "16", "--nodes", "4", "--tp", "2", "--out", tmp_path / "d"
    )
    assert "tensor-parallel groups: [[0, 1], [2, 3]" in result.stdout
    assert "data-parallel groups: [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3" in result.stdout


def test_the_pipeline_weights_rows_of_unequal_length_by_their_tokens(tmp_path):
    # unpacked rows of 3 to 60 tokens: the pipeline's micro-batches (4 × accumulation 6) hold other
    # rows than one rank's (8 × 3); the step's loss must still be the mean over all its tokens
    import json

    texts = [
        ("fine." if i % 3 else f"review {i}: " + "a long and winding tour " * 2) for i in range(240)
    ]
    data = tmp_path / "uneven.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    flags = ("--max-steps", "4", "--global-batch", "24", "--set", "data.packing=false")
    flags += ("--set", f"data.dataset={data}")
    dp, pp = tmp_path / "dp1", tmp_path / "pp2"
    train(dp, "--cpu", "--gpus", "1", *flags)
    train(pp, "--cpu", "--gpus", "2", "--pp", "2", "--micro-batch", "4", *flags)
    assert read_metrics(pp)[0]["gradient_accumulation_steps"] == 6
    gap = max_relative_gap(train_losses(pp), train_losses(dp))
    print(f"unpacked pp2 vs dp1: largest relative loss gap {gap:.2e}")
    assert gap < 1e-4, gap
