"""What LoRA (and QLoRA) training holds per GPU: the adapters peft adds, from config.json alone.

Pure Python (no torch, no peft): `dplaunch plan` and `parallel: auto` count a LoRA run with it.

peft puts two matrices A (r × in) and B (out × r) beside every targeted linear layer, so an
adapter has r·(in + out) parameters. ``target_modules: all-linear`` targets every linear (and
GPT-2 Conv1D) layer but the output head, as peft's ``all-linear`` does; a list of names targets
the layers whose module path is one of them or ends with ``.name`` (peft's rule).
``modules_to_save`` modules are trained in full: peft keeps the frozen original and adds a
trainable copy; a classification head is always one of them (peft's SEQ_CLS task type).

The base model stays in memory, frozen: no gradients, no optimizer states. QLoRA
(``quantize``) holds the base's linear layers (not the head, embeddings or norms) in
bitsandbytes' 4-bit nf4 (half a byte per weight + one fp32 absmax per block of 64) or 8-bit
(a byte per weight + one fp32 scale per output row); the rest of the base is held as without
quantization (fp32 in the ranks: peft's prepare_model_for_kbit_training casts it). Adapter counts are exact for the families :mod:`dplaunch.planning.estimate` counts exactly
(checked against peft in tests/test_estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dplaunch.planning.estimate import LLAMA_LIKE, StageShare, config_field, model_state_bytes
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.workload import ALL_LINEAR, LoraSpec
from dplaunch.tasks import task_of

# bitsandbytes' nf4 block: one fp32 absmax per 64 weights (without double quantization; with it,
# and on CPU after bitsandbytes repacks the weights, the constants take less)
NF4_BLOCK = 64
QUANTIZED_BYTES = {"4bit": 0.5, "8bit": 1.0}


@dataclass(frozen=True)
class Module:
    """A module of the HF model: its path (``named_modules()``), parameters, and where it lives."""

    path: str
    params: int
    # (in, out) of a linear layer, (vocabulary, hidden) of an embedding (peft adapts both when
    # named); None for norms
    shape: tuple[int, int] | None = None
    # decoder layer index; None: outside the blocks
    layer: int | None = None
    # outside the blocks: "embedding" (first pipeline stage) or "head" (last)
    side: str = "embedding"
    # the output head peft's all-linear leaves alone (lm_head, score, classifier, BERT's decoder)
    output_head: bool = False
    # an embedding table: adapted only when named, never quantized
    embedding: bool = False


@dataclass(frozen=True)
class LoraCount:
    """Trainable and quantized parameters of a LoRA run, per decoder layer and outside the blocks."""

    spec: LoraSpec
    exact: bool
    # adapter + saved-copy parameters of one decoder layer (every layer alike)
    trainable_per_layer: int
    # trainable parameters with the embedding (first stage) and with the head (last stage)
    trainable_embedding: int
    trainable_head: int
    # base parameters held quantized (QLoRA) and their bytes, per layer and with the head
    quantized_per_layer: int
    quantized_bytes_per_layer: float
    quantized_head: int
    quantized_bytes_head: float
    num_layers: int
    adapters: int
    # of the trainable parameters: those of full copies (modules_to_save), not adapters
    saved: int

    @property
    def trainable(self) -> int:
        """Every parameter with a gradient and optimizer states."""
        return (
            self.trainable_per_layer * self.num_layers
            + self.trainable_embedding
            + self.trainable_head
        )

    def stage(self, layers: int, first: bool, last: bool, tp: int = 1) -> tuple[int, int, float]:
        """(trainable, quantized params, quantized bytes) on one GPU of a pipeline stage of
        ``layers``. Tensor parallelism splits the quantized linear layers; the adapters are
        counted whole on every TP rank (an upper bound)."""
        trainable = self.trainable_per_layer * layers
        trainable += self.trainable_embedding if first else 0
        trainable += self.trainable_head if last else 0
        quantized = self.quantized_per_layer * layers + (self.quantized_head if last else 0)
        quantized_bytes = self.quantized_bytes_per_layer * layers
        quantized_bytes += self.quantized_bytes_head if last else 0
        return trainable, quantized // tp, quantized_bytes / tp

    def state_bytes(
        self,
        share: StageShare,
        *,
        dp: int,
        zero_stage: int,
        offload: str,
        mixed_precision: str,
        ddp: bool,
        tp: int = 1,
    ) -> tuple[int, tuple[float, float, float, float]]:
        """(trainable params, (weights, gradients, optimizer, cpu) bytes) one GPU of ``share`` holds.

        The trainable parameters get :func:`model_state_bytes` as in full fine-tuning, except under
        DDP, where they stay fp32 beside fp32 gradients and Adam's two states (4 + 4 + 8 bytes: peft
        keeps adapters fp32 and Accelerate computes under autocast). The frozen base adds its
        weights only: fp32 under DDP or in an fp32 run, 16-bit under DeepSpeed's bf16/fp16; under
        QLoRA its linear layers quantized. ZeRO-3 partitions the frozen weights
        too; ``offload: all`` moves that partition to the host.
        """
        trainable, quantized, quantized_bytes = self.stage(
            share.layers, share.holds_embedding, share.holds_head, tp
        )
        weights, gradients, optimizer, cpu = model_state_bytes(
            trainable,
            dp=dp,
            zero_stage=zero_stage,
            offload=offload,
            mixed_precision="no" if ddp else mixed_precision,
        )
        frozen = (share.params - quantized) * (4 if ddp or mixed_precision == "no" else 2)
        frozen += quantized_bytes
        frozen /= dp if zero_stage == 3 else 1
        if offload == "all":
            cpu += frozen
        else:
            weights += frozen
        return trainable, (weights, gradients, optimizer, cpu)


def _linear(path: str, n_in: int, n_out: int, bias: bool, layer: int | None, **kw: Any) -> Module:
    return Module(path, n_in * n_out + (n_out if bias else 0), (n_in, n_out), layer, **kw)


def _embedding(path: str, rows: int, hidden: int) -> Module:
    return Module(path, rows * hidden, (rows, hidden), embedding=True)


def model_modules(facts: ModelFacts, task: str = "causal-lm", num_labels: int | None = None):
    """(exact, modules): the linear layers, embeddings and head of the HF model, as peft sees them.

    Known families (llama, mistral, qwen2, qwen3, gpt2, bert) exactly; others as a Llama-shaped
    decoder with Llama's module names (``exact`` False). Norms inside the blocks are left out:
    neither adapted nor quantized, and their parameters are in the base count.
    """
    labels = int(num_labels if num_labels is not None else facts.raw.get("num_labels") or 2)
    # the sequence classifier's labels, None: the language-model head
    classify = labels if task_of(task).classifies else None
    if facts.model_type == "gpt2":
        return True, _gpt2_modules(facts, classify)
    if facts.model_type == "bert":
        return True, _bert_modules(facts, classify)
    return facts.model_type in LLAMA_LIKE, _llama_modules(facts, classify)


def _gpt2_modules(facts: ModelFacts, classify: int | None) -> list[Module]:
    def get(*keys: str) -> Any:
        return config_field(facts, *keys)

    hidden = int(get("n_embd", "hidden_size"))
    inter = int(get("n_inner", "intermediate_size") or 4 * hidden)
    vocab = int(get("vocab_size"))
    modules: list[Module] = []
    for i in range(int(get("n_layer", "num_hidden_layers"))):
        block = f"transformer.h.{i}"
        modules += [
            _linear(f"{block}.attn.c_attn", hidden, 3 * hidden, True, i),
            _linear(f"{block}.attn.c_proj", hidden, hidden, True, i),
            _linear(f"{block}.mlp.c_fc", hidden, inter, True, i),
            _linear(f"{block}.mlp.c_proj", inter, hidden, True, i),
        ]
    positions = int(get("n_positions", "max_position_embeddings"))
    modules += [
        _embedding("transformer.wte", vocab, hidden),
        _embedding("transformer.wpe", positions, hidden),
    ]
    return modules + [_output_head(hidden, vocab, classify)]


def _bert_modules(facts: ModelFacts, classify: int | None) -> list[Module]:
    def get(*keys: str) -> Any:
        return config_field(facts, *keys)

    hidden, inter = int(get("hidden_size")), int(get("intermediate_size"))
    vocab = int(get("vocab_size"))
    modules: list[Module] = []
    for i in range(int(get("num_hidden_layers"))):
        block = f"bert.encoder.layer.{i}"
        modules += [
            _linear(f"{block}.attention.self.{name}", hidden, hidden, True, i)
            for name in ("query", "key", "value")
        ]
        modules += [
            _linear(f"{block}.attention.output.dense", hidden, hidden, True, i),
            _linear(f"{block}.intermediate.dense", hidden, inter, True, i),
            _linear(f"{block}.output.dense", inter, hidden, True, i),
        ]
    modules.append(_embedding("bert.embeddings.word_embeddings", vocab, hidden))
    if classify is not None:
        return modules + [
            _linear("bert.pooler.dense", hidden, hidden, True, None, side="head"),
            _linear("classifier", hidden, classify, True, None, side="head", output_head=True),
        ]
    return modules + [
        _linear("cls.predictions.transform.dense", hidden, hidden, True, None, side="head"),
        _linear(
            "cls.predictions.decoder", hidden, vocab, True, None, side="head", output_head=True
        ),
    ]


def _llama_modules(facts: ModelFacts, classify: int | None) -> list[Module]:
    def get(*keys: str) -> Any:
        return config_field(facts, *keys)

    family = facts.model_type
    hidden = int(get("hidden_size") or facts.hidden_size)
    heads = int(get("num_attention_heads") or facts.num_heads)
    kv_heads = int(get("num_key_value_heads") or facts.num_kv_heads or heads)
    head_dim = int(get("head_dim") or hidden // heads)
    inter = int(get("intermediate_size") or facts.intermediate_size or 4 * hidden)
    vocab = int(get("vocab_size") or facts.vocab_size)
    qkv_bias = family == "qwen2" or bool(get("attention_bias"))
    o_bias = family != "qwen2" and bool(get("attention_bias"))
    mlp_bias = bool(get("mlp_bias"))
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    modules: list[Module] = []
    for i in range(int(get("num_hidden_layers") or facts.num_layers)):
        block = f"model.layers.{i}"
        modules += [
            _linear(f"{block}.self_attn.q_proj", hidden, q_out, qkv_bias, i),
            _linear(f"{block}.self_attn.k_proj", hidden, kv_out, qkv_bias, i),
            _linear(f"{block}.self_attn.v_proj", hidden, kv_out, qkv_bias, i),
            _linear(f"{block}.self_attn.o_proj", q_out, hidden, o_bias, i),
            _linear(f"{block}.mlp.gate_proj", hidden, inter, mlp_bias, i),
            _linear(f"{block}.mlp.up_proj", hidden, inter, mlp_bias, i),
            _linear(f"{block}.mlp.down_proj", inter, hidden, mlp_bias, i),
        ]
    modules += [
        _embedding("model.embed_tokens", vocab, hidden),
        Module("model.norm", hidden, side="head"),
    ]
    return modules + [_output_head(hidden, vocab, classify)]


def _output_head(hidden: int, vocab: int, classify: int | None) -> Module:
    """A decoder's last linear layer: the classifier's `score`, or the language model's lm_head."""
    if classify is not None:
        return _linear("score", hidden, classify, False, None, side="head", output_head=True)
    return _linear("lm_head", hidden, vocab, False, None, side="head", output_head=True)


