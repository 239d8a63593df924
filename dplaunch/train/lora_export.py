"""The exports of a LoRA run (end of training and `dplaunch export`), written from the trained
values alone: the base is built again in one process, unquantized and unpartitioned
(train/modeling.py), the adapter state loaded into it, saved with peft's save_pretrained
(RUN/adapter/), then merged into the base (RUN/model/). Under ZeRO-3 the values come from the
gathered state (accelerate's get_state_dict), never from the rank's empty partitions (the
empty-adapter bug, peft#453).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dplaunch.config.schema import ModelConfig
from dplaunch.run_directory.layout import ADAPTER_DIR, BASE_MODEL_DIR, EXPORT_DIR
from dplaunch.train.lora import outside_zero3, trained_names
from dplaunch.train.modeling import load_model


def rebuild_with_adapters(
    config: ModelConfig, tokenizer: Any, seed: int, label_names: list[str] | None, state: dict
) -> Any:
    """The run's base model, whole and unquantized on the CPU, with its adapters holding STATE
    (the trained values, names as in training). Raises ValueError when STATE does not fit."""
    unquantized = config.model_copy(
        update={"lora": config.lora.model_copy(update={"quantize": None})}  # type: ignore[union-attr]
    )
    with outside_zero3():
        model = load_model(unquantized, tokenizer, seed, label_names)
    missing, unexpected = model.load_state_dict(state, strict=False)
    untrained = sorted(set(trained_names(model)) - set(state))
    if unexpected or untrained:
        raise ValueError(
            f"the adapter state does not fit the model (missing {untrained[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    return model.eval()


def write_exports(
    model: Any,
    tokenizer: Any,
    config: ModelConfig,
    adapter_dir: Path | None,
    model_dir: Path | None,
    seed: int,
    label_names: list[str] | None,
) -> None:
    """Write the PEFT folder (ADAPTER_DIR) and the merged full model (MODEL_DIR). For a randomly
    initialised base (model.config) the adapter folder holds that base too (ADAPTER_DIR/base), as
    its base_model_name_or_path. MODEL is rebuild_with_adapters'; it is merged in place, last."""
    if adapter_dir is not None:
        peft_model_config = model.peft_config["default"]
        if config.config is not None:
            base_dir = adapter_dir / BASE_MODEL_DIR
            # a random-init base exists nowhere else: built again (seeded, as in training) and saved
            with outside_zero3():
                base = load_model(
                    config.model_copy(update={"lora": None}), tokenizer, seed, label_names
                )
            base.save_pretrained(str(base_dir), safe_serialization=True)
            tokenizer.save_pretrained(str(base_dir))
            peft_model_config.base_model_name_or_path = str(base_dir.resolve())
        else:
            peft_model_config.base_model_name_or_path = config.name_or_path
        model.save_pretrained(str(adapter_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(adapter_dir))
    if model_dir is not None:
        merged = model.merge_and_unload()
        merged.save_pretrained(str(model_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(model_dir))


def export_run(engine: Any, config: Any, tokenizer: Any, run_dir: Path) -> None:
    """End of a LoRA run: RUN/adapter/ and RUN/model/ (merged), written by rank 0 from the
    gathered trained values; every rank calls it."""
    state = engine.trained_state()
    if state is not None:
        model = rebuild_with_adapters(
            config.model, tokenizer, config.train.seed, config.data.label_names, state
        )
        write_exports(
            model,
            tokenizer,
            config.model,
            run_dir / ADAPTER_DIR,
            run_dir / EXPORT_DIR,
            config.train.seed,
            config.data.label_names,
        )
    engine.accelerator.wait_for_everyone()
