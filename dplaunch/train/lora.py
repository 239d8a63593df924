"""LoRA / QLoRA (peft) on the run's model: the adapters (and model.lora.modules_to_save) train,
the base stays frozen; checkpoints hold only what trains, exports give a PEFT folder and the
merged model.

In the ranks, load_model (train/modeling.py) wraps the model with ``add_adapters``; with
model.lora.quantize the pretrained base is loaded through bitsandbytes (``quantization_options``).
Every optimizer, checkpoint and export then sees only the parameters that require gradients.

The exports (end of training and `dplaunch export`) are written from the trained values alone
(``write_exports``): the base is built again in one process, unquantized and unpartitioned, the
adapter state loaded into it, saved with peft's save_pretrained (RUN/adapter/), then merged into
the base (RUN/model/). Under ZeRO-3 the values come from the gathered state (accelerate's
get_state_dict), never from the rank's empty partitions (the empty-adapter bug, peft#453).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dplaunch.config.schema import LoraConfig, ModelConfig


def lora_alpha(lora: LoraConfig) -> float:
    """The scaling numerator: model.lora.alpha, or 2 × r when unset."""
    return lora.alpha if lora.alpha is not None else 2.0 * lora.r


def peft_config(lora: LoraConfig, task: str) -> Any:
    """peft's LoraConfig for the run's model.lora and task (classification heads train in full:
    peft's SEQ_CLS adds `score`/`classifier` to modules_to_save itself)."""
    import peft

    return peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora_alpha(lora),
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=lora.modules_to_save,
        task_type="SEQ_CLS" if task == "sequence-classification" else "CAUSAL_LM",
    )


def quantization_options(lora: LoraConfig | None) -> dict[str, Any]:
    """from_pretrained's keyword arguments for model.lora.quantize (none without it): nf4 with
    bf16 compute, or LLM.int8."""
    if lora is None or lora.quantize is None:
        return {}
    _quiet_imports()
    import torch
    from transformers import BitsAndBytesConfig

    if lora.quantize == "4bit":
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    options: dict[str, Any] = {"quantization_config": config}
    if torch.cuda.is_available():
        # quantized weights are placed as they load (a quantized model cannot be moved later):
        # on this rank's GPU, as torchrun numbers them
        options["device_map"] = {"": torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))}
    return options


def _quiet_imports() -> None:
    # peft 0.21 asks transformers 5 a deprecated question on every wrap
    warnings.filterwarnings(
        "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
    )


def add_adapters(model: Any, config: ModelConfig, seed: int) -> Any:
    """MODEL wrapped with peft's LoRA adapters as model.lora says; only they (and modules_to_save)
    require gradients."""
    _quiet_imports()
    import torch
    from peft import get_peft_model, prepare_model_for_kbit_training

    lora = config.lora
    assert lora is not None
    if lora.quantize is not None and getattr(model, "is_quantized", False):
        # norms and the head in fp32; checkpointing (when asked) with the non-reentrant variant
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=config.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    # the adapters' random initialisation (lora_A) from a seed of their own: the same on every rank
    # and layout, whatever the base's construction drew from the global generator before
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, peft_config(lora, config.task))
    return wrapped


def is_lora_model(model: Any) -> bool:
    """Whether MODEL (unwrapped) is a peft model."""
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def trained_names(model: Any) -> list[str]:
    """The state-dict names of what trains (adapters and modules_to_save), in model order."""
    return [name for name, parameter in model.named_parameters() if parameter.requires_grad]


def trained_state(state: dict[str, Any], model: Any) -> dict[str, Any]:
    """Only what trains of a full state dict of MODEL (a compiled model's keys carry _orig_mod.)."""
    names = set(trained_names(model))
    return {key: value for key, value in state.items() if key.removeprefix("_orig_mod.") in names}


@contextlib.contextmanager
def outside_zero3() -> Iterator[None]:
    """Models built here are whole even in a ZeRO-3 rank: transformers builds partitioned
    (zero.Init, a collective) while DeepSpeed's HF config is registered."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def rebuild_with_adapters(
    config: ModelConfig, tokenizer: Any, seed: int, label_names: list[str] | None, state: dict
) -> Any:
    """The run's base model, whole and unquantized on the CPU, with its adapters holding STATE
    (the trained values, names as in training). Raises ValueError when STATE does not fit."""
    from dplaunch.train.modeling import load_model

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
    from dplaunch.run_directory.layout import BASE_MODEL_DIR

    if adapter_dir is not None:
        peft_model_config = model.peft_config["default"]
        if config.config is not None:
            base_dir = adapter_dir / BASE_MODEL_DIR
            # a random-init base exists nowhere else: built again (seeded, as in training) and saved
            from dplaunch.train.modeling import load_model

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
    from dplaunch.run_directory.layout import ADAPTER_DIR, EXPORT_DIR

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


def trained_line(model: Any) -> str:
    """What trains of a LoRA model, for the start-up log (ZeRO-3 partitions count in full)."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    trained = sum(size for size, grad in sizes if grad)
    total = sum(size for size, _ in sizes)
    return (
        f"LoRA: {trained:,} of {total:,} parameters train ({trained / total:.2%}: the adapters "
        "and modules_to_save); the base is frozen"
    )
