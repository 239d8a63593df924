"""The forecast: how long one optimizer step of a layout takes on a profile's hardware.

Pure Python (no torch), like the rest of planning/: `dplaunch plan` prints it for every row,
``parallel: auto`` picks the fastest row with it, and every run compares it with the step time it
measured (train/loop.py). The rates come from a profile (planning/profiles.py): measured by
``dplaunch calibrate``, or datasheet figures.

One step, per rank (the busiest pipeline stage), is the sum of these terms; each is a function
below with the formula in its docstring:

- **compute** (:func:`micro_batch_flops`): the FLOPs of the run's real model and micro-batch —
  every linear layer's product forward and backward (the backward computes a weight gradient only
  for weights that train, and an input gradient only where something before it trains: LoRA's
  frozen base), LoRA's adapters, the attention scores at the run's kernel, activation
  checkpointing's second forward of every decoder layer — divided by the profile's rate for that
  shape (:func:`compute_seconds`);
- **communication** (:func:`step_collectives`): every collective the layout issues in a step, each
  latency + bus bytes / bus bandwidth; what may run while the backward computes (DDP's buckets
  but the last, FSDP2's prefetched gathers and reduce-scatters, ZeRO's with overlap_comm) hides
  behind it by the profile's overlap (:func:`communication_seconds`);
- **bubble** (:func:`pipeline_seconds`): the pipeline's idle time, (pp − 1) / (m + pp − 1) of the
  step under DeepSpeed's 1F1B schedule, m micro-batches a step;
- **offload** (:func:`offload_seconds`): gradients to the host, DeepSpeed's CPU Adam over the
  rank's partition, updated weights back; FSDP2's CPU offload (:func:`fsdp_offload_seconds`):
  its weight and gradient shards through the host link every micro-batch, torch's AdamW over
  its partition on the host;
- **optimizer** (:func:`optimizer_seconds`): AdamW over the parameters this rank updates, on its
  device (none when offloaded: the host steps them);
- **overhead** (:class:`Overheads`, :func:`overhead_seconds`): what the engine spends besides
  its FLOPs and collectives — every op's dispatch (a GPU's kernel launches), DeepSpeed's and
  FSDP2's hooks around each tensor, ZeRO-1/2's gradient copies, Ulysses' permuted copies around
  its all-to-alls, the loop's own work per step — as counts of the layout (tensors, bytes,
  micro-batches, exchanges) × the seconds per unit `dplaunch calibrate` measured for the engine
  family in short real steps (planning/overhead_fit.py), or DEFAULT_OVERHEADS.

MFU is the model's FLOPs of the step (no recomputation) over step time × ranks × peak FLOP/s.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from dplaunch.planning.estimate import (
    BUCKET_SIZE,
    LLAMA_LIKE,
    ParameterCount,
    config_field,
    count_parameters,
    layers_per_stage,
)
from dplaunch.planning.lora import Module, adapted_modules, model_modules
from dplaunch.planning.loss_chunk import fuses
from dplaunch.planning.mesh import Mesh, fsdp_groups
from dplaunch.planning.model_facts import ModelFacts, attention_implementation
from dplaunch.planning.profiles import DTYPES, GPU_SHEETS, Profile, gpu_sheet_name
from dplaunch.planning.workload import LoraSpec, Workload
from dplaunch.tasks import task_of

if TYPE_CHECKING:
    from dplaunch.planning.rules import ParallelDims

# DDP's gradient buckets: dplaunch sets bucket_cap_mb=100 (train/loop.py make_accelerator)
DDP_BUCKET_BYTES = 100 * 2**20
# DeepSpeed ZeRO-3 as rendered (rendering/deepspeed_config.py) and its defaults
ZERO3_PREFETCH_ELEMENTS = BUCKET_SIZE // 4
ZERO3_PERSISTENCE_THRESHOLD = 100_000
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000
# DeepSpeed's pipeline engine sends a tensor's metadata (256 int32) before each micro-batch's
# activations when shapes may change (dynamic_shape), and the attention mask (int64) with them
PIPELINE_META_BYTES = 256 * 4
# torch's AdamW on the host (unfused: one tensor at a time, a dozen passes over memory, with the
# gradient clipping) over DeepSpeed's CPU Adam (fused AVX) on the same cores: 5.5× and 7.3× in two
# runs of 4 M parameters at one thread each (Xeon with AVX-512, torch 2.13, DeepSpeed 0.19.8,
# 2026-12-07); `dplaunch calibrate` measures only the GPU's fused AdamW and the CPU Adam
TORCH_ADAMW_OVER_CPU_ADAM = 6.0
# a term of the forecast, for the end-of-run "most wrong term"
TERMS = ("compute", "communication", "bubble", "offload", "optimizer", "overhead")


# ---------------------------------------------------------------------------------------------
# the model's structure, once per model: the tuner forecasts hundreds of (layout, micro-batch,
# checkpointing) combinations of one model, and each would walk its modules again


def _facts_key(facts: ModelFacts) -> str:
    return json.dumps(facts.raw, sort_keys=True, default=str)


def _per_model(function):
    """FUNCTION(facts, *args) remembered per (model config, args): its answers are read only."""
    answers: dict[tuple, Any] = {}

    @functools.wraps(function)
    def remembered(facts: ModelFacts, *args: Any) -> Any:
        key = (_facts_key(facts), *args)
        if key not in answers:
            if len(answers) > 512:
                answers.clear()
            answers[key] = function(facts, *args)
        return answers[key]

    return remembered


@_per_model
def _count(facts: ModelFacts, task: str, num_labels: int | None) -> ParameterCount:
    return count_parameters(facts, task, num_labels)


@_per_model
def _modules(facts: ModelFacts, task: str, num_labels: int | None) -> tuple[Module, ...]:
    return tuple(model_modules(facts, task, num_labels)[1])


# ---------------------------------------------------------------------------------------------
# the model's parameters and linear layers


@dataclass(frozen=True)
class Weight:
    """One parameter tensor: (rows, cols) as torch holds it (cols 1 for a vector)."""

    name: str
    rows: int
    cols: int
    layer: int | None
    side: str = "layer"  # "embedding" (first pipeline stage), "layer", "head" (last)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def decays(self) -> bool:
        """In AdamW's weight-decay group (train/engines.py build_optimizer): matrices not norms."""
        return self.cols > 1 and "norm" not in self.name.lower()


def model_weights(
    facts: ModelFacts,
    task: str = "causal-lm",
    num_labels: int | None = None,
    lora: LoraSpec | None = None,
) -> tuple[Weight, ...]:
    """Every parameter tensor of the HF model (with ``lora``: only those that train), in the
    order the model registers them: linear weights and biases from :func:`model_modules`,
    norms (what a layer holds beyond its linear layers) as vectors of the hidden size. A tied
    output head is the embedding: counted once."""
    return _model_weights(facts, task, num_labels, lora)


@_per_model
def _model_weights(
    facts: ModelFacts, task: str, num_labels: int | None, lora: LoraSpec | None
) -> tuple[Weight, ...]:
    count = _count(facts, task, num_labels)
    modules = list(_modules(facts, task, num_labels))
    weights: list[Weight] = []
    trained = None
    if lora is not None:
        targeted, saved = adapted_modules(modules, lora, task)
        trained = _lora_weights(targeted, saved, lora.r)
    by_layer: dict[int | None, int] = {}
    for module in modules:
        if module.output_head and count.tied_head:
            continue
        side = "layer" if module.layer is not None else module.side
        if module.shape is None:
            weights.append(Weight(f"{module.path}.weight", module.params, 1, module.layer, side))
        else:
            n_in, n_out = module.shape
            if module.embedding:
                weights.append(Weight(f"{module.path}.weight", n_in, n_out, None, "embedding"))
            else:
                weights.append(Weight(f"{module.path}.weight", n_out, n_in, module.layer, side))
                if module.params > n_in * n_out:
                    weights.append(
                        Weight(
                            f"{module.path}.bias",
                            module.params - n_in * n_out,
                            1,
                            module.layer,
                            side,
                        )
                    )
        by_layer[module.layer] = by_layer.get(module.layer, 0) + module.params
    hidden = count.hidden_size or 1
    # norms inside the blocks (and biases model_modules leaves out), as hidden-size vectors
    for layer in range(count.num_layers):
        rest = count.per_layer - by_layer.get(layer, 0)
        weights += _vectors(f"layers.{layer}.norm", rest, hidden, layer, "layer")
    outside = sum(w.numel for w in weights if w.layer is None)
    weights += _vectors(
        "norm", count.total - count.per_layer * count.num_layers - outside, hidden, None, "head"
    )
    return tuple(trained if trained is not None else weights)


