"""`parallel: auto` and `dplaunch plan`'s `*` row tune what people guess: the layout, the micro batch
(the global batch kept, accumulation following) and activation checkpointing together, each
combination's memory estimated and its step forecast, no trial run; what the run sets is kept."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import yaml

from dplaunch.planning.forecast import Overheads
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.plan import Machine
from dplaunch.planning.profiles import OPS, AttentionPoint, DensePoint, Link, profile_text
from tests.helpers import REPO, run_cli, synthetic_profile

FAMILIES = ("ddp", "zero1", "zero2", "zero3")
FAST_NETWORK = {"intra": {op: Link(1e-5, 1e11) for op in OPS}}
FAST_ATTENTION = (AttentionPoint("sdpa", "bf16", 1024, 1e15),)
# small matrix products far below the large ones' rate, and 50 ms of fixed work a micro-batch:
# few large micro-batches pay, even recomputing every layer to fit them
FAVOURS_LARGE_MICRO_BATCHES = synthetic_profile(
    "Test GPU",
    8,
    dense=tuple(DensePoint("bf16", 2048, t, r) for t, r in ((1024, 2e13), (16384, 2e14))),
    attention=FAST_ATTENTION,
    collectives=FAST_NETWORK,
    overheads={f: Overheads(forward_s=0.05, backward_s=0.05).to_dict() for f in FAMILIES},
)
# one rate whatever the shape and no fixed costs: recomputation is only a cost
FAVOURS_NO_RECOMPUTATION = dataclasses.replace(
    FAVOURS_LARGE_MICRO_BATCHES,
    dense=(DensePoint("bf16", 2048, 1024, 2e14),),
    overheads={f: {} for f in FAMILIES},
)


def llama_1b(**train):
    """examples/llama-1b.yaml with parallel: auto on 8 GPUs of 20 GB, global batch 64, and
    neither train.micro_batch_size nor model.gradient_checkpointing set (unless TRAIN sets
    them)."""
    data = yaml.safe_load((REPO / "examples" / "llama-1b.yaml").read_text())
    del data["train"]["micro_batch_size"]
    data["train"].update(train)
    data["parallel"] = "auto"
    data["launch"] = {"gpus": 8, "gpu_memory_gb": 20}
    return data


def auto_choice(data, profile):
    from dplaunch.config.load import build_run_config
    from dplaunch.planning.auto import resolve_auto_parallel

    config = build_run_config(data, assignments=[], base_dir=REPO / "examples")
    facts = ModelFacts.from_config_dict(data["model"]["config"])
    return config, resolve_auto_parallel(config, facts, Machine(visible_gpus=8), profile=profile)


def fastest_fitting_trial(choice):
    """The fastest combination that fits of every eligible row's levers (what auto must pick)."""
    trials = [
        (c, t)
        for c in choice.candidates
        if c.fits and c.fsdp is None
        for t in c.trials
        if t.fits and t.forecast is not None
    ]
    return min(trials, key=lambda ct: ct[1].forecast.step_time_s)


