"""`dplaunch export CHECKPOINT --out DIR`: one consolidated HF model + tokenizer, loadable anywhere.

Reads the checkpoint (its run.yaml says which model and tokenizer; its plan.json which engine
wrote it) and writes the full weights with `save_pretrained` (safetensors), loadable by
`from_pretrained` on one process. No GPU is used.

- DDP, ZeRO-1/2/3, pipeline and FSDP checkpoints: in this process, from the files (DDP's model
  file, ZeRO's fp32 master partitions joined by zero_to_fp32, the pipeline's per-layer files,
  FSDP's torch.distributed.checkpoint shards, tensor-parallel ones included).
- Tensor-parallel (AutoTP) checkpoints: how a weight was split depends on the layer (fused
  projections are cut per part), so only DeepSpeed's engine joins its shards. dplaunch starts a
  short job of tp CPU ranks (gloo, dp 1) in a temporary run directory; each rank builds the
  engine as training does, loads its shard of the weights (no optimizer state) and the engine's
  export writes the model, as at the end of training (dplaunch/train/export_ranks.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml

from dplaunch.commands.options import command
from dplaunch.errors import UserError
from dplaunch.run_directory.layout import RUN_FILE

if TYPE_CHECKING:
    from dplaunch.config.schema import RunConfig
    from dplaunch.planning.plan import Plan
    from dplaunch.run_directory.checkpoints import CheckpointInfo


@command()
def export_command(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A checkpoints/step-N directory, or a run directory (its newest checkpoint)."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory for the HF model + tokenizer.")],
    adapter: Annotated[
        bool,
        typer.Option(
            "--adapter",
            help="A LoRA run's adapter as a PEFT folder instead of the model merged with it.",
        ),
    ] = False,
) -> int:
    """One consolidated HF model + tokenizer (safetensors) from a checkpoint, for from_pretrained.

    Tensor-parallel checkpoints are joined by a short job of CPU ranks (one per tp rank). A LoRA
    run's checkpoint gives its adapter merged into the base, or with --adapter the PEFT folder.
    """
    return run_export(checkpoint, out, adapter)


def run_export(checkpoint: Path, out: Path, adapter: bool = False) -> int:
    """Write the consolidated model of a checkpoint (or of a run's newest checkpoint) to ``out``;
    of a LoRA run's, the adapter merged into its base, or (ADAPTER) the PEFT adapter folder."""
    from dplaunch.launching.rundir import check_output_dir

    info, config, plan = _read_checkpoint(checkpoint, adapter)
    if (out / "config.json").exists() or (out / "adapter_config.json").exists():
        raise UserError("--out", f"{out} already holds a model", "choose an empty or new directory")
    check_output_dir(out, "--out")
    # checked and planned before anything is written: one line, exit 2
    job = None
    # (FSDP's DCP shards, tp ones included, are joined in this process like the others; so are
    # the whole tensors of a checkpoint `dplaunch convert` wrote)
    converted = info.meta.get("format") is not None
    if plan.tensor_parallel_size > 1 and plan.engine != "fsdp" and not converted:
        _check_weight_files(info.path, plan.tensor_parallel_size)
        job = export_job_plan(config, plan)
    from dplaunch.train.export_weights import CONVERTED

    engine = CONVERTED if converted else plan.engine
    folder = _OutFolder(out)
    _quiet_export()
    typer.echo(f"exporting {info.path} (step {info.step}, {plan.layout_name}) to {out}")
    started = time.perf_counter()
    try:
        code = 0
        if job is not None:
            code = run_export_job(info.path, *job, out)
        elif config.model.lora is not None:
            export_lora_checkpoint(info.path, config, engine, plan.mixed_precision, out, adapter)
        else:
            export_checkpoint(info.path, config, engine, out)
    except UserError:
        folder.discard()
        raise
    except Exception as error:  # noqa: BLE001 — a checkpoint that does not load: one line
        folder.discard()
        message = " ".join(str(error).split())[:300]
        raise UserError(
            "CHECKPOINT",
            f"{info.path} could not be read ({type(error).__name__}: {message})",
            "it is damaged or not a dplaunch checkpoint: export another one (a run directory "
            "exports its newest checkpoint that verifies)",
        ) from None
    except BaseException:  # Ctrl-C: nothing half-written either
        folder.discard()
        raise
    if code != 0:
        folder.discard()
        return code
    size = sum(item.stat().st_size for item in out.iterdir() if item.is_file())
    how = "PeftModel.from_pretrained(base, OUT)" if adapter else "from_pretrained"
    typer.echo(
        f"wrote {out} ({size / 1e6:.1f} MB, {time.perf_counter() - started:.1f} s): "
        f"load it with {how}"
    )
    return 0


def _read_checkpoint(checkpoint: Path, adapter: bool) -> tuple[CheckpointInfo, RunConfig, Plan]:
    """The checkpoint (verified: a damaged one is one line), its run file and plan; a UserError
    when ADAPTER is asked of a run without LoRA or the run's local model is gone."""
    from dplaunch.config.schema import RunConfig
    from dplaunch.planning.plan import Plan
    from dplaunch.run_directory.checkpoints import find_checkpoint
    from dplaunch.run_directory.files import read_plan_file, read_run_file

    found = find_checkpoint(checkpoint.expanduser(), field="CHECKPOINT")
    info = found.info
    for damage in found.damaged:
        typer.echo(f"skipped: {damage.line()}", err=True)
    try:
        config = RunConfig.model_validate(read_run_file(info.path))
        saved_plan = read_plan_file(info.path)
    except (OSError, ValueError, yaml.YAMLError) as error:  # pydantic's errors are ValueErrors
        raise UserError(
            "CHECKPOINT",
            f"cannot read the run file or plan of {info.path} ({type(error).__name__})",
            "it is damaged: export another checkpoint",
        ) from None
    if adapter and config.model.lora is None:
        raise UserError(
            "--adapter",
            f"{info.path} is not a LoRA run's checkpoint (its {RUN_FILE} has no model.lora)",
            "drop --adapter to export the full model",
        )
    if config.model.lora is None:
        from dplaunch.train.modeling import checkpoint_model

        config.model = checkpoint_model(info.path, config.model)
    # a LoRA checkpoint holds no base weights: the run file's base (pretrained, or model.config
    # with its seed) is built again
    name = config.model.name_or_path
    if name is not None:
        # a checkpoint without its own model files (written before they were saved with it)
        # needs the run's model: a local one must still be there
        from dplaunch.hub import find_model_file, looks_like_path

        if looks_like_path(name):
            find_model_file(name, ("config.json",), "model.name_or_path")
    return info, config, Plan.from_dict(saved_plan)


class _OutFolder:
    """--out, created for an export: a failed export leaves nothing behind (the folders it
    created, or what it added to one that existed)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        # the outermost folder this export creates: removed whole if it fails
        self.created: Path | None = None
        if not out.exists():
            self.created = out.absolute()
            while not self.created.parent.exists():
                self.created = self.created.parent
        self.before = set() if self.created else set(out.iterdir())
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UserError(
                "--out",
                f"cannot create {out} ({error.strerror or error})",
                "choose a writable directory",
            ) from None

    def discard(self) -> None:
        """Remove what the export wrote."""
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        for item in set(self.out.iterdir()) - self.before:
            if item.is_dir():
                shutil.rmtree(item, ignore_errors=True)
            else:
                item.unlink(missing_ok=True)


def _quiet_export() -> None:
    # the export runs on this process's CPU: DeepSpeed (imported with transformers' integrations)
    # would warn that it found no GPU, and save_pretrained and zero_to_fp32 draw progress bars
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # zero_to_fp32's bars ("Loading checkpoint shards", "Gathering sharded weights"); tqdm reads
    # it when imported, which is later
    os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def export_checkpoint(directory: Path, config: object, engine: str, out: Path) -> None:
    """Build the run's model, load the checkpoint's full weights into it, save model + tokenizer."""
    from dplaunch.train.export_weights import export_tokenizer, write_checkpoint_model

    write_checkpoint_model(directory, config, engine, out, export_tokenizer(config))


def export_lora_checkpoint(
    directory: Path, config: RunConfig, engine: str, mixed_precision: str, out: Path, adapter: bool
) -> None:
    """A LoRA checkpoint's adapter, merged into the run's base built in the dtype it trained in
    under MIXED_PRECISION (the run's plan), or (ADAPTER) as a PEFT folder."""
    from dplaunch.train.export_weights import consolidated_state_dict, export_tokenizer
    from dplaunch.train.lora_export import write_exports

    tokenizer = export_tokenizer(config)
    state = consolidated_state_dict(directory, engine)
    try:
        write_exports(
            config,
            mixed_precision,
            tokenizer,
            state,
            out if adapter else None,
            None if adapter else out,
        )
    except ValueError as error:
        raise UserError(
            "CHECKPOINT",
            f"{directory} does not fit the model of its {RUN_FILE}: {error}",
            "export a checkpoint written by dplaunch for this run file",
        ) from None


def export_job_plan(config: RunConfig, saved: Plan) -> tuple[RunConfig, Plan]:
    """Run file and plan of a tensor-parallel checkpoint's export job: its tp and ZeRO stage, dp 1, CPU."""
    from dplaunch.config.schema import LaunchConfig, ParallelConfig
    from dplaunch.launching.ports import free_port
    from dplaunch.launching.prepare import model_facts
    from dplaunch.planning.plan import Machine, make_plan

    tp = saved.tensor_parallel_size
    launch = LaunchConfig(
        cpu=True, gpus=tp, master_port=free_port(), timeout_minutes=saved.timeout_minutes
    )
    # the weights load the same with or without optimizer offload; none skips CPU-Adam's build
    parallel = ParallelConfig(zero_stage=saved.zero_stage, tp=tp)
    # CPU ranks have no fp16: fp16 weights load exactly into fp32 parameters
    precision = "no" if saved.mixed_precision == "fp16" else saved.mixed_precision
    train = config.train.model_copy(update={"mixed_precision": precision})
    job = config.model_copy(update={"launch": launch, "parallel": parallel, "train": train})
    return job, make_plan(launch, parallel, train, Machine(), model_facts(config.model))


def run_export_job(directory: Path, job: RunConfig, plan: Plan, out: Path) -> int:
    """Start the export job's ranks in a temporary run directory; return the job's exit status."""
    from dplaunch.commands.train import start
    from dplaunch.launching.prepare import openmp_threads, render_files

    run_dir = Path(tempfile.mkdtemp(prefix="dplaunch-export-"))
    job.output_dir = str(run_dir)
    target = ["-m", "dplaunch.train.export_ranks"]
    target += [str(run_dir), str(directory.absolute()), str(out.absolute())]
    # CPU ranks even on a GPU node (whose GPUs may be busy): the job is short. Its launchers' and
    # ranks' temporary files go into the run directory, removed with it
    job_env = {"CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(run_dir)}
    prepared = render_files(
        job, plan, run_dir, target, extra_env=job_env, threads=openmp_threads(plan, None)
    )
    typer.echo(
        f"export job: {plan.world_size} CPU rank(s) join the tp {plan.tensor_parallel_size} "
        f"shards in {run_dir}"
    )
    # on failure the run directory stays (the ranks' tracebacks); the failing rank's error is last
    kept = [f"dplaunch: the export job's files are kept in {run_dir}"]
    code = start(prepared, after_failure=lambda _status: kept)
    if code == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _check_weight_files(directory: Path, tp: int) -> None:
    from dplaunch.train.export_weights import tensor_parallel_weight_files

    missing = [path for path in tensor_parallel_weight_files(directory, tp) if not path.is_file()]
    if missing:
        raise UserError(
            "CHECKPOINT",
            f"{directory} lacks the weights of {len(missing)} of its {tp} tensor-parallel ranks "
            f"({missing[0]})",
            "export a complete checkpoint (the run directory: its newest complete one)",
        )
