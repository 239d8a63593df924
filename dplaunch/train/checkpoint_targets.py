"""The universal form (dplaunch/train/universal.py) written as another engine's checkpoint, for
`dplaunch convert --to fsdp|deepspeed`: tensor by tensor, never the whole state at once.

- fsdp: a torch.distributed.checkpoint folder with the keys FSDP2's get_state_dict gives
  (model.NAME, optimizer.state.NAME.KEY, optimizer.param_groups), written by DCP's own writer
  with a planner that reads each tensor from the universal form only when it is written. Any
  FSDP2 program (and dplaunch's FSDP engine, any dp × tp) loads it with dcp.load.
- deepspeed: DeepSpeed's universal checkpoint (what its ds_to_universal writes: zero/NAME/
  fp32.pt, exp_avg.pt, exp_avg_sq.pt, step.pt, and the common optimizer state), which a DeepSpeed
  engine of any ZeRO stage and data-parallel size loads with "checkpoint": {"load_universal": true}.

Both are complete dplaunch checkpoint folders too (checkpoint.json says which form they hold),
so `--resume` takes them under any layout.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from dplaunch.run_directory.layout import DEEPSPEED_TAG, FSDP_TAG, FSDP_TRAINER_FILE
from dplaunch.train.universal import MOMENTS, STEP, UniversalReader

# the DeepSpeed version whose universal-checkpoint format this writes (its loader asserts one)
DEEPSPEED_FORMAT_VERSION = "0.19.8"


class ShapesOnly(torch.nn.Module):
    """A module whose named parameters are SHAPES on the meta device: what decides the optimizer's
    groups (train/engines.py), without building the model."""

    def __init__(self, shapes: dict[str, list[int]]):
        super().__init__()
        self._shapes = shapes

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        for name, shape in self._shapes.items():
            yield name, torch.nn.Parameter(torch.empty(shape, device="meta"))


def optimizer_param_groups(config: Any, shapes: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The optimizer's two groups (train/engines.py) as a torch AdamW state_dict gives them, with
    parameter names instead of numbers (what FSDP2's get_optimizer_state_dict gives)."""
    from dplaunch.train.engines import parameter_groups

    named = parameter_groups(ShapesOnly(shapes))
    weight_decay = (config.train.weight_decay, 0.0)
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for _, p in group], "weight_decay": decay}
            for group, decay in zip(named, weight_decay, strict=True)
        ],
        lr=config.train.lr,
    )
    groups = optimizer.state_dict()["param_groups"]
    for group, names in zip(groups, named, strict=True):
        group["params"] = [name for name, _ in names]
        # the scheduler's base learning rate, which every dplaunch optimizer's groups carry
        group["initial_lr"] = config.train.lr
    return groups


def write_fsdp(universal: Path, out: Path, config: Any) -> None:
    """OUT/fsdp (torch.distributed.checkpoint) and OUT/trainer_state.pt from a universal form."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    reader = UniversalReader(universal)
    lazy: dict[str, Any] = {}
    placeholders: dict[str, Any] = {}
    for name, shape in reader.shapes.items():
        lazy[f"model.{name}"] = (reader.weight, (name,))
        placeholders[f"model.{name}"] = torch.empty(shape, device="meta")
        if reader.has_state(name):
            for key in MOMENTS:
                lazy[f"optimizer.state.{name}.{key}"] = (reader.state, (name, key))
                placeholders[f"optimizer.state.{name}.{key}"] = torch.empty(shape, device="meta")
            lazy[f"optimizer.state.{name}.{STEP}"] = (reader.state, (name, STEP))
            placeholders[f"optimizer.state.{name}.{STEP}"] = torch.empty((), device="meta")

    class ReadWhenWritten(DefaultSavePlanner):
        """DCP's default planner, each tensor read from the universal form as it is written."""

        def resolve_data(self, write_item: Any) -> Any:
            found = lazy.get(write_item.index.fqn)
            if found is None:
                return super().resolve_data(write_item)
            read, args = found
            return read(*args)

    state = dict(placeholders)
    state["optimizer.param_groups"] = optimizer_param_groups(config, reader.shapes)
    with warnings.catch_warnings():
        # "no process group: saving from this process" is what is wanted here
        warnings.simplefilter("ignore")
        dcp.save(
            state,
            # a file per tensor: torch's writer holds a file's tensors until the file is closed
            storage_writer=FileSystemWriter(str(out / FSDP_TAG), single_file_per_rank=False),
            planner=ReadWhenWritten(),
            no_dist=True,
        )
    torch.save({"scheduler": reader.scheduler_state()}, out / FSDP_TRAINER_FILE)
    reader.close()


def write_deepspeed(universal: Path, out: Path, config: Any, step: int) -> None:
    """OUT/pytorch_model in DeepSpeed's universal-checkpoint form, from a universal form."""
    reader = UniversalReader(universal)
    tag_dir = out / DEEPSPEED_TAG
    zero = tag_dir / "zero"
    saved_step = torch.tensor(float(step))
    for name, weight, state in reader.entries():
        folder = zero / name
        folder.mkdir(parents=True)
        torch.save({"param": weight, "cat_dim": 0}, folder / "fp32.pt")
        for key in MOMENTS:
            if key in state:
                torch.save({"param": state[key], "cat_dim": 0}, folder / f"{key}.pt")
        if STEP in state:
            saved_step = state[STEP]
            torch.save(state[STEP], folder / "step.pt")
    groups = [
        {key: value for key, value in group.items() if key != "params"} | {"params": [index]}
        for index, group in enumerate(optimizer_param_groups(config, reader.shapes))
    ]
    common = {
        "zero_stage": 1,
        "loss_scaler": None,
        "dynamic_loss_scale": False,
        "overflow": False,
        "clip_grad": float(config.train.max_grad_norm),
        "ds_version": DEEPSPEED_FORMAT_VERSION,
        "param_groups": groups,
        "optimizer_state_dict": {
            "state": {index: {STEP: saved_step} for index in range(len(groups))},
            "param_groups": groups,
        },
    }
    torch.save(common, zero / "optimizer_state.pt")
    model_states = {
        "module": None,
        "buffer_names": [],
        "optimizer": None,
        "lr_scheduler": None,
        "skipped_steps": 0,
        "global_steps": step,
        "global_samples": step * config.train.global_batch_size,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_version": DEEPSPEED_FORMAT_VERSION,
        "param_shapes": [dict(reader.shapes)],
        "frozen_param_shapes": None,
    }
    torch.save(model_states, tag_dir / "mp_rank_00_model_states.pt")
    # Accelerate keeps the scheduler beside DeepSpeed's state (its save_state's custom object)
    from dplaunch.train.checkpoint_sources import ACCELERATE_SCHEDULER

    torch.save(reader.scheduler_state(), out / ACCELERATE_SCHEDULER)
    reader.close()


def copy_rng_files(universal: Path, out: Path) -> None:
    """The source ranks' RNG files (train/checkpoint.py's form) next to the converted state."""
    from dplaunch.run_directory.layout import rank_of, rng_state_file

    for path in universal.iterdir():
        if rank_of(path.name, rng_state_file) is not None:
            shutil.copy2(path, out / path.name)
