"""The benchmarks' interleaving harness really takes turns: while one contender trains, the others
(launcher and the processes it starts in sessions of their own, like torchrun's ranks) are frozen.

Not a benchmark: nothing here asserts how long anything took, only the order of the steps. Also
what the comparisons compute from their runs (the LoRA contenders' adapters, long context's
activation memory).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import RunFailed
from benchmarks.interleave import Contender, interleave
from tests.helpers import REPO

# a launcher that starts its "rank" in a new session and waits for it; the rank writes a clock
# line (step, wall time) after each step, as the contenders' step clocks do
FAKE_CONTENDER = """
import json, subprocess, sys, time
clock, steps, fail_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if sys.argv[4:] != ["rank"]:
    rank = subprocess.Popen([sys.executable, __file__, *sys.argv[1:4], "rank"], start_new_session=True)
    sys.exit(rank.wait())
with open(clock, "w", buffering=1) as out:
    for step in range(1, steps + 1):
        time.sleep(0.03)
        if step == fail_at:
            sys.exit(3)
        out.write(json.dumps({"step": step, "time": time.time()}) + "\\n")
"""
WARMUP, ROUNDS, TURN = 2, 3, 3
# steps a contender may take past a target before its freeze lands (a loaded machine reads its
# clock and signals it late): without them it could run out of steps before its last turn
OVERSHOOT = 20


def contender(folder: Path, name: str, fail_at: int = 0) -> Contender:
    script = folder / "fake_contender.py"
    script.write_text(FAKE_CONTENDER)
    clock = folder / f"{name}.jsonl"
    steps = WARMUP + (ROUNDS + 1) * TURN + OVERSHOOT
    return Contender(
        name,
        [sys.executable, str(script), str(clock), str(steps), str(fail_at)],
        {},
        folder / f"{name}.log",
        clock,
        lambda record: (record["step"], record["time"]),
    )


def test_contenders_train_by_turns_and_only_steps_inside_a_turn_count(tmp_path):
    import time

    turns = {name: [contender(tmp_path, name)] for name in ("a", "b")}
    rounds_done: list[float] = []  # said after each round, before the last one thaws them all
    measured = interleave(
        turns,
        warmup=WARMUP,
        rounds=ROUNDS,
        turn_steps=TURN,
        say=lambda _: rounds_done.append(time.time()),
    )
    assert {name: len(values) for name, values in measured.step_s.items()} == {"a": 3, "b": 3}
    assert set(measured.to_first_step) == {"a", "b"}
    assert len(rounds_done) == ROUNDS

    # every step after the warmup target up to the end of the rounds, both contenders, in the
    # order they happened. The end is a time, not a step: under load a contender runs a step or
    # more past a target before its freeze lands, and a fixed step window then cut a turn short
    timeline = sorted(
        (record["time"], name)
        for name in ("a", "b")
        for record in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())
        if record["step"] > WARMUP and record["time"] <= rounds_done[-1]
    )
    assert all(sum(n == name for _, n in timeline) >= ROUNDS * TURN for name in ("a", "b"))
    blocks: list[list[str]] = []
    for _, name in timeline:
        if blocks and blocks[-1][0] == name:
            blocks[-1].append(name)
        else:
            blocks.append([name])
    # the first two blocks may be short: a contender can finish steps between reaching WARMUP
    # and being frozen. After them, a contender that was not frozen (its rank runs in a session
    # of its own) would step in between the other's steps: blocks shorter than a turn
    assert len(blocks) >= 4 and all(len(block) >= TURN for block in blocks[2:]), blocks


def test_a_contender_that_fails_during_a_turn_is_reported_and_nothing_is_left_running(tmp_path):
    import psutil

    turns = {"a": [contender(tmp_path, "a")], "b": [contender(tmp_path, "b", fail_at=6)]}
    with pytest.raises(RunFailed, match=r"^b \(.*exited with 3 before step"):
        interleave(turns, warmup=WARMUP, rounds=ROUNDS, turn_steps=TURN, say=lambda _: None)
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path / "fake_contender.py") in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == []


def test_the_lora_comparison_gives_hf_trainer_the_adapters_dplaunch_trains():
    # benchmarks/lora.py: HF Trainer + PEFT must train exactly the parameters `dplaunch train
    # --lora 16` trains on the benchmark model, or the tokens/s ratio compares other work
    import yaml

    pytest.importorskip("peft")
    from benchmarks import lora, run
    from benchmarks.contenders.common import build_model
    from benchmarks.contenders.hf_trainer import with_lora
    from dplaunch.config.schema import ModelConfig
    from dplaunch.train.modeling import load_model
    from dplaunch.train.tokenizer import byte_level_tokenizer

    assert run.COMPARISONS["lora"] is lora and lora in run.DEFAULT
    bench = yaml.safe_load(lora.CONFIG.read_text())
    settings = ModelConfig.model_validate({**bench["model"], "lora": {"r": int(lora.RANK)}})
    ours = load_model(settings, byte_level_tokenizer(), seed=bench["train"]["seed"])
    peers = with_lora(build_model(bench, pad_token_id=0), settings.lora.model_dump())

    def trained(model):
        return {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}

    assert trained(peers) == trained(ours) and len(trained(ours)) == 4 * 7 * 2
    assert peers.peft_config["default"].lora_alpha == ours.peft_config["default"].lora_alpha == 32


def test_the_long_context_comparison_charges_sp_the_activations_over_its_runs_own_baseline():
    # what sp divides is the activations: rank 0's peak less the same run's memory with the model
    # and engine built (the header's memory_at_start_gb), not the whole process; the longest
    # length is the grid's climb within a budget fixed in the code before the runs
    from benchmarks import long_context

    records = [
        {"type": "header", "memory_at_start_gb": 0.65},
        {"type": "train", "step": 1, "memory_gb": 1.2, "tokens_per_s": 100.0},
        {"type": "train", "step": 2, "memory_gb": 1.4, "tokens_per_s": 120.0},
    ]
    numbers = long_context.activation_memory(records)
    assert numbers["activation_gb"] == 0.75 and numbers["tokens_per_s"] == 120.0
    climb = {"1024": {"activation_gb": 0.4}, "2048": {"activation_gb": 0.9},
             "3072": {"failed": "killed"}, "4096": {"activation_gb": 0.95}}  # fmt: skip
    assert long_context.longest_within_budget(climb, 1.0) == 2048
    assert long_context.longest_within_budget({"1024": {"activation_gb": 1.2}}, 1.0) == 0
    # the recorded result was measured under the budget the code holds, and reads as it says
    recorded = json.loads((REPO / "benchmarks" / "results" / "long_context.json").read_text())
    assert recorded["activation_budget_gb"] == long_context.ACTIVATION_BUDGET_GB
    for name, runs in recorded["runs"].items():
        longest = long_context.longest_within_budget(runs, recorded["activation_budget_gb"])
        assert longest == recorded["longest_within_budget"][name], name
        slope = long_context.per_thousand_tokens(runs)
        assert slope == recorded["activation_gb_per_1k_tokens"][name], name


SUITE_CPU_TEST = """
import subprocess, sys


