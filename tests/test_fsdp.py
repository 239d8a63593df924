"""FSDP2 (parallel.fsdp) trains like DDP, its checkpoints continue on any rank count, it exports.

Real CPU ranks on gloo, the tiny Llama and the shared comparison (6 steps, global batch 8, micro 2)
whose 2-rank DDP run is tests/conftest.py's dp_reference. The runs, each started once:

- `fsdp2`: 2 ranks, checkpoints every 2 steps, killed (kill -9 of rank 0) while step 4's shards
  are being written: steps 1-4 are FSDP-on-2 against DDP, the killed save must not become latest;
- `on4`: 4 ranks, FSDP × tensor parallelism (dp 2 × tp 2, the model's tp_plan), resume from
  fsdp2's step 2 (DCP re-shards dp 2 → dp 2 × tp 2) and finish;
- `on1`: 1 rank resumes from on4's step 4 (dp 2 × tp 2 → 1) and finishes;
- `hsdp`: 2 "nodes" × 2 ranks on loopback, hybrid sharding with CPU offload.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dplaunch.commands.export import run_export
from dplaunch.config.schema import RunConfig
from tests.conftest import COMPARISON_FLAGS
from tests.helpers import (
    FAULT,
    REPO,
    TINY_LLAMA,
    assert_forecast_collectives,
    latest,
    losses_by_step,
    max_relative_gap,
    rank_pids,
    read_metrics,
    refusal_line,
    run_cli,
    run_dplaunch,
    run_loopback_nodes,
    spy_environment,
    train,
    train_losses,
    wait_while_running,
)

pytestmark = pytest.mark.multiprocess

FSDP = ("--cpu", "--fsdp", "full", *COMPARISON_FLAGS, "--set", "train.checkpoint_every=2")


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict[str, Path]:
    """The module's FSDP runs (see the module docstring), each run once."""
    root = tmp_path_factory.mktemp("fsdp")
    runs = {name: root / name for name in ("fsdp2", "on4", "on1")}
    killed = runs["fsdp2"]
    process = subprocess.Popen(
        [sys.executable, "-m", "dplaunch", "train", str(TINY_LLAMA), "-o", str(killed),
         "--gpus", "2", *FSDP],
        stdout=open(f"{killed}.log", "w"),  # noqa: SIM115 — closed when the process ends
        stderr=subprocess.STDOUT,
        env=spy_environment(killed, **{FAULT: "4:sleep=8"}),
        cwd=REPO,
    )  # fmt: skip
    shards = killed / "checkpoints" / ".tmp-step-4" / "fsdp"
    wait_while_running(lambda: (shards / ".metadata").exists(), "the step-4 save", process)
    os.kill(rank_pids(killed)[0], signal.SIGKILL)
    assert process.wait(timeout=300) not in (0, 75)
    step_2 = killed / "checkpoints" / "step-2"
    train(runs["on4"], "--gpus", "4", "--tp", "2", *FSDP, "--resume", step_2)
    train(runs["on1"], "--gpus", "1", *FSDP, "--resume", runs["on4"] / "checkpoints" / "step-4")
    return runs


