"""Model and tokenizer from the run file: a pretrained checkpoint or a config dict (random init)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dplaunch.config.schema import BYTE_LEVEL, ModelConfig
from dplaunch.run_directory.layout import MODEL_FILES_DIR
from dplaunch.tasks import task_of
from dplaunch.train.lora import add_adapters, quantization_options
from dplaunch.train.tokenizer import byte_level_tokenizer


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer, with a pad token (the EOS token when the model has none)."""
    from transformers import AutoTokenizer

    name = model.tokenizer or model.name_or_path
    if name == BYTE_LEVEL:
        tokenizer = byte_level_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class _HoldLoadReport(logging.Filter):
    """Holds back transformers' LOAD REPORT table: load_model says what matters in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def loading_line(info: dict[str, Any], name: str) -> str | None:
    """One line on the weights a pretrained checkpoint did not provide (a new task head) or
    provided unused; None when every weight was loaded and used."""
    missing = sorted(info.get("missing_keys") or ())
    unused = sorted(info.get("unexpected_keys") or ())
    parts = []
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        parts.append(
            f"newly initialised (not in {name}): {', '.join(missing[:4])}{more}; this run trains them"
        )
    if unused:
        parts.append(f"{len(unused)} weight(s) of {name} unused by this model (e.g. {unused[0]})")
    return "; ".join(parts) or None


def load_model(
    model: ModelConfig,
    tokenizer: Any,
    seed: int,
    label_names: list[str] | None = None,
    *,
    on_gpu: bool = False,
    say: Callable[[str], None] | None = None,
    dtype: str = "float32",
) -> Any:
    """The HF model for the task; random initialisation is seeded so every rank builds the same
    weights. LABEL_NAMES (data.label_names) become the config's id2label and label2id. ``on_gpu``
    (the plan's target): a quantized base loads onto this rank's GPU, else the CPU. ``say`` gets
    one line on the weights a pretrained checkpoint lacks (a new head), in place of transformers'
    LOAD REPORT table. ``dtype``: the weights' (exports build the base in the dtype it trained
    in; a random-init model is initialised in fp32, then cast, to hold the values training
    started from)."""
    import torch
    from accelerate.utils import set_seed  # transformers' imports peft (1-2 s a rank) with it
    from transformers import AutoConfig

    auto, extra = _auto_class(model, label_names)
    # model.attn_implementation: the kernel the planner's memory estimate assumed (unset = HF's pick)
    kernel = {"attn_implementation": model.attn_implementation} if model.attn_implementation else {}
    set_seed(seed)
    if model.config is not None:
        fields = dict(model.config)
        config = AutoConfig.for_model(fields.pop("model_type"), **{**fields, **extra})
        config.pad_token_id = tokenizer.pad_token_id
        # a config class's own token ids are its hub model's (GPT-2: 50256): the tokenizer's
        # count, unless the run file sets them (generate() stops at eos_token_id)
        for name in ("bos_token_id", "eos_token_id"):
            if name not in fields and getattr(tokenizer, name, None) is not None:
                setattr(config, name, getattr(tokenizer, name))
        built = _from_config(auto, config, model.trust_remote_code, kernel)
        if dtype != "float32":
            built = built.to(getattr(torch, dtype))
    else:
        # float32 weights whatever the checkpoint's dtype (transformers 5 would keep a bf16
        # checkpoint in bf16): mixed precision computes in bf16/fp16 from fp32 master weights
        held = _HoldLoadReport()
        reporter = logging.getLogger("transformers.modeling_utils")
        reporter.addFilter(held)
        try:
            built, info = auto.from_pretrained(
                model.name_or_path,
                trust_remote_code=model.trust_remote_code,
                dtype=getattr(torch, dtype),
                output_loading_info=True,
                **extra,
                **kernel,
                **quantization_options(model.lora, on_gpu=on_gpu),
            )
        finally:
            reporter.removeFilter(held)
        line = loading_line(info, model.name_or_path)
        if line and say is not None:
            say(f"[dplaunch] {line}")
        if built.config.pad_token_id is None:
            built.config.pad_token_id = tokenizer.pad_token_id
    if model.gradient_checkpointing:
        built.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if model.lora is not None:
        # model.lora: peft adapters train, the base stays frozen (train/lora.py)
        built = add_adapters(built, model, seed)
    if model.checkpoint_every > 1:
        checkpoint_every_kth(built, model.checkpoint_every)
    return built


def checkpoint_every_kth(model: Any, every: int) -> int:
    """model.gradient_checkpointing every-K: only blocks 0, K, 2K… stay checkpointed (selective
    activation checkpointing, torchtitan's); the others keep their activations. transformers
    checkpoints a block when its own `gradient_checkpointing` flag is on. Returns the blocks
    left checkpointed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for index, block in enumerate(blocks):
        block.gradient_checkpointing = index % every == 0
    return sum(block.gradient_checkpointing for block in blocks)


def pretrained_skeleton(model: ModelConfig, label_names: list[str] | None = None) -> Any:
    """The pretrained model's modules on the meta device (no weight read or held): what an
    adapter-only export wraps to save the adapters with the names they have on the real base."""
    import torch
    from transformers import AutoConfig

    auto, extra = _auto_class(model, label_names)
    config = AutoConfig.from_pretrained(
        model.name_or_path, trust_remote_code=model.trust_remote_code, **extra
    )
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=model.trust_remote_code)


