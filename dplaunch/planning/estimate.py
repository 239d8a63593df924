"""Parameter counts, memory per GPU and communication per step of a parallel plan, from config.json alone.

Pure Python (no torch): the CLI prints plan tables without importing the training stack.

Units: every ``*_gb`` is GiB (2**30 bytes), the unit nvidia-smi (MiB / 1024) and DeepSpeed's own
estimators report; every ``*_bytes`` is bytes.

Parameter counts are exact for the families below (checked against ``model.parameters()`` of the
real HF model in tests/test_estimate.py) and an approximation flagged ``exact=False`` otherwise:

- llama, mistral, qwen2 (and qwen3, whose blocks add q/k RMSNorms over head_dim);
- gpt2;
- bert (encoder + pooler; classifier head for sequence classification, MLM-style head for causal-lm).

Fields that a config.json leaves out take Hugging Face's defaults for that family, because that is
what ``from_config`` builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from dplaunch.errors import UserError
from dplaunch.planning.loss_chunk import fuses, resolve_chunk, why_not_chunked
from dplaunch.planning.model_facts import ModelFacts, attention_implementation
from dplaunch.planning.rules import ParallelDims, check_offload, check_pipeline_depth
from dplaunch.planning.workload import Workload
from dplaunch.tasks import task_of

# DeepSpeed's reduce and all-gather buckets, in elements, as deepspeed.json sets them (rendering)
# and the estimate counts them: 200M keeps all-reduces efficient and fits a 24 GB card
BUCKET_SIZE = 200_000_000

GIB = 2**30

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")

# HF's config defaults, for fields a config.json omits (transformers' *Config() classes)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "gpt2": dict(
        vocab_size=50257,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_positions=1024,
        tie_word_embeddings=True,
    ),
    "bert": dict(
        vocab_size=30522,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=512,
        type_vocab_size=2,
        tie_word_embeddings=True,
    ),
}


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a model, split the way pipeline and tensor parallelism cut it.

    ``embedding`` lives on the first pipeline stage, ``head`` (final norm, pooler, classifier or
    untied lm_head) on the last, ``per_layer`` × ``num_layers`` in between. ``*_sharded`` is the part
    that DeepSpeed AutoTP splits over the tensor-parallel group (the attention/MLP matrices and the
    column-parallel biases; an untied lm_head); the rest (norms, row-parallel biases, embeddings)
    is replicated on every TP rank.
    """

    family: str
    exact: bool
    embedding: int
    per_layer: int
    per_layer_sharded: int
    num_layers: int
    head: int
    head_sharded: int
    # the output projection reuses the input embedding matrix (counted once, in ``embedding``)
    tied_head: bool
    # size of that shared matrix: a pipeline's last stage holds its own copy (TiedLayerSpec)
    tied_params: int
    # shape facts with HF's defaults filled in, for the activation and communication formulas
    hidden_size: int = 0
    num_heads: int = 1
    num_kv_heads: int = 1
    vocab_size: int = 0
    # the gated MLP's width (llama-like families; 0 = not one), for the activation formula
    intermediate_size: int = 0
    note: str = ""

    @property
    def total(self) -> int:
        """All parameters, tied ones counted once (== sum(p.numel() for p in model.parameters()))."""
        return self.embedding + self.per_layer * self.num_layers + self.head


def _config_value(raw: dict[str, Any], family: str, *keys: str) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    defaults = _DEFAULTS.get(family, {})
    for key in keys:
        if defaults.get(key) is not None:
            return defaults[key]
    return None


def config_field(facts: ModelFacts, *keys: str) -> Any:
    """The first of ``keys`` the config sets, else HF's default for the family (None if neither)."""
    return _config_value(facts.raw, facts.model_type, *keys)


def count_parameters(
    facts: ModelFacts, task: str = "causal-lm", num_labels: int | None = None
) -> ParameterCount:
    """Exact parameter count of the HF model for ``task``, computed from the architecture alone."""
    raw = facts.raw
    family = facts.model_type
    labels = int(num_labels if num_labels is not None else raw.get("num_labels") or 2)
    classify = task_of(task).classifies

    def get(*keys: str) -> Any:
        return _config_value(raw, family, *keys)

    if family in LLAMA_LIKE:
        return _llama_like(family, get, classify, labels)
    if family == "gpt2":
        return _gpt2(get, classify, labels)
    if family == "bert":
        return _bert(get, classify, labels)
    return _approximate(facts, classify, labels)