def _named(path: str, name: str) -> bool:
    # peft's target rule: the whole path, or its last dotted components
    return path == name or path.endswith("." + name)


def _inside(path: str, name: str) -> bool:
    # peft keeps adapters off a modules_to_save module and everything under it
    parts = path.split(".")
    width = len(name.split("."))
    return any(".".join(parts[i : i + width]) == name for i in range(len(parts)))


def adapted_modules(
    modules: list[Module], spec: LoraSpec, task: str = "causal-lm"
) -> tuple[list[Module], list[Module]]:
    """(modules that get adapters, modules trained in full as saved copies) of ``spec`` among
    ``modules`` (:func:`model_modules`), by peft's rules."""
    saved_names = list(spec.modules_to_save)
    if task_of(task).classifies:
        saved_names += ["score", "classifier"]  # peft's SEQ_CLS task type trains the head in full
    # peft wraps every module whose path ends with a name (plain suffix, its own rule)
    saved = [m for m in modules if any(m.path.endswith(name) for name in saved_names)]
    targeted = []
    for module in modules:
        if module.shape is None or any(_inside(module.path, name) for name in saved_names):
            continue
        if spec.target_modules == ALL_LINEAR:
            chosen = not module.output_head and not module.embedding
        else:
            chosen = any(_named(module.path, name) for name in spec.target_modules)
        if chosen:
            targeted.append(module)
    return targeted, saved


