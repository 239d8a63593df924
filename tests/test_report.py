"""`dplaunch report` on synthetic metrics.jsonl files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dplaunch.errors import UserError
from dplaunch.report import make_report, read_metrics

HEADER = {
    "type": "header",
    "world_size": 4,
    "data_parallel_size": 2,
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 1,
    "zero_stage": 1,
    "offload": "none",
    "global_batch_size": 32,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 4,
    "mixed_precision": "bf16",
}


def write_run(
    run_dir: Path,
    *,
    steps: int = 100,
    base_loss: float = 5.0,
    rate: float = 1000.0,
    memory: bool = True,
    finished: bool = True,
    task: str = "causal-lm",
) -> Path:
    """A run that logs every 5 steps, evaluates every 25; the first logged interval is slow."""
    run_dir.mkdir(parents=True)
    lines = [dict(HEADER)]
    for step in range(5, steps + 1, 5):
        record = {
            "type": "train",
            "step": step,
            "loss": base_loss * math.exp(-step / 40) + 1.0,
            "lr": 1e-3 * min(1.0, step / 20) * (1 - step / (steps + 1)),
            # warm-up: the first 10% of steps run at a tenth of the speed
            "tokens_per_s": rate / 10 if step <= steps * 0.1 else rate,
            "elapsed_s": step * 0.5,
        }
        if memory:
            record["memory_gb"] = 2.0 + step / 1000
        lines.append(record)
        if step % 25 == 0:
            evaluation = {"type": "eval", "step": step, "eval_loss": record["loss"] + 0.1}
            if task == "sequence-classification":
                evaluation["eval_accuracy"] = 0.5 + step / (2 * steps)
            else:
                evaluation["eval_perplexity"] = math.exp(evaluation["eval_loss"])
            lines.append(evaluation)
    if finished:
        lines.append({"type": "summary", "step": steps, "wall_s": steps * 0.5 + 1})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


def test_two_runs_give_overlaid_plots_and_a_summary(tmp_path):
    ddp = write_run(tmp_path / "ddp", rate=1000.0)
    zero = write_run(tmp_path / "zero2", rate=800.0, base_loss=4.0)
    out = tmp_path / "report"
    result = make_report([ddp, zero], out)

    names = sorted(p.name for p in result.plots)
    assert names == ["eval.png", "loss.png", "lr.png", "memory.png", "throughput.png"]
    for plot in result.plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert plot.stat().st_size > 10_000

    text = result.summary_path.read_text()
    assert "ddp" in text and "zero2" in text
    by_name = {run.name: run for run in result.runs}
    assert by_name["ddp"].steps == 100
    assert by_name["ddp"].final_loss == pytest.approx(5.0 * math.exp(-100 / 40) + 1.0)
    # the slow first 10% of steps are left out of the mean
    assert by_name["ddp"].mean_tokens_per_s == pytest.approx(1000.0)
    assert by_name["zero2"].mean_tokens_per_s == pytest.approx(800.0)
    assert by_name["ddp"].wall_s == pytest.approx(51.0)
    assert by_name["ddp"].final_eval["eval_loss"] == pytest.approx(by_name["ddp"].final_loss + 0.1)
    assert "tokens/s         1000.0" in text
    assert f"final loss       {by_name['zero2'].final_loss:.4f}" in text
    assert "wall time        51.0 s" in text
    assert "world 4, dp 2, tp 2, pp 1, ZeRO 1" in text


def test_a_crashed_run_without_memory_or_eval_still_reports(tmp_path):
    run = tmp_path / "crashed"
    run.mkdir()
    lines = [HEADER] + [
        {"type": "train", "step": s, "loss": 3.0, "lr": 1e-4, "tokens_per_s": 50.0, "elapsed_s": s}
        for s in (10, 20, 30)
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"type": "train", "st'
    (run / "metrics.jsonl").write_text(text)
    result = make_report([run], tmp_path / "out")
    assert sorted(p.name for p in result.plots) == ["loss.png", "lr.png", "throughput.png"]
    summary = result.runs[0]
    assert not summary.completed and summary.steps == 30 and summary.wall_s == 30
    assert "crashed" in result.summary_path.read_text()
    assert read_metrics(run).unreadable_lines == 1


def test_a_resumed_run_adds_up_its_segments_and_keeps_the_later_lines(tmp_path):
    run = tmp_path / "resumed"
    run.mkdir()
    first = [HEADER] + [
        {"type": "train", "step": s, "loss": 4.0, "lr": 1e-4, "tokens_per_s": 10.0, "elapsed_s": s}
        for s in (10, 20, 30)
    ]
    # preempted after step 30, checkpoint at 20: steps 21-30 run again
    second = [HEADER] + [
        {
            "type": "train",
            "step": s,
            "loss": 2.0,
            "lr": 1e-4,
            "tokens_per_s": 10.0,
            "elapsed_s": s - 20,
        }
        for s in (30, 40)
    ]
    second.append({"type": "summary", "step": 40, "wall_s": 21.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in first + second))
    metrics = read_metrics(run)
    assert [r["step"] for r in metrics.train] == [10, 20, 30, 40]
    assert metrics.train[2]["loss"] == 2.0
    assert metrics.segments == 2 and metrics.wall_s == 30 + 21
    summary = make_report([run], tmp_path / "out").runs[0]
    assert summary.completed and summary.steps == 40


def test_classification_accuracy_is_in_the_summary(tmp_path):
    run = write_run(tmp_path / "cls", task="sequence-classification", memory=False)
    result = make_report([run], tmp_path / "out")
    assert result.runs[0].final_eval["eval_accuracy"] == pytest.approx(1.0)
    assert "eval_accuracy    1.0000" in result.summary_path.read_text()
    assert "memory.png" not in {p.name for p in result.plots}


def test_runs_with_the_same_folder_name_get_distinct_labels(tmp_path):
    a = write_run(tmp_path / "a" / "run")
    b = write_run(tmp_path / "b" / "run")
    result = make_report([a, b], tmp_path / "out")
    assert [r.name for r in result.runs] == ["a/run", "b/run"]


def test_a_folder_without_metrics_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no metrics.jsonl"):
        make_report([tmp_path], tmp_path / "out")