def test_auto_picks_the_micro_batch_and_checkpointing_each_profile_favours():
    picks = {}
    for name, profile in (
        ("large micro-batches", FAVOURS_LARGE_MICRO_BATCHES),
        ("no recomputation", FAVOURS_NO_RECOMPUTATION),
    ):
        config, choice = auto_choice(llama_1b(), profile)
        row, trial = fastest_fitting_trial(choice)
        chosen = next(c for c in choice.candidates if c.recommended)
        assert (chosen.zero_stage, chosen.tp, chosen.pp) == (row.zero_stage, row.tp, row.pp)
        assert chosen.settings == trial.settings
        # the run file gets what was tuned; the global batch stays, accumulation follows
        tuned = choice.apply(config)
        assert tuned.train.micro_batch_size == trial.settings["micro_batch"]
        every = trial.settings["activation_checkpointing"]
        written = {0: False, 1: True}.get(every, f"every-{every}")
        assert tuned.model.gradient_checkpointing == written
        assert tuned.model.checkpoint_every == every
        assert tuned.train.global_batch_size == 64
        assert chosen.micro_batch * chosen.gradient_accumulation_steps * chosen.dp == 64
        # the note names the tuned levers and the runner-up
        assert "(micro-batch " in choice.note
        assert " s/step beats " in choice.note or ", as fast as " in choice.note
        picks[name] = trial.settings
    # large micro-batches fit only with checkpointing: 8 rows of 1,024 tokens checkpointing one
    # block in 4 (every-4) beat 16 rows checkpointing every block (which fit too) and every
    # smaller batch; the other profile never recomputes
    assert picks["large micro-batches"] == {"micro_batch": 8, "activation_checkpointing": 4}
    _, choice = auto_choice(llama_1b(), FAVOURS_LARGE_MICRO_BATCHES)
    trials = [t for c in choice.candidates if c.fsdp is None for t in c.trials]
    assert {t.settings["activation_checkpointing"] for t in trials} == {0, 1, 2, 4}
    timed = [t for t in trials if t.fits and t.forecast is not None]
    _, pick = fastest_fitting_trial(choice)
    every_block = min(
        (t for t in timed if t.settings["activation_checkpointing"] == 1),
        key=lambda t: t.forecast.step_time_s,
    )
    assert every_block.settings["micro_batch"] == 16
    assert every_block.forecast.step_time_s > pick.forecast.step_time_s
    assert "checkpointing 1 block in 4" in choice.note
    assert picks["no recomputation"]["activation_checkpointing"] == 0
    assert picks["no recomputation"]["micro_batch"] < 16


def test_a_micro_batch_and_checkpointing_the_run_sets_are_kept():
    data = llama_1b(micro_batch_size=4)
    data["model"]["gradient_checkpointing"] = False
    _, choice = auto_choice(data, FAVOURS_LARGE_MICRO_BATCHES)
    assert choice.settings == {}
    assert all(not c.trials for c in choice.candidates)  # nothing left to tune
    chosen = next(c for c in choice.candidates if c.recommended)
    assert chosen.micro_batch == 4 and chosen.activation_checkpointing is False
    # checkpointing set on, the micro batch still tuned
    data = llama_1b()
    data["model"]["gradient_checkpointing"] = True
    _, choice = auto_choice(data, FAVOURS_NO_RECOMPUTATION)
    assert set(choice.settings) == {"train.micro_batch_size"}
    assert all(c.activation_checkpointing for c in choice.candidates if c.forecast)


def test_without_a_profile_nothing_is_tuned_and_the_rule_picks():
    _, choice = auto_choice(llama_1b(), None)
    assert choice.settings == {} and all(not c.trials for c in choice.candidates)


@pytest.mark.parametrize("flag", [(), ("--micro-batch", "2")])
def test_the_plan_table_shows_each_rows_tuned_micro_batch_and_checkpointing(tmp_path, flag):
    profile = tmp_path / "profile.json"
    profile.write_text(profile_text(FAVOURS_LARGE_MICRO_BATCHES))
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(llama_1b()))
    result = run_cli("plan", run, "--profile", profile, *flag)
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.strip().startswith("plan"))
    assert header.split()[-7:-5] == ["micro", "ckpt"]
    line = [line for line in result.stdout.splitlines() if line.startswith("* ")][-1]
    rows = json.loads(run_cli("plan", run, "--profile", profile, "--json", *flag).stdout)
    [best] = [r for r in rows if r["recommended"]]
    if not flag:
        assert "micro batch tuned" in result.stdout
        assert "(micro-batch 8, checkpointing 1 block in 4) fits in 20 GB" in line
        assert (best["micro_batch"], best["checkpoint_every"]) == (8, 4)
        row = next(line for line in result.stdout.splitlines() if line.startswith("* ZeRO"))
        cells = row.split()  # … fits, then micro and ckpt
        assert cells[cells.index("yes") + 1 :][:2] == ["8×1", "1/4"], row
    else:  # --micro-batch is kept: only checkpointing is tuned
        assert re.search(r"\((no |activation |)checkpointing( 1 block in \d)?\) fits", line)
        assert {r["micro_batch"] for r in rows if r["micro_batch"]} == {2}
