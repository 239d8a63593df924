"""The exports of a LoRA run (end of training and `dplaunch export`), written from the trained
values alone: the PEFT folder (RUN/adapter/, peft's save_pretrained) and, unless
model.lora.export is adapter-only, the adapters merged into the base (RUN/model/).

For the merged model the base is built again in one process, unquantized and unpartitioned
(train/modeling.py), in the dtype it trained in (planning.lora.export_dtype: a 16-bit run's base
never in fp32), and the adapter state is loaded into it. An adapter-only export of a pretrained
base builds that base on the meta device: no weight of it is read or held. Under ZeRO-3 the
values come from the gathered state (accelerate's get_state_dict), never from the rank's empty
partitions (the empty-adapter bug, peft#453).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from dplaunch.config.schema import ModelConfig
from dplaunch.run_directory.layout import ADAPTER_DIR, BASE_MODEL_DIR, EXPORT_DIR
from dplaunch.train.lora import add_adapters, outside_zero3, trained_names
from dplaunch.train.modeling import load_model, pretrained_skeleton


def base_dtype(config: ModelConfig, mixed_precision: str) -> str:
    """The dtype the export builds the run's base in (planning.lora.export_dtype)."""
    from dplaunch.planning.lora import checkpoint_dtype, export_dtype
    from dplaunch.planning.model_facts import load_config_json

    quantize = config.lora.quantize if config.lora is not None else None
    saved = None
    if quantize is not None and config.name_or_path is not None:
        saved = checkpoint_dtype(load_config_json(config.name_or_path))
    return export_dtype(mixed_precision, quantize, saved)


def _with_state(model: Any, state: dict) -> Any:
    """MODEL (adapted) holding STATE (the trained values, names as in training); ValueError when
    STATE does not fit. A model on meta takes the values themselves, a real one copies them
    into its own dtypes."""
    on_meta = any(parameter.is_meta for parameter in model.parameters())
    missing, unexpected = model.load_state_dict(state, strict=False, assign=on_meta)
    untrained = sorted(set(trained_names(model)) - set(state))
    if unexpected or untrained:
        raise ValueError(
            f"the adapter state does not fit the model (missing {untrained[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    return model.eval()


def write_exports(
    run: Any,
    mixed_precision: str,
    tokenizer: Any,
    state: dict,
    adapter_dir: Path | None,
    model_dir: Path | None,
) -> None:
    """Write the PEFT folder (ADAPTER_DIR) and the merged full model (MODEL_DIR) of STATE, the
    trained values of RUN (its run file), the base built in the dtype it trained in under
    MIXED_PRECISION (:func:`base_dtype`). For a randomly initialised base (model.config) the
    adapter folder holds that base too (ADAPTER_DIR/base), as its base_model_name_or_path.
    Raises ValueError when STATE does not fit the model."""
    config, seed, label_names = run.model, run.train.seed, run.data.label_names
    dtype = base_dtype(config, mixed_precision)
    assert config.lora is not None
    unadapted = config.model_copy(update={"lora": None})
    if model_dir is None and config.config is None and not config.lora.moves_base:
        # adapter-only on a pretrained base: the base's modules on meta, only the adapters real
        model = _with_state(
            add_adapters(pretrained_skeleton(unadapted, label_names), config, seed), state
        )
        _save_adapter(model, tokenizer, adapter_dir, config.name_or_path)  # type: ignore[arg-type]
        return
    with outside_zero3():
        base = load_model(unadapted, tokenizer, seed, label_names, dtype=dtype)
    base_name = config.name_or_path
    if adapter_dir is not None and config.config is not None:
        # a random-init base exists nowhere else: saved before the adapters wrap it
        base_dir = adapter_dir / BASE_MODEL_DIR
        base.save_pretrained(str(base_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(base_dir))
        base_name = str(base_dir.resolve())
    adapted = add_adapters(base, config, seed)  # PiSSA/OLoRA: the base is the residual now
    with tempfile.TemporaryDirectory(prefix="dplaunch-initial-adapter-") as scratch:
        initial = None
        if config.lora.moves_base and adapter_dir is not None:
            # the adapters' start, which peft's conversion takes out of the trained ones
            initial = Path(scratch) / "initial"
            adapted.save_pretrained(str(initial), safe_serialization=True)
        model = _with_state(adapted, state)
        if adapter_dir is not None:
            _save_adapter(model, tokenizer, adapter_dir, base_name, initial)  # type: ignore[arg-type]
    if model_dir is not None:
        merged = model.merge_and_unload()
        merged.save_pretrained(str(model_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(model_dir))


def _save_adapter(
    model: Any, tokenizer: Any, adapter_dir: Path, base_name: str, initial: Path | None = None
) -> None:
    """The PEFT folder of MODEL on BASE_NAME; with INITIAL (the start of PiSSA/OLoRA adapters)
    converted by peft into a plain LoRA of rank 2r that adapts the original base."""
    model.peft_config["default"].base_model_name_or_path = base_name
    converting = {"path_initial_model_for_weight_conversion": str(initial)} if initial else {}
    model.save_pretrained(str(adapter_dir), safe_serialization=True, **converting)
    tokenizer.save_pretrained(str(adapter_dir))


def export_run(
    engine: Any, config: Any, tokenizer: Any, run_dir: Path, names: tuple[str, str] | None = None
) -> None:
    """End of a LoRA run: RUN/adapter/ and (model.lora.export merged) RUN/model/ (NAMES: other
    folders, adapter's then model's), written by rank 0 from the gathered trained values; every
    rank calls it."""
    adapter, model = names or (ADAPTER_DIR, EXPORT_DIR)
    state = engine.trained_state()
    if state is not None:
        merged = config.model.lora.export == "merged"
        write_exports(
            config,
            config.train.mixed_precision,
            tokenizer,
            state,
            run_dir / adapter,
            run_dir / model if merged else None,
        )
    engine.accelerator.wait_for_everyone()