def _vectors(name: str, params: int, size: int, layer: int | None, side: str) -> list[Weight]:
    vectors = [Weight(f"{name}.{i}", size, 1, layer, side) for i in range(params // size)]
    if params % size:
        vectors.append(Weight(f"{name}.rest", params % size, 1, layer, side))
    return vectors


def _lora_weights(targeted: list[Module], saved: list[Module], r: int) -> list[Weight]:
    """The tensors a LoRA run trains: lora_A (r × in) and lora_B (out × r) of every adapted
    layer, and the full copies of modules_to_save."""
    weights = []
    for module in targeted:
        n_in, n_out = module.shape or (0, 0)
        side = "layer" if module.layer is not None else module.side
        weights.append(Weight(f"{module.path}.lora_A", r, n_in, module.layer, side))
        weights.append(Weight(f"{module.path}.lora_B", n_out, r, module.layer, side))
    for module in saved:
        n_in, n_out = module.shape or (module.params, 1)
        side = "layer" if module.layer is not None else module.side
        weights.append(Weight(f"{module.path}.weight", n_out, n_in, module.layer, side))
        if module.shape and module.params > n_in * n_out:
            weights.append(
                Weight(f"{module.path}.bias", module.params - n_in * n_out, 1, module.layer, side)
            )
    return weights


# which linear layers of a decoder layer read the residual stream (inputs of attention or MLP),
# and which write it back (outputs), by the end of their module path
_ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "c_attn", "query", "key", "value")
_ATTENTION_OUTPUTS = ("o_proj", "attn.c_proj", "attention.output.dense")
_MLP_INPUTS = ("gate_proj", "up_proj", "c_fc", "intermediate.dense")
_MLP_OUTPUTS = ("down_proj", "mlp.c_proj", "output.dense")


@functools.lru_cache(maxsize=8192)
def _role(path: str) -> str:
    for role, names in (
        ("attention_in", _ATTENTION_INPUTS),
        ("attention_out", _ATTENTION_OUTPUTS),
        ("mlp_in", _MLP_INPUTS),
        ("mlp_out", _MLP_OUTPUTS),
    ):
        if any(path.endswith("." + name) for name in names):
            return role
    return "other"


# ---------------------------------------------------------------------------------------------
# compute


@dataclass(frozen=True)
class Flops:
    """FLOPs of one micro-batch on one rank (a multiply-add is 2), as torch's FlopCounterMode
    counts them: matrix products (``dense``: linear layers, adapters, the head) and the attention
    scores (``attention``), forward, backward, and recomputed (activation checkpointing)."""

    dense_forward: float = 0.0
    dense_backward: float = 0.0
    attention_forward: float = 0.0
    attention_backward: float = 0.0
    dense_recompute: float = 0.0
    attention_recompute: float = 0.0

    @property
    def total(self) -> float:
        """Everything computed, recomputation included (what FlopCounterMode counts)."""
        return self.model + self.dense_recompute + self.attention_recompute

    @property
    def model(self) -> float:
        """The model's FLOPs (no recomputation): what MFU counts."""
        return (
            self.dense_forward
            + self.dense_backward
            + self.attention_forward
            + self.attention_backward
        )

    def __add__(self, other: Flops) -> Flops:
        return Flops(*(a + b for a, b in zip(self._values(), other._values(), strict=True)))

    def scaled(self, factor: float) -> Flops:
        """Every count × FACTOR (rows of a micro-batch)."""
        return Flops(*(value * factor for value in self._values()))

    def _values(self) -> tuple[float, ...]:
        return (
            self.dense_forward,
            self.dense_backward,
            self.attention_forward,
            self.attention_backward,
            self.dense_recompute,
            self.attention_recompute,
        )


@dataclass(frozen=True)
class RankShare:
    """The part of each micro-batch one rank computes."""

    # the tensor-parallel degree: the decoder's linear layers, a split head and the heads
    tp: int = 1
    # the sequence-parallel degree: s/sp of the tokens, heads/sp heads over whole sequences
    sp: int = 1
    # (first layer, layers) of its pipeline stage; None: every layer
    stage: tuple[int, int] | None = None


@dataclass(frozen=True)
class _Adapters:
    """What trains in a run: everything (full), or LoRA adapters of rank r on the TARGETED
    modules and whole copies of the SAVED ones (modules_to_save)."""

    full: bool
    rank: int = 0
    targeted: frozenset[str] = frozenset()
    saved: frozenset[str] = frozenset()

    def trains(self, module: Module) -> bool:
        return self.full or module.path in self.saved

    def adapter_rank(self, module: Module) -> int:
        return self.rank if module.path in self.targeted else 0


def _adapters(modules: list[Module], lora: LoraSpec | None, task: str) -> _Adapters:
    if lora is None:
        return _Adapters(full=True)
    adapted, copies = adapted_modules(modules, lora, task)
    return _Adapters(
        False, lora.r, frozenset(m.path for m in adapted), frozenset(m.path for m in copies)
    )


def micro_batch_flops(
    facts: ModelFacts,
    *,
    micro_batch: int,
    seq_len: int,
    task: str = "causal-lm",
    num_labels: int | None = None,
    lora: LoraSpec | None = None,
    activation_checkpointing: bool | int = False,
    share: RankShare = RankShare(),
) -> Flops:
    """FLOPs of one micro-batch (``micro_batch`` × ``seq_len`` tokens) on one rank.

    A linear layer of (in, out) over T tokens: forward 2·T·in·out; backward 2·T·in·out for its
    weight's gradient when the weight trains, and 2·T·in·out for its input's gradient when its
    input requires one — which, walking the layer in order, is when anything before it trains
    (full training: always, the embedding trains; LoRA: from the first adapter on, or from the
    start under activation checkpointing, where peft makes the embedding's output require a
    gradient). A LoRA adapter of rank r adds forward 2·T·r·(in + out), backward the same for its
    two weights, 2·T·r·out for the gradient between them and 2·T·r·in into its input when that
    requires one. Attention scores of a layer: forward 4·b·heads·s²·head_dim (QKᵀ and the
    weighted values, every position counted as FlopCounterMode does), backward 2·b·heads·s²·d
    for each of the gradients of Q, K, V and the scores that is needed. Activation checkpointing
    recomputes every decoder layer's forward (``activation_checkpointing`` K > 1: every-K,
    layers 0, K, 2K… only) in the backward, up to the last tensor the backward
    needs (torch's non-reentrant checkpoint stops there): a pre-norm layer's last product (the
    MLP's output projection, or with an adapter there its lora_B) is not recomputed.

    Tensor parallelism divides the decoder's linear layers and a split head by ``share.tp`` (and
    the attention heads); sequence parallelism gives each rank s/sp of the tokens of the linear
    layers and heads/sp heads over whole sequences. ``share.stage`` = (first layer, layers) of a
    pipeline stage; the embedding's rank computes the rotary, the head's rank the head.

    Every count is linear in the micro-batch: one row's FLOPs, remembered per model, scaled.
    """
    checkpointing = int(activation_checkpointing)  # False 0, True 1, every-K K
    row = _row_flops(facts, seq_len, task, num_labels, lora, checkpointing, share)
    return row.scaled(micro_batch)


@_per_model
def _row_flops(
    facts: ModelFacts,
    seq_len: int,
    task: str,
    num_labels: int | None,
    lora: LoraSpec | None,
    checkpoint_every: int,
    share: RankShare,
) -> Flops:
    """micro_batch_flops of one row (CHECKPOINT_EVERY 0: no activation checkpointing)."""
    activation_checkpointing = checkpoint_every > 0
    micro_batch = 1
    count = _count(facts, task, num_labels)
    modules = list(_modules(facts, task, num_labels))
    adapters = _adapters(modules, lora, task)
    tp, sp = share.tp, share.sp
    tokens = micro_batch * seq_len / sp
    heads = max(count.num_heads, 1) / (tp * sp)
    scores = 2 * micro_batch * heads * seq_len * seq_len * _head_dim(facts, count)
    first, layers = share.stage if share.stage is not None else (0, count.num_layers)
    # does the residual stream entering this rank's first layer require a gradient?
    changed = adapters.targeted | adapters.saved
    embedding_trains = lora is None or any(m.embedding and m.path in changed for m in modules)
    stream = embedding_trains or (lora is not None and activation_checkpointing)
    if first != 0:  # not the embedding's rank
        stream = stream or lora is None or bool(changed)
    total = Flops()
    # pre-norm layers end with the MLP's output product, whose result nothing saves: torch's
    # checkpoint stops recomputing once the last saved tensor is back, before that product
    # (unless a dropout after it saves its mask: GPT-2's resid_pdrop, 0.1 by default)
    dropout = config_field(facts, "resid_pdrop")
    pre_norm = facts.model_type != "bert" and not (
        facts.model_type == "gpt2" and (0.1 if dropout is None else float(dropout)) > 0
    )
    for layer in range(first, first + layers):
        in_layer = [m for m in modules if m.layer == layer and m.shape is not None]
        layer_flops, stream, tail = _layer_flops(in_layer, tokens, scores, tp, stream, adapters)
        if activation_checkpointing and layer % checkpoint_every == 0:
            layer_flops += Flops(
                dense_recompute=layer_flops.dense_forward - (tail if pre_norm else 0.0),
                attention_recompute=layer_flops.attention_forward,
            )
        total += layer_flops
    if first + layers == count.num_layers:  # the head's rank
        for module in (
            m for m in modules if m.layer is None and m.shape is not None and not m.embedding
        ):
            rows = micro_batch if _pooled(facts, module) else tokens
            split = tp if module.output_head and count.head_sharded else 1
            flops, stream = _linear_flops(
                module, rows, split, stream, adapters.trains(module), adapters.adapter_rank(module)
            )
            total += flops
    return total


def _head_dim(facts: ModelFacts, count: ParameterCount) -> int:
    explicit = facts.raw.get("head_dim")
    return int(explicit) if explicit else count.hidden_size // max(count.num_heads, 1)


def _pooled(facts: ModelFacts, module: Module) -> bool:
    # BERT's pooler and classifier read the first token of each row; the other heads every token
    return facts.model_type == "bert" and module.path in ("bert.pooler.dense", "classifier")


def _linear_flops(
    module: Module, tokens: float, split: int, input_grad: bool, trains: bool, rank: int
) -> tuple[Flops, bool]:
    """(FLOPs of one linear layer and its adapter, whether its output requires a gradient)."""
    n_in, n_out = module.shape or (0, 0)
    product = 2 * tokens * n_in * n_out / split
    backward = (product if trains else 0.0) + (product if input_grad else 0.0)
    forward = product
    if rank:
        forward += 2 * tokens * rank * (n_in + n_out)
        # both adapter weights, the gradient between them, and into the input when needed
        backward += 2 * tokens * rank * (n_in + n_out) + 2 * tokens * rank * n_out
        backward += 2 * tokens * rank * n_in if input_grad else 0.0
    return Flops(dense_forward=forward, dense_backward=backward), input_grad or trains or bool(rank)


def _layer_flops(
    modules: list[Module],
    tokens: float,
    scores: float,
    tp: int,
    stream: bool,
    adapters: _Adapters,
) -> tuple[Flops, bool, float]:
    """(FLOPs of one decoder layer, whether the residual stream after it requires a gradient,
    the forward FLOPs after the last tensor its backward saves: the MLP output's last product).
    ``scores``: the FLOPs of one product of its attention scores (2·b·heads·s²·head_dim)."""
    total = Flops()
    tail = 0.0
    # attention: Q, K, V from the stream; the output projection reads the attention's result
    query = key = value = False
    mlp_hidden = False
    out_stream = stream
    for module in modules:
        role = _role(module.path)
        trains = adapters.trains(module)
        adapter = adapters.adapter_rank(module)
        if role == "attention_in":
            flops, grad = _linear_flops(module, tokens, tp, stream, trains, adapter)
            path = module.path
            query |= grad and (path.endswith(("q_proj", "query", "c_attn")))
            key |= grad and (path.endswith(("k_proj", "key", "c_attn")))
            value |= grad and (path.endswith(("v_proj", "value", "c_attn")))
        elif role == "attention_out":
            needed = sum((query or key, value, query, key))
            total += Flops(attention_forward=2 * scores, attention_backward=needed * scores)
            attended = query or key or value
            flops, grad = _linear_flops(module, tokens, tp, attended, trains, adapter)
            out_stream = out_stream or grad
        elif role == "mlp_in":
            flops, grad = _linear_flops(module, tokens, tp, out_stream, trains, adapter)
            mlp_hidden |= grad
        elif role == "mlp_out":
            flops, grad = _linear_flops(module, tokens, tp, mlp_hidden, trains, adapter)
            out_stream = out_stream or grad
            _, n_out = module.shape or (0, 0)
            # with an adapter its lora_B runs last (peft: base, then B(A(x))); else the product
            tail = 2 * tokens * adapter * n_out if adapter else flops.dense_forward
        else:
            flops, grad = _linear_flops(module, tokens, tp, out_stream, trains, adapter)
        total += flops
    return total, out_stream, tail


# ---------------------------------------------------------------------------------------------
# communication


@dataclass(frozen=True)
class Collective:
    """One collective of a step: its payload as the collective spy counts it (the whole buffer of
    an all-reduce, the gathered output of an all-gather, the input of a reduce-scatter or
    all-to-all, the tensor of a send), its group, and when it runs."""

    op: str
    bytes: float
    ranks: int
    # "intra": the group stays in a node; "inter": it spans nodes
    scope: str
    # "forward", "backward" (may overlap that phase's computation when ``overlaps``) or "step"
    phase: str
    what: str
    overlaps: bool = False

    @property
    def bus_bytes(self) -> float:
        """Bytes each rank moves on the busiest link (nccl-tests' bus bandwidth convention):
        all-reduce 2(p−1)/p of the buffer, all-gather / reduce-scatter / all-to-all (p−1)/p,
        broadcast and send the whole tensor."""
        p = self.ranks
        if self.op == "all_reduce":
            return self.bytes * 2 * (p - 1) / p
        if self.op in ("all_gather", "reduce_scatter", "all_to_all"):
            return self.bytes * (p - 1) / p
        return self.bytes

    def seconds(self, profile: Profile) -> float:
        """latency + bus bytes / bus bandwidth of its op on its scope."""
        op = "send" if self.op in ("send", "recv") else self.op
        link = profile.link(op, self.scope)
        return link.latency_s + self.bus_bytes / link.bus_bytes_per_s


def _element(mixed_precision: str) -> int:
    return 2 if mixed_precision in ("bf16", "fp16") else 4


def _scope(groups: list[list[int]], per_node: int) -> str:
    """ "inter" when any group holds ranks of two nodes."""
    spans = any(len({rank // per_node for rank in group}) > 1 for group in groups)
    return "inter" if spans else "intra"


def _buckets(sizes: list[int], cap: int) -> list[int]:
    """Greedy buckets of at most CAP (a tensor larger than CAP is a bucket of its own), filled in
    the backward's order (the last registered tensor first)."""
    buckets, current = [], 0
    for size in reversed(sizes):
        if current and current + size > cap:
            buckets.append(current)
            current = 0
        current += size
    if current:
        buckets.append(current)
    return buckets


def _pieces(total: int, cap: int) -> list[int]:
    """TOTAL split into ceil(total / cap) pieces (DeepSpeed's flat buffers, cut by bucket size)."""
    count = max(1, math.ceil(total / cap))
    return [total // count + (1 if i < total % count else 0) for i in range(count)]


@dataclass(frozen=True)
class Group:
    """A process group as the forecast sees it: its ranks and whether it spans nodes."""

    ranks: int
    scope: str = "intra"


class StepCollectives:
    """The collectives of one step, added as they are issued (a one-rank group moves nothing)."""

    def __init__(self) -> None:
        self.collectives: list[Collective] = []

    def add(
        self,
        op: str,
        size: float,
        group: Group,
        phase: str,
        what: str,
        *,
        times: int = 1,
        overlaps: bool = False,
    ) -> None:
        if group.ranks > 1:
            collective = Collective(op, size, group.ranks, group.scope, phase, what, overlaps)
            self.collectives.extend([collective] * times)


def step_collectives(
    facts: ModelFacts,
    dims: ParallelDims,
    workload: Workload,
    *,
    guard: bool = True,
    clip: bool = True,
    gpu: bool = True,
) -> list[Collective]:
    """Every collective rank 0 issues in one optimizer step of this layout, in groups of more
    than one rank (a one-rank group moves nothing). ``guard``: train.on_nonfinite is not off
    (one small all-reduce a step); ``clip``: train.max_grad_norm > 0; ``gpu``: GPU ranks, where
    DeepSpeed overlaps ZeRO-2/3's communication with the backward (overlap_comm,
    rendering/deepspeed_config.py).

    Per layout (m micro-batches a step, b × s tokens each, h hidden, e bytes an element of the
    compute dtype, g bytes of a gradient as it is reduced, Ψ the trained parameters):

    - DDP (and LoRA, and sequence parallelism, both on DDP): one broadcast of the model's buffers
      (the rotary frequencies) in the step's first forward; the gradients all-reduced once a step
      in buckets of 100 MiB, all but the last overlapping the backward;
    - ZeRO-1: the gradients all-reduced once a step, ZeRO-2 every micro-batch (in buckets of
      200 M elements); two 4-byte all-reduces (gradient norm, overflow); the updated weights
      all-gathered, one flat buffer per parameter group (decay, no decay);
    - ZeRO-3: every micro-batch, the partitioned weights (those of 100 k elements or more;
      smaller ones persist whole) all-gathered in prefetch buckets of 50 M elements — again in
      the backward only when the stage holds more than DeepSpeed's 1 G live parameters — and
      the gradients reduce-scattered; after the step two 8-byte all-reduces and one all-gather
      of every persistent trained tensor;
    - FSDP2: every micro-batch the root unit (embeddings, final norm, head) all-gathered once,
      each decoder block all-gathered in the forward and again in the backward, every unit's
      gradients reduce-scattered (each tensor's first dimension padded to a multiple of the
      shard group); HSDP then all-reduces each reduced shard across the nodes; with clipping (or
      the guard judging the gradient norm), one all-reduce of a float per parameter tensor over
      the shard group;
    - tensor parallelism (AutoTP): per micro-batch and layer, an all-reduce of b·s·h·e after
      each row-parallel layer in the forward and of the input gradient of each column-parallel
      layer in the backward; a split head all-gathers its logits (vocabulary padded to tp);
    - pipeline: per micro-batch, the activations (with their metadata and the attention mask)
      sent forward and their gradient sent back; after the step a 4-byte all-reduce of the
      gradient norm over the pipeline and the loss broadcast (8 bytes);
    - sequence parallelism (Ulysses): per micro-batch and layer, the position ids all-gathered
      and four all-to-alls in the forward (Q, K, V, the output) and four in the backward;
    - the non-finite guard: one all-reduce of world + 1 floats (the pipeline's too: its engine
      judges the step inside it, after DeepSpeed stepped).
    """
    count = _count(facts, workload.task, workload.num_labels)
    mesh = Mesh(dims.dp, dims.tp, dims.pp, dims.sp)
    m = workload.accumulation_steps(dims.dp) or 1
    e = _element(workload.mixed_precision)
    trained = model_weights(facts, workload.task, workload.num_labels, workload.lora)
    every = model_weights(facts, workload.task, workload.num_labels)
    everyone = Group(dims.world_size, _scope([list(range(dims.world_size))], dims.gpus_per_node))
    # DeepSpeed and DDP average over dp × sp ranks (sp groups are consecutive ranks)
    data_groups = mesh.data_parallel_groups() if dims.sp == 1 else [list(range(dims.world_size))]
    data = Group(dims.dp * dims.sp, _scope(data_groups, dims.gpus_per_node))
    step = StepCollectives()
    if dims.fsdp is not None:
        # the engine takes the gradient norm to clip, or for the guard to judge (not under fp16,
        # whose overflows are the scaler's)
        norm = clip or (guard and workload.mixed_precision != "fp16")
        _fsdp_collectives(step, dims, count, every, trained, e, m, norm)
    elif dims.pp > 1:
        _pipeline_collectives(step, dims, count, workload, (every, trained), data)
    elif dims.zero_stage > 0 or dims.tp > 1:
        if dims.tp > 1:
            _tensor_parallel_collectives(step, facts, count, dims, workload, m)
        shard = [_tp_weight(w, count, dims.tp) for w in every]
        trained_shard = [_tp_weight(w, count, dims.tp) for w in trained]
        _zero_collectives(
            step, dims, shard, trained_shard, workload, data, Group(dims.tp), overlap=gpu
        )
    else:
        _ddp_collectives(step, facts, count, trained, data)
    if dims.sp > 1:
        _ulysses_collectives(step, facts, count, dims, workload, m)
    if guard:
        step.add("all_reduce", 4 * (dims.world_size + 1), everyone, "step", "non-finite guard")
    return step.collectives


def _pipeline_collectives(step, dims, count, workload, weights, data) -> None:
    """Per micro-batch the activations sent forward and their gradient back; stage 0's DeepSpeed
    collectives (WEIGHTS: every tensor, the trained ones); the loss broadcast to every stage."""
    mesh = Mesh(dims.dp, dims.tp, dims.pp, dims.sp)
    pipe = Group(dims.pp, _scope(mesh.pipelines(), dims.gpus_per_node))
    b, s = workload.micro_batch, workload.seq_len
    activation = b * s * count.hidden_size * _element(workload.mixed_precision)
    for _ in range(workload.accumulation_steps(dims.dp) or 1):
        step.add("send", PIPELINE_META_BYTES, Group(2, pipe.scope), "forward", "metadata")
        step.add("send", activation, Group(2, pipe.scope), "forward", "activations")
        step.add("send", b * s * 8, Group(2, pipe.scope), "forward", "attention mask")
        step.add("recv", activation, Group(2, pipe.scope), "backward", "their gradient")
    # rank 0 is stage 0: the embedding and the first stage's layers
    first = layers_per_stage(count.num_layers, dims.pp)[0]

    def stage_0(weights: list[Weight]) -> list[Weight]:
        return [
            w for w in weights if w.side == "embedding" or (w.layer is not None and w.layer < first)
        ]

    every, trained = weights
    _zero_collectives(step, dims, stage_0(every), stage_0(trained), workload, data, pipe)
    step.add("broadcast", 8, pipe, "step", "pipeline: the loss to every stage")


def _ddp_collectives(step, facts, count, trained, data) -> None:
    """DDP: the model's buffers broadcast in the first forward; the gradients all-reduced in
    buckets, all but the last overlapping the backward."""
    if facts.model_type in LLAMA_LIKE:
        # the rotary frequencies and their original copy (fp32 buffers), once a step
        step.add("broadcast", 4 * _head_dim(facts, count), data, "forward", "DDP buffers")
    # DDP's gradients are fp32, as its weights
    buckets = _buckets([w.numel * 4 for w in trained], DDP_BUCKET_BYTES)
    for i, size in enumerate(buckets):
        last = i == len(buckets) - 1
        step.add("all_reduce", size, data, "backward", "DDP buckets", overlaps=not last)


def _ulysses_collectives(step, facts, count, dims, workload, m) -> None:
    """Per micro-batch and layer: the position ids gathered, Q, K, V and the output exchanged
    (sequence slices of every head ↔ whole sequences of heads/sp) and back in the backward."""
    group = Group(dims.sp)
    b, s, e = workload.micro_batch, workload.seq_len, _element(workload.mixed_precision)
    heads, kv_heads = count.num_heads, max(count.num_kv_heads, 1)
    slice_bytes = b * s // dims.sp * _head_dim(facts, count) * e
    exchange = [heads, kv_heads, kv_heads, heads]
    for _ in range(m):
        for _layer in range(count.num_layers):
            step.add("all_gather", b * s * 8, group, "forward", "Ulysses position ids")
            for n in exchange:
                step.add("all_to_all", slice_bytes * n, group, "forward", "Ulysses exchange")
        for _layer in range(count.num_layers):
            for n in reversed(exchange):
                step.add("all_to_all", slice_bytes * n, group, "backward", "Ulysses gradients")


def _tp_weight(weight: Weight, count: ParameterCount, tp: int) -> Weight:
    """A tensor as tensor-parallel rank 0 holds it: AutoTP splits the decoder's linear layers
    and a split head, column-parallel ones by rows, row-parallel ones (wider than tall) by
    columns; rank 0 takes the larger part of an uneven split."""
    split = (
        weight.layer is not None
        and weight.cols > 1
        or (weight.side == "head" and weight.cols > 1 and bool(count.head_sharded))
    )
    if tp == 1 or not split:
        return weight
    if weight.rows >= weight.cols:
        return replace(weight, rows=math.ceil(weight.rows / tp))
    return replace(weight, cols=math.ceil(weight.cols / tp))


def _tensor_parallel_collectives(step, facts, count, dims, workload, m) -> None:
    """AutoTP, per micro-batch: an all-reduce of b·s·h·e after every row-parallel layer (forward)
    and of every column-parallel layer's input gradient (backward); a split head gathers its
    logits (vocabulary padded to tp) and all-reduces its input gradient."""
    b, s, e = workload.micro_batch, workload.seq_len, _element(workload.mixed_precision)
    activation = b * s * count.hidden_size * e
    modules = _modules(facts, workload.task, workload.num_labels)
    layer_0 = [mod for mod in modules if mod.layer == 0 and mod.shape is not None]
    rows = sum(_role(mod.path) in ("attention_out", "mlp_out") for mod in layer_0)
    columns = sum(_role(mod.path) in ("attention_in", "mlp_in") for mod in layer_0)
    split_head = bool(count.head_sharded) and not task_of(workload.task).classifies
    vocab = math.ceil(count.vocab_size / dims.tp) * dims.tp
    group = Group(dims.tp)
    forward, backward = rows * count.num_layers, columns * count.num_layers
    for _ in range(m):
        step.add("all_reduce", activation, group, "forward", "TP row outputs", times=forward)
        if split_head:
            step.add("all_gather", b * s * vocab * e, group, "forward", "TP logits")
            step.add("all_reduce", activation, group, "backward", "TP head input gradient")
        step.add("all_reduce", activation, group, "backward", "TP input gradients", times=backward)


def _zero_collectives(
    step, dims, every, trained, workload, data, model_parallel, overlap=False
) -> None:
    """DeepSpeed's data-parallel collectives over the DATA group: stage 0's (with tp or pp) and
    ZeRO-1/2/3's. EVERY and TRAINED: the tensors this rank holds (its tensor-parallel shard, its
    pipeline stage); each gradient norm is all-reduced over DATA, then the MODEL_PARALLEL group.
    ``overlap``: overlap_comm, ZeRO-2's reductions and ZeRO-3's prefetched gathers and
    reduce-scatters run beside the computation."""
    e = _element(workload.mixed_precision)
    m = workload.accumulation_steps(dims.dp) or 1
    # bf16 runs reduce in fp32 (rendered communication_data_type); fp16 in 16 bits
    g = 2 if workload.mixed_precision == "fp16" else 4
    stage = dims.zero_stage
    local = sum(w.numel for w in trained)

    def norm(times: int, size: int = 4) -> None:
        for _ in range(times):
            step.add("all_reduce", size, data, "step", "gradient norm (data parallel)")
            step.add("all_reduce", size, model_parallel, "step", "gradient norm (tp/pp)")

    if stage == 0:
        for size in _pieces(local, 500_000_000):
            step.add("all_reduce", size * g, data, "step", "DeepSpeed gradient all-reduce")
        norm(1)
        return
    if stage in (1, 2):
        for _ in range(1 if stage == 1 else m):  # ZeRO-2 reduces every micro-batch
            for size in _pieces(local, BUCKET_SIZE):
                hides = overlap and stage == 2  # ZeRO-1 reduces after the last backward
                step.add(
                    "all_reduce",
                    size * g,
                    data,
                    "backward",
                    f"ZeRO-{stage} gradients",
                    overlaps=hides,
                )
        norm(2)
        groups = [sum(w.numel for w in trained if w.decays)]
        groups.append(sum(w.numel for w in trained if not w.decays))
        align = 2 * data.ranks  # DeepSpeed pads each flat group to this
        for numel in (n for n in groups if n):
            for size in _pieces(math.ceil(numel / align) * align, BUCKET_SIZE):
                step.add("all_gather", size * e, data, "step", f"ZeRO-{stage} updated weights")
        return
    persistent = [w for w in every if w.numel < ZERO3_PERSISTENCE_THRESHOLD]
    partitioned = sum(w.numel for w in every) - sum(w.numel for w in persistent)
    again = partitioned > ZERO3_MAX_LIVE_PARAMETERS
    for _ in range(m):
        for size in _pieces(partitioned, ZERO3_PREFETCH_ELEMENTS) if partitioned else []:
            step.add("all_gather", size * e, data, "forward", "ZeRO-3 weights", overlaps=overlap)
            if again:
                step.add(
                    "all_gather",
                    size * e,
                    data,
                    "backward",
                    "ZeRO-3 weights again",
                    overlaps=overlap,
                )
        for size in _pieces(local, BUCKET_SIZE):
            step.add(
                "reduce_scatter", size * g, data, "backward", "ZeRO-3 gradients", overlaps=overlap
            )
    norm(2, 8)
    names = {w.name for w in trained}
    for weight in persistent:
        if weight.name in names:
            step.add("all_gather", weight.numel * e, data, "step", "ZeRO-3 persistent weights")


def _fsdp_collectives(step, dims, count, every, trained, e, m, norm) -> None:
    """FSDP2 units: the root (embeddings, final norm, head) and each decoder block."""
    shard = dims.world_size if dims.fsdp == "full" else min(dims.gpus_per_node, dims.world_size)
    shard_groups, replicate_groups = fsdp_groups(dims.world_size, shard)
    sharded = Group(shard, _scope(shard_groups, dims.gpus_per_node))
    replicas = Group(dims.world_size // shard, _scope(replicate_groups, dims.gpus_per_node))

    def padded(weights: list[Weight]) -> int:
        return sum(math.ceil(w.rows / shard) * shard * w.cols for w in weights)

    lora = any(".lora_" in w.name for w in trained)
    units = [[w for w in every if w.layer is None]]
    units += [[w for w in every if w.layer == layer] for layer in range(count.num_layers)]
    if lora:
        # peft puts each adapter beside its layer: a block's unit holds its adapters too
        units = [u + [w for w in trained if w.layer == u[0].layer] for u in units if u]
    saved = {w.name for w in trained}

    def gradients(unit: list[Weight]) -> list[Weight]:
        return [w for w in unit if w.name in saved]

    root, blocks = units[0], units[1:]
    for _ in range(m):
        step.add("all_gather", padded(root) * e, sharded, "forward", "FSDP2 root unit")
        for unit in blocks:
            step.add(
                "all_gather", padded(unit) * e, sharded, "forward", "FSDP2 block", overlaps=True
            )
        for unit in [*reversed(blocks), root]:
            if unit is not root:
                step.add(
                    "all_gather",
                    padded(unit) * e,
                    sharded,
                    "backward",
                    "FSDP2 block again",
                    overlaps=True,
                )
            # gradients are reduced in fp32 (MixedPrecisionPolicy reduce_dtype)
            reduced = padded(gradients(unit)) * 4
            hides = unit is not root
            step.add(
                "reduce_scatter", reduced, sharded, "backward", "FSDP2 gradients", overlaps=hides
            )
            step.add(
                "all_reduce",
                reduced / shard,
                replicas,
                "backward",
                "HSDP across nodes",
                overlaps=hides,
            )
    if norm:
        # each tensor's norm is partial over its shards only: the replicas hold the same
        tensors = sum(len(gradients(unit)) for unit in units)
        step.add("all_reduce", 4 * tensors, sharded, "step", "FSDP2 gradient norms")


# ---------------------------------------------------------------------------------------------
# overhead: what an engine spends besides its FLOPs and collectives


@dataclass(frozen=True)
class Overheads:
    """The seconds one engine family spends besides FLOPs and collectives, per unit of what causes
    them (:func:`overhead_counts` gives a layout's units). `dplaunch calibrate` measures them in
    short real steps of each family (planning/overhead_fit.py); a profile without them takes
    :func:`default_overheads`.

    On CPU ranks every second adds to the step. On a GPU the host's work (dispatch, hooks) runs
    ahead of the device: a forward or backward takes the longer of the two, and only what the
    host spends beyond the device's time shows; the optimizer step's overhead adds (the loop waits
    for the device there), and so do ZeRO-1/2's gradient copies, which are device work."""

    # forward, every micro-batch: the engine's fixed work (the batch to the device, its hooks'
    # entry), per parameter tensor of the rank (the dispatch of the ops that use it, on a GPU
    # their kernel launches; ZeRO-3's fetch and release of it, FSDP2's unit hooks), and per byte
    # of the weights it runs (ZeRO-3 and FSDP2 copy every gathered weight in and out)
    forward_s: float = 0.0
    forward_tensor_s: float = 0.0
    forward_byte_s: float = 0.0
    # backward, every micro-batch: fixed; per parameter tensor (its backward ops' dispatch, the
    # gradient hooks DDP and ZeRO hang on the trained ones); per byte of trained gradient
    # (ZeRO-1/2 copy every gradient into their reduce buckets, average it, add it to the rank's
    # partition)
    backward_s: float = 0.0
    backward_tensor_s: float = 0.0
    backward_byte_s: float = 0.0
    # the optimizer step, once: the loop's own work (zeroing, the schedule, the guard's verdict,
    # DeepSpeed's step bookkeeping), and per trained tensor (AdamW, clipping and zeroing walk the
    # tensors one by one; the per-parameter rate is the optimizer term's)
    step_s: float = 0.0
    step_tensor_s: float = 0.0
    # Ulysses (sp > 1), every micro-batch, forward and backward alike: per all-to-all, and per
    # byte it exchanges (q, k, v and the attention output are permuted into contiguous copies
    # before it and after it)
    exchange_s: float = 0.0
    exchange_byte_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        """The non-zero coefficients (a profile's ``overheads`` entry)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Overheads:
        """Inverse of to_dict; keys it does not know (a newer dplaunch's) are left out."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in data.items() if k in names})


# the families `dplaunch calibrate` steps, each with its own engine code (train/engines.py,
# fsdp.py, sequence_parallel.py); "ulysses" holds only the exchange terms, added to any family
# when sp > 1
ENGINE_FAMILIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "ulysses")
# a family calibrate does not step takes the nearest one measured: ZeRO-1 and ZeRO-2 run the
# same hooks; DeepSpeed's stage 0 (AutoTP) and the pipeline hang none on the gradients
NEAREST_FAMILY = {
    "zero1": "zero2",
    "zero2": "zero1",
    "deepspeed": "ddp",
    "pipeline": "ddp",
}
# Defaults, for a profile without measured overheads. CPU ranks: from the phases of the forecast
# benchmark on a quiet 2-core AMD EPYC (2026-12-05, benchmarks/results/forecast.json, llama-13m,
# 39 tensors, 2 micro-batches a step): ZeRO-1/2's backward 0.17 s a micro-batch over DDP's for
# 52 MB of fp32 gradients (3.3 ns a byte), ZeRO-3 0.44 s (forward) and 0.63 s (backward) a step
# over DDP's (about 5.6 and 8 ms a tensor and micro-batch), FSDP2 about 2 ms a tensor, sp 2's
# forward 0.09 s over its forecast for 32 all-to-alls. GPUs: a kernel launch and its dispatch
# (~10 µs), two ops a tensor forward and four backward; ZeRO-3's fetch and release (~150 µs a
# tensor, its stream waits), DeepSpeed's gradient hooks (~50 µs), FSDP2's (~30 µs a tensor).
_CPU_BASE = Overheads(
    forward_tensor_s=1e-4, backward_tensor_s=2e-4, step_s=5e-3, step_tensor_s=5e-5
)
_GPU_BASE = Overheads(
    forward_tensor_s=2e-5, backward_tensor_s=4e-5, step_s=2e-3, step_tensor_s=5e-6
)
_CPU_EXTRA = {
    "zero1": Overheads(backward_byte_s=3.3e-9, step_s=5e-3),
    "zero2": Overheads(backward_byte_s=3.3e-9, step_s=5e-3),
    "zero3": Overheads(forward_tensor_s=5.6e-3, backward_tensor_s=8e-3, step_s=5e-3),
    "fsdp": Overheads(forward_tensor_s=1e-3, backward_tensor_s=1e-3),
    "ulysses": Overheads(exchange_s=2.8e-3),
}
_GPU_EXTRA = {
    "zero1": Overheads(backward_tensor_s=5e-5, step_s=2e-3),
    "zero2": Overheads(backward_tensor_s=5e-5, step_s=2e-3),
    "zero3": Overheads(forward_tensor_s=1.5e-4, backward_tensor_s=1.5e-4, step_s=2e-3),
    "fsdp": Overheads(forward_tensor_s=3e-5, backward_tensor_s=3e-5),
    "ulysses": Overheads(exchange_s=5e-5),
}


def engine_family(dims: ParallelDims) -> str:
    """The engine family whose overheads a layout pays: ddp, zero1, zero2, zero3, fsdp,
    deepspeed (stage 0 with tp), pipeline."""
    if dims.fsdp is not None:
        return "fsdp"
    if dims.pp > 1:
        return "pipeline"
    if dims.zero_stage > 0:
        return f"zero{dims.zero_stage}"
    return "deepspeed" if dims.tp > 1 else "ddp"


def default_overheads(profile: Profile, family: str) -> Overheads:
    """DEFAULTS for FAMILY on PROFILE's kind of device (see _CPU_EXTRA and _GPU_EXTRA); on a GPU
    the copies of ZeRO's and FSDP2's buckets (gradients; ZeRO-3's and FSDP2's gathered weights
    too): two passes over the bytes at 70 % of its memory bandwidth."""
    cpu = _cpu(profile)
    base, extra = (_CPU_BASE, _CPU_EXTRA) if cpu else (_GPU_BASE, _GPU_EXTRA)
    family = family if family in extra or family == "ddp" else NEAREST_FAMILY.get(family, "ddp")
    if family == "ulysses":
        return extra["ulysses"]
    more = extra.get(family, Overheads())
    terms = {f.name: getattr(base, f.name) + getattr(more, f.name) for f in fields(Overheads)}
    if not cpu and family in ("zero1", "zero2", "zero3", "fsdp"):
        sheet = GPU_SHEETS.get(gpu_sheet_name(profile.device) or "")
        copy = 2 / (0.7 * (sheet.memory_bytes_per_s if sheet else 2e12))
        terms["backward_byte_s"] = copy  # gradients into the reduce buckets
        if family in ("zero3", "fsdp"):
            terms["forward_byte_s"] = copy  # gathered weights out of the all-gather's buffer
    return Overheads(**terms)


def measured_overheads(profile: Profile) -> dict[str, Overheads]:
    """The overheads `dplaunch calibrate` measured, by family ({} for an older profile or a
    datasheet's)."""
    return {family: Overheads.from_dict(terms) for family, terms in profile.overheads.items()}


def overheads_for(profile: Profile, family: str) -> tuple[Overheads, bool]:
    """(FAMILY's overheads on PROFILE, whether measured): its own measurement, the nearest
    family's, else the defaults."""
    measured = measured_overheads(profile)
    for name in (family, NEAREST_FAMILY.get(family)):
        if name in measured:
            return measured[name], True
    return default_overheads(profile, family), False


def _cpu(profile: Profile) -> bool:
    return profile.device.upper().startswith("CPU")


@dataclass(frozen=True)
class OverheadCounts:
    """What a layout's overheads are counted in, on its busiest rank, per step."""

    micro_batches: int
    # parameter tensors the rank runs (its pipeline stage's; LoRA's adapters with the base)
    tensors: float
    # of them, those that train
    trained_tensors: float
    # bytes of the rank's trained gradients (its tensor-parallel shard), one micro-batch's
    gradient_bytes: float
    # bytes of the weights the rank runs (its stage, its tensor-parallel shard), once
    weight_bytes: float = 0.0
    # Ulysses, one micro-batch's forward (its backward exchanges as much): all-to-alls, bytes
    exchanges: float = 0.0
    exchange_bytes: float = 0.0


def overhead_counts(facts: ModelFacts, dims: ParallelDims, workload: Workload) -> OverheadCounts:
    """The counts of :class:`Overheads`' units for this layout and workload."""
    task, labels = workload.task, workload.num_labels
    count = _count(facts, task, labels)
    every = model_weights(facts, task, labels)
    trained = model_weights(facts, task, labels, workload.lora)
    adapters = [w for w in trained if ".lora_" in w.name]
    stage_layers = max(layers_per_stage(count.num_layers, dims.pp))

    def on_stage(weights: Any) -> float:
        # the busiest stage: its share of the layers and the larger of the two ends
        inside = sum(1 for w in weights if w.layer is not None)
        ends = [sum(1 for w in weights if w.layer is None and w.side == s) for s in SIDES]
        return inside * stage_layers / max(count.num_layers, 1) + (
            sum(ends) if dims.pp == 1 else max(ends)
        )

    element = _element(workload.mixed_precision)
    gradient = sum(_tp_weight(w, count, dims.tp).numel for w in trained) * element
    weight = sum(_tp_weight(w, count, dims.tp).numel for w in (*every, *adapters)) * element
    if dims.pp > 1:
        gradient *= stage_layers / max(count.num_layers, 1)
        weight *= stage_layers / max(count.num_layers, 1)
    exchanges = exchange_bytes = 0.0
    if dims.sp > 1:
        exchanges = 4.0 * count.num_layers
        b, s = workload.micro_batch * workload.rows_per_sample, workload.seq_len
        heads, kv_heads = count.num_heads, max(count.num_kv_heads, 1)
        exchange_bytes = (
            b * s / dims.sp * _head_dim(facts, count) * element * 2 * (heads + kv_heads)
        ) * count.num_layers
    return OverheadCounts(
        micro_batches=workload.accumulation_steps(dims.dp) or 1,
        tensors=on_stage(every) + on_stage(adapters),
        trained_tensors=on_stage(trained),
        gradient_bytes=gradient,
        weight_bytes=weight,
        exchanges=exchanges,
        exchange_bytes=exchange_bytes,
    )


SIDES = ("embedding", "layer", "head")


@dataclass(frozen=True)
class PhaseOverhead:
    """A phase's overhead seconds: on the host (dispatch, hooks), and on the device."""

    host: float = 0.0
    device: float = 0.0


# the coefficients the device pays (the others are the host's work): copies
DEVICE_TERMS = ("forward_byte_s", "backward_byte_s")
EXCHANGE_TERMS = ("exchange_s", "exchange_byte_s")


def overhead_units(counts: OverheadCounts) -> dict[str, dict[str, float]]:
    """Each phase's Overheads coefficient → how many of its units a step holds."""
    m = counts.micro_batches
    exchange = {"exchange_s": m * counts.exchanges, "exchange_byte_s": m * counts.exchange_bytes}
    return {
        "forward": {
            "forward_s": m,
            "forward_tensor_s": m * counts.tensors,
            "forward_byte_s": m * counts.weight_bytes,
            **exchange,
        },
        "backward": {
            "backward_s": m,
            "backward_tensor_s": m * counts.tensors,
            "backward_byte_s": m * counts.gradient_bytes,
            **exchange,
        },
        "step": {"step_s": 1.0, "step_tensor_s": counts.trained_tensors},
    }


def overhead_seconds(
    counts: OverheadCounts, terms: Overheads, exchange: Overheads | None = None
) -> dict[str, PhaseOverhead]:
    """Each phase's overhead: TERMS × COUNTS' units (EXCHANGE: Ulysses' terms, when sp > 1)."""
    parts = {}
    for phase, units in overhead_units(counts).items():
        host = device = 0.0
        for name, units_of in units.items():
            source = exchange if name in EXCHANGE_TERMS else terms
            seconds = (getattr(source, name) if source is not None else 0.0) * units_of
            if name in DEVICE_TERMS:
                device += seconds
            else:
                host += seconds
        parts[phase] = PhaseOverhead(host=host, device=device)
    return parts


def visible_overhead(phase: str, overhead: PhaseOverhead, device_s: float, gpu: bool) -> float:
    """The seconds a phase's OVERHEAD adds to its DEVICE_S: all of it on CPU ranks; on a GPU the
    host's forward and backward work only where it outlasts the device's (it runs ahead)."""
    if not gpu or phase == "step":
        return overhead.host + overhead.device
    return overhead.device + max(0.0, overhead.host - device_s - overhead.device)


# ---------------------------------------------------------------------------------------------
# time


@dataclass(frozen=True)
class Forecast:
    """One layout's step on one profile: the terms (seconds), and what follows from them."""

    step_time_s: float
    terms: dict[str, float]
    tokens_per_step: float
    model_flops_per_step: float
    world_size: int
    peak_flops_per_rank: float
    profile: str
    # the phases the run times itself (train/phase_clock.py): forward, backward and step, each
    # split into its terms (compute and communication; optimizer, offload and communication)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    collectives: tuple[Collective, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization: the model's FLOPs per second over the ranks' peak."""
        return self.model_flops_per_step / (
            self.step_time_s * self.world_size * self.peak_flops_per_rank
        )

    def traffic(self) -> dict[str, float]:
        """Bytes of each collective op in the step (sends and receives together)."""
        bytes_by_op: dict[str, float] = {}
        for collective in self.collectives:
            op = "send" if collective.op == "recv" else collective.op
            bytes_by_op[op] = bytes_by_op.get(op, 0.0) + collective.bytes
        return bytes_by_op

    def hours(self, steps: int | None) -> float | None:
        return None if steps is None else self.step_time_s * steps / 3600

    def gpu_hours(self, steps: int | None) -> float | None:
        hours = self.hours(steps)
        return None if hours is None else hours * self.world_size

    def to_dict(
        self, steps: int | None = None, price_per_gpu_hour: float | None = None, job: Any = None
    ) -> dict:
        """The keys `dplaunch plan --json` and plan.json carry: hours and GPU-hours to STEPS, or
        JOB's (planning/job_time.py JobTime: the steps with start-up, evaluation and
        checkpoints; its parts under "job_s")."""
        hours = job.hours if job is not None else self.hours(steps)
        gpu_hours = None if hours is None else hours * self.world_size
        data = {
            "step_time_s": round(self.step_time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "mfu": round(self.mfu, 5),
            "hours": None if hours is None else round(hours, 4),
            "gpu_hours": None if gpu_hours is None else round(gpu_hours, 4),
            "profile": self.profile,
            "terms_s": {name: round(value, 6) for name, value in self.terms.items()},
            "phases_s": {
                phase: {term: round(value, 6) for term, value in parts.items()}
                for phase, parts in self.phases.items()
            },
            "model_flops_per_step": self.model_flops_per_step,
            "peak_flops_per_rank": self.peak_flops_per_rank,
            "world_size": self.world_size,
        }
        if job is not None:
            data["job_s"] = job.to_dict()
        if price_per_gpu_hour is not None and gpu_hours is not None:
            data["cost"] = round(gpu_hours * price_per_gpu_hour, 2)
        return data


# measured and forecast step times further apart than this: the run says which term was most wrong
OFF_BY = 0.25


def mfu(forecast: dict[str, Any], step_time_s: float) -> float:
    """MFU of a measured step, from plan.json's forecast (its FLOPs, ranks and peak)."""
    return forecast["model_flops_per_step"] / (
        step_time_s * forecast["world_size"] * forecast["peak_flops_per_rank"]
    )


def compare_with_forecast(
    forecast: dict[str, Any],
    measured_step_s: float,
    measured_phases: dict[str, float] | None = None,
    joined: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The end-of-run record of measured against forecast: both step times and their ratio
    (measured / forecast); when more than OFF_BY apart, the term that was most wrong and a line
    that says so. ``joined``: phases the engine timed as one (DeepSpeed steps inside
    Accelerate's backward), joined in the forecast too."""
    predicted = forecast["step_time_s"]
    ratio = measured_step_s / predicted
    result: dict[str, Any] = {
        "step_time_s": round(measured_step_s, 6),
        "forecast_step_time_s": predicted,
        "forecast_ratio": round(ratio, 4),
    }
    if measured_phases:
        result["phases_s"] = {phase: round(s, 6) for phase, s in measured_phases.items()}
        if joined:  # `dplaunch report` compares them as the line below does
            result["phases_joined"] = list(joined)
    if measured_phases and joined:
        forecast, measured_phases = join_phases(forecast, measured_phases, joined)
    if abs(ratio - 1) > OFF_BY:
        term, detail = most_wrong_term(forecast, measured_step_s, measured_phases)
        result["forecast_most_wrong"] = term
        result["forecast_note"] = (
            f"the forecast was {ratio:.2f}× off ({predicted:.3g} s/step forecast, "
            f"{measured_step_s:.3g} s measured): {term} was the most wrong term ({detail})"
        )
    return result


def join_phases(
    forecast: dict[str, Any], measured: dict[str, float], joined: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, float]]:
    """FORECAST and MEASURED with the JOINED phases as one ("backward and step")."""
    name = " and ".join(joined)
    parts: dict[str, float] = {}
    for phase in joined:
        for term, seconds in forecast["phases_s"].get(phase, {}).items():
            parts[term] = parts.get(term, 0.0) + seconds
    phases = {p: v for p, v in forecast["phases_s"].items() if p not in joined}
    together = {p: v for p, v in measured.items() if p not in joined}
    together[name] = sum(measured.get(phase, 0.0) for phase in joined)
    return {**forecast, "phases_s": {**phases, name: parts}}, together


def most_wrong_term(
    forecast: dict[str, Any], measured_step_s: float, measured_phases: dict[str, float] | None
) -> tuple[str, str]:
    """(term, why): the phase whose measured seconds are furthest from its forecast (forward,
    backward, step), and in it the term the forecast gave the most time; without timed phases
    (the pipeline's step is one call) the largest term."""
    phases = forecast.get("phases_s") or {}
    if measured_phases and phases and set(phases) <= set(measured_phases):
        errors = {p: measured_phases[p] - sum(parts.values()) for p, parts in phases.items()}
        phase = max(errors, key=lambda p: abs(errors[p]))
        parts = phases[phase]
        term = max(parts, key=lambda name: parts[name])
        return term, (
            f"the {phase} took {measured_phases[phase]:.3g} s a step, forecast "
            f"{sum(parts.values()):.3g} s, {parts[term]:.3g} s of it {term}"
        )
    terms = forecast["terms_s"]
    term = max(terms, key=lambda name: terms[name])
    return term, (
        f"its phases were not timed; {term} is the largest term, {terms[term]:.3g} s of "
        f"{forecast['step_time_s']:.3g}"
    )


def why_faster(faster: Forecast, slower: Forecast) -> str:
    """Why FASTER beats SLOWER, in a few words: the term that differs most ("40 % less
    all-gather traffic", "no pipeline bubble", "no CPU offload", "25 % less compute")."""
    gaps = {term: slower.terms.get(term, 0.0) - faster.terms.get(term, 0.0) for term in TERMS}
    term = max(gaps, key=lambda name: gaps[name])
    if term == "communication":
        mine, theirs = faster.traffic(), slower.traffic()
        op = max(theirs, key=lambda name: theirs[name] - mine.get(name, 0.0), default=None)
        if op is None:
            return "less communication"
        words = op.replace("_", "-")
        if mine.get(op, 0.0) < 0.01 * theirs[op]:  # a few bytes of norms are no traffic
            return f"no {words} traffic"
        return f"{1 - mine[op] / theirs[op]:.0%} less {words} traffic"
    if term == "bubble":
        return "no pipeline bubble" if not faster.terms["bubble"] else "a smaller pipeline bubble"
    if term == "offload":
        return "no CPU offload" if not faster.terms["offload"] else "less CPU offload"
    share = 1 - faster.terms[term] / slower.terms[term] if slower.terms[term] else 1.0
    words = {"compute": "compute", "optimizer": "optimizer time", "overhead": "engine overhead"}
    return f"{share:.0%} less {words[term]}"


def seconds_apart(a: float, b: float) -> tuple[str, str]:
    """A and B with the fewest significant digits (3 or more) that tell them apart."""
    for digits in range(3, 8):
        left, right = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if left != right:
            return left, right
    return left, right


def compute_seconds(
    flops: Flops,
    profile: Profile,
    dtype: str,
    hidden: float,
    tokens: float,
    seq_len: int,
    kernel: str,
) -> tuple[float, float]:
    """(forward, backward + recompute) seconds of FLOPS: the matrix products at the profile's
    dense rate for (hidden, tokens), the attention scores at its kernel's rate for seq_len."""
    dense = profile.dense_rate(dtype, int(hidden), int(max(tokens, 1)))
    attention = profile.attention_rate(kernel, dtype, seq_len, int(hidden))
    forward = flops.dense_forward / dense + flops.attention_forward / attention
    backward = (flops.dense_backward + flops.dense_recompute) / dense + (
        flops.attention_backward + flops.attention_recompute
    ) / attention
    return forward, backward


def communication_seconds(
    collectives: list[Collective], profile: Profile, forward_s: float, backward_s: float
) -> dict[str, float]:
    """Exposed seconds of the step's collectives per phase: a collective that ``overlaps`` hides
    behind its phase's computation, at most the profile's ``overlap`` of it."""
    total = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    hideable = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    for collective in collectives:
        seconds = collective.seconds(profile)
        total[collective.phase] += seconds
        if collective.overlaps:
            hideable[collective.phase] += seconds
    compute = {"forward": forward_s, "backward": backward_s, "step": 0.0}
    return {
        phase: total[phase] - profile.overlap * min(hideable[phase], compute[phase])
        for phase in total
    }


def pipeline_seconds(stage_s: float, micro_batches: int, pp: int) -> tuple[float, float]:
    """(compute, bubble) of a 1F1B pipeline step: m micro-batches of a stage, then (pp − 1) more
    stage times while the pipeline fills and drains: the bubble is (pp−1)/(m+pp−1) of the step."""
    return micro_batches * stage_s, (pp - 1) * stage_s


def optimizer_seconds(params: float, profile: Profile) -> float:
    """AdamW (with gradient clipping and zeroing) over the PARAMS this rank updates."""
    return params * profile.optimizer_s_per_param


def offload_seconds(
    params: float, element: int, profile: Profile, offload: str, held: float
) -> float:
    """ZeRO-Offload: the rank's fp32 gradient partition to the host, DeepSpeed's CPU Adam over
    it, the updated weights back (element bytes each); offload "all" also fetches the HELD
    weights for the forward and again for the backward."""
    if offload == "none":
        return 0.0
    copies = params * (4 + element)
    if offload == "all":
        copies += 2 * held * element
    return copies / profile.host_device_bytes_per_s + params * profile.cpu_adam_s_per_param


def forecast_step(
    facts: ModelFacts,
    dims: ParallelDims,
    workload: Workload,
    profile: Profile,
    *,
    guard: bool = True,
    clip: bool = True,
    overheads: bool = True,
) -> Forecast:
    """The forecast of one optimizer step of DIMS for WORKLOAD (workload.Workload) on PROFILE;
    ``overheads`` False: the FLOPs and collectives alone (what calibrate's fit starts from)."""
    count = _count(facts, workload.task, workload.num_labels)
    dtype = DTYPES.get(workload.mixed_precision, "fp32")
    kernel = attention_implementation(facts.model_type, workload.attn_implementation)
    m = workload.accumulation_steps(dims.dp) or 1
    # dpo: a micro-batch's pairs are two rows each (chosen, rejected), in one forward
    b, s = workload.micro_batch * workload.rows_per_sample, workload.seq_len
    stages = layers_per_stage(count.num_layers, dims.pp)
    per_stage = _stage_flops(facts, dims, workload, stages)
    hidden = count.hidden_size / dims.tp
    tokens = b * s / dims.sp
    timed = [compute_seconds(f, profile, dtype, hidden, tokens, s, kernel) for f in per_stage]
    forward_s, backward_s = max(timed, key=sum)
    if workload.reference is not None and workload.generation is None:
        # dpo's reference forward of the same rows (no backward) before the policy's (grpo's
        # runs in the generate phase)
        forward_s *= 2
    gpu = not profile.device.upper().startswith("CPU")
    collectives = step_collectives(facts, dims, workload, guard=guard, clip=clip, gpu=gpu)
    exposed = communication_seconds(collectives, profile, forward_s * m, backward_s * m)
    if dims.pp > 1:
        compute, bubble = pipeline_seconds(forward_s + backward_s, m, dims.pp)
    else:
        compute, bubble = m * (forward_s + backward_s), 0.0
    offload, optimizer = _update_seconds(facts, dims, workload, profile, max(stages))
    phases = {
        "forward": {"compute": m * forward_s, "communication": exposed["forward"]},
        "backward": {"compute": m * backward_s, "communication": exposed["backward"]},
        "step": {"optimizer": optimizer, "offload": offload, "communication": exposed["step"]},
    }
    visible = _overhead_phases(facts, dims, workload, profile, phases) if overheads else {}
    for phase, seconds in visible.items():
        phases[phase]["overhead"] = seconds
    if workload.generation is not None:  # grpo samples and scores before its forward
        phases["generate"] = _generate_phase(facts, dims, workload, profile, m * forward_s)
    terms = {
        "compute": compute,
        "communication": sum(exposed.values()),
        "bubble": bubble,
        "offload": offload,
        "optimizer": optimizer,
        "overhead": sum(visible.values()),
        "generation": sum(phases.get("generate", {}).values()),
    }
    step = sum(terms.values())
    model_flops = sum(f.model for f in per_stage) * m * dims.dp * dims.tp * dims.sp
    if workload.reference is not None:
        reference = sum(f.dense_forward + f.attention_forward for f in per_stage)
        model_flops += reference * m * dims.dp * dims.tp * dims.sp
    return Forecast(
        step_time_s=step,
        terms=terms,
        tokens_per_step=b * s * m * dims.dp,
        model_flops_per_step=model_flops,
        world_size=dims.world_size,
        peak_flops_per_rank=profile.peak(dtype),
        profile=profile.label,
        phases=phases,
        collectives=tuple(collectives),
    )


def _stage_flops(
    facts: ModelFacts, dims: ParallelDims, workload: Workload, stages: list[int]
) -> list[Flops]:
    """One micro-batch's FLOPs on a rank of each pipeline stage (STAGES: its layers)."""
    options = dict(
        micro_batch=workload.micro_batch * workload.rows_per_sample,
        seq_len=workload.seq_len,
        task=workload.task,
        num_labels=workload.num_labels,
        lora=workload.lora,
        # every-K: K (1 every block), else off
        activation_checkpointing=workload.checkpoint_every
        if workload.activation_checkpointing
        else False,
    )
    per_stage, first = [], 0
    for layers in stages:
        share = RankShare(dims.tp, dims.sp, (first, layers))
        per_stage.append(micro_batch_flops(facts, share=share, **options))
        first += layers
    chunk = workload.loss_chunk
    if (
        chunk is not None
        and chunk > 0
        and not fuses(workload.task, dims.zero_stage, dims.fsdp is not None)
    ):
        # the chunked loss's checkpointed chunks: the head's forward once more in the backward
        count = _count(facts, workload.task, workload.num_labels)
        tokens = options["micro_batch"] * workload.seq_len / dims.sp
        head = 2.0 * tokens * count.hidden_size * count.vocab_size / dims.tp
        per_stage[-1] = per_stage[-1] + Flops(dense_recompute=head)
    return per_stage


def _generate_phase(
    facts: ModelFacts,
    dims: ParallelDims,
    workload: Workload,
    profile: Profile,
    scoring_forward_s: float,
) -> dict[str, float]:
    """grpo's generate phase (planning/generation_time.py) on this layout and profile."""
    from dplaunch.planning.generation_time import DecodeCosts, generation_seconds

    count = _count(facts, workload.task, workload.num_labels)
    counts = overhead_counts(facts, dims, workload)
    terms, _ = overheads_for(profile, engine_family(dims))
    dtype = DTYPES.get(workload.mixed_precision, "fp32")
    element = _element(workload.mixed_precision)
    params = count.total / dims.tp
    rows = workload.generation.rows if workload.generation is not None else 1
    gather_s = 0.0
    if (dims.zero_stage == 3 or dims.fsdp is not None) and dims.dp > 1:
        # every decode step gathers the whole model (each rank's shard from the others)
        groups = Mesh(dims.dp, dims.tp, dims.pp, dims.sp).data_parallel_groups()
        scope = _scope(groups, dims.gpus_per_node)
        gather = Collective("all_gather", params * element, dims.dp, scope, "forward", "decode")
        gather_s = gather.seconds(profile)
    costs = DecodeCosts(
        params=params,
        weight_bytes=params * element,
        dense_rate=profile.dense_rate(dtype, count.hidden_size // dims.tp, rows),
        tensors_overhead_s=terms.forward_s
        + terms.forward_tensor_s * counts.tensors
        + terms.forward_byte_s * counts.weight_bytes,
        gather_s=gather_s,
        scoring_forward_s=scoring_forward_s,
    )
    return generation_seconds(workload, dims, profile, costs)


def _overhead_phases(
    facts: ModelFacts,
    dims: ParallelDims,
    workload: Workload,
    profile: Profile,
    phases: dict[str, dict[str, float]],
) -> dict[str, float]:
    """The overhead each phase adds to its PHASES' device seconds (Overheads)."""
    terms, _ = overheads_for(profile, engine_family(dims))
    exchange = overheads_for(profile, "ulysses")[0] if dims.sp > 1 else None
    parts = overhead_seconds(overhead_counts(facts, dims, workload), terms, exchange)
    gpu = not _cpu(profile)
    return {
        phase: visible_overhead(phase, parts[phase], sum(phases[phase].values()), gpu)
        for phase in phases
    }


def _update_seconds(
    facts: ModelFacts, dims: ParallelDims, workload: Workload, profile: Profile, stage_layers: int
) -> tuple[float, float]:
    """(offload, optimizer) seconds of the optimizer step of the rank with the most layers
    (STAGE_LAYERS): its partition of the trained weights, their copies to and from the host."""
    count = _count(facts, workload.task, workload.num_labels)
    trained = sum(
        _tp_weight(w, count, dims.tp).numel
        for w in model_weights(facts, workload.task, workload.num_labels, workload.lora)
    )
    if dims.pp > 1:
        trained = trained * stage_layers / count.num_layers
    shards = dims.dp * dims.sp if (dims.zero_stage > 0) else 1
    if dims.fsdp is not None:
        shards = (
            dims.world_size if dims.fsdp == "full" else min(dims.gpus_per_node, dims.world_size)
        )
    partition = trained / shards
    held = count.total / shards
    offload = offload_seconds(
        partition, _element(workload.mixed_precision), profile, dims.offload, held
    )
    if dims.fsdp is not None and dims.offload != "none":
        micro_batches = workload.accumulation_steps(dims.dp) or 1
        return fsdp_offload_seconds(partition, held, micro_batches, profile), 0.0
    optimizer = 0.0 if dims.offload != "none" else optimizer_seconds(partition, profile)
    return offload, optimizer


def host_adamw_s_per_param(profile: Profile) -> float:
    """Seconds per parameter of torch's AdamW (unfused, with gradient clipping) on the host's
    cores a rank gets: what FSDP2's CPUOffloadPolicy steps. A CPU profile measured exactly that
    (its ``optimizer_s_per_param``); a GPU profile's AdamW is the GPU's fused kernel, so the host
    rate is its CPU Adam's times TORCH_ADAMW_OVER_CPU_ADAM (see there)."""
    if profile.device.upper().startswith("CPU"):
        return profile.optimizer_s_per_param
    return profile.cpu_adam_s_per_param * TORCH_ADAMW_OVER_CPU_ADAM


def fsdp_offload_seconds(
    partition: float, held: float, micro_batches: int, profile: Profile
) -> float:
    """FSDP2 with CPUOffloadPolicy: every micro-batch copies the HELD fp32 weight shards to the
    GPU twice (the forward's all-gather, the backward's again: blocks reshard after forward) and
    the reduce-scattered fp32 gradient shards back (4 bytes each way, the shards are fp32), then
    torch's AdamW steps the PARTITION on the host (:func:`host_adamw_s_per_param`)."""
    copies = micro_batches * (2 * held + partition) * 4
    return copies / profile.host_device_bytes_per_s + partition * host_adamw_s_per_param(profile)


__all__ = [
    "TERMS",
    "Collective",
    "Flops",
    "Forecast",
    "Weight",
    "communication_seconds",
    "compute_seconds",
    "compare_with_forecast",
    "forecast_step",
    "mfu",
    "most_wrong_term",
    "micro_batch_flops",
    "seconds_apart",
    "why_faster",
    "model_weights",
    "fsdp_offload_seconds",
    "host_adamw_s_per_param",
    "offload_seconds",
    "optimizer_seconds",
    "pipeline_seconds",
    "step_collectives",
]
