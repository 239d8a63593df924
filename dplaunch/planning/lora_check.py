"""model.lora checked before launch: the layout (planning/rules.py), the adapters' rank, the module
names the adapters and modules_to_save name, and QLoRA's needs. Pure Python: no torch, no peft;
the module names of the families dplaunch knows come from planning/lora.model_modules and the
table of their other modules here (tests/test_lora_bad_inputs.py checks both against the HF
classes)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from dplaunch.config.schema import ModelConfig
from dplaunch.errors import UserError
from dplaunch.planning.lora import model_modules
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.rules import ParallelDims
from dplaunch.tasks import task_of

_LLAMA_LIKE_OTHERS = (
    "model", "layers", "self_attn", "mlp", "act_fn", "norm", "input_layernorm",
    "post_attention_layernorm", "rotary_emb",
)  # fmt: skip
# family → the leaf names of its modules besides the linear layers, embeddings and head (those come
# from planning/lora.model_modules, which counts them): what modules_to_save may also name
OTHER_MODULES: dict[str, tuple[str, ...]] = {
    "llama": _LLAMA_LIKE_OTHERS,
    "mistral": _LLAMA_LIKE_OTHERS,
    "qwen2": _LLAMA_LIKE_OTHERS,
    "qwen3": (*_LLAMA_LIKE_OTHERS, "q_norm", "k_norm"),
    "gpt2": (
        "transformer", "h", "ln_1", "attn", "ln_2", "mlp", "ln_f", "act", "drop", "attn_dropout",
        "resid_dropout", "dropout",
    ),
}  # fmt: skip


def adaptable_names(facts: ModelFacts, task: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(linear layers, embeddings) of the model by leaf name, the task's head left out, as
    planning/lora.model_modules lists them."""
    _, modules = model_modules(facts, task)
    linear = [
        m.path.rsplit(".", 1)[-1]
        for m in modules
        if m.shape is not None and not (m.embedding or m.output_head)
    ]
    embeddings = [m.path.rsplit(".", 1)[-1] for m in modules if m.embedding]
    return tuple(dict.fromkeys(linear)), tuple(dict.fromkeys(embeddings))


def head_name(task: str) -> str:
    """The name of the task's output head in HF's classes of these families."""
    return task_of(task).head_module


