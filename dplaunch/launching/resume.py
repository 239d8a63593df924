"""The launcher's resume decision: which checkpoint a launch continues from, checked before launch.

`dplaunch train --resume auto|PATH` asks plan_resume before anything starts: the checkpoint
must continue the same training (model, data, data order), leave a step to train, and have a
layout the new plan can load (the same one, or a DDP/ZeRO one re-sharded for another
data-parallel size: dplaunch.launching.reshard). The answer goes to the ranks as resume.json.

The data order is a function of (seed, epoch, step) (dplaunch/train/data.py), so the data position
is the global step: a resumed run continues with exactly the next batch, also in later epochs. A
stream's (data.streaming) is each lane's place in its files, which the checkpoint holds
(data-position-N.json) for any rank count to continue from (dplaunch/data/streams.py).
Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dplaunch.errors import UserError
from dplaunch.run_directory.checkpoints import (
    CheckpointInfo,
    DamagedCheckpoint,
    find_checkpoint,
    newest_intact_checkpoint,
)
from dplaunch.run_directory.files import finished_at, read_plan_file, read_run_file, resume_text
from dplaunch.run_directory.layout import (
    CHECKPOINTS_DIR,
    EXPORT_DIR,
    RUN_FILE,
    UNIVERSAL_PREFIX,
)

# run-file sections that must be the same to continue a checkpoint: they decide the model and the data order
_SAME_SECTIONS = ("model", "data")
_SAME_TRAIN_KEYS = ("global_batch_size", "seed")
# keys that change neither the training samples nor the model's numbers: how data is read, what
# is evaluated on, whether activations are recomputed, which attention kernel computes the same sums
_FREE_KEYS = {
    "data": ("num_workers", "eval_dataset", "eval_split"),
    "model": ("gradient_checkpointing", "attn_implementation"),
}


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


@dataclass(frozen=True)
class ResumeChoice:
    """What a launch continues from (None: step 0), and the newer checkpoints that did not verify."""

    point: ResumePoint | None
    damaged: tuple[DamagedCheckpoint, ...] = ()


def resume_file_text(point: ResumePoint | None) -> str:
    """resume.json for the ranks of a launch: where they continue from, or a fresh start."""
    if point is None:
        return resume_text()
    return resume_text(
        point.checkpoint.path, point.checkpoint.step, point.load_dir, point.reshard == "universal"
    )


def plan_resume(
    run_dir: Path, resume: str, config: Any, plan: Any, *, start_over: bool = False
) -> ResumeChoice:
    """The checkpoint a launch continues from (None: a fresh start), checked against the new run.

    Every checkpoint is verified first (each file's size and CRC-32 as checkpoint.json recorded
    them): `auto` takes the newest that verifies and names the newer ones that did not. Raises
    UserError, before anything starts, when the checkpoint cannot continue in this run: damaged,
    another model, data or data order, no step left to train (max_steps or epochs at or below
    the checkpoint's step), or a layout that cannot be re-sharded; and when `auto` finds only
    damaged checkpoints, unless START_OVER (from step 0 over them) is asked for.
    """
    if resume == "auto":
        found = newest_intact_checkpoint(run_dir / CHECKPOINTS_DIR)
        if found.info is None:
            if found.damaged and not start_over:
                raise UserError(
                    "--resume",
                    "no checkpoint of this run verifies ("
                    + "; ".join(damage.line() for damage in found.damaged)
                    + "): starting from step 0 would train the whole run again over them",
                    "give --start-over to train from step 0 anyway (they are kept, renamed "
                    "damaged-step-N), or --resume PATH of an intact copy",
                )
            if not found.damaged:
                _refuse_retraining_a_finished_run(run_dir)
            return ResumeChoice(None, found.damaged)
    else:
        found = find_checkpoint(Path(resume).expanduser())
    info = found.info  # find_checkpoint found one or raised
    saved_config = _read_run_file(info.path)
    saved_plan = read_plan_file(info.path)
    notes = _check_same_training(saved_config, config, info)
    notes += _check_steps_left(config, info)
    reshard, layout_notes = _check_layout(saved_plan, plan, info)
    if not info.has_digests:
        # written before dplaunch recorded digests: it resumes as it always did
        notes.append(
            f"{info.name} records no file digests (an older dplaunch wrote it): only the "
            "structure of its safetensors and torch files was checked"
        )
    point = ResumePoint(info, run_dir, reshard, tuple(notes + layout_notes))
    return ResumeChoice(point, found.damaged)


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


def _read_run_file(checkpoint: Path) -> dict[str, Any]:
    try:
        return read_run_file(checkpoint) or {}
    except (OSError, yaml.YAMLError) as error:
        raise UserError(
            "--resume", f"cannot read {checkpoint / RUN_FILE}: {error}", "the checkpoint is damaged"
        ) from None


def _check_same_training(saved: dict[str, Any], config: Any, info: CheckpointInfo) -> list[str]:
    current = config.model_dump(mode="json")
    fix = (
        f"resume with the run file the checkpoint was written with (a copy: {info.path / RUN_FILE})"
    )
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
    where = f"the checkpoint {info.path}"
    export_hint = f"or export it (`dplaunch export {info.path} --out DIR`) and start a new run from that model"
    _refuse_other_format(saved, plan, where, export_hint)
    return _reshaping(saved, plan, where, export_hint)


def _refuse_other_format(saved: dict[str, Any], plan: Any, where: str, export_hint: str) -> None:
    # what no conversion loads: another pipeline cut, tp split, engine, ZeRO stage, offload or
    # DeepSpeed precision
    mesh = saved["mesh"]
    old_tp, old_pp = mesh["tensor_parallel_size"], mesh["pipeline_parallel_size"]
    old_zero = saved["zero_stage"]
    if old_pp != plan.pipeline_parallel_size:
        raise UserError(
            "parallel.pp",
            f"{where} has {old_pp} pipeline stage(s), this run {plan.pipeline_parallel_size}: "
            "DeepSpeed cannot re-cut a pipeline checkpoint into other stages",
            f"resume with --pp {old_pp}, {export_hint}",
        )
    # FSDP checkpoints (torch.distributed.checkpoint) re-shard to another tp on load
    new_fsdp = getattr(plan, "fsdp", None)
    both_fsdp = saved.get("fsdp") is not None and new_fsdp is not None
    if old_tp != plan.tensor_parallel_size and not both_fsdp:
        raise UserError(
            "parallel.tp",
            f"{where} has tensor-parallel degree {old_tp}, this run {plan.tensor_parallel_size}: "
            "its weights are split into tp shards",
            f"resume with --tp {old_tp}, {export_hint}",
        )
    old_fsdp = saved.get("fsdp")
    if (old_fsdp is None) != (new_fsdp is None):
        # FSDP full and hybrid both write torch.distributed.checkpoint: either loads the other's
        raise UserError(
            "parallel.fsdp",
            f"{where} was written by {'FSDP' if old_fsdp else 'DDP/ZeRO'}, this run uses "
            f"{'FSDP' if new_fsdp else 'DDP/ZeRO'}: the checkpoint formats differ",
            (f"resume with --fsdp {old_fsdp}" if old_fsdp else "resume without --fsdp")
            + f", {export_hint}",
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


def _reshaping(
    saved: dict[str, Any], plan: Any, where: str, export_hint: str
) -> tuple[str | None, list[str]]:
    # the checkpoint's layout in the new plan: as it is, re-sharded on load, or converted
    mesh = saved["mesh"]
    old_tp, old_pp = mesh["tensor_parallel_size"], mesh["pipeline_parallel_size"]
    old_dp, old_zero = mesh["data_parallel_size"], saved["zero_stage"]
    both_fsdp = saved.get("fsdp") is not None and getattr(plan, "fsdp", None) is not None
    notes = []
    if both_fsdp and (old_dp, old_tp) != (plan.data_parallel_size, plan.tensor_parallel_size):
        # torch.distributed.checkpoint re-shards on load: no conversion step
        notes.append(
            f"dp {old_dp} × tp {old_tp} → dp {plan.data_parallel_size} × tp "
            f"{plan.tensor_parallel_size}: the FSDP checkpoint's shards are re-sharded as they "
            f"load (torch.distributed.checkpoint); global batch {plan.global_batch_size} kept: "
            f"grad-accum {saved['gradient_accumulation_steps']} → {plan.gradient_accumulation_steps}"
        )
        return None, notes
    old_sp = mesh.get("sequence_parallel_size", 1)
    if old_sp != plan.sequence_parallel_size:
        notes.append(
            f"sequence-parallel degree {old_sp} → {plan.sequence_parallel_size} (every rank holds "
            "the whole model: the sequence slices are no part of a checkpoint)"
        )
    # DeepSpeed sees the sp ranks as data-parallel ones: ZeRO shards over dp × sp
    same_shards = old_dp * old_sp == plan.data_parallel_size * plan.sequence_parallel_size
    if old_dp == plan.data_parallel_size and (old_zero == 0 or same_shards):
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
    if same_shards:
        # as many ZeRO shards as before (dp and sp traded): they load as they are
        notes.append(f"data-parallel size {old_dp} → {plan.data_parallel_size}; {batch}")
        return None, notes
    notes.append(
        f"data-parallel size {old_dp} → {plan.data_parallel_size}: the ZeRO-{old_zero} optimizer shards are "
        f"re-sharded through a DeepSpeed universal checkpoint; {batch}"
    )
    return "universal", notes
