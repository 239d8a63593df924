"""Several evaluation sets, early stopping and the best checkpoint, as a user runs them: a tiny
Llama trains on a mixture of reviews and shouted texts, evaluates on each (eval_reviews_…,
eval_shouts_…), stops when eval_shouts_loss has not dropped by 0.3 for 2 evaluations, and
exports the best checkpoint as RUN/model and the last step as RUN/model-last. The run is
preempted at step 9 on 2 ranks and resumed on 1: the early-stopping record goes on from the
checkpoint (a fresh record would stop at another step)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import read_metrics, train, write_config

pytestmark = pytest.mark.multiprocess

MIN_DELTA, PATIENCE = 0.3, 2


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """The run directory: 2 ranks to step 9, then 1 rank from its checkpoint to the stop."""
    folder = tmp_path_factory.mktemp("early-stopping")
    texts = ({"text": "nice one " * (1 + (7 * i) % 4)} for i in range(300))
    (folder / "reviews.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    shouted = ({"body": "ZZ " * (1 + i % 4) + str(i)} for i in range(40))
    (folder / "shouts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in shouted))
    shouts = {"dataset": str(folder / "shouts.jsonl"), "text_column": "body"}
    run_file = write_config(
        folder / "run.yaml",
        data={
            "dataset": None,
            "eval_fraction": None,
            "mixture": [
                {"dataset": str(folder / "reviews.jsonl"), "weight": 0.8},
                {**shouts, "weight": 0.2},
            ],
            "eval_datasets": {"reviews": str(folder / "reviews.jsonl"), "shouts": shouts},
            "max_length": 32,
            "packing": False,
        },
        train={
            "max_steps": 24,
            "lr": 3.0e-3,
            "eval_every": 2,
            "keep_last": 1,
            "keep_best": True,
            "export_last": True,
            "early_stopping": {
                "metric": "eval_shouts_loss",
                "min_delta": MIN_DELTA,
                "patience": PATIENCE,
            },
        },
    )
    run = folder / "run"
    train(run, "--cpu", "--gpus", "2", "--set", "train.stop_after_steps=9", config=run_file)
    resumed = train(run, "--cpu", "--gpus", "1", "--resume", "auto", config=run_file)
    return run, resumed.stdout + resumed.stderr


def _evaluations(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if r["type"] == "eval"}


def test_each_evaluation_set_is_logged_under_its_name(stopped_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = stopped_run
    names = {
        f"eval_{s}_{m}"
        for s in ("reviews", "shouts")
        for m in ("loss", "perplexity", "token_accuracy")
    }
    assert all(set(record) == {"type", "step", *names} for record in _evaluations(run).values())
    board = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert {f"eval/{name}" for name in names} <= set(board.Tags()["scalars"])


def test_early_stopping_stops_where_the_rule_says_across_the_resume(stopped_run):
    run, log = stopped_run
    evaluations = _evaluations(run)
    # by hand: an evaluation improves when eval_shouts_loss is below the best by more than 0.3
    best = best_step = stop = None
    waited = 0
    for step in sorted(s for s in evaluations if s > 0):
        value = evaluations[step]["eval_shouts_loss"]
        if best is None or best - value > MIN_DELTA:
            best, best_step, waited = value, step, 0
        elif (waited := waited + 1) == PATIENCE:
            stop = step
            break
    assert stop is not None and 9 < stop < 24, evaluations
    assert max(evaluations) == stop  # no evaluation after it: the run ended there
    summary = [r for r in read_metrics(run) if r["type"] == "summary"][-1]
    assert (summary["step"], summary["early_stopped_at"], summary["best_step"]) == (
        stop,
        stop,
        best_step,
    )
    assert f"[dplaunch] early stopping at step {stop}: eval_shouts_loss" in log
    assert f"(step {best_step}) by more than 0.3 for 2 evaluation(s)" in log


def test_the_best_checkpoint_is_kept_and_exported_and_the_last_step_beside_it(stopped_run):
    import torch
    from safetensors.torch import load_file

    run, _ = stopped_run
    summary = [r for r in read_metrics(run) if r["type"] == "summary"][-1]
    best, last = summary["best_step"], summary["step"]
    # keep_last 1 keeps the newest; the best stays beside it
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == sorted(
        {f"step-{best}", f"step-{last}"}
    )
    for export, step in (("model", best), ("model-last", last)):
        exported = load_file(str(run / export / "model.safetensors"))
        saved = load_file(str(run / "checkpoints" / f"step-{step}" / "model.safetensors"))
        assert exported.keys() == saved.keys()
        assert all(torch.equal(exported[name], saved[name]) for name in saved), export
