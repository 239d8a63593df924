"""The launcher's resume decision: which checkpoint a launch continues from, checked before launch.

`dplaunch train --resume auto|PATH` asks plan_resume before anything starts: the checkpoint
must continue the same training (model, data, data order) and leave a step to train. Its layout
may be any: a checkpoint the new layout cannot load as it is (another engine, ZeRO stage, tp, pp,
a ZeRO data-parallel size, offload or precision) is converted once into its universal form
(dplaunch/train/universal.py) in the launched run before the ranks start
(dplaunch.launching.reshard), and every rank loads its part of that. The answer goes to the
ranks as resume.json.

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
from dplaunch.planning.rules import ParallelDims
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


# a conversion into the universal form: the start of its process (importing torch, Transformers
# and DeepSpeed) and the bytes of checkpoint it converts a second, measured on this project's
# 2-core test machine under load (benchmarks/README.md: 370.7 MB of FSDP2 state in 13.3 s, 25.8 s
# with the start); DeepSpeed's ZeRO files pass through ds_to_universal first, which writes them
# once more
CONVERT_START_S = 12.0
CONVERT_BYTES_PER_S = 28e6


@dataclass(frozen=True)
class ResumePoint:
    """Where a launch continues from: the checkpoint, and how the ranks load it."""

    checkpoint: CheckpointInfo
    # the run being launched
    run_dir: Path
    # True: the checkpoint's layout differs from this run's; the launcher converts it once into
    # its universal form (dplaunch.launching.reshard) and the ranks load that
    convert: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def universal(self) -> bool:
        """Whether the ranks load a universal form: converted here, or the checkpoint already."""
        return self.convert or self.checkpoint.meta.get("format") == "universal"

    @property
    def load_dir(self) -> Path:
        """The directory the engine loads: the checkpoint, or its universal conversion in this run."""
        if self.convert:
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
        point.checkpoint.path, point.checkpoint.step, point.load_dir, point.universal
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
    convert, layout_notes = check_layout(
        saved_plan, plan.dims, plan.mixed_precision, info, plan.gradient_accumulation_steps
    )
    check_room(info, config, plan, run_dir, convert=convert)
    if not info.has_digests:
        # written before dplaunch recorded digests: it resumes as it always did
        notes.append(
            f"{info.name} records no file digests (an older dplaunch wrote it): only the "
            "structure of its safetensors and torch files was checked"
        )
    point = ResumePoint(info, run_dir, convert, tuple(notes + layout_notes))
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


def _native_mismatch(
    saved: ParallelDims, saved_precision: str, dims: ParallelDims, precision: str, form: str | None
) -> str | None:
    """Why the layout DIMS in PRECISION cannot load the checkpoint of SAVED (in
    SAVED_PRECISION) as it is (None: it can). FORM: what `dplaunch convert` made of it
    (checkpoint.json's format), None for an engine's own."""
    if form == "deepspeed":
        return "DeepSpeed's universal checkpoint"
    engine = saved.engine if form is None else form
    if engine != dims.engine:
        return "another engine"
    if engine == "fsdp":
        # torch.distributed.checkpoint re-shards any dp × tp, full or hybrid, as it loads
        return None
    if precision == "fp16" and saved_precision != "fp16":
        return "fp16 needs a loss-scaler state only an fp16 run saves"
    if engine == "ddp":
        # every rank saved the same whole state: any data-parallel or sequence-parallel size
        return None
    if saved.zero_stage != dims.zero_stage:
        return "another ZeRO stage"
    if saved.offload != dims.offload or saved_precision != precision:
        return "other DeepSpeed optimizer state (offload, precision)"
    if (saved.tp, saved.pp) != (dims.tp, dims.pp):
        return "other tensor or pipeline shards"
    # DeepSpeed sees the sp ranks as data-parallel ones: ZeRO shards over dp × sp
    if saved.zero_stage and saved.dp * saved.sp != dims.dp * dims.sp:
        return "other ZeRO partitions"
    if saved.dp != dims.dp and engine == "pipeline":
        return "another data-parallel size of the pipeline"
    return None


def conversion_seconds(info: CheckpointInfo) -> float:
    """About how long converting INFO's checkpoint into its universal form takes."""
    size = float(info.meta.get("size_bytes") or 0)
    passes = 2 if info.meta.get("zero_stage") else 1
    return CONVERT_START_S + passes * size / CONVERT_BYTES_PER_S


def check_layout(
    saved: dict[str, Any],
    dims: ParallelDims,
    precision: str,
    info: CheckpointInfo,
    accumulation: int | None = None,
) -> tuple[bool, list[str]]:
    """Whether the layout DIMS in PRECISION loads the checkpoint (SAVED: its plan.json) through
    its universal form (converted once in this run) or as it is, and the resume notes that say
    so; ACCUMULATION: the new plan's (None: a layout the plan table only considers)."""
    from dplaunch.planning.plan import Plan

    old = Plan.from_dict(saved)
    change = f"{old.layout_name} → {dims.name(precision)}"
    batch = f"global batch {saved['global_batch_size']} kept"
    if accumulation is not None:
        batch += f": grad-accum {saved['gradient_accumulation_steps']} → {accumulation}"
    form = info.meta.get("format")
    if form == "universal":
        return False, [
            f"{change}: the checkpoint is a universal one (no conversion): each rank loads its "
            f"own part of every tensor; {batch}"
        ]
    why = _native_mismatch(old.dims, old.mixed_precision, dims, precision, form)
    notes = []
    if precision == "fp16" and old.mixed_precision != "fp16":
        notes.append("the fp16 loss scale starts afresh (the checkpoint was not trained in fp16)")
    if why is None:
        if change.split(" → ")[0] != change.split(" → ")[1]:
            notes.append(f"{change}: the checkpoint loads as it is; {batch}")
        return False, notes
    size = float(info.meta.get("size_bytes") or 0) / 1e6
    notes.insert(
        0,
        f"conversion: {change} ({why}): {info.name} ({size:.1f} MB) is converted once into its "
        f"universal form before the ranks start, about {conversion_seconds(info):.0f} s; {batch}",
    )
    return True, notes


def conversion_bytes(info: CheckpointInfo) -> float:
    """About the disk a conversion of INFO's checkpoint takes: its universal form, and under
    ZeRO DeepSpeed's intermediate one too."""
    size = float(info.meta.get("size_bytes") or 0)
    return size * (2 if info.meta.get("zero_stage") else 1) * 1.05


def check_room(
    info: CheckpointInfo, config: Any, plan: Any, run_dir: Path, *, convert: bool
) -> None:
    """Refuse, before launch, a resume that cannot hold the checkpoint's state: a conversion the
    run directory's disk has no room for, or (GPUs) a layout whose GPUs cannot hold the weights,
    gradients and Adam's state it would load."""
    import shutil

    if convert:
        where = run_dir / CHECKPOINTS_DIR
        while not where.exists() and where != where.parent:
            where = where.parent
        free, need = shutil.disk_usage(where).free, conversion_bytes(info)
        if need > free:
            raise UserError(
                "--resume",
                f"converting {info.path} into its universal form needs about {need / 1e9:.1f} GB "
                f"free in {where}, which has {free / 1e9:.1f} GB",
                "free some space, or resume with the layout that wrote it (no conversion then)",
            )
    if plan.target != "gpu":
        return
    from dplaunch.launching.devices import smallest_gpu_memory_gb
    from dplaunch.launching.prepare import model_facts
    from dplaunch.planning.auto import run_workload
    from dplaunch.planning.estimate import estimate_memory

    gpu_gb = smallest_gpu_memory_gb()
    if gpu_gb is None:
        return
    memory = estimate_memory(model_facts(config.model), plan.dims, run_workload(config))
    if memory.model_states_gb > gpu_gb:
        raise UserError(
            "launch.gpus",
            f"the checkpoint's state (weights, gradients, Adam) takes {memory.model_states_gb:.1f} "
            f"GiB per GPU under {plan.layout_name}, more than a GPU's {gpu_gb:.1f} GiB",
            "resume on more GPUs, or with a layout that shares or moves it (--zero 3, --fsdp "
            "full, --offload optimizer)",
        )
