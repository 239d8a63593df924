"""Checkpoints never lose work: exact resume, a killed rank, a full disk, SIGTERM, conversion, export.

Real 2-rank CPU runs of the tiny Llama on 44 reviews: 27 training samples, so global batch 8 gives 3
steps per epoch and an 8-step run crosses epoch boundaries at steps 3 and 6. Layouts: DDP, ZeRO-2,
ZeRO-3, tensor parallel (AutoTP) and pipeline parallel.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dplaunch.commands.export import run_export
from dplaunch.config.schema import RunConfig
from dplaunch.train.modeling import load_model, load_tokenizer
from tests.helpers import (
    DDP,
    FAULT,
    REPO,
    TINY_LLAMA,
    child_environment,
    files_under,
    finish_train,
    latest,
    losses_by_step,
    max_relative_gap,
    rank_pids,
    read_metrics,
    refusal_line,
    run_dplaunch,
    start_train,
    train,
    train_losses,
    wait_while_running,
    write_config,
)

pytestmark = pytest.mark.multiprocess

# micro batch 4: grad-accum 1 on 2 ranks, 2 on 1 rank (recomputed when the GPU count changes)
ZERO2 = ("--cpu", "--zero", "2", "--micro-batch", "4")
HYBRID = {
    "tp2": ("--cpu", "--gpus", "2", "--tp", "2"),
    "pp2": ("--cpu", "--gpus", "2", "--pp", "2"),
}


def test_a_run_survives_a_killed_rank_and_sigterm_with_the_exact_losses(tmp_path, run_file):
    straight = tmp_path / "straight"
    train(straight, *DDP, config=run_file)
    header = read_metrics(straight)[0]
    assert (header["steps_per_epoch"], header["total_steps"]) == (3, 8)  # crosses 2 epoch ends
    # finished without a checkpoint: --resume auto would train it again over its model: refused
    before = files_under(straight)
    line = refusal_line(
        run_dplaunch("train", run_file, "-o", straight, *DDP, "--resume", "auto", "--dry-run"),
        f"--resume: {straight} finished at step 8 and kept no checkpoint: --resume auto would "
        "train it again from step 0 and replace its model — choose another --output-dir (with "
        f"model.name_or_path: {straight / 'model'} to train the result further)",
    )
    assert files_under(straight) == before, line

    run = tmp_path / "run"
    every_2 = ("--set", "train.checkpoint_every=2", "--resume", "auto")
    # 1. kill -9 of rank 0 while checkpoint step 4 is written but not yet committed
    process = start_train(run_file, run, *DDP, *every_2, **{FAULT: "4:sleep=6"})
    temp = run / "checkpoints" / ".tmp-step-4"
    wait_while_running(lambda: (temp / "random_states_1.pkl").exists(), "the step-4 save", process)
    os.kill(rank_pids(run)[0], signal.SIGKILL)
    code, log = finish_train(process, run)
    assert "starting from step 0" in log  # --resume auto without a checkpoint: fresh, and says so
    assert code not in (0, 75), log[-3000:]
    assert latest(run) == "step-2" and not (run / "checkpoints" / "step-4").exists()

    # 2. the next --resume auto continues from step 2; SIGTERM while step 6 is being saved (and
    #    torchrun's second SIGTERM): the save completes, the ranks stop there, dplaunch exits 75
    process = start_train(run_file, run, *DDP, *every_2, **{FAULT: "6:sleep=6"})
    temp = run / "checkpoints" / ".tmp-step-6"
    wait_while_running(lambda: (temp / "random_states_1.pkl").exists(), "the step-6 save", process)
    process.send_signal(signal.SIGTERM)
    code, log = finish_train(process, run)
    assert code == 75, log[-3000:]
    assert f"resume: {run / 'checkpoints' / 'step-2'} (step 2" in log
    assert latest(run) == "step-6"
    stopped = json.loads((run / "stopped.json").read_text())
    assert (stopped["step"], stopped["reason"], stopped["exit_status"]) == (6, "SIGTERM", 75)
    saved = json.loads((run / "checkpoints" / "step-6" / "checkpoint.json").read_text())
    assert (saved["step"], saved["epoch"], saved["step_in_epoch"]) == (6, 2, 0)
    # keep_last 2: step-2 rotated out once step-6 was complete; the killed save's leftovers are gone
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-4", "step-6"]

    # 3. resume: steps 7 and 8; every step's loss and the final weights exactly as straight
    result = train(run, *DDP, *every_2, config=run_file)
    assert f"resume: {run / 'checkpoints' / 'step-6'} (step 6" in result.stdout
    assert losses_by_step(run) == losses_by_step(straight)
    assert [r["step"] for r in read_metrics(run) if r["type"] == "train"][-2:] == [7, 8]
    resumed, uninterrupted = (
        load_file(str(d / "model" / "model.safetensors")) for d in (run, straight)
    )
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)

    # the export of the run's newest checkpoint (step 8) gives the run's final weights
    exported = tmp_path / "exported"
    assert run_export(run, exported) == 0  # `dplaunch export RUN --out DIR`, in this process
    weights = load_file(str(exported / "model.safetensors"))
    assert all(torch.equal(weights[name], resumed[name]) for name in resumed)


@pytest.fixture(scope="module")
def zero2_runs(tmp_path_factory, run_file) -> tuple[Path, Path]:
    """A straight 2-rank ZeRO-2 run, and one stopped by train.stop_after_steps=4 (kept pristine)."""
    root = tmp_path_factory.mktemp("zero2")
    straight, stopped = root / "straight", root / "stopped"
    train(straight, *ZERO2, "--gpus", "2", config=run_file)
    stop_4 = ("--set", "train.stop_after_steps=4")
    result = train(stopped, *ZERO2, "--gpus", "2", *stop_4, config=run_file)  # exit status 0
    assert "stopped at step 4 (train.stop_after_steps)" in result.stderr
    assert latest(stopped) == "step-4" and not (stopped / "model").exists()
    return straight, stopped


def test_zero2_stopped_at_step_4_resumes_with_bit_identical_losses(tmp_path, zero2_runs, run_file):
    straight, stopped = zero2_runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    result = train(run, *ZERO2, "--gpus", "2", "--resume", "auto", config=run_file)
    assert "DEEPSPEED" in result.stdout and "the next batch is step 5" in result.stdout
    assert losses_by_step(run) == losses_by_step(straight)


def test_a_2_rank_zero2_checkpoint_continues_on_1_rank_and_a_full_disk_keeps_the_last_one(
    tmp_path, zero2_runs, run_file
):
    straight, stopped = zero2_runs
    run = tmp_path / "one-rank"
    # the disk fills up (RLIMIT_FSIZE) while step 8 is saved; step 6 was saved before
    result = run_dplaunch(
        "train", run_file, "-o", run, *ZERO2, "--gpus", "1",
        "--resume", stopped / "checkpoints" / "step-4", "--set", "train.checkpoint_every=2",
        env=child_environment(**{FAULT: "8:max_file_bytes=100000"}),
    )  # fmt: skip
    out = result.stdout + result.stderr
    # converted through the universal form; the global batch is kept with grad-accum 2
    assert "conversion: ZeRO-2 dp 2 → ZeRO-2 dp 1" in out and "grad-accum 1 → 2" in out, out[-3000:]
    losses, reference = losses_by_step(run), losses_by_step(straight)
    assert sorted(losses) == [5, 6, 7, 8]
    gap = max_relative_gap([losses[s] for s in range(5, 9)], [reference[s] for s in range(5, 9)])
    assert gap < 1e-5, (losses, reference)  # the same maths, summed in another order
    one_rank = json.loads((run / "checkpoints" / "step-6" / "checkpoint.json").read_text())
    assert (one_rank["world_size"], one_rank["gradient_accumulation_steps"]) == (1, 2)
    assert not (run / "checkpoints" / "universal-step-4").exists()  # served its purpose
    # the failed save is reported with what is still valid
    assert result.returncode == 1, out[-3000:]
    assert "could not write checkpoint step 8" in result.stderr, result.stderr[-3000:]
    assert "step-6 (step 6) is intact" in result.stderr
    assert latest(run) == "step-6" and not (run / "checkpoints" / "step-8").exists()


def _count_steps_until_stop(rank: int, port: int, folder: str) -> None:
    """One of two real gloo ranks stepping like the loop does: stop when any rank got a signal."""
    import torch.distributed as dist

    from dplaunch.stop_signals import StopSignals
    from dplaunch.train.control import ControlChannel

    signals = StopSignals()
    signals.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    control = ControlChannel(timeout_minutes=1)
    (Path(folder) / f"pid-{rank}").write_text(str(os.getpid()))
    step = 0
    while not control.any(signals.received is not None) and step < 3000:
        step += 1
        time.sleep(0.01 * (rank + 1))  # the ranks do not run in step
    (Path(folder) / f"rank-{rank}").write_text(json.dumps([step, signals.received]))
    dist.destroy_process_group()


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    import multiprocessing

    from dplaunch.launching.ports import free_port

    port, spawn = free_port(), multiprocessing.get_context("spawn")
    ranks = [
        spawn.Process(target=_count_steps_until_stop, args=(rank, port, str(tmp_path)))
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "pid-1").exists() or not (tmp_path / "pid-0").exists():
        assert time.monotonic() < deadline and all(p.is_alive() for p in ranks)
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGUSR1)  # only rank 1 hears it
    for process in ranks:
        process.join(60)
        assert process.exitcode == 0
    (step_0, heard_0), (step_1, heard_1) = (
        json.loads((tmp_path / f"rank-{rank}").read_text()) for rank in (0, 1)
    )
    assert (heard_0, heard_1) == (None, "SIGUSR1")
    assert step_0 == step_1 < 3000


def test_a_checkpoint_that_cannot_continue_this_run_is_refused_before_launch(
    tmp_path, zero2_runs, run_file
):
    _, stopped = zero2_runs
    checkpoint = stopped / "checkpoints" / "step-4"
    cases = [
        (("--zero", "2", "--set", "train.seed=8"), "train.seed: "),
        (("--zero", "2", "--global-batch", "16"), "train.global_batch_size: "),
        (("--zero", "2", "--set", "data.max_length=32"), "data: differs from the checkpoint's"),
    ]
    for extra, message in cases:
        run = tmp_path / "new"
        flags = ("--cpu", "--gpus", "2", "--micro-batch", "4", *extra, "--resume", checkpoint)
        result = run_dplaunch("train", run_file, "-o", run, *flags)
        assert result.returncode == 2, (extra, result.stdout[-1000:], result.stderr[-2000:])
        assert result.stderr.startswith(f"dplaunch: error: {message}"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and not run.exists()


def assert_same_logits(model_dir: Path, reference_dir: Path) -> None:
    """Both HF models, loaded by from_pretrained on one process, give the same logits."""
    from transformers import AutoModelForCausalLM

    inputs = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reference = AutoModelForCausalLM.from_pretrained(reference_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(inputs).logits, reference(inputs).logits, rtol=0, atol=1e-6
        )


def test_export_of_a_two_rank_zero3_checkpoint_gives_the_trained_model(tmp_path, run_file):
    run = tmp_path / "zero3"
    zero3 = ("--cpu", "--gpus", "2", "--zero", "3", "--max-steps", "4")
    trained = train(run, *zero3, "--set", "train.checkpoint_every=4", config=run_file)
    # before: 26 FutureWarning lines of DeepSpeed's deprecated collective names, and every rank
    # saying it "built" the op it loaded
    for noise in ("FutureWarning", "built successfully", "Traceback"):
        assert noise not in trained.stdout + trained.stderr, noise
    exported = tmp_path / "exported"
    result = run_dplaunch("export", run / "checkpoints" / "step-4", "--out", exported)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(step 4, ZeRO-3 dp 2) to " in result.stdout
    # before: zero_to_fp32's own four lines between these two ("Processing zero checkpoint …")
    exporting, wrote = result.stdout.splitlines()
    assert exporting.startswith("exporting ") and wrote.startswith(f"wrote {exported} (")
    # before: DeepSpeed's "Setting accelerator to CPU" warning and a shard bar
    assert not result.stderr.strip(), result.stderr
    assert_same_logits(exported, run / "model")
    # the trained weights: not ZeRO-3's empty (0-element) partitions, not the initial ones
    weights = load_file(str(exported / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (259, 64)
    config = RunConfig.model_validate(yaml.safe_load((run / "run.yaml").read_text()))
    initial = load_model(config.model, load_tokenizer(config.model), config.train.seed)
    moved = [
        (weights[name] - parameter.detach()).abs().max().item()
        for name, parameter in initial.named_parameters()
    ]
    assert min(moved) > 1e-4, moved  # every tensor trained
    # a checkpoint of an older dplaunch (no digests) that lost a rank's shard: whatever fails
    # while reading it is one line, and the --out folder it created is gone again
    broken = tmp_path / "broken"
    shutil.copytree(run / "checkpoints" / "step-4", broken)
    forget_digests(broken)
    next(broken.glob("pytorch_model/*optim_states.pt")).unlink()
    refusal_line(
        run_dplaunch("export", broken, "--out", tmp_path / "new" / "model"),
        f"CHECKPOINT: {broken} could not be read (",
    )
    assert not (tmp_path / "new").exists()


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory, run_file):
    """(straight 8 steps, 4 steps by stop_after_steps + 4 after --resume auto) of a layout, run once."""
    runs: dict[str, tuple[Path, Path]] = {}

    def get(layout: str) -> tuple[Path, Path]:
        if layout not in runs:
            root, flags = tmp_path_factory.mktemp(layout), HYBRID[layout]
            straight, run = root / "straight", root / "run"
            train(straight, *flags, config=run_file)
            result = train(run, *flags, "--set", "train.stop_after_steps=4", config=run_file)
            assert "stopped at step 4 (train.stop_after_steps)" in result.stderr
            assert latest(run) == "step-4" and not (run / "model").exists()
            # the resumed launch also checkpoints its last step (for the export test)
            every_4 = ("--set", "train.checkpoint_every=4")
            result = train(run, *flags, "--resume", "auto", *every_4, config=run_file)
            assert "the next batch is step 5" in result.stdout, result.stdout[-3000:]
            runs[layout] = straight, run
        return runs[layout]

    return get


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tp_and_pp_stopped_at_step_4_resume_with_bit_identical_losses(hybrid_runs, layout):
    straight, run = hybrid_runs(layout)
    header = read_metrics(run)[0]
    mesh = (header["tensor_parallel_size"], header["pipeline_parallel_size"])
    assert mesh == {"tp2": (2, 1), "pp2": (1, 2)}[layout]
    # steps 5-8 after the resume, across the epoch boundary at step 6, bit for bit
    assert [r["step"] for r in read_metrics(run) if r["type"] == "train"][-4:] == [5, 6, 7, 8]
    assert losses_by_step(run) == losses_by_step(straight)
    resumed, uninterrupted = (
        load_file(str(d / "model" / "model.safetensors")) for d in (run, straight)
    )
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


def test_export_of_a_tp2_checkpoint_gives_the_trained_model_in_one_process(tmp_path, hybrid_runs):
    _, run = hybrid_runs("tp2")
    exported, scratch = tmp_path / "exported", tmp_path / "tmp"
    scratch.mkdir()
    # the run directory: its newest checkpoint, step 8; the export job's run directory goes to TMPDIR
    result = run_dplaunch(
        "export", run, "--out", exported, env=child_environment(TMPDIR=str(scratch))
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(step 8, AutoTP dp 1 × tp 2)" in result.stdout
    assert "export job: 2 CPU rank(s) join the tp 2 shards" in result.stdout
    assert list(scratch.iterdir()) == []  # the temporary run directory is gone
    weights = load_file(str(exported / "model.safetensors"))
    # whole weights, not a rank's AutoTP shard
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert (exported / "tokenizer.json").is_file()
    # RUN/model: what the tp2 engine itself exported at the end of training (step 8)
    assert_same_logits(exported, run / "model")

    # a checkpoint that lost a rank's weights: one line before launch, nothing written
    broken = tmp_path / "broken"
    shutil.copytree(run / "checkpoints" / "step-8", broken)
    (broken / "pytorch_model" / "mp_rank_01_model_states.pt").unlink()
    result = run_dplaunch("export", broken, "--out", tmp_path / "never")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert (
        result.stderr.startswith("dplaunch: error: CHECKPOINT: ") and "mp_rank_01" in result.stderr
    )
    assert not (tmp_path / "never").exists()


def test_a_run_counts_as_finished_only_when_its_newest_launch_wrote_a_summary(tmp_path):
    from dplaunch.run_directory.files import _lines_from_the_end, finished_at

    def records(*kinds: str) -> None:
        lines = [json.dumps({"type": kind, "step": 8}) for kind in kinds]
        (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    assert finished_at(tmp_path) is None  # no metrics at all
    records("header", "train", "summary")
    assert finished_at(tmp_path) == 8
    records("header", "train", "summary", "header", "train")  # started again, then killed
    assert finished_at(tmp_path) is None
    records("header", "train", "stop")  # stopped on a signal
    assert finished_at(tmp_path) is None
    records("header", "summary", "header", "train", "summary")
    with (tmp_path / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"type": "tra')  # a line cut short
    assert finished_at(tmp_path) == 8
    # read from the end block by block: lines that straddle blocks come back whole
    lines = (tmp_path / "metrics.jsonl").read_bytes().split(b"\n")
    for block in (3, 7, 64):
        assert list(_lines_from_the_end(tmp_path / "metrics.jsonl", block)) == lines[::-1]


def test_the_other_nodes_wait_for_node_0s_universal_conversion_and_give_up_in_time(tmp_path):
    import threading

    from dplaunch.commands.train import _reshard
    from dplaunch.errors import UserError
    from dplaunch.launching.reshard import _universal_done, _universal_source, wait_for_universal
    from dplaunch.launching.resume import ResumePoint
    from dplaunch.run_directory.checkpoints import CheckpointInfo

    source = CheckpointInfo(tmp_path / "other-run" / "checkpoints" / "step-4", {"step": 4})
    point = ResumePoint(source, tmp_path / "run", convert=True)
    said: list[str] = []
    # node 0 finishes its conversion (an atomic rename of a folder holding "done") a bit later
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "done").write_text(_universal_source(point))
    point.load_dir.parent.mkdir(parents=True)
    finisher = threading.Timer(0.5, os.rename, (converted, point.load_dir))
    finisher.start()
    started = time.monotonic()
    wait_for_universal(point, limit_s=30, say=said.append, poll_s=0.05)
    assert time.monotonic() - started >= 0.4  # it did wait, for the rename
    assert said == [f"waiting for node 0 to convert step-4 into {point.load_dir}…"]
    # SLURM's time-limit warning reaches this node while it waits: noted, not lost, the wait goes on
    later = ResumePoint(source, tmp_path / "run-3", convert=True)
    later.load_dir.parent.mkdir(parents=True)
    (converted := tmp_path / "converted-3").mkdir()
    (converted / "done").write_text(_universal_source(later))
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    threading.Timer(0.5, os.rename, (converted, later.load_dir)).start()
    other_node = SimpleNamespace(plan=SimpleNamespace(node_rank=1, timeout_minutes=1))
    # where the signal goes if _reshard does not take it (instead of killing pytest)
    missed: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, _frame: missed.append(signum))
    try:
        assert _reshard(other_node, later) == "SIGUSR1" and not missed
        assert _universal_done(later)
    finally:
        signal.signal(signal.SIGUSR1, before)
    # the same step of another checkpoint converted into the same place is not this conversion
    another = CheckpointInfo(tmp_path / "third-run" / "checkpoints" / "step-4", {"step": 4})
    assert not _universal_done(ResumePoint(another, tmp_path / "run", convert=True))

    # a node 0 that never finishes: an error naming the setting, not a hang
    stuck = ResumePoint(source, tmp_path / "run-2", convert=True)
    with pytest.raises(UserError, match=r"node 0 has not converted .* after 0\.005 min"):
        wait_for_universal(stuck, limit_s=0.3, say=said.append, poll_s=0.05)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, run_file) -> tuple[Path, Path]:
    """A straight 1-rank DDP run, and one stopped by train.stop_after_steps=4 (kept pristine)."""
    root = tmp_path_factory.mktemp("ddp")
    straight, stopped = root / "straight", root / "stopped"
    train(straight, "--cpu", "--gpus", "1", config=run_file)
    train(stopped, "--cpu", "--gpus", "1", "--set", "train.stop_after_steps=4", config=run_file)
    return straight, stopped


@pytest.mark.parametrize("layout", ["ddp", "zero2", "pp2"])
def test_a_learning_rate_changed_on_resume_takes_effect(
    tmp_path, ddp_runs, zero2_runs, hybrid_runs, run_file, layout
):
    # a checkpoint restores the scheduler's base lr; the resumed run must use the run file's (the
    # schedule's position is the checkpoint's): twice the lr, twice the straight run's each step
    if layout == "ddp":
        flags = ("--cpu", "--gpus", "1")
        straight, stopped = ddp_runs
    elif layout == "zero2":
        flags = (*ZERO2, "--gpus", "2")
        straight, stopped = zero2_runs
    else:
        flags = HYBRID[layout]
        straight, stopped = hybrid_runs(layout)
    run = tmp_path / "resumed"
    lr = yaml.safe_load(run_file.read_text())["train"]["lr"]
    result = train(
        run,
        *flags,
        "--resume",
        stopped / "checkpoints" / "step-4",
        "--set",
        f"train.lr={2 * lr}",
        config=run_file,
    )
    assert (
        f"train.lr changed since the checkpoint: {lr} → {2 * lr}" in result.stdout + result.stderr
    )
    resumed = {r["step"]: r["lr"] for r in read_metrics(run) if r["type"] == "train"}
    before = {r["step"]: r["lr"] for r in read_metrics(straight) if r["type"] == "train"}
    assert sorted(resumed) == [5, 6, 7, 8]
    assert [resumed[step] for step in resumed] == [2 * before[step] for step in resumed]
    assert any(resumed.values())  # the schedule is not over


def test_a_change_that_keeps_the_training_passes_and_fp16_without_a_scaler_state_does_not(
    tmp_path, ddp_runs, run_file
):
    _, stopped = ddp_runs
    resume = ("--resume", stopped / "checkpoints" / "step-4", "--dry-run", "-o", tmp_path / "r")
    # recomputing activations changes no number
    result = run_dplaunch(
        "train", run_file, "--cpu", "--gpus", "1", *resume,
        "--set", "model.gradient_checkpointing=true",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # fp16 loads a loss scaler's state, which a run without fp16 never saved: the checkpoint goes
    # through its universal form and the loss scale starts afresh. fp16 needs GPUs, so the check
    # is called with this checkpoint's own plan turned fp16

    from dplaunch.launching.resume import check_layout
    from dplaunch.planning.plan import Plan
    from dplaunch.run_directory.checkpoints import read_checkpoint

    info = read_checkpoint(stopped / "checkpoints" / "step-4")
    saved = json.loads((info.path / "plan.json").read_text())
    assert (saved["zero_stage"], saved["mixed_precision"]) == (0, "no")
    same = Plan.from_dict(saved)
    assert check_layout(saved, same.dims, same.mixed_precision, info) == (False, [])
    convert, notes = check_layout(saved, same.dims, "fp16", info)
    assert convert and "(fp16 needs a loss-scaler state only an fp16 run saves)" in notes[0], notes
    assert notes[1] == "the fp16 loss scale starts afresh (the checkpoint was not trained in fp16)"


def test_a_stop_before_the_first_step_of_a_run_resumed_from_another_saves_in_this_run(
    tmp_path, ddp_runs, run_file
):
    # resumed from another run's checkpoint, stopped by a signal before its first step: the
    # checkpoint to continue from must be in this run, where --resume auto looks
    _, stopped = ddp_runs
    run = tmp_path / "new-run"
    process = start_train(
        run_file, run, "--cpu", "--gpus", "2", "--resume", str(stopped / "checkpoints" / "step-4")
    )
    wait_while_running(lambda: rank_pids(run), "the rank", process)
    # the rank ignores SIGUSR1 until its handler is installed, and its first step comes later
    while process.poll() is None:
        for pid in rank_pids(run).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(0.1)
    code, log = finish_train(process, run)
    assert code == 75, log[-3000:]
    assert "stopped at step 4" in log, log[-3000:]
    assert latest(run) == "step-4", log[-3000:]
    assert not (run / "metrics.jsonl").exists() or not train_losses(run)  # no step trained
    result = run_dplaunch(
        "train", run_file, "-o", run, "--cpu", "--gpus", "2", "--resume", "auto", "--dry-run"
    )
    assert result.returncode == 0, result.stderr
    assert f"resume: {run / 'checkpoints' / 'step-4'} (step 4" in result.stdout, result.stdout


def test_a_run_started_with_relative_paths_resumes_from_another_working_directory(tmp_path):
    # the run directory's run.yaml names its files by absolute path: resume (and export) work
    # from anywhere, and a relative path can never name another file there
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    rows = (REPO / "dplaunch/resources/data/reviews.jsonl").read_text().splitlines()[:44]
    (project / "data" / "reviews.jsonl").write_text("\n".join(rows) + "\n")
    write_config(project / "run.yaml", data={"dataset": "data/reviews.jsonl"})
    flags = ("--cpu", "--gpus", "1", "--max-steps", "2", "--set", "train.checkpoint_every=2")
    result = run_dplaunch("train", "run.yaml", "-o", "run", *flags, cwd=project)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = yaml.safe_load((project / "run" / "run.yaml").read_text())
    assert saved["data"]["dataset"] == str(project / "data" / "reviews.jsonl")
    result = run_dplaunch(
        "train", "project/run.yaml", "-o", "project/run", *flags, "--max-steps", "4",
        "--resume", "auto", "--dry-run", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "training continues with step 3" in result.stdout


def test_launch_sh_of_a_resumed_launch_whose_checkpoint_was_rotated_away_says_what_to_do(
    tmp_path, ddp_runs, run_file
):
    _, stopped = ddp_runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    keep_one = ("--set", "train.keep_last=1", "--set", "train.checkpoint_every=2")
    train(run, "--cpu", "--gpus", "1", "--resume", "auto", *keep_one, config=run_file)
    assert not (run / "checkpoints" / "step-4").exists() and latest(run) == "step-8"
    # launch.sh repeats that launch: from step-4, now gone
    result = subprocess.run(
        ["bash", str(run / "launch.sh")],
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "which is gone (train.keep_last keeps only the newest): continue with" in (
        result.stdout + result.stderr
    ), result.stderr[-3000:]


def test_a_time_limit_signal_during_a_conversion_keeps_it_and_stops_checkpointed(
    tmp_path, zero2_runs, run_file
):
    # A 2-rank ZeRO-2 run resubmitted on 1 GPU: its step 4 is converted before any rank starts.
    # SLURM's time-limit warning (SIGUSR1 to every process of the step, which the script's bash
    # wrapper leaves ignored) comes during that conversion.
    straight, stopped = zero2_runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    flags = (*ZERO2, "--gpus", "1", "--resume", "auto")
    process = start_train(run_file, run, *flags, slurm_step=True)
    wait_while_running(
        lambda: _runs_a_child(process, "dplaunch.train.convert"), "the conversion process", process
    )
    os.killpg(process.pid, signal.SIGUSR1)
    code, log = finish_train(process, run)
    # the conversion finished (the signal killed neither it nor the launcher), no rank started,
    # and the launch ended as a checkpointed one: 75, which the SLURM script requeues
    assert code == 75, log[-3000:]
    assert "universal form ready" in log, log[-3000:]
    assert (
        "dplaunch: SIGUSR1 (the time-limit warning) came while step-4 was converted, so no rank "
        "was started" in log
    ), log[-3000:]
    assert (run / "checkpoints" / "universal-step-4" / "done").exists()
    assert losses_by_step(run) == losses_by_step(stopped)  # no step trained
    # the requeued job's launch uses the kept conversion and trains on
    result = train(run, *flags, config=run_file)
    already = "using the universal form already converted in"
    assert f"{already} {run / 'checkpoints' / 'universal-step-4'}" in result.stdout
    assert "converting" not in result.stdout
    losses, reference = losses_by_step(run), losses_by_step(straight)
    assert sorted(losses) == list(range(1, 9))
    gap = max_relative_gap([losses[s] for s in range(5, 9)], [reference[s] for s in range(5, 9)])
    assert gap < 1e-5, (losses, reference)


def _runs_a_child(process: subprocess.Popen, text: str) -> bool:
    """Whether a child of ``process`` has ``text`` in its command line (one that exits meanwhile
    does not count)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        return any(
            text in " ".join(child.cmdline()) for child in psutil.Process(process.pid).children()
        )
    return False


