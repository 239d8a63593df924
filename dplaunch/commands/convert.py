"""`dplaunch convert CHECKPOINT --to universal|fsdp|deepspeed|hf --out DIR`: a checkpoint of any
layout in another form, without a run and without GPUs.

- universal: dplaunch's engine-neutral form (dplaunch/train/universal.py): fp32 weights and Adam's
  state by the model's own parameter names, in safetensors files; any layout resumes from it.
- fsdp: a torch.distributed.checkpoint folder, as FSDP2's get_state_dict names it.
- deepspeed: DeepSpeed's universal checkpoint (any ZeRO stage and GPU count loads it).
- hf: one Hugging Face model (from_pretrained), as `dplaunch export` writes it.

Every form goes through the universal one, tensor by tensor, within DPLAUNCH_CONVERT_MEMORY_MB
of host memory. The result appears whole or not at all: it is written into a temporary folder
beside OUT and renamed when complete. Each result is also a complete dplaunch checkpoint
(except hf): `dplaunch train --resume OUT` continues from it under any layout.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Annotated, Literal

import typer

from dplaunch.commands.options import command
from dplaunch.errors import UserError

ConvertTarget = Literal["universal", "fsdp", "deepspeed", "hf"]


@command()
def convert_command(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A checkpoints/step-N directory, or a run directory (its newest checkpoint)."
        ),
    ],
    to: Annotated[
        ConvertTarget,
        typer.Option(
            "--to",
            help="universal (dplaunch's, any layout resumes from it), fsdp (torch DCP), "
            "deepspeed (DeepSpeed's universal checkpoint) or hf (from_pretrained).",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="The folder to write (new or empty).")],
) -> int:
    """A checkpoint of any layout as another form: weights, optimizer state, schedule, data
    position and RNG (hf: the model), converted tensor by tensor."""
    return run_convert(checkpoint, to, out)


def run_convert(checkpoint: Path, to: str, out: Path) -> int:
    """Write CHECKPOINT (or a run's newest one) as the form TO into OUT; return the exit status."""
    import typer

    from dplaunch.run_directory.checkpoints import find_checkpoint

    if to == "hf":
        from dplaunch.commands.export import run_export

        return run_export(checkpoint, out)
    info = find_checkpoint(checkpoint.expanduser(), field="CHECKPOINT").info
    out = out.expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError("--out", f"{out} already exists and is not empty", "give a new folder")
    from dplaunch.config.schema import RunConfig
    from dplaunch.run_directory.files import read_run_file
    from dplaunch.run_directory.layout import TEMP_PREFIX
    from dplaunch.train.convert import memory_budget, write_universal

    config = RunConfig.model_validate(read_run_file(info.path))
    temp = out.absolute().with_name(f"{TEMP_PREFIX}{out.name}-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        universal = temp if to == "universal" else temp.with_name(temp.name + "-universal")
        try:
            report = write_universal(
                info.path, universal, memory_bytes=memory_budget(), say=typer.echo
            )
        except ValueError as error:
            raise UserError(
                "CHECKPOINT", str(error), "convert a checkpoint dplaunch wrote"
            ) from None
        if to != "universal":
            _write_target(to, universal, temp, info.step, config)
            shutil.rmtree(universal)
        if out.exists():
            out.rmdir()
        os.rename(temp, out)
    finally:
        for left in (temp, temp.with_name(temp.name + "-universal")):
            shutil.rmtree(left, ignore_errors=True)
    from dplaunch.train.convert import peak_rss_bytes

    size = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    # the whole command's high-water mark: the universal step's and the rest's
    peak = peak_rss_bytes()
    typer.echo(
        f"wrote {out} ({to}, {size / 1e6:.1f} MB, {report['parameters']} parameters, step "
        f"{info.step}, peak RSS {peak / 1e6:.0f} MB): resume from it with `dplaunch train RUN.yaml "
        f"--resume {out}` under any layout"
    )
    return 0


def _write_target(to: str, universal: Path, out: Path, step: int, config: object) -> None:
    """The fsdp or deepspeed form of UNIVERSAL in OUT, with the checkpoint's other files."""
    from dplaunch.run_directory.files import copy_checkpoint_description, read_checkpoint_meta
    from dplaunch.train import checkpoint_targets
    from dplaunch.train.convert import write_converted_meta

    out.mkdir(parents=True)
    if to == "fsdp":
        checkpoint_targets.write_fsdp(universal, out, config)
    else:
        checkpoint_targets.write_deepspeed(universal, out, config, step)
    checkpoint_targets.copy_rng_files(universal, out)
    copy_checkpoint_description(universal, out)
    write_converted_meta(out, {**read_checkpoint_meta(universal), "format": to})
