"""Consolidated weights of a checkpoint for `dplaunch export`: read from the files in one process,
or (tensor parallel) loaded into the ranks of the export job, whose engine joins the shards."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

from dplaunch.errors import UserError
from dplaunch.run_directory.layout import DEEPSPEED_TAG, PIPELINE_TAG, RUN_FILE
from dplaunch.train.checkpoint import CheckpointError

# the engine name of a checkpoint `dplaunch convert` wrote (checkpoint.json's "format")
CONVERTED = "converted"


def export_tokenizer(config: Any) -> Any:
    """The run's tokenizer as its ranks had it, chat template included: the end-of-run export
    and `dplaunch export` then write the same tokenizer files (the built-in byte-level tokenizer
    has no template of its own; an sft run gives it data.chat_template)."""
    from dplaunch.train.data import attach_chat_template
    from dplaunch.train.modeling import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    if getattr(tokenizer, "chat_template", None) is None:
        try:
            attach_chat_template(tokenizer, config.data, config.model.task)
        except (OSError, ValueError) as error:
            raise UserError(
                "data.chat_template",
                f"the run's chat template cannot be read for the export ({error})",
                "put the template file back where the run file names it",
            ) from None
    return tokenizer


def consolidated_state_dict(directory: Path, engine: str) -> dict[str, Any]:
    """The full model state dict of a DDP, ZeRO-1/2/3 or FSDP checkpoint (fp32 master weights for
    ZeRO and FSDP), or of one `dplaunch convert` wrote (ENGINE: CONVERTED)."""
    if engine == CONVERTED:
        return _converted_weights(directory)
    if engine == "fsdp":
        from dplaunch.train.fsdp import consolidated_fsdp_state_dict

        return consolidated_fsdp_state_dict(directory)
    if engine == "ddp":
        from safetensors.torch import load_file

        state = load_file(str(directory / "model.safetensors"))
        # checkpoints hold the unwrapped model; strip DDP's prefix should an older one have it
        return {name.removeprefix("module."): tensor for name, tensor in state.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # zero_to_fp32: every rank's partition of the fp32 master weights, joined (ZeRO-3 included).
    # It print()s each step of the joining ("Processing zero checkpoint …", "Reconstructed …"):
    # that goes nowhere. Its problems are exceptions, and DeepSpeed's warnings and logs go to
    # stderr, left as they are.
    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=DEEPSPEED_TAG)


def write_checkpoint_model(
    directory: Path, config: Any, engine: str, out: Path, tokenizer: Any
) -> None:
    """Build the run's model, load the full weights of the checkpoint in DIRECTORY (written by
    ENGINE) into it, and save it with TOKENIZER to OUT (`dplaunch export`; the ranks' export of
    train.keep_best's checkpoint)."""
    from dplaunch.train.modeling import load_model

    model = load_model(
        config.model,
        tokenizer,
        config.train.seed,
        config.data.label_names,
    )
    if engine == "pipeline":
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
                f"{directory} does not fit the model of its {RUN_FILE} "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})",
                "export a checkpoint written by dplaunch for this run file",
            )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


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


def _converted_weights(directory: Path) -> dict[str, Any]:
    """The weights of a universal, fsdp or deepspeed form (`dplaunch convert`), by the model's
    names, read through its universal-form reader."""
    import tempfile

    from dplaunch.config.schema import RunConfig
    from dplaunch.run_directory.files import read_checkpoint_meta, read_run_file
    from dplaunch.train.checkpoint_sources import open_source

    config = RunConfig.model_validate(read_run_file(directory))
    with tempfile.TemporaryDirectory(prefix="dplaunch-export-") as work:
        source = open_source(directory, read_checkpoint_meta(directory), config, Path(work))
        try:
            return {name: weight for name, weight, _ in source.entries()}
        finally:
            source.close()