def test_fsdp_on_2_ranks_trains_like_ddp_and_a_killed_save_never_becomes_latest(
    fsdp_runs, dp_reference
):
    run = fsdp_runs["fsdp2"]
    log = Path(f"{run}.log").read_text()
    assert "engine: fsdp" in log and "shard groups: [[0, 1]]" in log
    assert "FSDP2 full: 4 × LlamaDecoderLayer + root sharded over 2 rank(s)" in log
    assert not (run / "deepspeed.json").exists()  # DeepSpeed plays no part
    # every rank wrote its own shards of step 2 (torch.distributed.checkpoint)
    step_2 = run / "checkpoints" / "step-2" / "fsdp"
    assert sorted(p.name for p in step_2.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # the save killed in the middle left step 2 as the newest checkpoint
    assert latest(run) == "step-2" and not (run / "checkpoints" / "step-4").exists()
    losses, reference = train_losses(run), train_losses(dp_reference)
    assert len(losses) == 4 and max_relative_gap(losses, reference[:4]) < 1e-5, (losses, reference)
    # the root unit once, each block twice, the reduce-scatters, the norm: the forecast's count
    assert_forecast_collectives(run)


@pytest.mark.parametrize("name", ["on4", "on1"])
def test_an_fsdp_checkpoint_continues_on_tp2_x_dp2_then_on_1_rank_with_ddps_losses_and_weights(
    fsdp_runs, dp_reference, name
):
    run = fsdp_runs[name]
    if name == "on4":
        header = read_metrics(run)[0]
        assert (header["data_parallel_size"], header["tensor_parallel_size"]) == (2, 2)
    first = 3 if name == "on4" else 5  # on4 resumed after step 2, on1 after on4's step 4
    losses, reference = losses_by_step(run), dict(enumerate(train_losses(dp_reference), 1))
    assert sorted(losses) == list(range(first, 7))
    gap = max(abs(losses[step] - reference[step]) / reference[step] for step in losses)
    assert gap < 1e-5, (losses, reference)
    assert read_metrics(run)[0]["world_size"] == (4 if name == "on4" else 1)
    weights = load_file(str(run / "model" / "model.safetensors"))
    expected = load_file(str(dp_reference / "model" / "model.safetensors"))
    assert weights.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(weights[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


def test_the_export_of_an_fsdp_checkpoint_reproduces_the_sharded_models_eval_loss(
    fsdp_runs, tmp_path
):
    from transformers import AutoModelForCausalLM

    run = fsdp_runs["on4"]  # 4 ranks wrote its step-6 shards
    exported = tmp_path / "exported"
    assert run_export(run / "checkpoints" / "step-6", exported) == 0
    weights = load_file(str(exported / "model.safetensors"))
    final = load_file(str(run / "model" / "model.safetensors"))  # written at the end of training
    assert all(torch.equal(weights[key], final[key]) for key in final)
    config = RunConfig.model_validate(yaml.safe_load((run / "run.yaml").read_text()))
    model = AutoModelForCausalLM.from_pretrained(exported)
    sharded = [r for r in read_metrics(run) if r["type"] == "eval"][-1]["eval_loss"]
    assert abs(eval_loss(model, config) - sharded) / sharded < 1e-5


def eval_loss(model, config: RunConfig) -> float:
    """The evaluation loss of MODEL on the run's evaluation set, in this process (the loop's sums)."""
    from dplaunch.train.data import Batcher, Sharding, load_splits, tokenize
    from dplaunch.train.engines import loss_sums
    from dplaunch.train.modeling import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    _, raw = load_splits(config.data, config.train.seed)
    rows = tokenize(raw, tokenizer, config.data, config.model.task)
    batcher = Batcher(
        rows, Sharding(0, 1, 2, 1), pad_id=tokenizer.pad_token_id, task="causal-lm", seed=0
    )
    total, count = 0.0, 0.0
    with torch.no_grad():
        for batch, real in batcher.eval_micro_batches(2):
            logits = model(**batch, use_cache=False).logits
            losses, counts, _ = loss_sums(logits, batch["labels"], "causal-lm")
            total += float(losses[:real].sum())
            count += float(counts[:real].sum())
    return total / count


def test_hybrid_sharding_on_2_nodes_of_2_ranks_with_cpu_offload_trains_like_ddp(
    tmp_path, dp_reference
):
    run_dir = tmp_path / "hsdp"
    flags = ("--fsdp", "hybrid", "--offload", "all", *COMPARISON_FLAGS)
    outputs = run_loopback_nodes(TINY_LLAMA, run_dir, *flags, gpus=4, env=spy_environment(run_dir))
    assert "shard groups: [[0, 1], [2, 3]]" in outputs[0]
    assert "replicate groups: [[0, 2], [1, 3]]" in outputs[0]
    assert "sharded over 2 rank(s), replicated 2×" in outputs[0]
    assert "offloaded to CPU" in outputs[0]
    losses = train_losses(run_dir)
    assert max_relative_gap(losses, train_losses(dp_reference)) < 1e-5
    # reduce-scatter inside the node, the shard all-reduced across the nodes: the forecast's
    assert_forecast_collectives(run_dir)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ("--fsdp", "full", "--zero", "3"),
            "parallel.fsdp: FSDP and ZeRO-3 both shard the model's states",
        ),
        (
            ("--fsdp", "full", "--pp", "2"),
            "parallel.fsdp: FSDP with pp 2: the pipeline engine is DeepSpeed's",
        ),
        (
            ("--fsdp", "hybrid", "--tp", "2"),
            "parallel.fsdp: HSDP with tp 2 would need a 3-D mesh",
        ),
        (
            ("--fsdp", "full", "--offload", "optimizer"),
            "parallel.offload: FSDP offloads parameters, gradients",
        ),
    ],
    ids=["zero", "pp", "hybrid-tp", "offload-optimizer"],
)
def test_fsdp_with_an_incompatible_layout_is_refused_before_launch(tmp_path, flags, expected):
    run_dir = tmp_path / "run"
    result = run_dplaunch("train", TINY_LLAMA, "--cpu", "--gpus", "2", *flags, "-o", run_dir)
    refusal_line(result, expected)
    assert not run_dir.exists()