def bitsandbytes_installed() -> bool:
    """Whether bitsandbytes can be imported (found, not imported: the CLI stays fast)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def check_lora(
    model: ModelConfig,
    facts: ModelFacts,
    dims: ParallelDims,
    installed: Callable[[], bool] = bitsandbytes_installed,
) -> None:
    """Raise the first thing about model.lora the ranks could not train on the layout DIMS (one
    UserError)."""
    lora = model.lora
    if lora is None:
        return
    dims.check_lora()
    if lora.quantize is not None and dims.fsdp is not None:
        raise UserError(
            "model.lora.quantize",
            f"{lora.quantize} (QLoRA) with FSDP: fully_shard does not shard bitsandbytes' "
            "quantized weights (not built)",
            "drop --fsdp (DDP or ZeRO train QLoRA), or drop model.lora.quantize",
        )
    if facts.hidden_size and lora.r >= facts.hidden_size:
        raise UserError(
            "model.lora.r",
            f"rank {lora.r} is not below the model's hidden size {facts.hidden_size}: each "
            "adapter would hold as many values as the weight it adapts",
            f"use an r well below {facts.hidden_size} (8 to 64 is usual)",
        )
    _check_names(model, facts)
    check_lora_variant(model, dims)
    if lora.quantize is not None:
        if model.config is not None:
            raise UserError(
                "model.lora.quantize",
                "bitsandbytes quantizes a pretrained model's weights as they load, and "
                "model.config builds a randomly initialised model",
                "set model.name_or_path to a pretrained model, or drop model.lora.quantize",
            )
        if not installed():
            raise UserError(
                "model.lora.quantize",
                f"{lora.quantize} (QLoRA) needs bitsandbytes, which is not installed",
                "pip install 'dplaunch[qlora]'",
            )


def _check_names(model: ModelConfig, facts: ModelFacts) -> None:
    lora = model.lora
    assert lora is not None
    if lora.target_modules == []:
        raise UserError(
            "model.lora.target_modules",
            "the list is empty: no layer would get an adapter",
            "name layers, e.g. [q_proj, v_proj], or use all-linear",
        )
    others = OTHER_MODULES.get(facts.model_type)
    if others is None:  # a family not listed: peft checks the names in the ranks
        return
    linear, embeddings = adaptable_names(facts, model.task)
    head = head_name(model.task)
    adaptable = (*linear, *embeddings, head)
    if isinstance(lora.target_modules, list):
        unknown = [n for n in lora.target_modules if n.rsplit(".", 1)[-1] not in adaptable]
        if unknown:
            raise UserError(
                "model.lora.target_modules",
                f"{', '.join(unknown)} names no linear or embedding layer of a "
                f"{facts.model_type} model",
                f"choose among {', '.join(adaptable)}, or use all-linear",
            )
    every = (*adaptable, *others)
    unknown = [n for n in lora.modules_to_save or [] if n.rsplit(".", 1)[-1] not in every]
    if unknown:
        raise UserError(
            "model.lora.modules_to_save",
            f"{', '.join(unknown)} names no module of a {facts.model_type} model",
            f"choose among {', '.join((head, *embeddings, 'norm' if 'norm' in others else 'ln_f'))}",
        )


def check_lora_variant(model: ModelConfig, dims: ParallelDims) -> None:
    """DoRA where peft builds it on the layout DIMS (every LoRA layout, QLoRA's ZeRO-3 aside),
    and model.lora.init pissa/olora where the run's exports and reference can follow the base it
    rewrites: training runs on the residual W − B₀A₀, which the export builds again from the
    unquantized base, and whose adapter peft converts to a plain LoRA of the original base
    (LoraModel.subtract_mutated_init: only lora_A/lora_B). rsLoRA trains wherever LoRA does."""
    lora = model.lora
    assert lora is not None
    if lora.use_dora and lora.quantize is not None and dims.zero_stage == 3:
        raise UserError(
            "model.lora.use_dora",
            f"DoRA with QLoRA ({lora.quantize}) under ZeRO-3: peft gathers each layer's weight "
            "to take its norm, and DeepSpeed cannot gather bitsandbytes' quantized parameters "
            "(peft 0.21: 'Params4bit' object has no attribute 'ds_status')",
            "use DDP or ZeRO-1/2 for QDoRA (--zero 2), or drop model.lora.quantize",
        )
    if not lora.moves_base:
        return
    init = f"model.lora.init {lora.init}"
    if task_of(model.task).preference:
        raise UserError(
            "model.lora.init",
            f"{lora.init} takes the adapters' start out of the base, and dpo's reference is "
            "the policy with its adapters disabled: the residual base, not the model trained from",
            "use model.lora.init default or gaussian with dpo",
        )
    if lora.quantize is not None:
        raise UserError(
            "model.lora.init",
            f"{lora.init} rewrites the base weights, which QLoRA quantized as they loaded: the "
            "export (built from the unquantized base) would not hold the residual trained on",
            "drop model.lora.quantize, or use model.lora.init default",
        )
    if lora.use_dora:
        raise UserError(
            "model.lora.use_dora",
            f"with {init}: peft converts a PiSSA/OLoRA adapter into a plain LoRA (lora_A, "
            "lora_B), which has no DoRA magnitude",
            "drop one of model.lora.use_dora and model.lora.init",
        )
    if lora.modules_to_save or task_of(model.task).classifies:
        saved = "the classification head" if not lora.modules_to_save else "modules_to_save"
        raise UserError(
            "model.lora.init",
            f"{lora.init}: peft's conversion of the adapter keeps only lora_A and lora_B, so "
            f"{saved} (trained in full) would be lost from RUN/adapter",
            "use model.lora.init default or gaussian",
        )
