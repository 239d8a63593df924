"""Rank 0's terminal: a live progress bar on an interactive terminal, one line per logged step
in a file or a SLURM log (the multi-process tests read those lines as they always did)."""

from __future__ import annotations

import io
import re

import pytest

from dplaunch.run_directory.environment import PROGRESS_ENV
from dplaunch.train.metrics import REDRAW, RankPrinter, RedrawnLines
from tests.helpers import TINY_LLAMA, child_environment, read_metrics, run_dplaunch


def record(loss: float, tokens_per_s: float, elapsed_s: float) -> dict:
    return {"loss": loss, "lr": 1e-4, "tokens_per_s": tokens_per_s, "elapsed_s": elapsed_s}


def test_without_a_terminal_each_logged_step_is_one_line_as_before():
    out = io.StringIO()
    say = RankPrinter(True, stream=out)
    say.train_step(5, 20, record(1.23456, 1234.4, 5.0), 0)
    say("eval  step 5")
    assert out.getvalue() == "step 5/20  loss 1.2346  lr 1.00e-04  tokens/s 1234\neval  step 5\n"


def test_a_logged_step_shows_the_tokens_read_and_the_data_loaders_share_of_the_time():
    out = io.StringIO()
    RankPrinter(True, stream=out).train_step(
        5, 20, {**record(1.0, 2000.0, 5.0), "tokens": 1_234_567, "data_share": 0.234}, 0
    )
    assert out.getvalue().endswith("tokens/s 2000  tokens 1.2M  data 23%\n")
    bar = io.StringIO()
    RankPrinter(True, stream=bar, width=160).train_step(
        5, 20, {**record(1.0, 2000.0, 5.0), "tokens": 5_000, "data_share": 0.5}, 0
    )
    assert "tokens 5.0k  data 50%  ETA" in bar.getvalue()


def test_on_a_terminal_the_bar_shows_step_loss_tokens_and_eta_and_redraws_in_place():
    out = io.StringIO()
    say = RankPrinter(True, stream=out, width=120)
    say.train_step(15, 40, record(1.23456, 12345.0, 10.0), 10)  # 5 steps in 10 s, 25 to go
    first = out.getvalue()
    for field in ("step 15/40", "38%", "loss 1.2346", "tokens/s 12,345", "ETA 0:00:50"):
        assert field in first, (field, first)
    assert first.count("\n") == 1 and not first.startswith(REDRAW)
    say("eval  step 15  eval_loss 1.0")  # above the bar, which is drawn again below it
    say.train_step(40, 40, record(0.5, 12000.0, 60.0), 10)
    rest = out.getvalue()[len(first) :].split("\n")
    assert rest[0] == REDRAW + "eval  step 15  eval_loss 1.0"
    assert rest[1] == first.rstrip("\n")
    assert rest[2].startswith(REDRAW) and "step 40/40" in rest[2] and "ETA 0:00:00" in rest[2]
    say("[dplaunch] exported")  # the finished bar stays; the rest goes below it
    assert out.getvalue().endswith("ETA 0:00:00\n[dplaunch] exported\n")


@pytest.mark.parametrize("width", [40, 60, 80, 100, 130])
def test_a_narrow_terminal_loses_the_least_useful_fields_never_the_step_count_or_the_eta(width):
    out = io.StringIO()
    full = {**record(1.0, 12345.0, 10.0), "mfu": 0.0123, "tokens": 1_234_567, "data_share": 0.5}
    RankPrinter(True, stream=out, width=width).train_step(1234, 5000, full, 1224)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue()).rstrip("\n")
    assert len(shown) <= width and "…" not in shown, shown
    assert shown.startswith("step 1234/5000 ━") and shown.endswith("ETA 1:02:46"), shown
    if width == 130:  # the bar gives up cells before any field goes
        assert "tokens/s 12,345  MFU 1.2%  tokens 1.2M  data 50%" in shown, shown


def test_tqdm_redraws_become_lines_that_replace_each_other():
    out = io.StringIO()
    stream = RedrawnLines(out)
    stream.write("\rtokenising:  10%|#")
    stream.write("\rtokenising: 100%|##########|")
    stream.write("\n")
    stream.write("a warning\n")
    assert out.getvalue().split("\n") == [
        "tokenising:  10%|#",
        REDRAW + "tokenising: 100%|##########|",
        "a warning",
        "",
    ]


def test_disabled_ranks_print_nothing():
    out = io.StringIO()
    say = RankPrinter(False, stream=out, width=80)
    say("hello")
    say.train_step(1, 2, record(1.0, 1.0, 1.0), 0)
    assert out.getvalue() == ""


@pytest.mark.multiprocess
def test_a_run_on_a_terminal_draws_the_bar_and_tokenising_progress(tmp_path):
    """dplaunch passes the terminal's width to the ranks when its stdout is one; forced here."""
    env = child_environment(**{PROGRESS_ENV: "100", "HF_DATASETS_CACHE": str(tmp_path / "cache")})
    result = run_dplaunch("train", TINY_LLAMA, "--gpus", "1", "-o", tmp_path / "run", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ETA 0:00:00" in result.stdout and REDRAW in result.stdout
    assert "step 8/8  loss" not in result.stdout  # no plain step lines on a terminal
    assert "tokenising: 100%" in result.stderr  # datasets' progress, relayed line by line
    records = [r for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 9))  # metrics.jsonl as always
