"""LoRA / QLoRA (peft) on the run's model: the adapters (and model.lora.modules_to_save) train,
the base stays frozen; checkpoints hold only what trains, exports give a PEFT folder and the
merged model.

In the ranks, load_model (train/modeling.py) wraps the model with ``add_adapters``; with
model.lora.quantize the pretrained base is loaded through bitsandbytes (``quantization_options``).
Every optimizer, checkpoint and export then sees only the parameters that require gradients.

The exports are train/lora_export.py's (they build the base again with train/modeling.py,
which builds on this module).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

from dplaunch.config.schema import LoraConfig, ModelConfig
from dplaunch.tasks import task_of


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
        task_type=task_of(task).peft_task_type,
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        # peft's True: A Kaiming-uniform, B zero
        init_lora_weights=True if lora.init == "default" else lora.init,
    )


def quantization_options(lora: LoraConfig | None, *, on_gpu: bool) -> dict[str, Any]:
    """from_pretrained's keyword arguments for model.lora.quantize (none without it): nf4 with
    bf16 compute, or LLM.int8; placed on this rank's GPU (``on_gpu``: the plan's target) or CPU.

    Under ZeRO-3 (DeepSpeed's HF config registered) as peft documents it: no device_map, which
    transformers refuses there (its quantizer then loads onto the rank's current device, which
    Accelerate set), and the 4-bit weights stored in the compute dtype, so that ZeRO-3 can
    partition and gather them like the model's other 16-bit parameters."""
    if lora is None or lora.quantize is None:
        return {}
    _quiet_imports()
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.integrations import is_deepspeed_zero3_enabled

    zero3 = is_deepspeed_zero3_enabled()
    if lora.quantize == "4bit":
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.bfloat16 if zero3 else torch.uint8,
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    options: dict[str, Any] = {"quantization_config": config}
    if zero3:
        return options
    # quantized weights are placed as they load (a quantized model cannot be moved later): on
    # this rank's GPU as torchrun numbers them, or (CPU ranks, on a GPU machine too) the CPU
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    options["device_map"] = {"": torch.device("cuda", local_rank) if on_gpu else "cpu"}
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


def trained_line(model: Any) -> str:
    """What trains of a LoRA model, for the start-up log (ZeRO-3 partitions count in full)."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    trained = sum(size for size, grad in sizes if grad)
    total = sum(size for size, _ in sizes)
    return (
        f"LoRA: {trained:,} of {total:,} parameters train ({trained / total:.2%}: the adapters "
        "and modules_to_save); the base is frozen"
    )
