"""Checkpoints that never lose work, written by the ranks: atomic directories, a `latest` pointer,
rotation (the layout of RUN/checkpoints/: dplaunch/run_directory/layout.py).

A save writes `.tmp-step-N/`; after a barrier (every rank done) rank 0 writes checkpoint.json,
renames the directory to `step-N`, moves `latest`, and only then deletes checkpoints beyond
`train.keep_last`. A kill -9 at any moment leaves the previous checkpoint and `latest` intact.

The launcher decides where a launch resumes from (dplaunch/launching/resume.py) and re-shards a
ZeRO checkpoint for another data-parallel size (dplaunch/launching/reshard.py); the ranks load
what resume.json names. The top of this module imports no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplaunch.run_directory.checkpoints import complete_checkpoints, newest_checkpoint
from dplaunch.run_directory.files import (
    file_record,
    fsync_directory,
    fsync_file,
    read_checkpoint_meta,
    sync_to_disk,
    write_checkpoint_meta,
    write_latest,
    write_stop_record,
    write_text_atomic,
)
from dplaunch.run_directory.layout import (
    CHECKPOINTS_DIR,
    META_FILE,
    MODEL_FILES_DIR,
    PLAN_FILE,
    RUN_FILE,
    TEMP_PREFIX,
    UNIVERSAL_PREFIX,
    digests_part_file,
    rank_of,
    rng_state_file,
    step_dir,
)
from dplaunch.train.checkpoint_faults import fault_from_environment
from dplaunch.train.control import ControlChannel


class CheckpointError(RuntimeError):
    """A save that did not complete; the previous checkpoint is still valid."""


@dataclass(frozen=True)
class SaveHooks:
    """What a checkpoint holds besides the engine's state (None: nothing of that kind)."""

    # rank 0 writes the model's Hugging Face files (config, tokenizer) into the checkpoint
    model_files: Callable[[Path], None] | None = None
    # each rank writes where its data stands (a stream's lanes); None: the position is the step
    # (the cached path's order is a function of it)
    data_position: Callable[[Path], None] | None = None
    # more of checkpoint.json (train.early_stopping's record), and a checkpoint rotation keeps
    # beside the keep_last newest (train.keep_best's best one)
    meta: Callable[[], dict[str, Any]] | None = None
    kept: Callable[[], Path | None] | None = None


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
        hooks: SaveHooks = SaveHooks(),
    ):
        self.write_model_files = hooks.model_files
        self.save_data_position = hooks.data_position
        self.hooks = hooks
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
        # TEST ONLY: None in every real run (dplaunch/train/checkpoint_faults.py)
        self._fault = fault_from_environment()

    def save(self, step: int, steps_per_epoch: int | None, reason: str) -> Path:
        """Write checkpoint step-N atomically; raise CheckpointError (previous one intact) on failure."""
        started = time.perf_counter()
        final = self.directory / step_dir(step)
        temp = self.directory / f"{TEMP_PREFIX}{step_dir(step)}"
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
            what = f"{temp}: {problem}" if problem else f"{temp} (on rank 0)"
            raise CheckpointError(
                f"checkpoint step {step} failed, {intact}: could not create {what}"
            )
        try:
            self._inject_fault(step, "max_file_bytes")
            self.engine.save(str(temp))
            if not self.engine.saves_rng:
                save_rng_state(temp, self.rank)
            if self.save_data_position is not None:
                self.save_data_position(temp)
            self._inject_fault(step, "sleep")
        except Exception as error:  # noqa: BLE001 — reported with what is still valid
            raise CheckpointError(
                f"could not write checkpoint step {step}, {intact}: {temp}: {error}"
            ) from error
        self.control.barrier()  # every rank has written its part
        try:
            # the ranks read the files back (from the page cache) and record each one's size and
            # CRC-32, a share each: checkpoint.json lists them, a resume verifies them
            record_digests(temp, self.rank, _world_size())
            # on disk before checkpoint.json says "complete": a node that crashes after the
            # commit must not leave a complete checkpoint of truncated files
            sync_to_disk(temp, *_local_place())
        except OSError as error:
            problem = error
        else:
            problem = None
        if self.control.any(problem is not None):
            why = problem or "another rank could not (its error file says why)"
            raise CheckpointError(
                f"could not write checkpoint step {step} to disk, {intact}: {temp}: {why}"
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
            meta = read_checkpoint_meta(final)
            self.say(
                f"[dplaunch] checkpoint {final} ({reason}): {meta['size_bytes'] / 1e6:.1f} MB in "
                f"{meta['save_seconds']:.2f} s"
            )
            self._rotate(keep=final, step=step)
        return final

    def _commit(
        self,
        temp: Path,
        final: Path,
        step: int,
        steps_per_epoch: int | None,
        reason: str,
        started: float,
    ) -> None:
        for name in (RUN_FILE, PLAN_FILE):
            shutil.copy2(self.run_dir / name, temp / name)
            fsync_file(temp / name)
        if self.write_model_files is not None:
            self.write_model_files(temp / MODEL_FILES_DIR)
            sync_to_disk(temp / MODEL_FILES_DIR, 0, 1)
        files = merge_digests(temp)
        meta = {
            "step": step,
            # a stream's epoch is unknown: its position is in data-position-N.json
            "epoch": step // steps_per_epoch if steps_per_epoch else None,
            "step_in_epoch": step % steps_per_epoch if steps_per_epoch else None,
            "steps_per_epoch": steps_per_epoch,
            "reason": reason,
            **self.meta,
            **(self.hooks.meta() if self.hooks.meta is not None else {}),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "save_seconds": round(time.perf_counter() - started, 3),
            "size_bytes": sum(record["bytes"] for record in files.values()),
            "files": files,
        }
        write_checkpoint_meta(temp, meta)
        fsync_directory(temp)
        if final.exists():
            # a checkpoint of the same step from an abandoned continuation: replaced as a whole
            old = self.directory / f"{TEMP_PREFIX}old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(temp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temp, final)
        fsync_directory(self.directory)
        write_latest(self.directory, final.name)

    def _rotate(self, keep: Path, step: int) -> None:
        # a re-sharded copy served only this launch's start: its own checkpoint now exists
        for converted in self.directory.glob(f"{UNIVERSAL_PREFIX}*"):
            shutil.rmtree(converted, ignore_errors=True)
        # checkpoints of later steps were left behind by a resume from an earlier one: another
        # line of training, neither counted nor deleted here
        complete = [info for info in complete_checkpoints(self.directory) if info.step <= step]
        best = self.hooks.kept() if self.hooks.kept is not None else None
        for info in complete[: max(0, len(complete) - self.keep_last)]:
            if info.path != keep and (best is None or info.path.resolve() != best.resolve()):
                shutil.rmtree(info.path, ignore_errors=True)

    def load(self, resume: dict[str, Any]) -> int:
        """Restore the state resume.json names; return the step to continue from."""
        meta = read_checkpoint_meta(Path(resume["checkpoint"]))
        if resume.get("universal"):
            # a checkpoint of another layout, converted by the launcher (train/universal.py)
            self.engine.load_universal(resume["load_dir"], int(meta["step"]))
            load_rng_state(Path(resume["load_dir"]), self.rank)
        else:
            self.engine.load(resume["load_dir"])
            if not self.engine.saves_rng:
                load_rng_state(Path(resume["checkpoint"]), self.rank)
        self.last_saved_step = int(meta["step"])
        self.last_saved_path = Path(resume["checkpoint"])
        if self.rank == 0 and self.holds_last_saved():
            # resumed from an earlier checkpoint of this run: a crash before the next save must
            # come back here, not to the later steps this launch trains again
            write_latest(self.directory, self.last_saved_path.name)
        return self.last_saved_step

    def holds_last_saved(self) -> bool:
        """Whether the last checkpoint saved or loaded is one of this run's (not another run's)."""
        path = self.last_saved_path
        return path is not None and self.directory.resolve() in Path(path).resolve().parents

    def write_stop_record(self, step: int, reason: str, checkpoint: Path, exit_status: int) -> None:
        """Rank 0 tells the launcher how this launch ended (read by `dplaunch train`)."""
        if self.rank == 0:
            write_stop_record(self.run_dir, step, reason, checkpoint, exit_status)

    def _inject_fault(self, step: int, kind: str) -> None:
        # TEST ONLY: nothing happens unless the tests set DPLAUNCH_TEST_CHECKPOINT_FAULT
        if self._fault is not None:
            self._fault.apply(step, kind)


def save_rng_state(directory: Path, rank: int) -> None:
    """Python, NumPy and torch RNG of this rank, and its own GPU's (for engines whose own save
    has none). One GPU's state, not every visible GPU's: a resume on fewer GPUs than the save
    would otherwise restore states into generators that do not exist."""
    import random

    import numpy as np
    import torch

    cuda = None
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        cuda = {"device": device, "state": torch.cuda.get_rng_state(device)}
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }
    torch.save(state, directory / rng_state_file(rank))