def count_lora(
    facts: ModelFacts,
    spec: LoraSpec,
    task: str = "causal-lm",
    num_labels: int | None = None,
) -> LoraCount:
    """Adapters, saved copies and quantized weights of ``spec`` on this model."""
    exact, modules = model_modules(facts, task, num_labels)
    targeted, saved = adapted_modules(modules, spec, task)
    # bitsandbytes quantizes every linear layer but the output head (transformers skips it)
    quantized = [m for m in modules if m.shape and not m.output_head and not m.embedding]

    def adapter(module: Module) -> int:
        n_in, n_out = module.shape or (0, 0)
        return spec.r * (n_in + n_out) + (n_out if spec.dora else 0)

    def quantized_bytes(module: Module) -> float:
        n_in, n_out = module.shape or (0, 0)
        if spec.quantize == "4bit":
            return n_in * n_out * (QUANTIZED_BYTES["4bit"] + 4 / NF4_BLOCK)
        return n_in * n_out * QUANTIZED_BYTES["8bit"] + 4 * n_out

    def per_part(items: list[Module], measure) -> tuple[int | float, int | float, int | float]:
        layer0 = sum(measure(m) for m in items if m.layer == 0)
        embedding = sum(measure(m) for m in items if m.layer is None and m.side == "embedding")
        head = sum(measure(m) for m in items if m.layer is None and m.side == "head")
        return layer0, embedding, head

    adapters = per_part(targeted, adapter)
    copies = per_part(saved, lambda m: m.params)
    weights = (lambda m: m.shape[0] * m.shape[1]) if spec.quantize else (lambda m: 0)
    q_params = per_part(quantized, weights)
    q_bytes = per_part(quantized, quantized_bytes if spec.quantize else (lambda m: 0))
    num_layers = 1 + max((m.layer for m in modules if m.layer is not None), default=-1)
    return LoraCount(
        spec=spec,
        exact=exact,
        trainable_per_layer=int(adapters[0] + copies[0]),
        trainable_embedding=int(adapters[1] + copies[1]),
        trainable_head=int(adapters[2] + copies[2]),
        quantized_per_layer=int(q_params[0]),
        quantized_bytes_per_layer=float(q_bytes[0]),
        quantized_head=int(q_params[2]),
        quantized_bytes_head=float(q_bytes[2]),
        num_layers=num_layers,
        adapters=sum(adapter(m) for m in targeted),
        saved=sum(m.params for m in saved),
    )