def _auto_class(model: ModelConfig, label_names: list[str] | None) -> tuple[Any, dict[str, Any]]:
    """The transformers auto class of the task, and the config fields its labels set."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    task = task_of(model.task)
    auto = AutoModelForSequenceClassification if task.classifies else AutoModelForCausalLM
    extra: dict[str, Any] = {}
    if task.classifies:
        extra["num_labels"] = model.num_labels
        if label_names:
            extra["id2label"] = dict(enumerate(label_names))
            extra["label2id"] = {name: number for number, name in enumerate(label_names)}
    return auto, extra


def _from_config(auto: Any, config: Any, trust_remote_code: bool, kernel: dict[str, Any]) -> Any:
    """A randomly initialised model that holds the same weights built whole or under ZeRO-3.

    Under ZeRO-3 (DeepSpeed's HF config set) transformers builds the model partitioned from
    construction (zero.Init), skips torch's per-layer default initialisation, then initialises
    module by module on rank 0 (initialize_weights_zero3). Built whole, torch's default
    initialisation would first draw from the seeded generator and shift every later draw: so the
    whole model is built the same way, without the default initialisation, then initialised in
    the same module order. DDP, ZeRO and the pipeline then start from one set of weights."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return auto.from_config(config, trust_remote_code=trust_remote_code, **kernel)
    from transformers.initialization import no_init_weights

    with no_init_weights():
        built = auto.from_config(config, trust_remote_code=trust_remote_code, **kernel)
    built.init_weights()
    return built


def checkpoint_model(directory: Path, model: ModelConfig) -> ModelConfig:
    """The model section that rebuilds a checkpoint's model from its own files (its HF config
    and tokenizer, saved with it): no pretrained weights to read first, no Hub, no revision that
    moved since. Checkpoints without them (older ones) keep the run file's model."""
    files = directory / MODEL_FILES_DIR
    if not (files / "config.json").is_file():
        return model
    fields = json.loads((files / "config.json").read_text())
    # weights are loaded in float32, whatever dtype the model was trained or saved in
    for key in ("dtype", "torch_dtype", "transformers_version"):
        fields.pop(key, None)
    tokenizer = model.tokenizer if model.tokenizer == BYTE_LEVEL else str(files)
    return model.model_copy(update={"name_or_path": None, "config": fields, "tokenizer": tokenizer})


def model_skeleton(directory: Path, config: Any) -> Any:
    """A checkpoint's model (CONFIG: its run file) built on the meta device: every parameter's name,
    shape and whether it trains (LoRA), without memory or weights. From the checkpoint's own HF
    config when it has one, else the run file's model section (a pretrained one: from its config)."""
    import torch

    model = checkpoint_model(directory, config.model)
    if model.config is None:
        from transformers import AutoConfig

        fields = AutoConfig.from_pretrained(
            model.name_or_path, trust_remote_code=model.trust_remote_code
        ).to_dict()
        model = model.model_copy(update={"name_or_path": None, "config": fields})
    # quantization belongs to from_pretrained; the names of what trains are the same without it
    if model.lora is not None and model.lora.quantize is not None:
        model = model.model_copy(update={"lora": model.lora.model_copy(update={"quantize": None})})
    tokenizer = load_tokenizer(model)
    with torch.device("meta"):
        return load_model(model, tokenizer, config.train.seed, config.data.label_names)
