"""Checkpoints that never lose work: atomic directories, a `latest` pointer, rotation, resume points.

    RUN/checkpoints/
      step-4/            complete: every rank finished writing before it got this name
        checkpoint.json  the data position (step, epoch) and the layout that wrote it; written last
        run.yaml, plan.json   the resolved run file and plan of the run that wrote it
        ...              the engine's state: accelerate's save_state (model, optimizer, scheduler,
                         RNG of every rank) or DeepSpeed's checkpoint under ZeRO/TP/PP
      latest             "step-4": the newest complete checkpoint (replaced via temp file + rename)
      .tmp-step-6/       a save in progress (or killed): never read, removed by the next save
      universal-step-4/  step-4 re-sharded for another GPU count (ZeRO); removed by the next save

A save writes `.tmp-step-N/`; after a barrier (every rank done) rank 0 writes checkpoint.json,
renames the directory to `step-N`, moves `latest`, and only then deletes checkpoints beyond
`train.keep_last`. A kill -9 at any moment leaves the previous checkpoint and `latest` intact.

The data order is a function of (seed, epoch, step) (dplaunch/train/data.py), so the data position
is the global step: a resumed run continues with exactly the next batch, also in later epochs.

The top of this module imports no torch: the launcher uses it to find and check a resume point
before anything starts (`dplaunch train --resume`, `dplaunch export`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dplaunch.errors import UserError

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
# RUN/model: the trained model a finished run exports (save_pretrained)
EXPORT_DIR = "model"
# the model's HF config (config.json, generation_config.json) and tokenizer, in every checkpoint:
# `dplaunch export` builds the model from them, without the pretrained weights or the Hub
MODEL_FILES_DIR = "hf"
META_FILE = "checkpoint.json"
TEMP_PREFIX = ".tmp-"
# the launcher tells the ranks where to resume from (always written by `dplaunch train`)
RESUME_FILE = "resume.json"
# rank 0 says why it stopped before the last step (signal or train.stop_after_steps)
STOP_FILE = "stopped.json"
# a ZeRO checkpoint converted for another data-parallel size: RUN/checkpoints/universal-step-N
UNIVERSAL_PREFIX = "universal-"
# accelerate's tag of the DeepSpeed checkpoint inside save_state's directory
DEEPSPEED_TAG = "pytorch_model"
# the pipeline engine's tag (dplaunch/train/pipeline.py)
PIPELINE_TAG = "pipeline"

# "checkpointed on a signal; continue with --resume auto" (EX_TEMPFAIL): the SLURM script requeues on it
EXIT_CHECKPOINTED = 75
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

# Test hook, read here only: "STEP:sleep=SECONDS" sleeps in every rank after it wrote its part of
# checkpoint step STEP and before the commit (a window to kill -9 a rank mid-save);
# "STEP:max_file_bytes=N" caps the size of files the ranks write from that save on (RLIMIT_FSIZE:
# the kernel then fails the writes, as on a full disk).
FAULT_ENV = "DPLAUNCH_TEST_CHECKPOINT_FAULT"

_STEP_DIR = re.compile(r"^step-(\d+)$")
# run-file sections that must be the same to continue a checkpoint: they decide the model and the data order
_SAME_SECTIONS = ("model", "data")
_SAME_TRAIN_KEYS = ("global_batch_size", "seed")
# keys that change neither the training samples nor the model's numbers: how data is read, what
# is evaluated on, whether activations are recomputed, which attention kernel computes the same sums
_FREE_KEYS = {
    "data": ("num_workers", "eval_dataset", "eval_split"),
    "model": ("gradient_checkpointing", "attn_implementation"),
}


class CheckpointError(RuntimeError):
    """A save that did not complete; the previous checkpoint is still valid."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk and what checkpoint.json says about it."""

    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class ResumePoint:
    """Where a launch continues from: the checkpoint, and how the ranks load it."""

    checkpoint: CheckpointInfo
    # the run being launched
    run_dir: Path
    # "universal": a ZeRO checkpoint re-sharded for another data-parallel size (see convert_to_universal)
    reshard: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def load_dir(self) -> Path:
        """The directory the engine loads: the checkpoint, or its universal conversion in this run."""
        if self.reshard == "universal":
            name = f"{UNIVERSAL_PREFIX}{self.checkpoint.name}"
            return self.run_dir / CHECKPOINTS_DIR / name
        return self.checkpoint.path

    def to_json(self) -> str:
        """resume.json for the ranks."""
        return json.dumps(
            {
                "checkpoint": str(self.checkpoint.path.absolute()),
                "step": self.checkpoint.step,
                "load_dir": str(self.load_dir.absolute()),
                "universal": self.reshard == "universal",
            },
            indent=2,
        )