def test_a_universal_conversion_of_another_checkpoint_is_replaced_not_loaded(tmp_path, zero2_runs):
    from dplaunch.launching.reshard import _universal_done, convert_to_universal
    from dplaunch.launching.resume import ResumePoint
    from dplaunch.run_directory.checkpoints import read_checkpoint

    _, stopped = zero2_runs
    point = ResumePoint(
        read_checkpoint(stopped / "checkpoints" / "step-4"), tmp_path / "run", convert=True
    )
    # left by a resume from another run's step 4 into this run, which crashed before saving
    point.load_dir.mkdir(parents=True)
    (point.load_dir / "done").write_text('{"checkpoint": "/elsewhere/step-4"}\n')
    (point.load_dir / "stale-weights").write_text("not these")
    said: list[str] = []
    convert_to_universal(point, say=said.append)
    assert not (point.load_dir / "stale-weights").exists()
    assert _universal_done(point) and said[0].startswith(f"converting {stopped}"), said
    convert_to_universal(point, say=said.append)  # now done: reused
    assert said[-1] == f"using the universal form already converted in {point.load_dir}"


def test_a_resume_from_an_earlier_checkpoint_of_the_run_leaves_the_later_ones_alone(
    tmp_path, ddp_runs, run_file
):
    _, stopped = ddp_runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    one_rank = ("--cpu", "--gpus", "1", "--set", "train.checkpoint_every=2")
    train(run, *one_rank, "--resume", "auto", "--set", "train.keep_last=3", config=run_file)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest", "step-4", "step-6", "step-8",
    ]  # fmt: skip
    # back to step 4 (another lr, say): while step 6 is saved again, a crash must come back to
    # step 4, not to the step 8 of the line of training this launch abandons
    process = start_train(
        run_file, run, *one_rank, "--resume", str(run / "checkpoints" / "step-4"),
        "--set", "train.keep_last=1", "--set", "train.stop_after_steps=6",
        **{FAULT: "6:sleep=4"},
    )  # fmt: skip
    temp = run / "checkpoints" / ".tmp-step-6"
    wait_while_running(lambda: (temp / "random_states_0.pkl").exists(), "the step-6 save", process)
    assert latest(run) == "step-4"
    code, log = finish_train(process, run)
    assert code == 0, log[-3000:]
    # keep_last 1 counts this line only: step 4 goes, the abandoned step 8 stays, unused
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest", "step-6", "step-8",
    ]  # fmt: skip
    assert latest(run) == "step-6"


