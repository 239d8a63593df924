"""The plan table: every DDP / ZeRO / offload / tp / pp / sp layout for a GPU count, its memory and traffic.

Pure Python. Numbers come from :mod:`dplaunch.planning.estimate`; this module only enumerates
layouts, checks which fit, and picks one.

How one plan is recommended (among those that fit; ``_rank`` is the code):

1. plain data parallelism without offload (DDP, ZeRO-1/2/3) first — nothing to cut, no CPU in the
   step; then sequence parallelism (sp, Ulysses) without offload, which splits only activations
   (states are ZeRO's to split): it fits where activations, not states, are the problem; then
   tensor/pipeline parallel without offload; CPU offload last (PCIe-bound Adam);
2. within that, the smallest degree tp·pp·sp: splitting the model or its sequences further only
   buys memory, and its costs are not bytes (pipeline bubble, per-layer latency of TP, Ulysses'
   all-to-alls), so bytes alone would always pick the deepest pipeline;
3. then the least network traffic per step per GPU (bytes, :func:`estimate_communication`);
4. ties → the simpler plan: no offload, lower ZeRO stage, smaller pp, smaller tp.

With a hardware profile (every row then has a forecast) the recommendation is the fastest plan
that fits instead, and each row is **tuned**: the levers the run leaves open (LEVERS: the micro
batch, when train.micro_batch_size is unset — every divisor of the rank's share of the global
batch, accumulation following; activation checkpointing, when model.gradient_checkpointing is
unset — off, every block, or one block in 2 or 4 (every-K)) are searched together, each
combination estimated (memory) and forecast (time), and the row shows its fastest combination
that fits. A lever is a Workload field and its choices: its
memory and time terms are the estimate's and the forecast's, which read the workload.

FSDP2 rows (parallel.fsdp, tp = pp = 1) are listed beside them with the same columns: FSDP full
holds ZeRO-3's states (its formula, sharded over every data-parallel rank), FSDP2's own
transients (the unsharded root and two blocks, a block's fp32 reduce-scatter input) in place of
ZeRO-3's gathered layer and buckets, and sends ZeRO-3's traffic; HSDP (several nodes only) shards over a node's GPUs, so its memory is ZeRO-3's with
dp = GPUs per node, and its traffic ZeRO-3's inside the node plus an all-reduce of the node's
gradient shard across the nodes. They are recommended only when the run asks for FSDP
(``fsdp``: auto then picks among that kind's rows by the same rule), so the DeepSpeed/DDP choice
of ``parallel: auto`` does not change for runs that did not ask.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dplaunch.errors import UserError
from dplaunch.planning.estimate import (
    GIB,
    MemoryEstimate,
    ParameterCount,
    count_parameters,
    estimate_communication,
    estimate_memory,
)
from dplaunch.planning.forecast import Forecast, forecast_step, seconds_apart, why_faster
from dplaunch.planning.job_time import JobSetting
from dplaunch.planning.lora import LoraCount, count_lora
from dplaunch.planning.model_facts import ModelFacts, attention_implementation
from dplaunch.planning.plan import batch_math
from dplaunch.planning.profiles import Profile
from dplaunch.planning.rules import (
    ParallelDims,
    engine_name,
    sequence_parallel_kernel,
)
from dplaunch.planning.workload import Workload

TP_DEGREES = (1, 2, 4, 8)
# sequence-parallel degrees the table lists (where they divide the GPUs and the model's heads)
SP_DEGREES = (2, 4, 8)
OFFLOAD_RANK = {"none": 0, "optimizer": 1, "all": 2}
# the largest micro batch the tuner tries (memory stops it sooner on most models)
MAX_TUNED_MICRO_BATCH = 128


@dataclass(frozen=True)
class Lever:
    """A setting the tuner chooses together with the layout: the Workload field it names (and
    ``apply`` sets), the run-file key `parallel: auto` writes (``run_value`` of the tuned value),
    its value in the plan's words, and the values to try on dp data-parallel ranks of a model of
    so many blocks (``choices(workload, dp, layers)``; the workload's own first)."""

    name: str
    key: str
    words: Callable[[Any], str]
    choices: Callable[[Workload, int, int], tuple[Any, ...]]
    apply: Callable[[Workload, Any], Workload]
    run_value: Callable[[Any], Any] = lambda value: value


def _micro_batches(workload: Workload, dp: int, _layers: int) -> tuple[int, ...]:
    # every micro batch that splits the rank's share of the global batch (batch_math's rule)
    per_rank = (workload.global_batch_size or workload.micro_batch * dp) // dp
    divisors = [m for m in range(1, min(per_rank, MAX_TUNED_MICRO_BATCH) + 1) if per_rank % m == 0]
    return (workload.micro_batch, *(m for m in divisors if m != workload.micro_batch))


# activation checkpointing's values (model.gradient_checkpointing): 0 none, 1 every block, K one
# block in K (every-K: blocks 0, K, 2K…, each recomputing its K − 1 followers' share)
CHECKPOINT_EVERY_CHOICES = (0, 1, 2, 4)


def checkpointing_of(workload: Workload) -> int:
    """WORKLOAD's activation checkpointing as the lever's value: 0 none, else every K."""
    return workload.checkpoint_every if workload.activation_checkpointing else 0


def _checkpointing(workload: Workload, _dp: int, layers: int) -> tuple[int, ...]:
    own = checkpointing_of(workload)
    # every-K with K < the blocks (K = the blocks would checkpoint block 0 alone)
    others = (k for k in CHECKPOINT_EVERY_CHOICES if k != own and (k < 2 or k < layers))
    return (own, *others)


def checkpointing_words(every: int) -> str:
    if every == 0:
        return "no checkpointing"
    return "activation checkpointing" if every == 1 else f"checkpointing 1 block in {every}"


LEVERS = (
    Lever(
        "micro_batch",
        "train.micro_batch_size",
        lambda m: f"micro-batch {m}",
        _micro_batches,
        lambda workload, m: replace(workload, micro_batch=m),
    ),
    Lever(
        "activation_checkpointing",
        "model.gradient_checkpointing",
        checkpointing_words,
        _checkpointing,
        lambda workload, every: replace(
            workload, activation_checkpointing=every > 0, checkpoint_every=max(every, 1)
        ),
        # the run file's words: false, true or every-K
        lambda every: every == 1 if every < 2 else f"every-{every}",
    ),
)


def open_levers(workload: Workload) -> tuple[Lever, ...]:
    """The levers this workload leaves to the tuner: those named in ``workload.tunable``, the
    micro batch only where a global batch is given and no micro batch is."""
    open_ = []
    for lever in LEVERS:
        if lever.name not in workload.tunable:
            continue
        if lever.name == "micro_batch" and (
            workload.global_batch_size is None or workload.fixed_micro_batch is not None
        ):
            continue
        open_.append(lever)
    return tuple(open_)


@dataclass
class Trial:
    """One combination of the open levers' values on a layout: its memory and its forecast."""

    settings: dict[str, Any]
    total_gb: float
    fits: bool
    forecast: Forecast | None = None


@dataclass
class Candidate:
    """One parallel layout and what it costs on the busiest GPU."""

    zero_stage: int
    offload: str
    tp: int
    pp: int
    dp: int
    params_per_gpu: int
    weights_gb: float
    gradients_gb: float
    optimizer_gb: float
    model_states_gb: float
    activations_gb: float
    total_gb: float
    # host memory per GPU process for offloaded states
    cpu_gb: float
    # bytes one GPU sends to others per optimizer step (DP + TP + PP traffic), in GiB
    comm_gb_per_step: float
    # host <-> GPU copies per step for offload (PCIe), in GiB
    offload_gb_per_step: float
    gpu_memory_gb: float
    # gpu memory × (1 − safety margin)
    usable_gb: float
    fits: bool
    recommended: bool = False
    # one line: why this plan is recommended, or why nothing fits (on the smallest plan)
    why: str = ""
    # every line the total is made of (MemoryEstimate.breakdown), for `dplaunch plan`
    memory: MemoryEstimate | None = None
    # FSDP2 rows: "full" or "hybrid" (zero_stage 0 then; the memory is ZeRO-3's formula)
    fsdp: str | None = None
    # ranks sharing each sequence (Ulysses); dp × sp × tp × pp = GPUs
    sp: int = 1
    # the step's forecast on the profile `dplaunch plan` was given (None: no profile, or the
    # layout cannot split the global batch)
    forecast: Forecast | None = None
    # the run's batch maths on dp ranks (plan.batch_math, as `train` does it): samples per
    # forward on each rank and micro-batches per step; None: no global batch given, or dp
    # cannot split it
    micro_batch: int | None = None
    gradient_accumulation_steps: int | None = None
    activation_checkpointing: bool = False
    # with it: one block in checkpoint_every is checkpointed (1: all)
    checkpoint_every: int = 0
    # the open levers' values this row was estimated with (Lever.name → value), and every
    # combination the tuner tried on this layout (empty: not tuned)
    settings: dict[str, Any] = field(default_factory=dict)
    trials: tuple[Trial, ...] = ()

    def dims(self, gpus: int, gpus_per_node: int) -> ParallelDims:
        """The layout as the rules and the forecast take it."""
        return ParallelDims(
            gpus, gpus_per_node, self.tp, self.pp, self.zero_stage, self.offload,
            fsdp=self.fsdp, sp=self.sp,
        )  # fmt: skip

    @property
    def other_gb(self) -> float:
        """What the total holds besides model states and the layers' activations."""
        return self.total_gb - self.model_states_gb - self.activations_gb

    @property
    def name(self) -> str:
        """Short label: DDP, ZeRO-2, ZeRO-3 + offload all, no ZeRO (DeepSpeed stage 0 for tp/pp),
        FSDP, HSDP."""
        if self.fsdp is not None:
            label = "FSDP" if self.fsdp == "full" else "HSDP"
        elif self.zero_stage == 0:
            label = "DDP" if self.tp == 1 and self.pp == 1 else "no ZeRO"
        else:
            label = f"ZeRO-{self.zero_stage}"
        if self.offload != "none":
            label += f" + offload {self.offload}"
        return label

    @property
    def engine(self) -> str:
        """The engine that trains this row, as Plan.engine names it: ddp, deepspeed, pipeline, fsdp."""
        return engine_name(self.zero_stage, self.tp, self.pp, self.fsdp)

    @property
    def headroom(self) -> float:
        """Fraction of the GPU's full memory left free."""
        return 1 - self.total_gb / self.gpu_memory_gb

    @property
    def layout(self) -> str:
        """The plan in words: "ZeRO-1 with tp 4 and pp 2"."""
        degrees = [
            f"{axis} {n}"
            for axis, n in (("sp", self.sp), ("tp", self.tp), ("pp", self.pp))
            if n > 1
        ]
        return self.name + (" with " + " and ".join(degrees) if degrees else "")

    @property
    def tuned_layout(self) -> str:
        """The layout and the levers' values tuned for it: "ZeRO-2 (micro-batch 4, no
        checkpointing)"."""
        return self.layout + settings_words(self.settings)


def settings_words(settings: dict[str, Any]) -> str:
    """ " (micro-batch 4, activation checkpointing)" of tuned SETTINGS; "" when none."""
    words = [lever.words(settings[lever.name]) for lever in LEVERS if lever.name in settings]
    return f" ({', '.join(words)})" if words else ""


def workload_memory(
    facts: ModelFacts,
    dims: ParallelDims,
    workload: Workload,
    *,
    count: ParameterCount | None = None,
    lora: LoraCount | None = None,
) -> MemoryEstimate:
    """The memory estimate the plan table makes for one layout of this workload, its LoRA counted
    from ``workload.lora`` unless given (the benchmark compares it with the peaks a run measured:
    one estimate for both)."""
    if lora is None and workload.lora is not None:
        lora = count_lora(facts, workload.lora, workload.task, workload.num_labels)
    return estimate_memory(facts, dims, workload, count=count, lora=lora)


def layout_workload(workload: Workload, dp: int) -> Workload | None:
    """WORKLOAD as `train` runs it on DP data-parallel ranks: its micro batch from the run's
    batch maths (plan.batch_math: the configured one, or the largest that splits the global
    batch ÷ dp); None when dp cannot split the global batch; unchanged without a global batch
    (each rank one micro batch a step)."""
    if workload.global_batch_size is None:
        return workload
    try:
        micro, _ = batch_math(workload.global_batch_size, workload.fixed_micro_batch, dp)
    except UserError:
        return None
    return replace(workload, micro_batch=micro)


def _powers_of_two(limit: int) -> list[int]:
    degrees, degree = [], 1
    while degree <= limit:
        degrees.append(degree)
        degree *= 2
    return degrees


def _layouts(
    facts: ModelFacts, gpus: int, gpus_per_node: int, task: str, sequences: bool, lora: bool
):
    """(tp, pp, sp) the rules (planning/rules.py) allow for this model on this many GPUs; sp > 1
    only when ``sequences`` (sequence parallelism composes with dp and ZeRO alone); for LoRA
    only the layouts it trains on (data parallelism)."""
    for tp in TP_DEGREES:
        for pp in _powers_of_two(facts.num_layers):
            dims = ParallelDims.if_allowed(gpus, gpus_per_node, tp, pp, model=facts, task=task)
            if dims is not None and (not lora or dims.trains_lora):
                yield tp, pp, 1
    for sp in SP_DEGREES if sequences and not lora else ():
        if ParallelDims.if_allowed(gpus, gpus_per_node, sp=sp, model=facts, task=task):
            yield 1, 1, sp


def _stages_and_offloads(dims: ParallelDims):
    """The layout with each ZeRO stage / offload pair the rules allow (PP with ZeRO ≤ 1, TP with ≤ 2).

    With a single data-parallel rank ZeRO partitions nothing, so its rows without offload would
    repeat stage 0's numbers; they are left out.
    """
    for stage in range(4):
        for offload in OFFLOAD_RANK:
            # ZeRO partitions over the sp ranks too (DeepSpeed sees them as data-parallel)
            if offload == "none" and stage > 0 and dims.dp * dims.sp == 1:
                continue
            changed = ParallelDims.if_allowed(
                **{**asdict(dims), "zero_stage": stage, "offload": offload}
            )
            if changed is not None:
                yield changed


@dataclass(frozen=True)
class Eligible:
    """Which rows that fit the recommendation may pick: those of the engine the run asks for
    (``fsdp``: FSDP of that kind; None: DDP, ZeRO, tp, pp and sp rows), and, with ``feasible``,
    those it says run as configured (a global batch that dp divides, data the pipeline takes).
    The others stay in the table."""

    fsdp: str | None = None
    feasible: Callable[[Candidate], bool] | None = None


def candidate_plans(
    facts: ModelFacts,
    workload: Workload,
    *,
    gpus: int,
    gpus_per_node: int,
    gpu_memory_gb: float,
    safety_margin: float = 0.1,
    eligible: Eligible = Eligible(),
    profile: Profile | None = None,
) -> list[Candidate]:
    """Every layout for ``gpus`` GPUs with its memory per GPU and traffic per step; one recommended.

    ``gpu_memory_gb`` is GiB per GPU; a plan fits when total ≤ gpu_memory_gb × (1 − safety_margin).
    The workload's ``global_batch_size`` (optional) sets the micro-batches per step, which scale
    TP/PP traffic and cap the pipeline's in-flight micro-batches; unset = one micro-batch per step
    for traffic, pp in flight for memory. ``eligible``: the rows the recommendation may pick
    (Eligible). Its ``attn_implementation``: unset = what transformers picks for the model;
    only eager keeps the attention scores. The workload's
    ``sequence_parallel``: list sp 2/4/8 rows too (Ulysses; sdpa or flash kernels only); its
    ``profile``: the hardware's rates (planning/profiles.py): every row gets its forecast step
    time (planning/forecast.py; the workload's ``guard`` and ``clip`` as the run's
    train.on_nonfinite and max_grad_norm), and the fastest row that fits is recommended.
    ``lora``: a LoRA run (only adapters trained; :mod:`dplaunch.planning.lora`).
    """
    if gpus < 1:
        raise UserError("launch.gpus", f"{gpus} GPUs", "plan for at least 1 GPU")
    if gpus_per_node < 1:
        raise UserError("launch.gpus_per_node", f"{gpus_per_node} GPUs per node", "use at least 1")
    if not 0 <= safety_margin < 1:
        raise UserError("safety_margin", f"{safety_margin} is not in [0, 1)")
    lora = workload.lora
    sizing = _Sizing(
        facts,
        count_parameters(facts, workload.task, workload.num_labels),
        count_lora(facts, lora, workload.task, workload.num_labels) if lora else None,
        gpu_memory_gb,
        gpu_memory_gb * (1 - safety_margin),
    )
    candidates: list[Candidate] = []
    for dims in _table_layouts(facts, workload, gpus, gpus_per_node):
        work = layout_workload(workload, dims.dp)
        # a layout that cannot split the global batch: its memory at the planning micro batch
        row = _layout_row(sizing, dims, work or workload)
        candidates.append(row if work is None else _tuned_row(sizing, dims, work, row, profile))
    feasible = _splits_the_batch(workload, eligible.feasible)
    _recommend(candidates, _only_for_activations(candidates, feasible), eligible.fsdp)
    return candidates


@dataclass(frozen=True)
class _Sizing:
    """What every row of one table is estimated with: the model, its counts, the GPU's memory."""

    facts: ModelFacts
    count: ParameterCount
    lora: LoraCount | None
    gpu_memory_gb: float
    usable: float


def _table_layouts(facts: ModelFacts, workload: Workload, gpus: int, gpus_per_node: int):
    """Every layout of the table: DDP / ZeRO / offload with tp, pp, sp, then the FSDP2 rows."""
    sequences = workload.sequence_parallel and sequence_parallel_kernel(
        attention_implementation(facts.model_type, workload.attn_implementation)
    )
    lora = workload.lora
    for tp, pp, sp in _layouts(facts, gpus, gpus_per_node, workload.task, sequences, bool(lora)):
        if workload.seq_len % sp:  # each rank holds an equal slice (check_sequence_length)
            continue
        yield from _stages_and_offloads(ParallelDims(gpus, gpus_per_node, tp, pp, sp=sp))
    if lora is None or lora.quantize is None:  # no QLoRA under FSDP (lora_check.check_lora)
        yield from _fsdp_layouts(facts, workload.task, gpus, gpus_per_node)


def _layout_row(sizing: _Sizing, dims: ParallelDims, work: Workload) -> Candidate:
    """The row of DIMS for WORK: its memory per GPU and its traffic per step. FSDP2 rows: a LoRA
    run's frozen shards in fp32 (_fp32_frozen_shards), HSDP's all-reduce across the nodes."""
    facts, count, lora = sizing.facts, sizing.count, sizing.lora
    memory = workload_memory(facts, dims, work, count=count, lora=lora)
    traffic = estimate_communication(facts, dims, work, count=count, lora=lora)
    network = traffic.network_bytes
    if dims.fsdp is not None:
        shard = dims.fsdp_shard_size
        if lora is not None:
            frozen = count.total - lora.trainable
            memory = _fp32_frozen_shards(memory, frozen, shard, dims.offload, work)
        replicas = dims.world_size // shard
        if replicas > 1:
            # the node's gradient shard, all-reduced across the nodes (ring: 2n(r−1)/r)
            b = 2 if work.mixed_precision in ("bf16", "fp16") else 4
            trained = count.total if lora is None else lora.trainable
            network += 2 * (trained / shard) * b * (replicas - 1) / replicas
    return _row(memory, network, traffic.offload_bytes, sizing.gpu_memory_gb, sizing.usable, dims)


def _tuned_row(
    sizing: _Sizing, dims: ParallelDims, work: Workload, row: Candidate, profile: Profile | None
) -> Candidate:
    """ROW (DIMS under WORK, the run's batch maths) with its forecast; with a profile and open
    levers, the row of their fastest combination that fits (each tried is kept in ``trials``)."""
    levers = open_levers(work) if profile is not None else ()
    if profile is None or not levers:
        forecast = _forecast(sizing.facts, dims, work, profile) if profile is not None else None
        return _settled(row, work, {}, forecast)
    trials: list[tuple[Trial, Candidate, Workload]] = []
    layers = sizing.facts.num_layers
    for values in itertools.product(*(lever.choices(work, dims.dp, layers) for lever in levers)):
        settings = {lever.name: value for lever, value in zip(levers, values, strict=True)}
        tried = work
        for lever, value in zip(levers, values, strict=True):
            tried = lever.apply(tried, value)
        # the first combination is the workload's own: its row is ROW
        tried_row = _layout_row(sizing, dims, tried) if trials else row
        # what does not fit is not forecast, but for the row's own (its table cells)
        forecast = (
            _forecast(sizing.facts, dims, tried, profile) if tried_row.fits or not trials else None
        )
        trials.append(
            (Trial(settings, tried_row.total_gb, tried_row.fits, forecast), tried_row, tried)
        )
    fitting = [t for t in trials if t[0].fits]
    trial, chosen, tried = min(fitting, key=lambda t: _trial_time(t[0])) if fitting else trials[0]
    chosen = _settled(chosen, tried, trial.settings, trial.forecast)
    chosen.trials = tuple(t[0] for t in trials)
    return chosen


def _trial_time(trial: Trial) -> tuple:
    """A trial's forecast seconds; between equals the simpler: no recomputation, fewer and
    larger micro-batches."""
    seconds = trial.forecast.step_time_s if trial.forecast is not None else float("inf")
    settings = trial.settings
    every = settings.get("activation_checkpointing", 0)
    # the share of blocks recomputed, then fewer and larger micro-batches
    simpler = (1 / every if every else 0, -settings.get("micro_batch", 0))
    return (round(seconds, 9), *simpler)


def _forecast(facts: ModelFacts, dims: ParallelDims, work: Workload, profile: Profile) -> Forecast:
    return forecast_step(facts, dims, work, profile, guard=work.guard, clip=work.clip)


def _settled(
    row: Candidate, work: Workload, settings: dict[str, Any], forecast: Forecast | None
) -> Candidate:
    """ROW with WORK's batch maths and checkpointing, the SETTINGS tuned and its FORECAST."""
    if work.global_batch_size is not None:
        row.micro_batch = work.micro_batch
        row.gradient_accumulation_steps = work.accumulation_steps(row.dp)
    row.activation_checkpointing = work.activation_checkpointing
    row.checkpoint_every = checkpointing_of(work)
    row.settings = dict(settings)
    row.forecast = forecast
    return row


def _splits_the_batch(
    workload: Workload, feasible: Callable[[Candidate], bool] | None
) -> Callable[[Candidate], bool] | None:
    """``feasible``, and only the layouts whose dp splits the global batch (a run refuses the
    others: plan.batch_math)."""
    if workload.global_batch_size is None:
        return feasible

    def splits(candidate: Candidate) -> bool:
        if layout_workload(workload, candidate.dp) is None:
            return False
        return feasible is None or feasible(candidate)

    return splits


def _fsdp_layouts(facts: ModelFacts, task: str, gpus: int, gpus_per_node: int):
    """FSDP full (and HSDP on several nodes), with and without CPU offload (the module docstring
    says how their memory and traffic are counted)."""
    kinds = ["full", "hybrid"] if 1 < gpus_per_node < gpus else ["full"]
    for kind in kinds:
        if not ParallelDims.if_allowed(gpus, gpus_per_node, fsdp=kind, model=facts, task=task):
            continue
        for offload in ("none", "all"):
            yield ParallelDims(gpus, gpus_per_node, offload=offload, fsdp=kind)


def _row(
    memory: MemoryEstimate,
    network_bytes: float,
    offload_bytes: float,
    gpu_memory_gb: float,
    usable: float,
    dims: ParallelDims,
) -> Candidate:
    """One row of the table: the layout DIMS, its memory estimate and its traffic per step."""
    return Candidate(
        zero_stage=dims.zero_stage,
        offload=dims.offload,
        tp=dims.tp,
        pp=dims.pp,
        dp=dims.dp,
        sp=dims.sp,
        fsdp=dims.fsdp,
        params_per_gpu=memory.params_per_gpu,
        weights_gb=memory.weights_gb,
        gradients_gb=memory.gradients_gb,
        optimizer_gb=memory.optimizer_gb,
        model_states_gb=memory.model_states_gb,
        activations_gb=memory.activations_gb,
        total_gb=memory.total_gb,
        cpu_gb=memory.cpu_gb,
        comm_gb_per_step=network_bytes / GIB,
        offload_gb_per_step=offload_bytes / GIB,
        gpu_memory_gb=gpu_memory_gb,
        usable_gb=usable,
        fits=memory.total_gb <= usable,
        memory=memory,
    )


def _fp32_frozen_shards(
    memory: MemoryEstimate, frozen: int, shard: int, offload: str, workload: Workload
) -> MemoryEstimate:
    """A LoRA FSDP row's memory: ZeRO-3's, but FSDP keeps the frozen base's shards in the model's
    fp32 (DeepSpeed's bf16/fp16 run holds them in 16 bits): 2 more bytes per frozen parameter
    and shard, on the GPU or (offload all) on the host."""
    if workload.mixed_precision not in ("bf16", "fp16"):
        return memory  # an fp32 run's estimate already holds them in 4 bytes
    extra = 2 * frozen / shard / GIB
    if offload == "all":  # the shards live on the host
        return replace(memory, cpu_gb=memory.cpu_gb + extra)
    return replace(
        memory,
        weights_gb=memory.weights_gb + extra,
        model_states_gb=memory.model_states_gb + extra,
        total_gb=memory.total_gb + extra,
    )


def _only_for_activations(
    candidates: list[Candidate], feasible: Callable[[Candidate], bool] | None
) -> Callable[[Candidate], bool] | None:
    """``feasible``, and sequence parallelism only where activations are the problem: where the
    same ZeRO stage and offload without it does not fit (a layout that cannot split the global
    batch is no reason to split sequences)."""
    plain_fits = {
        (c.zero_stage, c.offload)
        for c in candidates
        if c.fits and c.tp * c.pp * c.sp == 1 and c.fsdp is None
    }
    if not any(c.sp > 1 for c in candidates):
        return feasible

    def eligible(candidate: Candidate) -> bool:
        if candidate.sp > 1 and (candidate.zero_stage, candidate.offload) in plain_fits:
            return False
        return feasible is None or feasible(candidate)

    return eligible


def _tier(candidate: Candidate) -> int:
    if candidate.offload != "none":
        return 3
    if candidate.tp * candidate.pp > 1:
        return 2
    return 1 if candidate.sp > 1 else 0


def _rank(candidate: Candidate) -> tuple:
    return (
        _tier(candidate),
        candidate.tp * candidate.pp * candidate.sp,
        round(candidate.comm_gb_per_step, 6),
        round(candidate.offload_gb_per_step, 6),
        OFFLOAD_RANK[candidate.offload],
        candidate.zero_stage,
        candidate.pp,
        candidate.tp,
    )


def _recommend(
    candidates: list[Candidate],
    feasible: Callable[[Candidate], bool] | None = None,
    fsdp: str | None = None,
) -> None:
    # the engine the run asked for: its rows only (FSDP rows only when it asked for FSDP)
    # (HSDP on one node is FSDP full: its rows stand in)
    candidates = [c for c in candidates if c.fsdp == fsdp] or [
        c for c in candidates if c.fsdp == "full"
    ]
    fitting = [c for c in candidates if c.fits and (feasible is None or feasible(c))]
    ruled_out = [c for c in candidates if c.fits and c not in fitting]
    if not fitting and ruled_out:
        best = min(ruled_out, key=_rank)
        best.why = (
            f"the plans that fit cannot run as configured; the best of them ({best.layout}, "
            f"dp {best.dp}) was ruled out"
        )
        return
    if not fitting:
        smallest = min(candidates, key=lambda c: (c.total_gb, _rank(c)))
        smallest.why = (
            f"nothing fits: the smallest plan ({smallest.layout}) "
            f"needs {smallest.total_gb:.1f} GB per GPU of {smallest.usable_gb:.1f} usable; "
            "use more GPUs, activation checkpointing or a smaller micro batch"
        )
        return
    if all(c.forecast is not None for c in fitting):
        _recommend_fastest(fitting)
        return
    best = min(fitting, key=_rank)
    best.recommended = True
    fits = f"{best.layout} fits in {best.gpu_memory_gb:g} GB with {best.headroom:.0%} headroom"
    tier = _tier(best)
    if tier == 0:
        reason = "and needs the least communication of the data-parallel plans"
    elif tier == 1:
        reason = (
            f"; no data-parallel plan fits without offload, the activations are the problem, and "
            f"sp {best.sp} is the least sequence splitting that fits"
        )
    elif tier == 2:
        reason = (
            f"; no data-parallel plan fits without offload, and tp·pp = {best.tp * best.pp} is the "
            "least model splitting that does, with the least communication"
        )
    else:
        reason = "; only plans with CPU offload fit, and this one needs the least communication"
    best.why = f"{fits} {reason}" if tier == 0 else fits + reason


def _options(candidate: Candidate) -> list[tuple[Candidate, Trial]]:
    """(row, trial) of every combination of a row's levers that fits and has a forecast; a row
    not tuned is its own."""
    trials = candidate.trials or (
        Trial(candidate.settings, candidate.total_gb, candidate.fits, candidate.forecast),
    )
    return [(candidate, t) for t in trials if t.fits and t.forecast is not None]


def _recommend_fastest(fitting: list[Candidate]) -> None:
    """With a forecast: the fastest plan that fits (its layout and its levers' values); the line
    names the runner-up (another layout, or the same one tuned otherwise) and why."""
    options = sorted(
        (option for candidate in fitting for option in _options(candidate)),
        key=lambda o: (_trial_time(o[1])[0], _rank(o[0]), *_trial_time(o[1])[1:]),
    )
    (best, trial), *others = options
    best.recommended = True
    assert trial.forecast is not None
    fits = (
        f"{best.tuned_layout} fits in {best.gpu_memory_gb:g} GB with {best.headroom:.0%} headroom"
    )
    if not others:
        best.why = f"{fits}; the fastest forecast, {trial.forecast.step_time_s:.3g} s/step"
        return
    runner_row, runner = others[0]
    assert runner.forecast is not None
    mine, theirs = seconds_apart(trial.forecast.step_time_s, runner.forecast.step_time_s)
    runner_name = runner_row.layout + settings_words(runner.settings)
    if mine == theirs:  # a tie to the digits: the simpler plan (the table's rule) wins
        best.why = (
            f"{fits}; the fastest forecast: {best.tuned_layout} {mine} s/step, as fast as "
            f"{runner_name}, and the simpler plan"
        )
        return
    best.why = (
        f"{fits}; the fastest forecast: {best.tuned_layout} {mine} s/step beats {runner_name} "
        f"{theirs} s/step: {why_faster(trial.forecast, runner.forecast)}"
    )


def recommendation_line(candidates: list[Candidate]) -> str:
    """The recommended plan's reason, or why nothing fits."""
    for candidate in candidates:
        if candidate.why:
            return candidate.why
    return ""


ROW_KEYS = (
    "name",
    "engine",
    "fsdp",
    "zero_stage",
    "offload",
    "tp",
    "pp",
    "sp",
    "dp",
    "micro_batch",
    "gradient_accumulation_steps",
    "activation_checkpointing",
    "checkpoint_every",
    # the levers' values the tuner chose for this row ({}: none tuned)
    "settings",
    "params_per_gpu",
    "weights_gb",
    "gradients_gb",
    "optimizer_gb",
    "model_states_gb",
    "activations_gb",
    "other_gb",
    "total_gb",
    "cpu_gb",
    "comm_gb_per_step",
    "offload_gb_per_step",
    "gpu_memory_gb",
    "usable_gb",
    "fits",
    "recommended",
    "why",
)


# the forecast's keys of a row (None without a profile); cost with --price-per-gpu-hour
FORECAST_KEYS = ("step_time_s", "tokens_per_s", "mfu", "hours", "gpu_hours", "profile")


def to_json_rows(
    candidates: list[Candidate],
    job: JobSetting | None = None,
    price_per_gpu_hour: float | None = None,
) -> list[dict]:
    """Plain dicts (floats rounded to 0.001 GiB) for ``--json`` output; the forecast's keys
    (FORECAST_KEYS: hours and GPU-hours of the ``job``, the cost at ``price_per_gpu_hour``)."""
    rows = []
    for candidate in candidates:
        values = {key: getattr(candidate, key) for key in ROW_KEYS}
        flat = {k: round(v, 3) if isinstance(v, float) else v for k, v in values.items()}
        forecast = candidate.forecast
        if forecast is not None:
            time = job.time(forecast) if job is not None else None
            flat.update(forecast.to_dict(None, price_per_gpu_hour, job=time))
        else:
            flat.update(dict.fromkeys(FORECAST_KEYS))
        if candidate.memory is not None:
            flat["attn_implementation"] = candidate.memory.attn_implementation
            flat["memory_gb"] = {
                name: round(gib, 3) for name, _, gib in candidate.memory.breakdown()
            }
            flat["host_gb_per_rank"] = round(candidate.memory.host_gb, 3)
        rows.append(flat)
    return rows


def _forecast_cells(
    candidate: Candidate, job: JobSetting | None, price_per_gpu_hour: float | None
) -> str:
    forecast = candidate.forecast
    if forecast is None:
        return f"{'-':>9}{'-':>11}{'-':>6}{'-':>8}{'-':>9}" + (
            f"{'-':>10}" if price_per_gpu_hour is not None else ""
        )
    hours = job.time(forecast).hours if job is not None else None
    gpu_hours = None if hours is None else hours * forecast.world_size
    cells = (
        f"{forecast.step_time_s:>9.3g}{forecast.tokens_per_s:>11,.0f}{forecast.mfu:>6.0%}"
        f"{_number(hours):>8}{_number(gpu_hours):>9}"
    )
    if price_per_gpu_hour is not None:
        cost = None if gpu_hours is None else gpu_hours * price_per_gpu_hour
        cells += f"{'-' if cost is None else f'{cost:,.0f}':>10}"
    return cells


def _lever_cells(candidate: Candidate) -> str:
    micro = "-"
    if candidate.micro_batch is not None:
        micro = f"{candidate.micro_batch}×{candidate.gradient_accumulation_steps}"
    every = candidate.checkpoint_every if candidate.activation_checkpointing else 0
    # on, off, or 1/K: one block in K (every-K)
    ckpt = "off" if not every else "on" if every == 1 else f"1/{every}"
    return f"{micro:>9}{ckpt:>5}"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _table_name(candidate: Candidate) -> str:
    return candidate.name + (f" + sp {candidate.sp}" if candidate.sp > 1 else "")


def format_table(
    candidates: list[Candidate],
    job: JobSetting | None = None,
    price_per_gpu_hour: float | None = None,
) -> str:
    """Fixed-width text table, the recommended row marked ``*``, then the recommendation line.
    With forecasts: step time, tokens/s, MFU, and the hours and GPU-hours of the ``job`` (its
    steps, start-up, evaluation and checkpoints; the cost at ``price_per_gpu_hour``)."""
    # sp rows name longer plans ("ZeRO-1 + offload optimizer + sp 2")
    width = max([26, *(len(_table_name(c)) + 1 for c in candidates)])
    forecasts = any(c.forecast is not None for c in candidates)
    header = (
        f"  {'plan':<{width}}{'tp':>3}{'pp':>4}{'dp':>5}{'states':>9}{'activ':>8}{'other':>8}{'total':>8}"
        f"{'cpu':>8}{'comm/step':>11}{'fits':>6}"
    )
    if forecasts:
        # the micro batch (× accumulation) and checkpointing each row was tuned to
        header += f"{'micro':>9}{'ckpt':>5}"
        header += f"{'s/step':>9}{'tokens/s':>11}{'MFU':>6}{'hours':>8}{'GPU-h':>9}"
        header += f"{'cost':>10}" if price_per_gpu_hour is not None else ""
    lines = [header, "  " + "-" * (len(header) - 2)]
    # small models: enough decimals that their numbers are not all 0.0
    largest = max((c.total_gb for c in candidates), default=0.0)
    d = 1 if largest >= 10 else 2 if largest >= 1 else 3
    for c in candidates:
        mark = "*" if c.recommended else " "
        lines.append(
            f"{mark} {_table_name(c):<{width}}{c.tp:>3}{c.pp:>4}{c.dp:>5}{c.model_states_gb:>9.{d}f}"
            f"{c.activations_gb:>8.{d}f}{c.other_gb:>8.{d}f}{c.total_gb:>8.{d}f}{c.cpu_gb:>8.{d}f}"
            f"{c.comm_gb_per_step:>11.{d}f}{'yes' if c.fits else 'no':>6}"
            + (_lever_cells(c) + _forecast_cells(c, job, price_per_gpu_hour) if forecasts else "")
        )
    if candidates:
        lines.append(
            f"  (GB = GiB per GPU; usable {candidates[0].usable_gb:.1f} GB after the safety margin)"
        )
    line = recommendation_line(candidates)
    if line:
        lines.append(("* " if any(c.recommended for c in candidates) else "! ") + line)
    return "\n".join(lines)