def test_an_fsdp_checkpoint_resumes_under_ddp_through_its_universal_form(fsdp_runs, tmp_path):
    # formerly refused (the formats differ): now converted once before launch, said in one line
    # (the resumes themselves: tests/test_layout_matrix*.py)
    checkpoint = fsdp_runs["on1"] / "checkpoints" / "step-6"
    result = run_cli(
        "train", TINY_LLAMA, "--cpu", "--gpus", "2", "--max-steps", "8", "--global-batch", "8",
        "--resume", checkpoint, "-o", tmp_path / "ddp", "--dry-run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "resume note: conversion: FSDP2 full dp 1 → DDP dp 2 (another engine)" in result.stdout


# -- planning: the plan, the plan table, parallel: auto (no processes) ---------------------------


def test_the_plan_of_hsdp_on_2_nodes_of_4_shows_its_shard_and_replicate_groups():
    from dplaunch.config.schema import LaunchConfig, ParallelConfig, TrainConfig
    from dplaunch.planning.plan import Machine, make_plan

    launch = LaunchConfig(gpus=8, nodes=2, cpu=True)
    plan = make_plan(launch, ParallelConfig(fsdp="hybrid"), TrainConfig(), Machine())
    lines = plan.summary_lines()
    assert plan.engine == "fsdp" and not plan.uses_deepspeed
    assert (
        "FSDP2 hybrid (HSDP: shard inside a node, replicate across nodes): mesh replicate 2 × shard 4"
        in lines
    )
    assert "  shard groups: [[0, 1, 2, 3], [4, 5, 6, 7]]" in lines
    assert "  replicate groups: [[0, 4], [1, 5], [2, 6], [3, 7]]" in lines
    assert "engine: fsdp" in lines


def test_the_plan_table_lists_fsdp_with_zero3s_states_and_auto_picks_it_only_when_asked(tmp_path):
    from dplaunch.planning.auto import resolve_auto_parallel
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.plan import Machine
    from tests.helpers import LLAMA_7B, llama_7b_run_file, run_config

    facts = ModelFacts.from_config_dict(LLAMA_7B)
    settings = ("launch.gpus=16", "launch.nodes=2", "launch.gpu_memory_gb=80")
    config = run_config(llama_7b_run_file(tmp_path / "7b.yaml"), *settings)
    choice = resolve_auto_parallel(config, facts, Machine(visible_gpus=8))
    # the plain data-parallel rows (tp, pp and sp rows share these names)
    rows = {c.name: c for c in choice.candidates if c.tp * c.pp * c.sp == 1}
    # FSDP full holds ZeRO-3's states, and FSDP2's own transients: the root (embeddings, head)
    # and two blocks unsharded in bf16 instead of one gathered layer; HSDP shards over a node's
    # 8 GPUs only: more per GPU
    assert rows["FSDP"].model_states_gb == pytest.approx(rows["ZeRO-3"].model_states_gb)
    assert rows["FSDP"].memory.gathered_gb > 2 * rows["ZeRO-3"].memory.gathered_gb
    assert rows["FSDP"].comm_gb_per_step == pytest.approx(rows["ZeRO-3"].comm_gb_per_step)
    assert rows["HSDP"].model_states_gb > rows["FSDP"].model_states_gb
    assert {"FSDP + offload all", "HSDP + offload all"} <= rows.keys()
    # a run that did not ask for FSDP keeps its DeepSpeed/DDP choice
    assert choice.parallel.fsdp is None and not any(c.fsdp and c.recommended for c in rows.values())
    hybrid = {"auto": True, "fsdp": "hybrid"}  # YAML `parallel: {auto: true, fsdp: hybrid}`
    asked = run_config(llama_7b_run_file(tmp_path / "7b.yaml", hybrid), *settings)
    choice = resolve_auto_parallel(asked, facts, Machine(visible_gpus=8))
    assert (choice.parallel.fsdp, choice.parallel.zero_stage) == ("hybrid", 0)
    assert choice.note.startswith("parallel: auto → HSDP fits in 80 GB")


def test_parallel_auto_with_the_fsdp_flag_plans_among_the_fsdp_rows(tmp_path):
    # --parallel auto and --fsdp full together: auto keeps the engine asked for
    result = run_dplaunch(
        "train", TINY_LLAMA, "--parallel", "auto", "--fsdp", "full", "--cpu", "--gpus", "2",
        "--set", "launch.gpu_memory_gb=16", "--dry-run", "-o", tmp_path / "run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "engine: fsdp" in result.stdout
    assert "parallel: auto → FSDP fits in 16 GB" in result.stdout


def test_fsdp2s_unsharded_root_and_reduce_scatter_input_are_what_the_estimate_counts(monkeypatch):
    # one CPU rank in this process, bf16 compute: after the forward the root (embeddings, final
    # norm, head) stays unsharded in bf16 until its backward; each block's gradients go to the
    # reduce-scatter through a flat fp32 copy
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from dplaunch.planning.estimate import count_parameters, fsdp_transient_bytes
    from dplaunch.planning.model_facts import ModelFacts
    from tests.helpers import one_rank_fsdp_engine

    spec = yaml.safe_load(TINY_LLAMA.read_text())
    config = RunConfig.model_validate(spec)
    config.train.mixed_precision = "bf16"
    count = count_parameters(ModelFacts.from_config_dict(spec["model"]["config"]))
    reduced: list[int] = []
    copy_in = _fsdp_collectives.foreach_reduce_scatter_copy_in

    def measured(grads, flat, world_size):
        reduced.append(sum(g.numel() * g.element_size() for g in grads) + flat.nbytes)
        return copy_in(grads, flat, world_size)

    monkeypatch.setattr(_fsdp_collectives, "foreach_reduce_scatter_copy_in", measured)
    ids = torch.randint(3, 259, (2, 16), generator=torch.Generator().manual_seed(0))
    with one_rank_fsdp_engine(config) as engine:
        root = engine.model._get_fsdp_state()._fsdp_param_group
        loss = engine.model(input_ids=ids, labels=ids, use_cache=False).loss
        unsharded = sum(p.unsharded_param.nbytes for p in root.fsdp_params)
        loss.backward()
    block, root_params = count.per_layer, count.embedding + count.head
    largest = max(block, root_params)  # here a block (36,992 parameters; the root 33,216)
    estimated_unsharded, estimated_reduce = fsdp_transient_bytes(root_params, block, largest, 2)
    assert unsharded == 2 * root_params  # the root part of the unsharded estimate, exactly
    assert estimated_unsharded == unsharded + 2 * 2 * block
    assert max(reduced) == estimated_reduce  # bf16 gradients + their fp32 copy