def test_a_checkpoint_is_synced_to_disk_once_per_node_shared_by_its_ranks(tmp_path, monkeypatch):
    from dplaunch.run_directory.files import sync_to_disk
    from dplaunch.run_directory.layout import TEMP_PREFIX, digests_part_file

    folder = tmp_path / ".tmp-step-2"
    for name in ("pytorch_model/mp_rank_00_model_states.pt", "pytorch_model/zero_1.pt", "a.pkl"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x" * 10)
    # another rank's digests part, written through a temporary name while this rank syncs: it is
    # renamed away at any moment, even between the listing and the fsync; its writer syncs it
    in_flight = folder / f"{TEMP_PREFIX}{digests_part_file(1)}.4242.0a1b2c3d"
    in_flight.write_text("{}")
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    shares = [sync_to_disk(folder, local_rank, 3) for local_rank in range(3)]
    everything = sorted(entry for entry in folder.rglob("*") if entry != in_flight)
    assert sorted(entry for share in shares for entry in share) == everything  # each once
    assert all(shares)  # the work is shared
    assert len(synced) == len(everything) + 1  # and the folder itself, by local rank 0


def test_a_checkpoint_of_a_pretrained_model_exports_without_the_pretrained_model(tmp_path):
    # the checkpoint holds the model's HF config and tokenizer: export rebuilds the model from
    # them, so the base model may be gone from the cache (or offline, or moved on the Hub)
    spec = RunConfig.model_validate(yaml.safe_load(TINY_LLAMA.read_text())).model
    base = tmp_path / "base-model"
    tokenizer = load_tokenizer(spec)
    load_model(spec, tokenizer, seed=3).save_pretrained(base)
    tokenizer.save_pretrained(base)
    run_file = write_config(
        tmp_path / "pretrained.yaml",
        model={"config": None, "name_or_path": str(base), "tokenizer": str(base)},
    )
    run = tmp_path / "run"
    train(run, "--cpu", "--gpus", "1", "--max-steps", "2", "--set", "train.checkpoint_every=2",
          config=run_file)  # fmt: skip
    checkpoint = run / "checkpoints" / "step-2"
    assert (checkpoint / "hf" / "config.json").is_file()
    assert (checkpoint / "hf" / "tokenizer.json").is_file()
    shutil.rmtree(base)
    exported = tmp_path / "exported"
    result = run_dplaunch("export", checkpoint, "--out", exported)
    assert result.returncode == 0, result.stderr[-3000:]
    # before: DeepSpeed's "Setting accelerator to CPU" warning and a "Writing model shards" bar
    assert not result.stderr.strip(), result.stderr
    # the trained weights, as the run's own end-of-training export wrote them
    assert_same_logits(exported, run / "model")
    assert (exported / "tokenizer.json").is_file()
    # a checkpoint without hf/ (written before it was saved with them, and with file digests)
    # needs the base model: gone, that is one line naming it, not a traceback
    shutil.rmtree(checkpoint / "hf")
    forget_digests(checkpoint)
    result = run_dplaunch("export", checkpoint, "--out", tmp_path / "never")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("dplaunch: error: model.name_or_path: "), result.stderr
    assert not (tmp_path / "never").exists()


# --- damaged checkpoints: verified before a resume or an export, never resumed over -----------


def forget_digests(checkpoint: Path) -> None:
    """Make CHECKPOINT look written by a dplaunch before file digests (no "files" record)."""
    meta = json.loads((checkpoint / "checkpoint.json").read_text())
    meta.pop("files")
    (checkpoint / "checkpoint.json").write_text(json.dumps(meta))


def test_a_checkpoint_records_the_size_and_crc32_of_every_file_it_holds(ddp_runs):
    import zlib

    _, stopped = ddp_runs
    checkpoint = stopped / "checkpoints" / "step-4"
    records = json.loads((checkpoint / "checkpoint.json").read_text())["files"]
    on_disk = sorted(
        str(path.relative_to(checkpoint))
        for path in checkpoint.rglob("*")
        if path.is_file() and path.name != "checkpoint.json"
    )
    assert sorted(records) == on_disk and "model.safetensors" in records
    for name, record in records.items():
        data = (checkpoint / name).read_bytes()
        assert record == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


def test_the_ranks_share_the_digests_of_a_save_and_rank_0_adds_the_files_of_the_commit(tmp_path):
    from dplaunch.train.checkpoint import merge_digests, record_digests

    folder = tmp_path / ".tmp-step-2"
    for index, name in enumerate(["a.pt", "b/c.pt", "b/d.bin", "e.safetensors", "f.pkl"]):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(bytes([index]) * (index + 1) * 1000)
    for rank in range(3):
        record_digests(folder, rank, 3)
    parts = [json.loads(p.read_text()) for p in sorted(folder.glob(".digests-rank-*.json"))]
    assert len(parts) == 3 and all(parts)
    assert sorted(name for part in parts for name in part) == sorted(  # each file once
        ["a.pt", "b/c.pt", "b/d.bin", "e.safetensors", "f.pkl"]
    )
    (folder / "run.yaml").write_text("written at the commit\n")
    merged = merge_digests(folder)
    assert sorted(merged) == ["a.pt", "b/c.pt", "b/d.bin", "e.safetensors", "f.pkl", "run.yaml"]
    assert not list(folder.glob(".digests-rank-*"))


def test_a_damaged_checkpoint_is_named_in_one_line_never_resumed_over_nor_exported(
    tmp_path, ddp_runs, run_file
):
    _, stopped = ddp_runs
    one_rank = ("--cpu", "--gpus", "1")
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    step_4 = run / "checkpoints" / "step-4"
    weights = step_4 / "model.safetensors"
    with open(weights, "r+b") as handle:  # a copy cut short, a full disk
        handle.truncate(weights.stat().st_size // 2)
    before = files_under(run)
    # before: every rank failed with a SafetensorError, and the message advised --resume auto
    damaged = f"{step_4} is damaged (model.safetensors holds"
    refusal_line(
        run_dplaunch("train", run_file, "-o", run, *one_rank, "--resume", "auto", "--dry-run"),
        f"--resume: no checkpoint of this run verifies ({damaged}",
        "starting from step 0 would train the whole run again over them",
        "give --start-over",
    )
    refusal_line(
        run_dplaunch("train", run_file, "-o", run, *one_rank, "--resume", step_4, "--dry-run"),
        f"--resume: {damaged}",
    )
    # before: a 49-line traceback and an empty --out folder
    out = tmp_path / "exports" / "model"
    refusal_line(run_dplaunch("export", step_4, "--out", out), f"CHECKPOINT: {damaged}")
    assert not (tmp_path / "exports").exists()
    assert files_under(run) == before  # refused: nothing renamed, nothing written

    # a committed checkpoint whose checkpoint.json is unreadable (before: "no complete
    # checkpoint … starting from step 0", and the whole run trained again over it)
    shutil.copy2(stopped / "checkpoints" / "step-4" / "model.safetensors", weights)
    (step_4 / "checkpoint.json").write_text('{"step": 4, "epo')
    refusal_line(
        run_dplaunch("train", run_file, "-o", run, *one_rank, "--resume", "auto", "--dry-run"),
        f"no checkpoint of this run verifies ({step_4} is damaged (its checkpoint.json is "
        "missing or unreadable))",
    )
    result = run_dplaunch(
        "train", run_file, "-o", run, *one_rank, "--resume", "auto", "--start-over", "--dry-run"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resume: no checkpoint verifies: starting from step 0 (--start-over)" in result.stdout
    refusal_line(
        run_dplaunch("train", run_file, "-o", tmp_path / "new", *one_rank, "--start-over"),
        "--start-over: ",
        "add --resume auto",
    )


def test_a_checkpoint_of_an_older_dplaunch_without_digests_resumes_and_a_cut_one_is_found(
    tmp_path, ddp_runs, run_file
):
    _, stopped = ddp_runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    step_4 = run / "checkpoints" / "step-4"
    forget_digests(step_4)
    flags = ("--cpu", "--gpus", "1", "--resume", "auto", "--dry-run")
    result = run_dplaunch("train", run_file, "-o", run, *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resume: {step_4} (step 4" in result.stdout
    assert "step-4 records no file digests (an older dplaunch wrote it)" in result.stdout
    # its safetensors header still tells how long the file must be, torch's zip how it ends
    for name in ("model.safetensors", "optimizer.bin"):
        shutil.copytree(stopped, tmp_path / name)
        checkpoint = tmp_path / name / "checkpoints" / "step-4"
        forget_digests(checkpoint)
        with open(checkpoint / name, "r+b") as handle:
            handle.truncate((checkpoint / name).stat().st_size - 100)
        refusal_line(
            run_dplaunch("train", run_file, "-o", tmp_path / name, *flags),
            f"{checkpoint} is damaged ({name}: ",
        )


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_continues_from_the_one_before(
    tmp_path, ddp_runs, run_file
):
    straight, stopped = ddp_runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    one_rank = ("--cpu", "--gpus", "1", "--set", "train.checkpoint_every=2", "--resume", "auto")
    train(run, *one_rank, "--set", "train.stop_after_steps=6", config=run_file)
    step_6 = run / "checkpoints" / "step-6"
    with open(step_6 / "optimizer.bin", "r+b") as handle:  # one flipped byte, mid-file
        handle.seek(1000)
        byte = handle.read(1)
        handle.seek(1000)
        handle.write(bytes([byte[0] ^ 0xFF]))
    result = train(run, *one_rank, config=run_file)
    kept = run / "checkpoints" / "damaged-step-6"
    assert (
        f"resume: {step_6} is damaged (optimizer.bin does not hold the bytes that were written"
        in result.stderr
    )
    assert f"set aside as {kept} (kept, not read again)" in result.stderr
    assert f"resume: {run / 'checkpoints' / 'step-4'} (step 4" in result.stdout
    assert losses_by_step(run) == losses_by_step(straight)  # steps 5-8 trained again, exactly
    assert (kept / "optimizer.bin").is_file()  # never deleted


def test_a_failed_run_never_offers_a_cut_checkpoint_as_where_to_continue(tmp_path):
    # before: "the newest complete checkpoint is …/step-4: continue with --resume auto", the
    # checkpoint whose cut weights file had just failed every rank
    from dplaunch.commands.train import _failure_hints
    from dplaunch.run_directory.files import file_record

    run = tmp_path / "run"
    for step in (2, 4):
        checkpoint = run / "checkpoints" / f"step-{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "model.safetensors").write_bytes(bytes(range(256)) * step)
        files = {"model.safetensors": file_record(checkpoint / "model.safetensors")}
        (checkpoint / "checkpoint.json").write_text(json.dumps({"step": step, "files": files}))
    step_2, step_4 = run / "checkpoints" / "step-2", run / "checkpoints" / "step-4"
    os.truncate(step_4 / "model.safetensors", 100)
    assert _failure_hints(run) == [
        f"dplaunch: {step_4} is damaged (model.safetensors holds 100 bytes, 1,024 were "
        "written): --resume auto skips it",
        f"dplaunch: the newest checkpoint whose files are whole is {step_2} (step 2): continue "
        "with --resume auto (it checks their CRC-32 first)",
    ]
    os.truncate(step_2 / "model.safetensors", 0)
    assert _failure_hints(run)[-1] == (
        "dplaunch: no checkpoint of this run is whole: --resume auto refuses to train over them "
        "from step 0 (--start-over does)"
    )