def load_rng_state(directory: Path, rank: int) -> None:
    """Restore save_rng_state's file of this rank when there is one (another world size may lack
    it); its GPU state goes to this rank's own GPU."""
    import random

    import numpy as np
    import torch

    path = directory / rng_state_file(rank)
    if not path.is_file():
        return
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"]["state"], torch.cuda.current_device())


def record_digests(folder: Path, rank: int, world_size: int) -> None:
    """Write the sizes and digests of this rank's share of FOLDER's files (every world_size-th
    file of the sorted list) to its part file, durably."""
    names = _checkpoint_files(folder)
    records = {name: file_record(folder / name) for name in names[rank::world_size]}
    write_text_atomic(folder / digests_part_file(rank), json.dumps(records) + "\n", durable=True)


def merge_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """Rank 0 at the commit: every file's record, from the ranks' parts (removed after) and, for
    the files the parts miss (written at the commit), read here."""
    records: dict[str, dict[str, Any]] = {}
    for part in folder.glob(digests_part_file("*")):
        records.update(json.loads(part.read_text()))
        part.unlink()
    names = _checkpoint_files(folder)
    for name in names:
        if name not in records:
            records[name] = file_record(folder / name)
    return {name: records[name] for name in names}


def _checkpoint_files(folder: Path) -> list[str]:
    """The files a checkpoint.json records: all but itself and the digests' part files (which
    other ranks may be writing meanwhile, through a temporary name)."""
    return sorted(
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if path.is_file()
        and path.name != META_FILE
        and not path.name.startswith(TEMP_PREFIX)
        and rank_of(path.name, digests_part_file) is None
    )


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def _local_place() -> tuple[int, int]:
    """(this rank's index on its node, ranks on the node), as torchrun sets them."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
