"""`dplaunch export CHECKPOINT --out DIR`: one consolidated HF model + tokenizer, in one process.

Reads only the checkpoint (its run.yaml says which model and tokenizer; its plan.json which engine
wrote it), gathers the full weights from the checkpoint files and writes them with
`save_pretrained` (safetensors), loadable by `from_pretrained` anywhere. No ranks, no GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
import yaml

from dplaunch.errors import UserError


def run_export(checkpoint: Path, out: Path) -> int:
    """Write the consolidated model of a checkpoint (or of a run's newest checkpoint) to ``out``."""
    from dplaunch.config.schema import RunConfig
    from dplaunch.planning.plan import Plan
    from dplaunch.train.checkpoint import find_checkpoint

    info = find_checkpoint(checkpoint.expanduser(), field="CHECKPOINT")
    config = RunConfig.model_validate(yaml.safe_load((info.path / "run.yaml").read_text()))
    plan = Plan.from_dict(json.loads((info.path / "plan.json").read_text()))
    if (out / "config.json").exists():
        raise UserError("--out", f"{out} already holds a model", "choose an empty or new directory")
    if plan.tensor_parallel_size > 1:
        raise UserError(
            "CHECKPOINT",
            f"{info.path} is tensor-parallel (tp {plan.tensor_parallel_size}): its weights are "
            "AutoTP shards that only the running engine knows how to join",
            "resume it on its own layout with the step as the end, which exports at once: "
            f"dplaunch train RUN_FILE --tp {plan.tensor_parallel_size} --gpus {plan.world_size} "
            f"--resume {info.path} --set train.max_steps={info.step} -o NEW_RUN_DIR",
        )
    typer.echo(
        f"exporting {info.path} (step {info.step}, {plan.engine}"
        + (f" ZeRO-{plan.zero_stage}" if plan.zero_stage else "")
        + f", {plan.world_size} rank(s)) to {out}"
    )
    started = time.perf_counter()
    export_checkpoint(info.path, config, plan.engine, out)
    size = sum(item.stat().st_size for item in out.iterdir() if item.is_file())
    typer.echo(
        f"wrote {out} ({size / 1e6:.1f} MB, {time.perf_counter() - started:.1f} s): "
        "load it with from_pretrained"
    )
    return 0


def export_checkpoint(directory: Path, config: object, engine: str, out: Path) -> None:
    """Build the run's model, load the checkpoint's full weights into it, save model + tokenizer."""
    from dplaunch.train.checkpoint import consolidated_state_dict
    from dplaunch.train.modeling import load_model, load_tokenizer

    tokenizer = load_tokenizer(config.model)  # type: ignore[attr-defined]
    model = load_model(config.model, tokenizer, config.train.seed)  # type: ignore[attr-defined]
    if engine == "pipeline":
        from dplaunch.train.checkpoint import load_pipeline_layers

        load_pipeline_layers(directory, model)
    else:
        state = consolidated_state_dict(directory, engine)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # tied weights are stored once; anything else missing means a wrong checkpoint
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        missing = [name for name in missing if name not in tied]
        if missing or unexpected:
            raise UserError(
                "CHECKPOINT",
                f"{directory} does not fit the model of its run.yaml "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})",
                "export a checkpoint written by dplaunch for this run file",
            )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