def test_starts_processes():
    subprocess.run([sys.executable, "-m", "dplaunch", "--help"], check=True, capture_output=True)
    subprocess.run([sys.executable, "-c", "sum(range(3 * 10**7))"], check=True)
"""


def test_the_suite_profile_counts_the_cpu_of_the_processes_each_test_starts(tmp_path):
    # benchmarks/suite_cpu.py: a real pytest run with its tracer; the CLI's process and the
    # busy one are seen, each under its kind and the test that started it
    test_file = tmp_path / "test_profiled.py"
    test_file.write_text(SUITE_CPU_TEST)
    records = tmp_path / "records.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite_cpu", "--keep", str(records), str(test_file),
         "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    from benchmarks.suite_cpu import read_records

    processes = list(read_records(records.read_text().splitlines()).values())
    kinds = {process.kind for process in processes}
    assert {"pytest", "dplaunch --help", "other python"} <= kinds, kinds
    busy = next(p for p in processes if "sum(range(3 * 10**7))" in p.argv)
    assert busy.test.endswith("test_profiled.py::test_starts_processes"), busy.test
    assert busy.cpu is not None and busy.cpu > 0.1
    table = result.stdout.split("CPU of the processes each test started")[1]
    assert "test_profiled.py::test_starts_processes" in table
    assert "dplaunch --help" in result.stdout.split("CPU of the processes each test file")[0]


def test_a_forked_process_that_records_only_its_exit_is_counted():
    # a rank the suite's fork server forks inherits the tracer: no start record, its exit has
    # its own command line, test and CPU
    from benchmarks.suite_cpu import read_records

    rank = ["python", "-u", "-m", "dplaunch.train", "/run"]
    records = [
        {
            "kind": "start",
            "pid": 7,
            "argv": ["python", "-m", "x"],
            "test": "t.py::a (call)",
            "cpu": 0.0,
        },
        {
            "kind": "exit",
            "pid": 7,
            "argv": ["python", "-m", "x"],
            "test": "t.py::a (call)",
            "cpu": 1.5,
        },
        {"kind": "exit", "pid": 9, "argv": rank, "test": "t.py::b (setup)", "cpu": 2.5},
    ]
    processes = read_records(json.dumps(record) for record in records)
    assert (processes[7].cpu, processes[9].cpu, processes[9].test) == (1.5, 2.5, "t.py::b")
    assert processes[9].kind == "rank (python -m dplaunch.train)"