def lora_line(lora: LoraCount, total_params: int) -> str:
    """One line for `dplaunch plan`: rank, targets, trainable parameters, and how the base is held."""
    base = f"{lora.spec.quantize} (QLoRA)" if lora.spec.quantize else "frozen"
    saved = f" + {lora.saved:,} in modules_to_save" if lora.saved else ""
    approx = "" if lora.exact else " (approximate: Llama-shaped module names)"
    return (
        f"LoRA r {lora.spec.r} on {lora.spec.targets_label}: {lora.trainable:,} trainable "
        f"parameters ({lora.adapters:,} in adapters{saved}; {lora.trainable / total_params:.2%} "
        f"of the model){approx}; base weights {base}: no gradients, no optimizer states"
    )


# the dtypes an export may build its base in, and their bytes per weight
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_MIXED_PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def checkpoint_dtype(config_json: dict[str, Any]) -> str | None:
    """The dtype a pretrained checkpoint's config.json states (transformers 5 writes ``dtype``,
    older versions ``torch_dtype``); None when it states none we build in."""
    dtype = config_json.get("dtype") or config_json.get("torch_dtype")
    return dtype if dtype in DTYPE_BYTES else None


def export_dtype(mixed_precision: str, quantize: str | None, saved_dtype: str | None) -> str:
    """The dtype a LoRA export builds its base in: the one the base trained in. Under bf16/fp16
    mixed precision that 16-bit dtype; QLoRA's base (held quantized, computed in 16 bits) the
    checkpoint's own 16-bit dtype (``saved_dtype``) first; an fp32 run's base fp32."""
    if quantize is not None and saved_dtype in ("bfloat16", "float16"):
        return saved_dtype
    return _MIXED_PRECISION_DTYPES.get(mixed_precision, "float32")


def export_host_bytes(total_params: int, lora: LoraCount, dtype: str) -> float:
    """Host RAM rank 0 holds while it writes a LoRA run's exports (train/lora_export.py): the
    gathered fp32 trained values and the adapters they are loaded into, plus the base built
    again in ``dtype`` (a random-init base is built in fp32, then cast) unless the export is
    adapter-only on a pretrained base, which is never built."""
    trained = 2 * 4 * lora.trainable
    spec = lora.spec
    if spec.export == "adapter-only" and not spec.random_base:
        return trained
    element = max(DTYPE_BYTES[dtype], 4 if spec.random_base else 0)
    return trained + element * total_params


__all__ = [
    "ALL_LINEAR",
    "DTYPE_BYTES",
    "LoraCount",
    "LoraSpec",
    "Module",
    "adapted_modules",
    "checkpoint_dtype",
    "count_lora",
    "export_dtype",
    "export_host_bytes",
    "lora_line",
    "model_modules",
]
