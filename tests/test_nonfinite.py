"""The non-finite guard: a NaN loss at one step on one rank stops the run keeping the last good
checkpoint (naming step and rank), or is skipped on every rank as if the step's batch were not there.

Real 2-rank CPU runs of the tiny Llama; the NaN comes from the test hook DPLAUNCH_TEST_NONFINITE
("STEP:RANK" poisons that rank's loss; "STEP:omit" leaves the step's batch out: the reference).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dplaunch.run_directory.environment import NONFINITE_FAULT_ENV
from dplaunch.train.nonfinite import EXIT_NONFINITE, NonFiniteGuard
from tests.helpers import (
    TINY_LLAMA,
    child_environment,
    one_rank_fsdp_engine,
    read_metrics,
    run_dplaunch,
)

DDP = ("--cpu", "--gpus", "2", "--max-steps", "5")
ZERO2 = ("--cpu", "--gpus", "2", "--zero", "2", "--max-steps", "5")
LAYOUTS = {
    "ddp": DDP,
    "zero2": ZERO2,
    "fsdp": ("--cpu", "--gpus", "2", "--fsdp", "full", "--max-steps", "5"),
}


def train_with(run_dir: Path, *flags: str, fault: str) -> tuple[int, str]:
    result = run_dplaunch(
        "train", "examples/tiny-llama.yaml", "-o", run_dir, *flags,
        env=child_environment(**{NONFINITE_FAULT_ENV: fault}),
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr


@pytest.mark.multiprocess
def test_a_nan_loss_stops_the_run_at_that_step_and_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    code, log = train_with(run, *DDP, "--set", "train.checkpoint_every=2", fault="3:1")
    assert code == EXIT_NONFINITE, log[-3000:]
    assert "stopped at step 3: non-finite loss on rank 1 (train.on_nonfinite: stop)" in log, log
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-2"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-2"]
    assert f"the last good checkpoint is {checkpoints / 'step-2'}" in log
    assert not (run / "model").exists()  # no export of a broken model
    assert [r["step"] for r in read_metrics(run) if r["type"] == "train"] == [1, 2]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["ddp", "zero2", "fsdp"])
def test_a_skipped_nan_step_gives_the_weights_of_a_run_without_that_batch(tmp_path, layout):
    flags = (*LAYOUTS[layout], "--set", "train.on_nonfinite=skip")
    code, log = train_with(tmp_path / "skip", *flags, fault="3:1")
    assert code == 0, log[-3000:]
    assert "step 3: non-finite loss on rank 1: update skipped on every rank" in log, log
    code, log = train_with(tmp_path / "omit", *flags, fault="3:omit")
    assert code == 0, log[-3000:]
    skipped, omitted = read_metrics(tmp_path / "skip"), read_metrics(tmp_path / "omit")
    assert [r["step"] for r in skipped if r["type"] == "skipped"] == [3]
    assert skipped[-1]["skipped_steps"] == 1
    losses = [
        [(r["step"], r["loss"]) for r in m if r["type"] == "train"] for m in (skipped, omitted)
    ]
    assert losses[0] == losses[1] and [s for s, _ in losses[0]] == [1, 2, 4, 5]
    weights = [
        load_file(tmp_path / name / "model" / "model.safetensors") for name in ("skip", "omit")
    ]
    assert weights[0].keys() == weights[1].keys()
    for key, tensor in weights[0].items():
        assert tensor.isfinite().all() and tensor.equal(weights[1][key]), key


def test_skips_in_a_row_beyond_max_skipped_steps_stop_the_run_and_a_good_step_resets_the_count():
    guard = NonFiniteGuard("skip", 2, SimpleNamespace(num_processes=1, process_index=0), "no")
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    verdicts = []
    for step, loss in enumerate([nan, nan, one, nan, nan, nan], start=1):
        guard.begin(step)
        skipped = guard.judge(loss, None, [], None)
        verdicts.append((skipped, guard.verdict()))
    assert [skipped for skipped, _ in verdicts] == [True, True, False, True, True, True]
    assert [verdict for _, verdict in verdicts[:5]] == [None] * 5
    assert verdicts[5][1] == (
        "step 6: non-finite loss on rank 0: 3 updates in a row skipped, more than "
        "train.max_skipped_steps 2"
    )


def test_on_nonfinite_off_written_bare_in_yaml_means_off():
    from dplaunch.config.schema import TrainConfig

    assert TrainConfig.model_validate(yaml.safe_load("on_nonfinite: off")).on_nonfinite == "off"


def test_fsdp_without_clipping_judges_its_sharded_gradient_norm():
    # max_grad_norm 0 leaves the norm to the guard, whose own sum of FSDP's DTensor gradients
    # could not be written into its plain flags tensor: every rank failed at the first step
    from dplaunch.config.schema import RunConfig

    config = RunConfig.model_validate(yaml.safe_load(TINY_LLAMA.read_text()))
    config.train.max_grad_norm = 0.0
    ids = torch.randint(3, 259, (2, 16), generator=torch.Generator().manual_seed(0))
    with one_rank_fsdp_engine(config, guard_mode="skip") as engine:
        for step, poisoned in ((1, False), (2, True)):
            engine.guard.begin(step)
            before = [p.detach().full_tensor().clone() for p in engine.model.parameters()]
            if poisoned:  # a NaN gradient with a finite loss: the norm alone tells
                engine.model.model.norm.register_forward_hook(_nan_gradient)
            engine.train_step([{"input_ids": ids, "labels": ids.clone()}])
            after = [p.detach().full_tensor() for p in engine.model.parameters()]
            changed = any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
            assert changed != poisoned and (engine.guard.event is not None) == poisoned
        assert engine.guard.event.gradient and not engine.guard.event.loss_ranks


def _nan_gradient(_module, _inputs, output):
    # the output's own values forward; backward, the unused branch's sqrt(-x) gives 0 · NaN
    return torch.where(
        torch.ones_like(output, dtype=torch.bool), output, (-1 - output.abs()).sqrt()
    )