FRESH_START_JSON = json.dumps({"checkpoint": None}, indent=2)


# ---------------------------------------------------------------------------------------------
# finding checkpoints (torch-free: the launcher and `dplaunch export` use these)


def read_checkpoint(path: Path) -> CheckpointInfo | None:
    """The checkpoint at ``path`` if it is complete (has its checkpoint.json), else None."""
    if path.name.startswith(TEMP_PREFIX):
        return None
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or "step" not in meta:
        return None
    return CheckpointInfo(path, meta)


def complete_checkpoints(checkpoints_dir: Path) -> list[CheckpointInfo]:
    """Every complete checkpoint in a checkpoints directory, oldest step first."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for entry in checkpoints_dir.iterdir():
        if _STEP_DIR.match(entry.name) and entry.is_dir():
            info = read_checkpoint(entry)
            if info is not None:
                found.append(info)
    return sorted(found, key=lambda info: info.step)


def newest_checkpoint(checkpoints_dir: Path) -> CheckpointInfo | None:
    """What `latest` names when that is complete; otherwise the complete checkpoint of highest step."""
    try:
        name = (checkpoints_dir / LATEST_FILE).read_text().strip()
    except OSError:
        name = ""
    if name and _STEP_DIR.match(name):
        info = read_checkpoint(checkpoints_dir / name)
        if info is not None:
            return info
    found = complete_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def find_checkpoint(path: Path, field: str = "--resume") -> CheckpointInfo:
    """A checkpoint directory, or the newest complete one in a checkpoints or run directory."""
    if not path.exists():
        raise UserError(
            field,
            f"{path} does not exist",
            "give --resume auto (this run's newest complete checkpoint) or the path of a "
            "checkpoint or run directory"
            if field == "--resume"
            else "give a checkpoint or run directory",
        )
    info = read_checkpoint(path)
    if info is not None:
        return info
    for candidate in (path, path / CHECKPOINTS_DIR):
        info = newest_checkpoint(candidate)
        if info is not None:
            return info
    if path.name.startswith(TEMP_PREFIX) or (path / "..").resolve().name == CHECKPOINTS_DIR:
        raise UserError(
            field,
            f"{path} is not a complete checkpoint (a save that was interrupted)",
            "give the run directory: its newest complete checkpoint is used",
        )
    raise UserError(
        field,
        f"{path} holds no complete dplaunch checkpoint",
        "give a checkpoints/step-N directory or a run directory",
    )


# ---------------------------------------------------------------------------------------------
# deciding a resume before launch (torch-free)


def plan_resume(run_dir: Path, resume: str, config: Any, plan: Any) -> ResumePoint | None:
    """The checkpoint a launch continues from (None: a fresh start), checked against the new run.

    Raises UserError, before anything starts, when the checkpoint cannot continue in this run:
    another model, data or data order, no step left to train (max_steps or epochs at or
    below the checkpoint's step), or a layout that cannot be re-sharded.
    """
    if resume == "auto":
        info = newest_checkpoint(run_dir / CHECKPOINTS_DIR)
        if info is None:
            _refuse_retraining_a_finished_run(run_dir)
            return None
    else:
        info = find_checkpoint(Path(resume).expanduser())
    saved_config = _read_yaml(info.path / "run.yaml")
    saved_plan = json.loads((info.path / "plan.json").read_text())
    notes = _check_same_training(saved_config, config, info)
    notes += _check_steps_left(config, info)
    reshard, layout_notes = _check_layout(saved_plan, plan, info)
    return ResumePoint(info, run_dir, reshard, tuple(notes + layout_notes))


def _refuse_retraining_a_finished_run(run_dir: Path) -> None:
    # --resume auto without a checkpoint starts again from step 0: right after a crash before the
    # first save, but for a run that finished it would train it again and replace its model
    step = finished_at(run_dir)
    if step is None:
        return
    exported = run_dir / EXPORT_DIR
    raise UserError(
        "--resume",
        f"{run_dir} finished at step {step} and kept no checkpoint: --resume auto would train it "
        "again from step 0 and replace its model",
        f"choose another --output-dir (with model.name_or_path: {exported} to train the result "
        "further)",
    )


def finished_at(run_dir: Path) -> int | None:
    """The step at which the newest launch recorded in RUN/metrics.jsonl finished; None when that
    launch stopped early, failed or is not recorded."""
    for line in _lines_from_the_end(run_dir / "metrics.jsonl"):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed rank
        kind = record.get("type") if isinstance(record, dict) else None
        if kind == "summary":
            return int(record.get("step", 0))
        if kind in ("header", "stop"):
            return None
    return None


def _lines_from_the_end(path: Path, block: int = 1 << 20) -> Iterator[bytes]:
    # a long run's metrics.jsonl holds a line per logged step: read only as far back as needed
    try:
        handle = path.open("rb")
    except OSError:
        return
    with handle:
        end = handle.seek(0, os.SEEK_END)
        rest = b""
        while end > 0:
            start = max(0, end - block)
            handle.seek(start)
            lines = (handle.read(end - start) + rest).split(b"\n")
            rest = lines.pop(0) if start > 0 else b""  # maybe the tail of a line further back
            yield from reversed(lines)
            end = start


def _check_steps_left(config: Any, info: CheckpointInfo) -> list[str]:
    # a last step before the checkpoint's is almost always a --max-steps meant as "this many more
    # steps". At the checkpoint's step there is nothing left to train, and the run exports the
    # model: what a job requeued or resubmitted after its final save needs (--resume auto always)
    train, step = config.train, info.step
    if train.max_steps is not None:
        last, field = train.max_steps, "train.max_steps"
        told = f"{train.max_steps} is before"
        fix = (
            f"--max-steps counts all steps, not more steps: give one above {step} (e.g. "
            f"{step + train.max_steps} for {train.max_steps} more), or start a new run without --resume"
        )
    else:
        steps_per_epoch = info.meta.get("steps_per_epoch")
        if not steps_per_epoch:
            return []
        # the loop's rule; the data, hence the steps per epoch, are the checkpoint's (checked above)
        last, field = math.ceil((train.epochs or 1) * int(steps_per_epoch)), "train.epochs"
        told = f"{train.epochs or 1} epoch(s) of {steps_per_epoch} steps end at step {last}, before"
        fix = f"raise train.epochs or give --max-steps above {step}, or start a new run without --resume"
    if last > step:
        return []
    if last == step:
        return [
            f"the checkpoint is the run's last step ({step}): nothing left to train, the run "
            "exports its model"
        ]
    raise UserError(
        field,
        f"{told} the checkpoint's step {step} ({info.path}): the resumed run would train no step",
        fix,
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise UserError(
            "--resume", f"cannot read {path}: {error}", "the checkpoint is damaged"
        ) from None


def _check_same_training(saved: dict[str, Any], config: Any, info: CheckpointInfo) -> list[str]:
    current = config.model_dump(mode="json")
    fix = f"resume with the run file the checkpoint was written with (a copy: {info.path / 'run.yaml'})"
    for section in _SAME_SECTIONS:
        old, new = dict(saved.get(section) or {}), dict(current.get(section) or {})
        for key in _FREE_KEYS.get(section, ()):
            old.pop(key, None)
            new.pop(key, None)
        difference = _first_difference(old, new, section)
        if difference:
            raise UserError(
                section,
                f"differs from the checkpoint's ({difference}): it would not continue the same training",
                fix,
            )
    saved_train, train = saved.get("train") or {}, current["train"]
    for key in _SAME_TRAIN_KEYS:
        if saved_train.get(key) != train[key]:
            why = (
                "the data position is counted in optimizer steps of that many samples"
                if key == "global_batch_size"
                else "the data order depends on it"
            )
            raise UserError(
                f"train.{key}",
                f"the checkpoint was trained with {saved_train.get(key)}, this run asks for {train[key]} ({why})",
                f"resume with {key} {saved_train.get(key)}",
            )
    notes = []
    for key in (
        "max_steps",
        "epochs",
        "lr",
        "scheduler",
        "warmup_steps",
        "weight_decay",
        "max_grad_norm",
    ):
        if saved_train.get(key) != train[key]:
            notes.append(
                f"train.{key} changed since the checkpoint: {saved_train.get(key)} → {train[key]}"
            )
    return notes


def _first_difference(old: Any, new: Any, where: str) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            found = _first_difference(old.get(key), new.get(key), f"{where}.{key}")
            if found:
                return found
        return ""
    return "" if old == new else f"{where}: {old!r} → {new!r}"


def _check_layout(
    saved: dict[str, Any], plan: Any, info: CheckpointInfo
) -> tuple[str | None, list[str]]:
    """How the new plan loads the checkpoint; UserError when the layout cannot be reshaped."""
    mesh = saved["mesh"]
    old_tp, old_pp = mesh["tensor_parallel_size"], mesh["pipeline_parallel_size"]
    old_dp, old_zero = mesh["data_parallel_size"], saved["zero_stage"]
    where = f"the checkpoint {info.path}"
    export_hint = f"or export it (`dplaunch export {info.path} --out DIR`) and start a new run from that model"
    if old_pp != plan.pipeline_parallel_size:
        raise UserError(
            "parallel.pp",
            f"{where} has {old_pp} pipeline stage(s), this run {plan.pipeline_parallel_size}: "
            "DeepSpeed cannot re-cut a pipeline checkpoint into other stages",
            f"resume with --pp {old_pp}, {export_hint}",
        )
    if old_tp != plan.tensor_parallel_size:
        raise UserError(
            "parallel.tp",
            f"{where} has tensor-parallel degree {old_tp}, this run {plan.tensor_parallel_size}: "
            "its weights are split into tp shards",
            f"resume with --tp {old_tp}, {export_hint}",
        )
    if old_zero != plan.zero_stage:
        raise UserError(
            "parallel.zero_stage",
            f"{where} was written by ZeRO stage {old_zero} ({'DDP' if old_zero == 0 else 'DeepSpeed'}), "
            f"this run uses stage {plan.zero_stage}: the checkpoint formats differ",
            f"resume with --zero {old_zero}, {export_hint}",
        )
    if saved["offload"] != plan.offload:
        raise UserError(
            "parallel.offload",
            f"{where} was written with offload {saved['offload']!r}, this run asks for {plan.offload!r}",
            f"resume with --offload {saved['offload']}",
        )
    if plan.uses_deepspeed and saved["mixed_precision"] != plan.mixed_precision:
        raise UserError(
            "train.mixed_precision",
            f"{where} holds DeepSpeed {saved['mixed_precision']} optimizer state, this run asks for {plan.mixed_precision}",
            f"resume with --mixed-precision {saved['mixed_precision']}",
        )
    if plan.mixed_precision == "fp16" and saved["mixed_precision"] != "fp16":
        # Accelerate's load_state reads the fp16 loss scaler's state, which only fp16 saves
        raise UserError(
            "train.mixed_precision",
            f"{where} was trained with {saved['mixed_precision']}, and fp16 needs the loss "
            "scaler state only an fp16 run saves",
            f"resume with --mixed-precision {saved['mixed_precision']}",
        )
    notes = []
    if old_dp == plan.data_parallel_size:
        return None, notes
    batch = (
        f"global batch {plan.global_batch_size} kept: grad-accum {saved['gradient_accumulation_steps']} → "
        f"{plan.gradient_accumulation_steps}"
    )
    if plan.engine == "pipeline" or old_tp > 1:
        raise UserError(
            "launch.gpus",
            f"{where} has {old_dp} data-parallel replica(s) of a tp {old_tp} × pp {old_pp} layout, this run "
            f"{plan.data_parallel_size}: dplaunch re-shards only DDP and ZeRO checkpoints without tp/pp",
            f"resume on {saved['world_size']} GPUs, {export_hint}",
        )
    if old_zero == 0:
        notes.append(
            f"data-parallel size {old_dp} → {plan.data_parallel_size} (DDP state is the same on every rank); {batch}"
        )
        return None, notes
    notes.append(
        f"data-parallel size {old_dp} → {plan.data_parallel_size}: the ZeRO-{old_zero} optimizer shards are "
        f"re-sharded through a DeepSpeed universal checkpoint; {batch}"
    )
    return "universal", notes


def convert_to_universal(point: ResumePoint, say: Any = print) -> None:
    """Write the universal form of a ZeRO checkpoint (DeepSpeed's ds_to_universal), once, atomically.

    Runs in the launcher, in a child process, before the ranks start: every rank then loads its own
    slice of the full-precision weights and optimizer state for the new data-parallel size. The
    result goes into the launched run (the source checkpoint may belong to another, read-only run).
    """
    target = point.load_dir
    if _universal_done(point):
        say(f"using the universal checkpoint in {target}")
        return
    if target.exists():
        # the conversion of another checkpoint of the same step (another run's, or one saved
        # again since): never load it for this one
        shutil.rmtree(target)
    source = point.checkpoint.path
    temp = target.with_name(f"{TEMP_PREFIX}{target.name}-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    say(f"re-sharding {source.name} for the new data-parallel size (DeepSpeed ds_to_universal)…")
    started = time.perf_counter()
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(source / DEEPSPEED_TAG),
        "--output_folder",
        str(temp / DEEPSPEED_TAG),
        "--inject_missing_state",
        "--num_extract_workers",
        workers,
        "--num_merge_workers",
        workers,
    ]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    # SLURM signals every process of the step: the time-limit warning (SIGUSR1) is the launcher's
    # to note (run_train), and would otherwise kill the conversion it waits for
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=env,
        check=False,
        preexec_fn=_ignore_usr1,
    )
    if result.returncode != 0:
        shutil.rmtree(temp, ignore_errors=True)
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise UserError(
            "--resume",
            f"converting {source} to a universal checkpoint failed:\n{tail}\n",
            f"resume on {point.checkpoint.meta.get('world_size')} GPUs (no conversion needed)",
        )
    # the accelerate-level files (scheduler, RNG of every rank) go next to the converted engine state
    for item in source.iterdir():
        if item.is_file() and item.suffix == ".pkl":
            shutil.copy2(item, temp / item.name)
    (temp / "done").write_text(_universal_source(point))
    try:
        os.rename(temp, target)
    except OSError:
        # another node's launcher converted it first: use theirs
        shutil.rmtree(temp, ignore_errors=True)
        if not _universal_done(point):
            raise
    say(f"universal checkpoint ready in {time.perf_counter() - started:.1f} s: {target}")


def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _universal_source(point: ResumePoint) -> str:
    """What a universal conversion was made from: its `done` file's text."""
    source = {
        "checkpoint": str(point.checkpoint.path.resolve()),
        "saved_at": point.checkpoint.meta.get("saved_at"),
    }
    return json.dumps(source, sort_keys=True) + "\n"


def _universal_done(point: ResumePoint) -> bool:
    """Whether point.load_dir holds a finished conversion of point's own checkpoint."""
    try:
        return (point.load_dir / "done").read_text() == _universal_source(point)
    except OSError:
        return False


def wait_for_universal(
    point: ResumePoint, limit_s: float, say: Any = print, poll_s: float = 2.0
) -> None:
    """On the nodes other than 0: wait for node 0's launcher to finish convert_to_universal.

    Their launchers would otherwise start at once and wait in torchrun's rendezvous, which gives
    up after 10 minutes; converting a large ZeRO checkpoint can take longer.
    """
    if _universal_done(point):
        return
    say(f"waiting for node 0 to re-shard {point.checkpoint.name} into {point.load_dir}…")
    started = time.monotonic()
    while not _universal_done(point):
        if time.monotonic() - started > limit_s:
            raise UserError(
                "--resume",
                f"node 0 has not re-sharded {point.checkpoint.path} into {point.load_dir} "
                f"after {limit_s / 60:g} min (launch.timeout_minutes)",
                "look at node 0's output; if the conversion just takes longer, raise "
                "launch.timeout_minutes",
            )
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------------
# consolidated weights for `dplaunch export`: from the files in one process, or (tensor
# parallel) loaded into the ranks of the export job, whose engine joins the shards


def consolidated_state_dict(directory: Path, engine: str) -> dict[str, Any]:
    """The full model state dict of a DDP or ZeRO-1/2/3 checkpoint (fp32 master weights for ZeRO)."""
    if engine == "ddp":
        from safetensors.torch import load_file

        state = load_file(str(directory / "model.safetensors"))
        # checkpoints hold the unwrapped model; strip DDP's prefix should an older one have it
        return {name.removeprefix("module."): tensor for name, tensor in state.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # zero_to_fp32: every rank's partition of the fp32 master weights, joined (ZeRO-3 included)
    return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=DEEPSPEED_TAG)


def tensor_parallel_weight_files(directory: Path, tp: int) -> list[Path]:
    """The model-state file of each AutoTP rank in a DeepSpeed checkpoint (DeepSpeed's names)."""
    return [directory / DEEPSPEED_TAG / f"mp_rank_{rank:02d}_model_states.pt" for rank in range(tp)]


def load_module_weights(deepspeed_engine: Any, directory: Path) -> None:
    """Only the model weights of a DeepSpeed checkpoint into a running engine (each rank its AutoTP shard).

    No optimizer, scheduler or RNG state is read (the export job of a tensor-parallel checkpoint).
    """
    loaded, _ = deepspeed_engine.load_checkpoint(
        str(directory),
        tag=DEEPSPEED_TAG,
        load_module_only=True,
        load_optimizer_states=False,
        load_lr_scheduler_states=False,
    )
    if loaded is None:
        raise CheckpointError(f"{directory / DEEPSPEED_TAG} holds no DeepSpeed model states")


def load_pipeline_layers(directory: Path, model: Any) -> None:
    """Fill an HF model with a pipeline checkpoint's per-layer files (every stage's layers)."""
    import torch

    from dplaunch.train.pipeline import pipeline_layers

    for index, layer in enumerate(pipeline_layers(model)):
        files = sorted((directory / PIPELINE_TAG).glob(f"layer_{index:02d}-*model_states.pt"))
        if not files:
            raise UserError(
                "CHECKPOINT",
                f"{directory} has no file for pipeline layer {index}",
                "export a complete pipeline checkpoint written for this run file",
            )
        # specs (tied embedding, lm_head) build modules around the HF model's own submodules
        module = layer if isinstance(layer, torch.nn.Module) else layer.build()
        module.load_state_dict(torch.load(files[0], map_location="cpu", weights_only=True))


# ---------------------------------------------------------------------------------------------
# the launcher's view of how the ranks ended


def read_stop_record(run_dir: Path) -> dict[str, Any] | None:
    """What rank 0 wrote when it stopped before the last step (None when it did not)."""
    try:
        return json.loads((run_dir / STOP_FILE).read_text())
    except (OSError, ValueError):
        return None


def clear_stop_record(run_dir: Path) -> None:
    """Forget the stop record of a previous launch of this run directory."""
    (run_dir / STOP_FILE).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# inside the ranks


class StopSignals:
    """SIGUSR1/SIGTERM set a flag; the loop stops at the next step boundary. Repeats are harmless.

    The launcher notes SIGUSR1 alone the same way while it re-shards a checkpoint (``signals``).
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.received: str | None = None
        self._signals = signals
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        # only a flag: the save in progress (if any) goes on untouched, a second signal changes nothing
        if self.received is None:
            self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class ControlChannel:
    """Small collective decisions (stop now? did the save work?) on a CPU gloo group of all ranks.

    A separate group keeps these few-byte all-reduces off the GPU (no device sync) and never
    interleaves them with the engine's own collectives.
    """

    def __init__(self, timeout_minutes: float):
        import torch.distributed as dist

        self.dist = dist
        self.group = None
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self.enabled:
            from datetime import timedelta

            self.group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on at least one."""
        if not self.enabled:
            return flag
        import torch

        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self.dist.all_reduce(value, op=self.dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def barrier(self) -> None:
        if self.enabled:
            self.dist.barrier(group=self.group)


class Checkpointer:
    """Saves and loads checkpoints of one run; every rank holds one and calls save/load together."""

    def __init__(
        self,
        run_dir: Path,
        engine: Any,
        control: ControlChannel,
        *,
        rank: int,
        keep_last: int,
        meta: dict[str, Any],
        say: Any,
        write_model_files: Any = None,
    ):
        self.write_model_files = write_model_files
        self.run_dir = run_dir
        self.directory = run_dir / CHECKPOINTS_DIR
        self.engine = engine
        self.control = control
        self.rank = rank
        self.keep_last = keep_last
        # layout facts that go into every checkpoint.json
        self.meta = meta
        self.say = say
        # the newest checkpoint of this launch (or the one it resumed from)
        self.last_saved_step: int | None = None
        self.last_saved_path: Path | None = None
        self._fault = _parse_fault(os.environ.get(FAULT_ENV, ""))

    def save(self, step: int, steps_per_epoch: int, reason: str) -> Path:
        """Write checkpoint step-N atomically; raise CheckpointError (previous one intact) on failure."""
        started = time.perf_counter()
        final = self.directory / f"step-{step}"
        temp = self.directory / f"{TEMP_PREFIX}step-{step}"
        previous = newest_checkpoint(self.directory)
        intact = (
            f"{previous.path} (step {previous.step}) is intact and `latest` still names it"
            if previous
            else "no earlier checkpoint exists"
        )
        problem: BaseException | None = None
        try:
            if self.rank == 0:
                self.directory.mkdir(parents=True, exist_ok=True)
                for stale in self.directory.glob(f"{TEMP_PREFIX}*"):
                    shutil.rmtree(stale, ignore_errors=True)  # saves that were killed
                temp.mkdir()
        except OSError as error:
            problem = error
        # rank 0 may have failed to create the directory: nobody writes then
        if self.control.any(problem is not None):
            raise CheckpointError(
                f"checkpoint step {step} failed, {intact}: could not create {temp}: {problem}"
            )
        try:
            self._apply_fault(step, "max_file_bytes")
            self.engine.save(str(temp))
            if not getattr(self.engine, "saves_rng", False):
                save_rng_state(temp, self.rank)
            self._apply_fault(step, "sleep")
        except Exception as error:  # noqa: BLE001 — reported with what is still valid
            raise CheckpointError(
                f"could not write checkpoint step {step}, {intact}: {temp}: {error}"
            ) from error
        self.control.barrier()  # every rank has written its part
        try:
            # on disk before checkpoint.json says "complete": a node that crashes after the
            # commit must not leave a complete checkpoint of truncated files
            sync_to_disk(temp, *_local_place())
        except OSError as error:
            problem = error
        else:
            problem = None
        if self.control.any(problem is not None):
            raise CheckpointError(
                f"could not write checkpoint step {step} to disk, {intact}: {temp}: {problem}"
            )
        failed = False
        if self.rank == 0:
            try:
                self._commit(temp, final, step, steps_per_epoch, reason, started)
            except OSError as error:
                failed = True
                shutil.rmtree(temp, ignore_errors=True)
                message = f"could not commit checkpoint step {step}, {intact}: {error}"
        if self.control.any(failed):
            raise CheckpointError(
                message if self.rank == 0 else f"rank 0 could not commit checkpoint step {step}"
            )
        self.last_saved_step, self.last_saved_path = step, final
        if self.rank == 0:
            meta = json.loads((final / META_FILE).read_text())
            self.say(
                f"[dplaunch] checkpoint {final} ({reason}): {meta['size_bytes'] / 1e6:.1f} MB in "
                f"{meta['save_seconds']:.2f} s"
            )
            self._rotate(keep=final, step=step)
        return final

    def _commit(
        self, temp: Path, final: Path, step: int, steps_per_epoch: int, reason: str, started: float
    ) -> None:
        for name in ("run.yaml", "plan.json"):
            shutil.copy2(self.run_dir / name, temp / name)
            _fsync_file(temp / name)
        if self.write_model_files is not None:
            self.write_model_files(temp / MODEL_FILES_DIR)
            sync_to_disk(temp / MODEL_FILES_DIR, 0, 1)
        meta = {
            "step": step,
            "epoch": step // steps_per_epoch,
            "step_in_epoch": step % steps_per_epoch,
            "steps_per_epoch": steps_per_epoch,
            "reason": reason,
            **self.meta,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "save_seconds": round(time.perf_counter() - started, 3),
            "size_bytes": _tree_size(temp),
        }
        write_file_atomic(temp / META_FILE, json.dumps(meta, indent=2) + "\n")
        _fsync_directory(temp)
        if final.exists():
            # a checkpoint of the same step from an abandoned continuation: replaced as a whole
            old = self.directory / f"{TEMP_PREFIX}old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(temp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temp, final)
        _fsync_directory(self.directory)
        write_file_atomic(self.directory / LATEST_FILE, final.name + "\n")

    def _rotate(self, keep: Path, step: int) -> None:
        # a re-sharded copy served only this launch's start: its own checkpoint now exists
        for converted in self.directory.glob(f"{UNIVERSAL_PREFIX}*"):
            shutil.rmtree(converted, ignore_errors=True)
        # checkpoints of later steps were left behind by a resume from an earlier one: another
        # line of training, neither counted nor deleted here
        complete = [info for info in complete_checkpoints(self.directory) if info.step <= step]
        for info in complete[: max(0, len(complete) - self.keep_last)]:
            if info.path != keep:
                shutil.rmtree(info.path, ignore_errors=True)

    def load(self, resume: dict[str, Any]) -> int:
        """Restore the state resume.json names; return the step to continue from."""
        self.engine.load(resume["load_dir"])
        if not getattr(self.engine, "saves_rng", False):
            load_rng_state(Path(resume["checkpoint"]), self.rank)
        meta = json.loads((Path(resume["checkpoint"]) / META_FILE).read_text())
        self.last_saved_step = int(meta["step"])
        self.last_saved_path = Path(resume["checkpoint"])
        if self.rank == 0 and self.holds_last_saved():
            # resumed from an earlier checkpoint of this run: a crash before the next save must
            # come back here, not to the later steps this launch trains again
            write_file_atomic(self.directory / LATEST_FILE, self.last_saved_path.name + "\n")
        return self.last_saved_step

    def holds_last_saved(self) -> bool:
        """Whether the last checkpoint saved or loaded is one of this run's (not another run's)."""
        path = self.last_saved_path
        return path is not None and self.directory.resolve() in Path(path).resolve().parents

    def write_stop_record(self, step: int, reason: str, checkpoint: Path, exit_status: int) -> None:
        """Rank 0 tells the launcher how this launch ended (read by `dplaunch train`)."""
        if self.rank == 0:
            record = {
                "step": step,
                "reason": reason,
                "checkpoint": str(checkpoint),
                "exit_status": exit_status,
            }
            write_file_atomic(self.run_dir / STOP_FILE, json.dumps(record) + "\n")

    def _apply_fault(self, step: int, kind: str) -> None:
        if self._fault is None or self._fault[0] != step or self._fault[1] != kind:
            return
        if kind == "sleep":
            time.sleep(self._fault[2])
        elif kind == "max_file_bytes":
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (int(self._fault[2]), resource.RLIM_INFINITY))


def _parse_fault(text: str) -> tuple[int, str, float] | None:
    if not text:
        return None
    step, _, action = text.partition(":")
    kind, _, value = action.partition("=")
    if kind not in ("sleep", "max_file_bytes"):
        raise ValueError(
            f"{FAULT_ENV}={text!r}: expected STEP:sleep=SECONDS or STEP:max_file_bytes=N"
        )
    return int(step), kind, float(value)


def save_rng_state(directory: Path, rank: int) -> None:
    """Python, NumPy and torch RNG of this rank (for engines whose own save has none)."""
    import random

    import numpy as np
    import torch

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(state, directory / f"rng-rank-{rank}.pt")


def load_rng_state(directory: Path, rank: int) -> None:
    """Restore save_rng_state's file of this rank when there is one (another world size may lack it)."""
    import random

    import numpy as np
    import torch

    path = directory / f"rng-rank-{rank}.pt"
    if not path.is_file():
        return
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_file_atomic(path: Path, text: str) -> None:
    """Write via a temporary file, fsync and rename: readers see the old or the new file, never half."""
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(temp, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _local_place() -> tuple[int, int]:
    """(this rank's index on its node, ranks on the node), as torchrun sets them."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def sync_to_disk(folder: Path, local_rank: int, local_size: int) -> list[Path]:
    """fsync FOLDER's files and folders, shared among the ranks of a node; return this rank's.

    Every node syncs every file: dirty pages live in the page cache of the node that wrote them
    (Lustre and NFS clients too), and a node does not know which files its ranks wrote."""
    entries = sorted(folder.rglob("*"))
    mine = [entry for index, entry in enumerate(entries) if index % local_size == local_rank]
    for entry in mine:
        if entry.is_dir():
            _fsync_directory(entry)
        elif entry.is_file():
            _fsync_file(entry)
    if local_rank == 0:
        _fsync_directory(folder)
    return mine


def _tree_size(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())