def _llama_like(family: str, get: Any, classify: bool, labels: int) -> ParameterCount:
    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or heads)
    head_dim = int(get("head_dim") or hidden // heads)
    inter = int(get("intermediate_size"))
    vocab = int(get("vocab_size"))
    layers = int(get("num_hidden_layers"))
    tied = bool(get("tie_word_embeddings"))
    # qwen2 always has q/k/v biases; llama/qwen3 have attention_bias (q/k/v/o); llama has mlp_bias
    qkv_bias = family == "qwen2" or bool(get("attention_bias"))
    o_bias = family != "qwen2" and bool(get("attention_bias"))
    mlp_bias = bool(get("mlp_bias"))

    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    attention_sharded = attention + (q_out + 2 * kv_out if qkv_bias else 0)
    mlp_sharded = 3 * hidden * inter + (2 * inter if mlp_bias else 0)
    replicated = 2 * hidden  # input_layernorm + post_attention_layernorm
    replicated += hidden if o_bias else 0  # row-parallel biases are added after the all-reduce
    replicated += hidden if mlp_bias else 0
    if family == "qwen3":
        replicated += 2 * head_dim  # q_norm, k_norm
    sharded = attention_sharded + mlp_sharded

    embedding = vocab * hidden
    if classify:
        head, head_sharded = hidden + hidden * labels, 0  # final norm + score (no bias)
    elif tied:
        head, head_sharded = hidden, 0
    else:
        head, head_sharded = hidden + vocab * hidden, vocab * hidden
    return ParameterCount(
        family=family,
        exact=True,
        embedding=embedding,
        per_layer=sharded + replicated,
        per_layer_sharded=sharded,
        num_layers=layers,
        head=head,
        head_sharded=head_sharded,
        tied_head=tied and not classify,
        tied_params=vocab * hidden if tied and not classify else 0,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=vocab,
        intermediate_size=inter,
    )


def _gpt2(get: Any, classify: bool, labels: int) -> ParameterCount:
    hidden = int(get("n_embd", "hidden_size"))
    inter = int(get("n_inner", "intermediate_size") or 4 * hidden)
    vocab = int(get("vocab_size"))
    positions = int(get("n_positions", "max_position_embeddings"))
    layers = int(get("n_layer", "num_hidden_layers"))
    # Conv1D c_attn (column) and c_fc (column) split with their biases; c_proj (row) biases replicate
    sharded = (
        (hidden * 3 * hidden + 3 * hidden)
        + hidden * hidden
        + (hidden * inter + inter)
        + inter * hidden
    )
    replicated = 2 * (2 * hidden) + 2 * hidden  # ln_1, ln_2 (weight+bias); the two c_proj biases
    embedding = vocab * hidden + positions * hidden
    head = 2 * hidden + (hidden * labels if classify else 0)  # ln_f (+ score, no bias)
    return ParameterCount(
        family="gpt2",
        exact=True,
        embedding=embedding,
        per_layer=sharded + replicated,
        per_layer_sharded=sharded,
        num_layers=layers,
        head=head,
        head_sharded=0,
        tied_head=not classify,
        tied_params=0 if classify else vocab * hidden,
        hidden_size=hidden,
        num_heads=int(get("n_head", "num_attention_heads")),
        num_kv_heads=int(get("n_head", "num_attention_heads")),
        vocab_size=vocab,
    )


def _bert(get: Any, classify: bool, labels: int) -> ParameterCount:
    hidden = int(get("hidden_size"))
    inter = int(get("intermediate_size"))
    vocab = int(get("vocab_size"))
    positions = int(get("max_position_embeddings"))
    types = int(get("type_vocab_size"))
    layers = int(get("num_hidden_layers"))
    # q/k/v and intermediate are column-parallel (biases split); attention/output dense are row-parallel
    sharded = (
        3 * (hidden * hidden + hidden) + hidden * hidden + (hidden * inter + inter) + inter * hidden
    )
    replicated = 2 * hidden + 2 * (2 * hidden)  # two row-parallel biases, two LayerNorms
    embedding = (vocab + positions + types) * hidden + 2 * hidden
    if classify:
        head = (hidden * hidden + hidden) + (hidden * labels + labels)  # pooler + classifier
    else:
        # BertLMHeadModel: no pooler; transform dense + LayerNorm, decoder tied to word embeddings + bias
        head = (hidden * hidden + hidden) + 2 * hidden + vocab
    tied = not classify and bool(get("tie_word_embeddings"))
    if not classify and not tied:
        head += vocab * hidden
    return ParameterCount(
        family="bert",
        exact=True,
        embedding=embedding,
        per_layer=sharded + replicated,
        per_layer_sharded=sharded,
        num_layers=layers,
        head=head,
        head_sharded=0,
        tied_head=tied,
        tied_params=vocab * hidden if tied else 0,
        hidden_size=hidden,
        num_heads=int(get("num_attention_heads")),
        num_kv_heads=int(get("num_attention_heads")),
        vocab_size=vocab,
    )


def _approximate(facts: ModelFacts, classify: bool, labels: int) -> ParameterCount:
    """Unknown family: a Llama-shaped decoder (GQA attention, gated MLP if intermediate is set).

    per layer ≈ 2h² + 2h·kv·(h/heads) [q, o, k, v] + 3h·I [gate, up, down] + 2h [two norms];
    with no intermediate size, a GPT-style 4h MLP (8h²). Embedding V·h; head h (+ V·h if untied).
    Biases, extra norms, position tables and MoE experts are not counted.
    """
    hidden, heads = facts.hidden_size, max(facts.num_heads, 1)
    kv_out = facts.num_kv_heads * (hidden // heads)
    attention = 2 * hidden * hidden + 2 * hidden * kv_out
    inter = facts.intermediate_size
    mlp = 3 * hidden * int(inter) if inter else 8 * hidden * hidden
    tied = facts.tied_embeddings and not classify
    head = hidden + (hidden * labels if classify else 0 if tied else facts.vocab_size * hidden)
    return ParameterCount(
        family=facts.model_type,
        exact=False,
        embedding=facts.vocab_size * hidden,
        per_layer=attention + mlp + 2 * hidden,
        per_layer_sharded=attention + mlp,
        num_layers=facts.num_layers,
        head=head,
        head_sharded=0 if tied or classify else facts.vocab_size * hidden,
        tied_head=tied,
        tied_params=facts.vocab_size * hidden if tied else 0,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=facts.num_kv_heads,
        vocab_size=facts.vocab_size,
        note=f"{facts.model_type!r} is not a known family: Llama-shaped approximation "
        "(no biases, extra norms, position tables or MoE experts)",
    )


# ---------------------------------------------------------------------------------------------
# memory per GPU


@dataclass(frozen=True)
class StageShare:
    """What one GPU of a pipeline stage holds: parameters (after TP) and its decoder layers."""

    stage: int
    layers: int
    params: int
    holds_embedding: bool
    holds_head: bool
    # the stage's first decoder layer, of the whole model
    first_layer: int = 0


class AdapterCount(Protocol):
    """What the estimate asks of a LoRA run's count (planning/lora.py's LoraCount, which builds
    on this module): the trained and quantized parameters of a stage, and the bytes it holds."""

    def stage(self, layers: int, first: bool, last: bool, tp: int = 1) -> tuple[int, int, float]:
        """(trainable, quantized params, quantized bytes) of ``layers`` decoder layers."""

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
        """(trainable params, (weights, gradients, optimizer, cpu) bytes) of one GPU of SHARE."""


def layers_per_stage(num_layers: int, pp: int) -> list[int]:
    """Decoder layers of each pipeline stage: as even as possible, earlier stages take the rest.

    This is DeepSpeed's ``partition_uniform``; the embedding goes with stage 0, the head with the last.
    """
    base, rest = divmod(num_layers, pp)
    return [base + (1 if stage < rest else 0) for stage in range(pp)]


def stage_shares(count: ParameterCount, *, tp: int = 1, pp: int = 1) -> list[StageShare]:
    """Parameters held by one GPU of every pipeline stage, with tensor parallelism applied.

    TP (DeepSpeed AutoTP) divides ``per_layer_sharded`` and ``head_sharded`` (an untied lm_head) by
    tp and replicates the rest; embeddings are not split. With PP and tied embeddings the last
    stage holds its own copy of the shared matrix (DeepSpeed TiedLayerSpec), so it is counted there.
    Integer division rounds shards down; the error is < tp parameters per matrix.
    """
    layer = count.per_layer - count.per_layer_sharded + count.per_layer_sharded // tp
    head = count.head - count.head_sharded + count.head_sharded // tp
    shares, first_layer = [], 0
    for stage, layers in enumerate(layers_per_stage(count.num_layers, pp)):
        first, last = stage == 0, stage == pp - 1
        params = layers * layer
        params += count.embedding if first else 0
        params += head if last else 0
        params += count.tied_params if last and not first else 0
        shares.append(StageShare(stage, layers, params, first, last, first_layer))
        first_layer += layers
    return shares


# what a GPU holds besides model states and activations; each is a named line of the breakdown
# (MemoryEstimate.breakdown, printed by `dplaunch plan`)
#
# CUDA context, loaded kernels and cuBLAS/cuDNN workspaces of one torch process: nvidia-smi shows
# about 0.5–1 GiB per process on A100/H100-class GPUs before any tensor exists (lazy module
# loading); the top of that range, since none of it shows in max_memory_allocated
CUDA_CONTEXT_BYTES = GIB
# one NCCL communicator's buffers: NCCL_BUFFSIZE (4 MiB) per channel and protocol, up to 32
# channels on NVLink, send and receive sides: about 0.5 GiB for each group a rank reduces in
NCCL_BYTES_PER_COMMUNICATOR = GIB // 2
# bytes per logit element in HF's causal-LM loss (transformers loss_utils.ForCausalLMLoss, with
# the loop's `model(**batch).loss`): forward holds the model's logits (2 or 4) + their fp32 upcast
# (4) + log_softmax's fp32 output (4, saved); backward holds that saved output + its gradient +
# the logits' fp32 gradient (4 each) = 12, the peak in 16-bit and fp32 alike
LOSS_BYTES_PER_LOGIT = 12
# bytes per logit of a chunk of train.loss_chunk's fused form (train/chunked_loss.py): one fp32
# buffer holds the logits, their softmax and their gradient in turn (+2 in 16-bit: the cast)
FUSED_BYTES_PER_LOGIT = 4
# bytes per element of the attention probabilities HF's eager attention keeps for backward: the
# fp32 softmax output (eager upcasts the softmax) + its 16-bit copy under mixed precision
# (fp32: the one fp32 tensor). Measured on CPU: tests/test_estimate.py
EAGER_SCORE_BYTES = {"16-bit": 6, "fp32": 4}


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory of the busiest GPU of a plan (the pipeline stage with the largest total), in GiB.

    ``total_gb`` = model states + CUDA context + NCCL buffers + the larger of the two peaks:
    forward/backward (activations, logits, autocast copies, ZeRO-3 gathered layer, reduce buckets)
    and the optimizer step (the fp32 gradient partition; activations are freed by then).
    """

    # parameters this GPU's share of the model has before ZeRO partitions it (after TP and PP)
    params_per_gpu: int
    stage: int
    layers_per_gpu: int
    weights_gb: float
    gradients_gb: float
    optimizer_gb: float
    model_states_gb: float
    # the decoder layers' activations (all in-flight micro-batches), without the logits
    activations_gb: float
    # ZeRO-3 gathers one full layer (or the embedding / lm_head) at a time to compute it
    gathered_gb: float
    total_gb: float
    # host memory this GPU's process needs for offloaded states (and their fp32 gradients)
    cpu_gb: float
    exact_parameters: bool
    # the attention kernel the estimate assumes (model.attn_implementation or transformers' pick)
    attn_implementation: str = "eager"
    # logits in the loss: micro-batch × sequence × vocabulary × LOSS_BYTES_PER_LOGIT
    logits_gb: float = 0.0
    # DDP under autocast: the 16-bit copy of every matrix, cached for the forward, kept for backward
    autocast_gb: float = 0.0
    # DeepSpeed's reduce buckets (and ZeRO-3's prefetch bucket), fixed by BUCKET_SIZE
    buckets_gb: float = 0.0
    # the fp32 gradient partition DeepSpeed's ZeRO optimizer builds for the step
    step_gb: float = 0.0
    nccl_gb: float = 0.0
    cuda_context_gb: float = 0.0
    # host RAM one rank holds while loading the model (the fp32 model, whole or partitioned;
    # QLoRA's quantized model)
    host_load_gb: float = 0.0
    host_load_quantized: bool = False
    # SDPA's masks of packed rows kept for the backward (:func:`packed_mask_bytes`)
    mask_gb: float = 0.0
    # FSDP2's layout (zero_stage 3's states): gathered_gb and buckets_gb are its unsharded root
    # and blocks and its reduce-scatter of a unit (:func:`fsdp_transient_bytes`)
    fsdp: bool = False
    # parameters with gradients and optimizer states on this GPU before ZeRO partitions them
    # (params_per_gpu, or LoRA's adapters and saved copies); None: not computed
    trainable_params: int | None = None
    # dpo: the reference model, a frozen copy of the weights held as the policy's are
    reference_gb: float = 0.0
    # grpo: the KV cache of one prompt's completions while they are sampled (kv_cache_bytes)
    kv_cache_gb: float = 0.0
    # train.loss_chunk: the tokens of a chunk of the head and loss (0: the full logits), and
    # then logits_gb is one chunk's (planning/loss_chunk.py)
    loss_chunk: int = 0

    @property
    def forward_backward_gb(self) -> float:
        """The forward/backward peak beyond the model states."""
        return (
            self.activations_gb
            + self.logits_gb
            + self.autocast_gb
            + self.mask_gb
            + self.gathered_gb
            + self.buckets_gb
        )

    @property
    def host_gb(self) -> float:
        """Host RAM one rank needs at its peak: loading, or the offloaded states while training."""
        return max(self.host_load_gb, self.cpu_gb)

    def host_line(self, ranks_per_node: int) -> str:
        """Host RAM of a node whose ranks all hold :attr:`host_gb` at once, in words."""
        model = "the quantized model" if self.host_load_quantized else "the fp32 model"
        what = "offloaded states" if self.cpu_gb > self.host_load_gb else f"{model} at load"
        return (
            f"{ranks_per_node} rank(s) per node × {self.host_gb:.1f} GiB ({what}) = "
            f"{ranks_per_node * self.host_gb:.1f} GiB"
        )

    def breakdown(self) -> list[tuple[str, str, float]]:
        """(field, words, GiB) of every line the total is made of, in the order they add up."""
        words = {
            "weights_gb": "weights",
            "gradients_gb": "gradients",
            "optimizer_gb": "optimizer states (Adam)",
            "reference_gb": "reference model (frozen copy: dpo, grpo's KL)",
            "activations_gb": f"activations ({self.layers_per_gpu} layers, "
            f"{self.attn_implementation} attention)",
            "logits_gb": (
                f"logits of a {self.loss_chunk:,}-token chunk of the loss"
                if self.loss_chunk
                else f"logits in the loss ({LOSS_BYTES_PER_LOGIT} bytes each)"
            ),
            "autocast_gb": "autocast 16-bit weight copies (DDP)",
            "mask_gb": "attention masks of packed rows (sdpa)",
            "gathered_gb": (
                "FSDP unsharded root + 2 blocks" if self.fsdp else "ZeRO-3 gathered layer"
            ),
            "buckets_gb": (
                "FSDP reduce-scatter of a unit"
                if self.fsdp
                else "DeepSpeed reduce/prefetch buckets"
            ),
            "step_gb": "fp32 gradient partition at the step",
            "kv_cache_gb": "KV cache while sampling (grpo)",
            "nccl_gb": "NCCL buffers",
            "cuda_context_gb": "CUDA context",
        }
        return [(name, text, getattr(self, name)) for name, text in words.items()]

    def breakdown_lines(self) -> list[str]:
        """The breakdown as text, then how the lines make the total."""
        lines = [f"  {text:<48}{gib:>9.2f}" for _, text, gib in self.breakdown() if gib]
        sampling = self.kv_cache_gb + (self.gathered_gb if self.kv_cache_gb else 0.0)
        peaks = {
            "forward/backward": self.forward_backward_gb,
            "optimizer step": self.step_gb,
            "sampling": sampling,
        }
        peak = max(peaks, key=lambda name: peaks[name])  # the first of equal ones
        lines.append(f"  {'total (peak: ' + peak + ')':<48}{self.total_gb:>9.2f}")
        return lines


def _bytes_per_param(mixed_precision: str, zero_stage: int = 0) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter for Adam (ZeRO paper, §3.1).

    Mixed precision: 16-bit weights (2) + 16-bit gradients (2) + fp32 master weights, momentum and
    variance (K = 12). fp32: 4 + 4 + momentum and variance (K = 8). (Plain DDP through Accelerate
    keeps fp32 weights and gradients under autocast: 4 + 4 + 8, the same 16 bytes in total.)

    One measured exception to the paper's fp32 figure: DeepSpeed's ZeRO-1/2/3 optimizers keep an
    fp32 master copy of their partition even when the model itself is fp32, so fp32 under ZeRO
    is 4 + 4 + 12 (tests/memory_probe.py: per-rank storage on 2 CPU ranks, ZeRO 0-3).
    """
    if mixed_precision in ("bf16", "fp16"):
        return 2, 2, 12
    if mixed_precision == "no":
        return 4, 4, 12 if zero_stage >= 1 else 8
    raise UserError(
        "train.mixed_precision", f"unknown value {mixed_precision!r}", "use no, bf16 or fp16"
    )


def model_state_bytes(
    params: int, *, dp: int, zero_stage: int, offload: str = "none", mixed_precision: str = "bf16"
) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer, cpu) bytes on one GPU for Ψ = ``params`` and Nd = ``dp``.

    With w, g, K from :func:`_bytes_per_param` (2, 2, 12 for mixed precision; 4, 4, 8 for fp32
    DDP, 4, 4, 12 for fp32 ZeRO):

    - DDP / ZeRO-0: (w + g + K)·Ψ
    - ZeRO-1: (w + g + K/Nd)·Ψ          optimizer states partitioned
    - ZeRO-2: (w + (g + K)/Nd)·Ψ        gradients too
    - ZeRO-3: (w + g + K)·Ψ/Nd          weights too

    offload="optimizer" moves the optimizer partition (K·Ψ/Nd, or K·Ψ without ZeRO partitioning)
    to host memory; offload="all" (ZeRO-3 only) moves the weight partition too. Offloaded bytes
    count 0 on the GPU and are returned as ``cpu``.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise UserError("parallel.zero_stage", f"{zero_stage} is not 0, 1, 2 or 3")
    if offload not in ("none", "optimizer", "all"):
        raise UserError(
            "parallel.offload", f"unknown value {offload!r}", "use none, optimizer or all"
        )
    check_offload(zero_stage, offload)
    w, g, k = _bytes_per_param(mixed_precision, zero_stage)
    weights = w * params / (dp if zero_stage >= 3 else 1)
    gradients = g * params / (dp if zero_stage >= 2 else 1)
    optimizer = k * params / (dp if zero_stage >= 1 else 1)
    cpu = 0.0
    if offload in ("optimizer", "all"):
        cpu += optimizer
        optimizer = 0.0
    if offload == "all":
        cpu += weights
        weights = 0.0
    return weights, gradients, optimizer, cpu


# bytes per s·b·h one llama-like decoder layer keeps for backward besides the attention scores
# (SwiGLU MLP of width i, RMSNorms), measured on CPU with saved-tensor hooks (tests/test_estimate.py):
# (replicated on every TP rank, split over TP, × i/h split over TP) for the three ways ranks
# hold weights — 16-bit weights (DeepSpeed bf16/fp16), fp32 weights under autocast (DDP: the
# residual stream and the norms stay fp32), fp32. The split of the first two is read from the
# graph (the two RMSNorms' fp32 input and 16-bit output are replicated), the sums are measured.
LLAMA_LAYER_BYTES = {"16-bit": (12, 12, 8), "autocast": (22, 12, 8), "fp32": (16, 24, 16)}


def activation_bytes_per_layer(
    count: ParameterCount,
    *,
    micro_batch: int,
    seq_len: int,
    tp: int = 1,
    mixed_precision: str = "bf16",
    attention_scores: bool = True,
    autocast: bool = False,
) -> float:
    """Activations one transformer layer keeps for backward.

    GPT/BERT-style layers (Korthikanti et al. 2022, eq. 1-2): 16-bit s·b·h·34 bytes besides the
    attention scores; with tensor parallelism (no sequence parallelism) s·b·h·(10 + 24/t) — the
    10 (layer-norm inputs, dropout masks of the residual) is replicated on every TP rank, the
    rest is split. fp32 doubles it. Llama-like layers (llama, mistral, qwen2, qwen3):
    s·b·h·(R + (S + M·i/h)/t) with (R, S, M) from :data:`LLAMA_LAYER_BYTES` — 16-bit weights
    (24 + 8·i/h at t = 1: 45.5 for Llama-2-7B, not 34), ``autocast`` = fp32 weights under
    autocast (DDP; 34 + 8·i/h), fp32 (40 + 16·i/h).
    ``attention_scores`` (eager attention) adds the score matrices, a/t heads × s × s × b elements
    at :data:`EAGER_SCORE_BYTES` each: HF's eager attention keeps the fp32 softmax output and, in
    16-bit, its 16-bit copy (6 bytes; the paper's 5 assumed a 16-bit softmax and a dropout mask).
    SDPA, flash and flex attention never build the matrix: no such term.
    """
    s, b, h, a = seq_len, micro_batch, count.hidden_size, count.num_heads
    sixteen_bit = mixed_precision in ("bf16", "fp16")
    if count.family in LLAMA_LIKE and count.intermediate_size:
        kind = ("autocast" if autocast else "16-bit") if sixteen_bit else "fp32"
        replicated, split, per_width = LLAMA_LAYER_BYTES[kind]
        width = count.intermediate_size / h
        layer = s * b * h * (replicated + (split + per_width * width) / tp)
    else:
        layer = s * b * h * (10 + 24 / tp) * (1 if sixteen_bit else 2)
    if attention_scores:
        layer += (a / tp) * s * s * b * EAGER_SCORE_BYTES["16-bit" if sixteen_bit else "fp32"]
    return layer


def fsdp_transient_bytes(
    root_params: int, block_params: int, largest_trained: int, element: int
) -> tuple[float, float]:
    """(unsharded, reduce-scatter) bytes FSDP2 holds beyond its shards while it computes
    (train/fsdp.py's layout, torch 2.13's fully_shard):

    - the root (embeddings, final norm, head) stays unsharded from its forward to its backward
      (reshard_after_forward=False), and the blocks are all-gathered one ahead of the one
      computing: root + 2 blocks, in the compute dtype (``element`` bytes);
    - a unit's gradients are reduce-scattered from a flat input in the reduce dtype (fp32),
      copied from its unsharded gradients (compute dtype): ``element + 4`` bytes a trained
      parameter of the largest unit (a block, or the root: a large vocabulary's embedding and
      head).

    Measured on one CPU rank (the unsharded root after the forward, the reduce-scatter inputs of
    the backward): tests/test_fsdp.py."""
    unsharded = element * (root_params + 2 * block_params)
    return unsharded, (element + 4) * largest_trained


def packed_mask_bytes(
    micro_batch: int, seq_len: int, layers: int, sp: int, element: int, checkpointed: bool
) -> float:
    """Bytes of the attention masks SDPA keeps for the backward when rows hold packed examples
    (sft with data.packing): a row's mask is L × L, over the whole row even under sequence
    parallelism (the gathered sequence), not divided by sp.

    Without sp, transformers gives SDPA a boolean mask, which SDPA turns into an additive one in
    the compute dtype in every layer and keeps: layers × b·L²·element (the layers that keep
    their activations: one at a time when checkpointed). Under sp, dplaunch builds that additive
    mask once per forward and every layer uses it: b·L²·element. Measured on CPU:
    tests/test_sequence_parallel.py."""
    per_mask = micro_batch * seq_len * seq_len * element
    if sp > 1:
        return per_mask
    return per_mask * (min(layers, 1) if checkpointed else layers)


@dataclass(frozen=True)
class _Layout:
    """A layout as the estimate counts it: FSDP is ZeRO-3 over its shard group, ZeRO partitions
    over dp × sp (DeepSpeed sees the sp ranks as data-parallel ones), a rank holds seq_len / sp
    tokens of each sequence."""

    zero_stage: int
    offload: str
    # the ranks states are partitioned over, and the data-parallel degree of NCCL's communicators
    state_ranks: int
    comm_dp: int
    tp: int
    pp: int
    sp: int
    # micro-batches per optimizer step (None: unknown)
    steps: int | None
    # DDP keeps fp32 weights and computes under autocast; DeepSpeed and FSDP hold 16-bit ones
    ddp: bool
    # FSDP2: ZeRO-3's states, its own unsharded units and reduce-scatter input (its frozen
    # weights, a LoRA base or dpo's reference, stay fp32 shards)
    fsdp: bool = False

    @classmethod
    def of(cls, dims: ParallelDims, workload: Workload) -> _Layout:
        zero_stage = 3 if dims.fsdp else dims.zero_stage
        dp = dims.fsdp_shard_size if dims.fsdp else dims.dp
        return cls(
            zero_stage=zero_stage,
            offload=dims.offload,
            state_ranks=dp * dims.sp,
            comm_dp=dp,
            tp=dims.tp,
            pp=dims.pp,
            sp=dims.sp,
            steps=workload.accumulation_steps(dims.dp),
            ddp=zero_stage == 0 and dims.tp == 1 and dims.pp == 1,
            fsdp=dims.fsdp is not None,
        )


@dataclass(frozen=True)
class _StageFixed:
    """Bytes every pipeline stage of a layout shares (see estimate_memory)."""

    layer_full: float
    checkpoint: float
    logits: float
    largest_unit: int
    autocast: float
    buckets: float
    nccl: float
    host_load: float
    element: int
    implementation: str
    # QLoRA: the host load is the quantized model
    quantized_load: bool = False
    # FSDP2: the unsharded root and blocks (in place of ZeRO-3's gathered unit)
    fsdp_unsharded: float = 0.0
    # grpo: the KV cache and last logits of one prompt's completions while sampling
    generation: float = 0.0
    # train.loss_chunk can run on this layout and task (planning/loss_chunk.py)
    chunkable: bool = False


def estimate_memory(
    facts: ModelFacts,
    dims: ParallelDims,
    workload: Workload,
    *,
    count: ParameterCount | None = None,
    lora: AdapterCount | None = None,
) -> MemoryEstimate:
    """Memory on the busiest GPU of the layout DIMS running WORKLOAD, as the ranks will run it on GPUs.

    ``count``: the model's parameter count when already made; ``lora``
    (:func:`dplaunch.planning.lora.count_lora` of ``workload.lora``): a LoRA run's adapters.

    Sequence parallelism (``dims.sp``, Ulysses): a rank keeps 1/sp of every sequence, and between
    its all-to-alls attention runs on whole sequences of heads/sp heads, as many bytes: every
    activation and the logits are those of ``seq_len / sp`` tokens. DeepSpeed sees the sp ranks
    as data-parallel ones, so ZeRO partitions over dp × sp. FSDP (``dims.fsdp``) holds what
    ZeRO-3 holds over its shard group (every rank, or a node's).

    ``lora``: only the adapters (and modules_to_save copies) have gradients and optimizer states,
    ZeRO partitions those; the frozen base weights are held whole (partitioned under ZeRO-3),
    quantized under QLoRA (``LoraCount.state_bytes``). Activations are counted as for full
    fine-tuning (the adapters' own, s·b·r per adapter, are left out).

    Model states: :func:`model_state_bytes` of the parameters this GPU holds (:func:`stage_shares`).
    ZeRO-3 also needs the largest unit it gathers at once (a layer, the embedding or the head) in
    16-bit: ``gathered_gb``.

    Activations per GPU: L_stage layers × :func:`activation_bytes_per_layer` × in-flight
    micro-batches; the score matrices count only for eager attention (``attn_implementation``,
    unset = transformers' pick, :func:`attention_implementation`). With activation checkpointing
    a layer keeps only its input, 2·s·b·h bytes (4 in fp32 or under DDP's autocast; not split by
    TP), plus one layer's full activations while it is recomputed. Pipeline stage k of
    DeepSpeed's 1F1B schedule holds min(pp − k, micro-batches) micro-batches in flight (the
    workload's accumulation steps; unknown = pp), so stage 0 holds as many activations as the
    whole unsplit model: PP does not shrink activation memory on the first stage.

    The rest, each a line of :meth:`MemoryEstimate.breakdown`:

    - logits (last stage): b·s·V × :data:`LOSS_BYTES_PER_LOGIT` for causal-lm, b·labels × the
      same for classification;
    - autocast copies (DDP in bf16/fp16, whose weights stay fp32): 2 bytes × every parameter that
      enters a matrix product (all but the input embedding; a tied head reuses it);
    - attention masks (the workload's ``packed`` rows, under sdpa): :func:`packed_mask_bytes`;
    - FSDP2: its unsharded root and blocks and its reduce-scatter input
      (:func:`fsdp_transient_bytes`) instead of ZeRO-3's gathered layer and buckets;
    - DeepSpeed buckets (rendered with reduce_bucket_size = BUCKET_SIZE elements, overlap_comm on
      GPUs): ZeRO-1/2 two reduce buffers of BUCKET_SIZE gradient elements; ZeRO-3 one, plus its
      prefetch bucket of BUCKET_SIZE/4 16-bit parameters;
    - the step (ZeRO ≥ 1, not offloaded): the fp32 gradient partition, 4·Ψ/Nd bytes, while
      activations are freed — so the total takes the larger of the two peaks;
    - NCCL buffers, one communicator per parallel axis of degree > 1; the CUDA context.

    ``host_load_gb``: host RAM a rank holds while it builds or loads the model, the whole fp32
    model (4 bytes × all parameters: TP and PP cut it afterwards) — except ZeRO-3, where
    ``zero.Init`` builds each rank's partition only (4·Ψ/Nd), and QLoRA, whose base is
    quantized as it loads (the quantized model, whole: transformers skips zero.Init for it).

    dpo (``workload.task``): a pair is two rows in the forward (chosen, rejected): the
    activations and logits of 2 × the micro batch; with ``workload.holds_reference`` a frozen copy of
    the weights held as the policy's are (:func:`reference_bytes`), ``reference_gb``, whose
    forward runs before the policy's and adds no activation peak.
    """
    layout = _Layout.of(dims, workload)
    count = count or count_parameters(facts, workload.task, workload.num_labels)
    check_pipeline_depth(layout.pp, count.num_layers)
    fixed = _stage_fixed(facts, count, layout, workload, lora)
    stages = [
        _stage_memory(share, count, layout, fixed, workload, lora)
        for share in stage_shares(count, tp=layout.tp, pp=layout.pp)
    ]
    return max(stages, key=lambda estimate: estimate.total_gb)  # the first of equal totals


def _stage_fixed(
    facts: ModelFacts,
    count: ParameterCount,
    layout: _Layout,
    workload: Workload,
    lora: AdapterCount | None,
) -> _StageFixed:
    # what every stage of the layout shares: one layer's activations, the logits, the buffers
    seq_len = workload.seq_len / layout.sp
    micro_batch = workload.micro_batch * workload.rows_per_sample
    implementation = attention_implementation(facts.model_type, workload.attn_implementation)
    sixteen_bit = workload.mixed_precision in ("bf16", "fp16")
    layer_full = activation_bytes_per_layer(
        count,
        micro_batch=micro_batch,
        seq_len=seq_len,
        tp=layout.tp,
        mixed_precision=workload.mixed_precision,
        attention_scores=implementation == "eager",
        autocast=layout.ddp and sixteen_bit,
    )
    element = 2 if sixteen_bit else 4
    # a checkpointed layer keeps its input: the residual stream, fp32 under DDP's autocast
    checkpoint = (4 if layout.ddp else element) * seq_len * micro_batch * count.hidden_size
    if task_of(workload.task).classifies:
        labels = workload.num_labels
        labels = int(labels if labels is not None else facts.raw.get("num_labels") or 2)
        logits = micro_batch * labels * LOSS_BYTES_PER_LOGIT
    else:
        logits = micro_batch * seq_len * count.vocab_size * LOSS_BYTES_PER_LOGIT
    tp = layout.tp
    layer_params = count.per_layer - count.per_layer_sharded + count.per_layer_sharded // tp
    head_params = count.head - count.head_sharded + count.head_sharded // tp
    autocast = 2 * (count.total - count.embedding + count.tied_params)
    autocast = autocast if layout.ddp and sixteen_bit else 0
    if lora is not None and autocast:
        # QLoRA's quantized layers dequantize inside their own kernels: no autocast copy of them
        autocast -= 2 * lora.stage(count.num_layers, True, True)[1]
    buckets = {1: 2 * BUCKET_SIZE, 2: 2 * BUCKET_SIZE, 3: BUCKET_SIZE + BUCKET_SIZE // 4}
    buckets_bytes = buckets.get(layout.zero_stage, 0) * element
    fsdp_unsharded = 0.0
    if layout.fsdp:
        root = count.embedding + head_params
        trained = (layer_params, root)
        if lora is not None:
            trained = (lora.stage(1, False, False)[0], lora.stage(0, True, True)[0])
        fsdp_unsharded, buckets_bytes = fsdp_transient_bytes(
            root, layer_params, max(trained), element
        )
    quantized, quantized_bytes = lora.stage(count.num_layers, True, True)[1:] if lora else (0, 0)
    if quantized:
        # QLoRA: bitsandbytes quantizes each weight as it loads (and transformers builds a
        # quantized model whole, without zero.Init): the quantized model, never the fp32 one
        host_load = 4 * (count.total - quantized) + quantized_bytes
    else:
        host_load = 4 * count.total / (layout.state_ranks if layout.zero_stage == 3 else 1)
    axes = (layout.comm_dp, layout.tp, layout.pp, layout.sp)
    generation = 0.0
    if workload.generation is not None:
        generation = kv_cache_bytes(facts, count, workload, element)
        # the last position's logits of each row, fp32 (sampling)
        generation += workload.generation.rows * count.vocab_size * 4
    return _StageFixed(
        layer_full=layer_full,
        checkpoint=checkpoint,
        logits=logits,
        largest_unit=max(layer_params, count.embedding, head_params),
        autocast=autocast,
        buckets=buckets_bytes,
        nccl=NCCL_BYTES_PER_COMMUNICATOR * sum(degree > 1 for degree in axes),
        host_load=host_load,
        element=element,
        implementation=implementation,
        quantized_load=bool(quantized),
        fsdp_unsharded=fsdp_unsharded,
        generation=generation,
        chunkable=why_not_chunked(workload.task, tp=layout.tp, pp=layout.pp) is None,
    )


def _stage_memory(
    share: StageShare,
    count: ParameterCount,
    layout: _Layout,
    fixed: _StageFixed,
    workload: Workload,
    lora: AdapterCount | None,
) -> MemoryEstimate:
    # the estimate of one GPU of pipeline stage SHARE
    in_flight = min(layout.pp - share.stage, layout.steps or layout.pp)
    activations = _stage_activations(share, fixed, workload, in_flight)
    stage_logits, chunk = _head_logits(share, count, layout, fixed, workload, activations)
    masks = 0.0
    if workload.packed and fixed.implementation == "sdpa":
        masks = in_flight * packed_mask_bytes(
            workload.micro_batch,
            workload.seq_len,
            share.layers,
            layout.sp,
            fixed.element,
            workload.activation_checkpointing,
        )
    dp, zero_stage, offload = layout.state_ranks, layout.zero_stage, layout.offload
    state_shape = dict(
        dp=dp, zero_stage=zero_stage, offload=offload, mixed_precision=workload.mixed_precision
    )
    if lora is None:
        trainable = share.params
        weights, gradients, optimizer, cpu = model_state_bytes(share.params, **state_shape)
    else:
        trainable, (weights, gradients, optimizer, cpu) = lora.state_bytes(
            share, ddp=layout.ddp, tp=layout.tp, **state_shape
        )
    reference = reference_bytes(share.params, layout, workload) if workload.holds_reference else 0.0
    if offload == "all":  # the reference's partition lives with the policy's, on the host
        cpu, reference = cpu + reference, 0.0
    fp32_partition = 4 * trainable / dp if zero_stage >= 1 else 0
    step = fp32_partition if offload == "none" else 0
    cpu += fp32_partition if offload != "none" else 0
    gathered = fixed.element * fixed.largest_unit if zero_stage == 3 else 0
    gathered = fixed.fsdp_unsharded if layout.fsdp else gathered
    states = weights + gradients + optimizer + reference
    forward_backward = (
        activations + stage_logits + fixed.autocast + masks + gathered + fixed.buckets
    )
    # grpo samples before the forward: the KV cache (and, ZeRO-3/FSDP2, a gathered unit) is
    # freed by then
    sampling = fixed.generation + (gathered if fixed.generation else 0)
    total = states + CUDA_CONTEXT_BYTES + fixed.nccl + max(forward_backward, step, sampling)
    return MemoryEstimate(
        params_per_gpu=share.params,
        stage=share.stage,
        layers_per_gpu=share.layers,
        weights_gb=weights / GIB,
        gradients_gb=gradients / GIB,
        optimizer_gb=optimizer / GIB,
        model_states_gb=states / GIB,
        activations_gb=activations / GIB,
        gathered_gb=gathered / GIB,
        total_gb=total / GIB,
        cpu_gb=cpu / GIB,
        exact_parameters=count.exact,
        attn_implementation=fixed.implementation,
        logits_gb=stage_logits / GIB,
        autocast_gb=fixed.autocast / GIB,
        buckets_gb=fixed.buckets / GIB,
        step_gb=step / GIB,
        nccl_gb=fixed.nccl / GIB,
        cuda_context_gb=CUDA_CONTEXT_BYTES / GIB,
        host_load_gb=fixed.host_load / GIB,
        trainable_params=trainable,
        host_load_quantized=fixed.quantized_load,
        mask_gb=masks / GIB,
        fsdp=layout.fsdp,
        reference_gb=reference / GIB,
        kv_cache_gb=fixed.generation / GIB,
        loss_chunk=chunk,
    )


def _head_logits(
    share: StageShare,
    count: ParameterCount,
    layout: _Layout,
    fixed: _StageFixed,
    workload: Workload,
    activations: float,
) -> tuple[float, int]:
    """(the stage's logits bytes, train.loss_chunk's tokens a chunk or 0): the full logits, or
    one chunk's and, where the head is whole on the rank (the fused form), its fp32 gradient."""
    if not share.holds_head:
        return 0.0, 0
    if not fixed.chunkable:
        return fixed.logits, 0
    tokens = workload.micro_batch * workload.rows_per_sample * workload.seq_len / layout.sp
    chunk = resolve_chunk(workload.loss_chunk, tokens, count.hidden_size, fixed.logits, activations)
    if not chunk:
        return fixed.logits, 0
    if not fuses(workload.task, layout.zero_stage, layout.fsdp):
        # a checkpointed chunk holds what the full logits' loss holds, for its tokens
        return fixed.logits * chunk / tokens, chunk
    # the fused form: the chunk's one fp32 [tokens, vocabulary] buffer (logits, softmax, then
    # their gradient, in place: train/chunked_loss.py), the 16-bit logits it is cast from (or the
    # gradient cast back to the 16-bit head), and the head's fp32 gradient from the forward on
    sixteen_bit = workload.mixed_precision in ("bf16", "fp16")
    per_logit = FUSED_BYTES_PER_LOGIT + (2 if sixteen_bit else 0)
    return chunk * count.vocab_size * per_logit + 4 * count.vocab_size * count.hidden_size, chunk


def _stage_activations(
    share: StageShare, fixed: _StageFixed, workload: Workload, in_flight: int
) -> float:
    """The activation peak of a stage: every block's activations of IN_FLIGHT micro-batches, or
    with checkpointing, where its checkpointed blocks (every-K: 0, K, 2K…) keep only their input
    and the others everything. The backward walks the blocks from the last: when a
    checkpointed block is recomputed, the blocks after it have freed theirs, so the peak is the
    larger of all that is saved and, for each checkpointed block, what the blocks before it
    save, its input and its recomputed activations."""
    if not workload.activation_checkpointing:
        return share.layers * fixed.layer_full * in_flight
    first = share.first_layer
    saved, peak = 0.0, 0.0
    for layer in range(first, first + share.layers):
        if workload.checkpointed(layer):
            peak = max(peak, (saved + fixed.checkpoint) * in_flight + fixed.layer_full)
            saved += fixed.checkpoint
        else:
            saved += fixed.layer_full
    return max(peak, saved * in_flight)


def kv_cache_bytes(
    facts: ModelFacts, count: ParameterCount, workload: Workload, element: int
) -> float:
    """grpo: the KV cache of one prompt's completions at their longest: 2 (keys, values) ×
    layers × key/value heads × head size × rows (num_generations, sampled together) × the
    prompt's and completion's tokens (workload.seq_len) × ELEMENT bytes. Each rank samples one
    prompt's completions at a time (train/generation.py), so one group's cache is the peak."""
    assert workload.generation is not None
    heads = int(facts.raw.get("num_key_value_heads") or count.num_heads)
    head_size = int(facts.raw.get("head_dim") or count.hidden_size // max(count.num_heads, 1))
    rows = workload.generation.rows
    return 2.0 * count.num_layers * heads * head_size * rows * workload.seq_len * element


def reference_bytes(params: int, layout: _Layout, workload: Workload) -> float:
    """Bytes of dpo's reference model on one GPU: a frozen copy of Ψ = ``params`` held as the
    policy's weights are (train/preference.py): whole under DDP (fp32, as its weights) and
    ZeRO-1/2 (DeepSpeed's 16-bit weights in mixed precision), partitioned over Nd under ZeRO-3,
    fp32 shards under FSDP."""
    sixteen_bit = workload.mixed_precision in ("bf16", "fp16")
    element = 4 if layout.ddp or layout.fsdp or not sixteen_bit else 2
    return element * params / (layout.state_ranks if layout.zero_stage == 3 else 1)


# ---------------------------------------------------------------------------------------------
# communication per step


@dataclass(frozen=True)
class CommunicationEstimate:
    """Bytes one GPU sends per optimizer step, per kind of traffic (busiest stage)."""

    data_parallel_bytes: float
    tensor_parallel_bytes: float
    pipeline_bytes: float
    # host <-> GPU copies of offloaded states (PCIe, not the network)
    offload_bytes: float

    @property
    def network_bytes(self) -> float:
        """Collective and point-to-point traffic between GPUs."""
        return self.data_parallel_bytes + self.tensor_parallel_bytes + self.pipeline_bytes

    @property
    def network_gb(self) -> float:
        return self.network_bytes / GIB


def estimate_communication(
    facts: ModelFacts,
    dims: ParallelDims,
    workload: Workload,
    *,
    count: ParameterCount | None = None,
    lora: AdapterCount | None = None,
) -> CommunicationEstimate:
    """Bytes sent per GPU per optimizer step of the layout DIMS running WORKLOAD; a ring
    all-reduce of n bytes over p ranks sends 2n(p−1)/p.

    Ψ = parameters this GPU holds (busiest stage, after TP), b = 2 bytes (16-bit) or 4 (fp32),
    m = micro-batches per step (gradient accumulation; unknown = 1), s·mb·h = one layer's output
    activations. DeepSpeed averages gradients over the sp ranks too (Ulysses' all-to-alls are not
    counted); FSDP is counted as ZeRO-3 over its shard group.

    - DDP, ZeRO-1, ZeRO-2: one gradient all-reduce (or reduce-scatter + all-gather of the updated
      weights), 2Ψ·b·(dp−1)/dp — once per step (DDP skips sync on accumulation micro-steps).
    - ZeRO-3: weights all-gathered in forward and again in backward + gradient reduce-scatter,
      3Ψ·b·(dp−1)/dp.
    - TP: 4 all-reduces of s·mb·h·b per layer per micro-batch (2 forward, 2 backward), each
      2·(tp−1)/tp of it sent; an untied causal-lm head split by AutoTP adds one all-reduce of the
      logits s·mb·V·b in forward.
    - PP: a stage sends its output activations forward and its input gradients backward, s·mb·h·b
      each per micro-batch (a middle stage does both: 2·s·mb·h·b·m).
    - LoRA (``lora``): the gradients, their reduce-scatter and the offload copies are the
      trainable parameters' (adapters); ZeRO-3 still gathers every weight twice,
      (2Ψ + Ψ_trainable)·b·(dp−1)/dp.
    - Offload (PCIe): gradients down and updated 16-bit weights up, (b + 2)·Ψ/Nd per step;
      offload="all" also fetches the weight partition for forward and backward, + 2·2Ψ/Nd.
    """
    layout = _Layout.of(dims, workload)
    dp, tp, pp = layout.state_ranks, layout.tp, layout.pp
    count = count or count_parameters(facts, workload.task, workload.num_labels)
    psi = max(share.params for share in stage_shares(count, tp=tp, pp=pp))
    b = 2 if workload.mixed_precision in ("bf16", "fp16") else 4
    m = max(1, layout.steps or 1)
    ring = lambda ranks: 2 * (ranks - 1) / ranks  # noqa: E731
    trained = psi
    if lora is not None:
        stages = layers_per_stage(count.num_layers, pp)
        trained = max(
            lora.stage(layers, stage == 0, stage == pp - 1)[0]
            for stage, layers in enumerate(stages)
        )
    # ZeRO-3 gathers every weight in forward and in backward, then reduce-scatters the gradients
    sent = 2 * psi + trained if layout.zero_stage == 3 else 2 * trained
    data_parallel = sent * b * (dp - 1) / dp
    tokens = workload.seq_len * workload.micro_batch
    activation = tokens * count.hidden_size * b
    layers = max(layers_per_stage(count.num_layers, pp))
    tensor_parallel = 0.0
    if tp > 1:
        tensor_parallel = 4 * layers * activation * ring(tp) * m
        if count.head_sharded:
            tensor_parallel += tokens * count.vocab_size * b * ring(tp) * m
    pipeline = (2 if pp > 2 else 1) * activation * m if pp > 1 else 0.0
    offload_bytes = 0.0
    partition = 1 / (dp if layout.zero_stage >= 1 else 1)
    if layout.offload in ("optimizer", "all"):
        offload_bytes += (b + 2) * trained * partition
    if layout.offload == "all":
        offload_bytes += 2 * 2 * psi * partition
    return CommunicationEstimate(data_parallel, tensor_parallel, pipeline, offload_bytes)


__all__ = [
    "CUDA_CONTEXT_BYTES",
    "EAGER_SCORE_BYTES",
    "GIB",
    "LLAMA_LAYER_BYTES",
    "LOSS_BYTES_PER_LOGIT",
    "NCCL_BYTES_PER_COMMUNICATOR",
    "CommunicationEstimate",
    "MemoryEstimate",
    "ParameterCount",
    "StageShare",
    "activation_bytes_per_layer",
    "config_field",
    "count_parameters",
    "estimate_communication",
    "estimate_memory",
    "layers_per_stage",
    "model_state_bytes",
    "kv_cache_bytes",
    "reference_bytes",
    "stage_shares",
]
