"""The plan: every decision about a run, made once, purely, before anything is written or started.

World size, nodes, the dp × tp × pp mesh, ZeRO stage, batch math and backend are decided here,
and every user mistake the plan can see becomes one UserError (one line, exit code 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dplaunch.config.schema import LaunchConfig, ParallelConfig, TrainConfig
from dplaunch.errors import UserError
from dplaunch.planning.lora import count_lora
from dplaunch.planning.mesh import Mesh, fsdp_groups
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.rules import (
    ParallelDims,
)
from dplaunch.planning.workload import LoraSpec, Workload

Target = Literal["gpu", "cpu"]
Engine = Literal["ddp", "deepspeed", "pipeline", "fsdp"]
DEFAULT_MASTER_PORT = 29500
# the largest micro batch the planner picks on its own; users set train.micro_batch_size for more
DEFAULT_MAX_MICRO_BATCH = 8


@dataclass(frozen=True)
class Plan:
    """Everything a launch needs, derived from the run config and the machine."""

    target: Target
    # the layout (world, ranks per node, tp, pp, sp, ZeRO or FSDP, offload), whose rules it passed
    dims: ParallelDims
    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    mixed_precision: str
    global_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    timeout_minutes: float
    notes: tuple[str, ...] = field(default=())
    stage_layers: tuple[str, ...] = field(default=())
    # "tensorflow": `dplaunch launch` of a TensorFlow script, whose strategy owns the collectives,
    # the batch and the precision (launching/frameworks.py)
    framework: Literal["pytorch", "tensorflow"] = "pytorch"
    # the forecast of this plan's step (planning/forecast.py Forecast.to_dict: step_time_s,
    # tokens_per_s, mfu, hours, gpu_hours, profile, terms_s, phases_s…); None without a profile
    forecast: dict[str, Any] | None = None
    # train.loss_chunk as planned (planning/loss_chunk.py): the tokens of a chunk of the head
    # and the loss, which the ranks compute so (train/chunked_loss.py); 0: the full logits
    loss_chunk: int = 0

    @property
    def forwards_are_collective(self) -> bool:
        """Whether every forward needs every rank of a group (ZeRO-3 and FSDP2 gather weights,
        TP splits them): ranks that generate must then run as many forwards, in step."""
        return self.zero_stage == 3 or self.tensor_parallel_size > 1 or self.engine == "fsdp"

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def processes_per_node(self) -> int:
        return self.dims.gpus_per_node

    @property
    def mesh(self) -> Mesh:
        return self.dims.mesh

    @property
    def zero_stage(self) -> int:
        return self.dims.zero_stage

    @property
    def offload(self) -> str:
        return self.dims.offload

    @property
    def fsdp(self) -> str | None:
        """parallel.fsdp: None (DDP/ZeRO), "full" or "hybrid" (FSDP2, dplaunch/train/fsdp.py)."""
        return self.dims.fsdp

    @property
    def layout_name(self) -> str:
        """The layout in a few words (ParallelDims.name): "ZeRO-3 dp 2 (bf16)"."""
        return self.dims.name(self.mixed_precision)

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.data_parallel_size

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.tensor_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.mesh.pipeline_parallel_size

    @property
    def sequence_parallel_size(self) -> int:
        return self.mesh.sequence_parallel_size

    @property
    def backend(self) -> str:
        return "nccl" if self.target == "gpu" else "gloo"

    @property
    def process_group_backend(self) -> str:
        """The ranks' default process group: NCCL on GPUs, with gloo beside it for host tensors
        under FSDP's CPU offload (its gradients live on the host, and clipping and the fp16
        scaler's overflow check all-reduce them), as Accelerate and torchtitan do there."""
        if self.backend == "nccl" and self.engine == "fsdp" and self.offload == "all":
            return "cuda:nccl,cpu:gloo"
        return self.backend

    @property
    def engine(self) -> Engine:
        return self.dims.engine  # type: ignore[return-value]

    @property
    def uses_deepspeed(self) -> bool:
        return self.engine in ("deepspeed", "pipeline")

    @property
    def fsdp_shard_size(self) -> int:
        """Ranks that split FSDP's parameters: every data-parallel rank (full), a node's (hybrid)."""
        return self.dims.fsdp_shard_size

    def fsdp_lines(self) -> list[str]:
        """The FSDP mesh: its shape, shard groups and replicate groups."""
        shard, replicate = fsdp_groups(self.data_parallel_size, self.fsdp_shard_size)
        # data-parallel indices → global ranks, one set of groups per tensor-parallel rank
        tp = range(self.tensor_parallel_size)
        shard = [[self.mesh.rank_of(0, d, t) for d in group] for t in tp for group in shard]
        replicate = [[self.mesh.rank_of(0, d, t) for d in group] for t in tp for group in replicate]
        kind = (
            "HSDP: shard inside a node, replicate across nodes"
            if self.fsdp == "hybrid"
            else "full shard"
        )
        lines = [
            f"FSDP2 {self.fsdp} ({kind}): mesh replicate "
            f"{self.data_parallel_size // self.fsdp_shard_size} × shard {self.fsdp_shard_size}"
            + (f" × tp {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""),
            f"  shard groups: {shard}",
        ]
        # full: every rank holds its own shard, nothing is replicated
        return lines + ([f"  replicate groups: {replicate}"] if self.fsdp == "hybrid" else [])

    def batch_line(self) -> str:
        """micro × grad-accum × dp = global, as users want to read it."""
        return (
            f"micro batch {self.micro_batch_size} × grad-accum {self.gradient_accumulation_steps} "
            f"× dp {self.data_parallel_size} = global batch {self.global_batch_size}"
        )

    def summary_lines(self) -> list[str]:
        """The resolved plan, one fact per line."""
        device = "GPU" if self.target == "gpu" else "CPU rank"
        world = (
            f"world size {self.world_size} ({self.num_nodes} node(s) × {self.processes_per_node} "
        )
        if self.framework == "tensorflow":
            # the mesh, engine, batch and precision lines are PyTorch's: the script decides them
            lines = [world + f"{device}(s), collectives by the script's TensorFlow strategy)"]
            return lines + [f"note: {note}" for note in self.notes]
        lines = [
            world + f"{device}(s), backend {self.process_group_backend})",
            *self.mesh.describe(list(self.stage_layers)),
            *(self.fsdp_lines() if self.fsdp else []),
            f"engine: {self.engine}"
            + (f", ZeRO stage {self.zero_stage}" if self.zero_stage else "")
            + (f", offload {self.offload}" if self.offload != "none" else ""),
            self.batch_line(),
            f"mixed precision: {self.mixed_precision}",
        ]
        if self.num_nodes > 1:
            lines.append(
                f"node rank {self.node_rank}, rendezvous {self.master_addr}:{self.master_port}"
            )
        return lines + [f"note: {note}" for note in self.notes]

    def header(self) -> dict[str, Any]:
        """The first line of metrics.jsonl."""
        return {
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "sequence_parallel_size": self.sequence_parallel_size,
            "zero_stage": self.zero_stage,
            **({"fsdp": self.fsdp} if self.fsdp else {}),
            "offload": self.offload,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "mixed_precision": self.mixed_precision,
            "target": self.target,
            "num_nodes": self.num_nodes,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (plan.json in the run directory)."""
        # the keys and order plan.json has always had (a checkpoint's plan.json is read back)
        keys = (
            "target", "world_size", "num_nodes", "processes_per_node", "node_rank", "master_addr",
            "master_port", "mesh", "zero_stage", "offload", "mixed_precision", "global_batch_size",
            "micro_batch_size", "gradient_accumulation_steps", "timeout_minutes", "notes",
            "stage_layers", "fsdp", "framework", "forecast", "loss_chunk",
        )  # fmt: skip
        data = {key: getattr(self, key) for key in keys}
        data["mesh"] = dataclasses.asdict(self.mesh)
        data["notes"] = list(self.notes)
        data["stage_layers"] = list(self.stage_layers)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of to_dict."""
        data = dict(data)
        mesh = Mesh(**data.pop("mesh"))
        data["dims"] = ParallelDims(
            data.pop("world_size"),
            data.pop("processes_per_node"),
            mesh.tensor_parallel_size,
            mesh.pipeline_parallel_size,
            data.pop("zero_stage"),
            data.pop("offload"),
            fsdp=data.pop("fsdp", None),
            sp=mesh.sequence_parallel_size,
        )
        data["notes"] = tuple(data.get("notes", ()))
        data["stage_layers"] = tuple(data.get("stage_layers", ()))
        return cls(**data)


@dataclass(frozen=True)
class Machine:
    """What the planner may know about where it runs (filled in by the CLI, pure afterwards)."""

    visible_gpus: int = 0
    # True for `dplaunch config`/`slurm`: render for the target the flags describe, GPUs need not be here
    render_only: bool = False
    # the lowest compute capability among the visible GPUs and that GPU's name (None: not known)
    oldest_gpu: tuple[float, str] | None = None
    # GiB of RAM on this node (devices.host_memory_gb); None = unknown, not checked
    host_memory_gb: float | None = None


@dataclass(frozen=True)
class ModelChoices:
    """What the run file's model section decides that the plan checks."""

    # model.task: the pipeline engine trains causal LMs only
    task: str = "causal-lm"
    # model.attn_implementation: flash kernels need GPUs and 16-bit compute
    attn_implementation: str | None = None
    # model.lora: a quantized base is what a rank holds in host RAM at load
    lora: LoraSpec | None = None

    @classmethod
    def of(cls, model: Any) -> ModelChoices:
        """From the run file's ``model`` section (config.schema.ModelConfig)."""
        lora = LoraSpec.from_config(model.lora, random_base=model.config is not None)
        return cls(model.task, model.attn_implementation, lora)


def make_plan(
    launch: LaunchConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    machine: Machine,
    model: ModelFacts | None = None,
    choices: ModelChoices = ModelChoices(),
    extra_notes: Sequence[str] = (),
) -> Plan:
    """Decide the whole layout of a run; raise UserError for anything that cannot work.

    ``model`` the model's facts (None: not known here, its checks are skipped); ``choices``
    the run file's model section; ``extra_notes`` what the checks before planning found, shown
    after the plan's own notes.
    """
    task, attn_implementation = choices.task, choices.attn_implementation
    notes: list[str] = []
    target, total, nodes, per_node = _placement(launch, machine, notes)
    dims = ParallelDims(
        total,
        per_node,
        parallel.tp,
        parallel.pp,
        parallel.zero_stage,
        parallel.offload,
        fsdp=parallel.fsdp,
        sp=parallel.sp,
    )
    dims.check(model, task)
    mesh = dims.mesh
    if train.max_steps is not None and 0 < train.max_steps <= train.warmup_steps:
        notes.append(
            f"train.warmup_steps {train.warmup_steps} is not below the run's "
            f"{train.max_steps} steps (train.max_steps): the warm-up never ends, the learning "
            f"rate rises the whole run to {train.max_steps}/{train.warmup_steps} of train.lr"
        )
    notes += dims.notes()
    dims.check_compile(train.compile)
    dims.check_kernel(attn_implementation)
    mixed_precision = _mixed_precision(train.mixed_precision, target, machine)
    dims.check_precision(attn_implementation, target, mixed_precision)
    micro, accumulation = batch_math(
        train.global_batch_size, train.micro_batch_size, mesh.data_parallel_size
    )
    stage_layers = tuple(pipeline_stage_names(model, mesh.pipeline_parallel_size)) if model else ()
    if model is not None and machine.host_memory_gb is not None and not machine.render_only:
        notes += _host_memory_notes(
            model, dims, mixed_precision, choices, machine.host_memory_gb, target == "gpu"
        )
    return Plan(
        target=target,
        dims=dims,
        num_nodes=nodes,
        node_rank=launch.node_rank,
        master_addr=launch.master_addr,
        master_port=launch.master_port or DEFAULT_MASTER_PORT,
        mixed_precision=mixed_precision,
        global_batch_size=train.global_batch_size,
        micro_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        timeout_minutes=launch.timeout_minutes,
        notes=(*notes, *extra_notes),
        stage_layers=stage_layers,
    )


def _placement(
    launch: LaunchConfig, machine: Machine, notes: list[str]
) -> tuple[Target, int, int, int]:
    """(target, ranks, nodes, ranks per node) of the launch section on this machine; UserError
    when the machine cannot hold them (checked here only, never for files rendered elsewhere)."""
    target, total = _devices(launch, machine, notes)
    nodes, per_node = _nodes(launch, total)
    if nodes > 1 and launch.node_rank >= nodes:
        raise UserError(
            "launch.node_rank",
            f"{launch.node_rank} is not below the node count {nodes}",
            f"use 0..{nodes - 1}",
        )
    here = target == "gpu" and not machine.render_only
    if here and nodes == 1 and total > machine.visible_gpus:
        raise UserError(
            "launch.gpus",
            f"{total} GPUs requested but this machine shows {machine.visible_gpus}",
            "spread them over nodes with --nodes N (one command per node) or run `dplaunch slurm`",
        )
    if here and nodes > 1 and per_node > machine.visible_gpus:
        raise UserError(
            "launch.gpus_per_node",
            f"{per_node} GPUs per node planned but this node shows {machine.visible_gpus}",
            "lower --gpus or raise --nodes",
        )
    if nodes > 1 and launch.master_addr in ("127.0.0.1", "localhost"):
        notes.append(
            "several nodes rendezvous at 127.0.0.1: pass --master-addr <head node> unless all run here"
        )
    return target, total, nodes, per_node


def _devices(launch: LaunchConfig, machine: Machine, notes: list[str]) -> tuple[Target, int]:
    if launch.cpu:
        total = launch.gpus or 1
        notes.append(f"--cpu: {total} CPU rank(s)")
        return "cpu", total
    if machine.render_only:
        return "gpu", launch.gpus or max(machine.visible_gpus, 1)
    if machine.visible_gpus == 0:
        total = launch.gpus or 1
        notes.append(f"no GPU visible: running {total} CPU rank(s) instead")
        return "cpu", total
    return "gpu", launch.gpus or machine.visible_gpus


def _nodes(launch: LaunchConfig, total: int) -> tuple[int, int]:
    nodes = launch.nodes
    if launch.gpus_per_node is not None:
        if nodes == 1 and launch.gpus_per_node < total:
            if total % launch.gpus_per_node:
                raise UserError(
                    "launch.gpus_per_node",
                    f"{launch.gpus_per_node} does not divide {total} GPUs",
                    "choose a divisor of --gpus",
                )
            nodes = total // launch.gpus_per_node
        if nodes * launch.gpus_per_node != total:
            raise UserError(
                "launch.gpus",
                f"{nodes} node(s) × {launch.gpus_per_node} GPUs per node = "
                f"{nodes * launch.gpus_per_node}, not {total}",
                "make --gpus equal nodes × GPUs per node",
            )
        return nodes, launch.gpus_per_node
    if total % nodes:
        raise UserError(
            "launch.nodes",
            f"{total} GPUs cannot be spread evenly over {nodes} nodes",
            f"use a GPU count that is a multiple of {nodes}",
        )
    return nodes, total // nodes


def _host_memory_notes(
    model: ModelFacts,
    dims: ParallelDims,
    mixed_precision: str,
    choices: ModelChoices,
    host_memory_gb: float,
    refuse: bool,
) -> list[str]:
    """The notes of the host-RAM checks: the ranks at load, and (LoRA) rank 0 at export."""
    task, lora = choices.task, choices.lora
    notes = [
        check_host_memory(
            model, dims, mixed_precision, task, host_memory_gb, refuse=refuse, lora=lora
        )
    ]
    if lora is not None:
        notes.append(
            check_export_memory(
                model, dims, mixed_precision, task, host_memory_gb, lora, refuse=refuse
            )
        )
    return [note for note in notes if note]


# a node's RAM the ranks may take at load before the plan says so
HOST_MEMORY_NOTE_FRACTION = 0.8


def check_host_memory(
    model: ModelFacts,
    dims: ParallelDims,
    mixed_precision: str,
    task: str,
    host_memory_gb: float,
    *,
    refuse: bool = True,
    lora: LoraSpec | None = None,
) -> str | None:
    """Refuse a plan whose ranks cannot fit in this node's RAM; a note when they take most of it.

    ``refuse=False`` (CPU ranks, which rehearse GPU plans on a small machine) notes it instead.

    Every rank of a node builds or loads the model in host RAM at the same time: the whole fp32
    model, 4 bytes × all parameters (TP and PP cut it afterwards), except under ZeRO-3, where
    zero.Init builds each rank's partition only, and under QLoRA (``lora`` quantized), whose
    base is quantized as it loads; offloaded states stay there while training
    (estimate.MemoryEstimate.host_gb). Nodes of a multi-node job are taken to be alike.
    """
    from dplaunch.planning.estimate import estimate_memory

    # FSDP: every rank builds the whole model, then shards it (what ZeRO-0 holds at load)
    if dims.fsdp is not None:
        dims = dataclasses.replace(dims, fsdp=None, offload="none")
    workload = Workload(mixed_precision=mixed_precision, task=task, lora=lora)
    adapters = count_lora(model, lora, task) if lora is not None else None
    memory = estimate_memory(model, dims, workload, lora=adapters)
    per_node = dims.gpus_per_node
    need = per_node * memory.host_gb
    line = f"host RAM: {memory.host_line(per_node)} of this node's {host_memory_gb:.1f} GiB"
    if need > host_memory_gb and refuse:
        fix = "use fewer ranks per node (--gpus-per-node) or a node with more memory"
        # zero.Init partitions a model as it is built, but not a quantized one
        if dims.zero_stage != 3 and not memory.host_load_quantized:
            fix = "use ZeRO-3 (each rank then builds only its partition), fewer ranks per " + (
                "node (--gpus-per-node) or a node with more memory"
            )
        raise UserError("launch.gpus_per_node", line, fix)
    if need > host_memory_gb:
        return line + ": more than it has (CPU ranks: not refused, a GPU launch would be)"
    if need > HOST_MEMORY_NOTE_FRACTION * host_memory_gb:
        return line
    return None


def check_export_memory(
    model: ModelFacts,
    dims: ParallelDims,
    mixed_precision: str,
    task: str,
    host_memory_gb: float,
    lora: LoraSpec,
    *,
    refuse: bool = True,
) -> str | None:
    """Refuse a LoRA plan whose end-of-training export cannot fit in node 0's RAM; a note when
    it takes most of it (``refuse=False``: a note either way, as check_host_memory).

    Rank 0 builds the base again in host RAM (planning.lora.export_host_bytes, in the dtype of
    planning.lora.export_dtype) while every rank of its node still holds its offloaded states."""
    from dplaunch.planning.estimate import GIB, count_parameters, estimate_memory
    from dplaunch.planning.lora import checkpoint_dtype, export_dtype, export_host_bytes

    adapters = count_lora(model, lora, task)
    workload = Workload(mixed_precision=mixed_precision, task=task, lora=lora)
    offloaded = estimate_memory(model, dims, workload, lora=adapters).cpu_gb
    dtype = export_dtype(mixed_precision, lora.quantize, checkpoint_dtype(model.raw))
    if lora.random_base:
        dtype = "float32"  # built in fp32 as in training, cast after
    export_gb = export_host_bytes(count_parameters(model, task).total, adapters, dtype) / GIB
    per_node = dims.gpus_per_node
    need = export_gb + per_node * offloaded
    what = "the PEFT folder" if lora.export == "adapter-only" else "the merged model"
    line = f"host RAM at export: rank 0 builds the base ({dtype}) for {what}, {export_gb:.1f} GiB"
    if lora.export == "adapter-only" and not lora.random_base:
        line = f"host RAM at export: rank 0 holds the adapters, {export_gb:.1f} GiB"
    if offloaded:
        line += f", + {per_node} rank(s) × {offloaded:.1f} GiB of offloaded states = {need:.1f} GiB"
    line += f" of this node's {host_memory_gb:.1f} GiB"
    if need > host_memory_gb and refuse:
        if lora.export == "merged":
            raise UserError(
                "model.lora.export",
                line,
                "set model.lora.export: adapter-only (the PEFT folder alone: the base is not "
                "built again), or use a node with more memory",
            )
        raise UserError(
            "model.config",
            line,
            "train from a pretrained base (model.name_or_path: an adapter-only export then "
            "does not build it), or use a node with more memory",
        )
    if need > host_memory_gb:
        return line + ": more than it has (CPU ranks: not refused, a GPU launch would be)"
    if need > HOST_MEMORY_NOTE_FRACTION * host_memory_gb:
        return line
    return None


# bf16 tensor cores (and bf16 in NCCL) start with Ampere; older GPUs emulate it slowly, or fail
BF16_MIN_COMPUTE_CAPABILITY = 8.0


def _mixed_precision(requested: str, target: Target, machine: Machine) -> str:
    if requested == "fp16" and target == "cpu":
        raise UserError(
            "train.mixed_precision",
            "fp16 needs GPUs (CPU ranks have no fp16 kernels)",
            "use bf16 or no on CPU",
        )
    oldest = machine.oldest_gpu
    if (
        requested == "bf16"
        and target == "gpu"
        and not machine.render_only
        and oldest is not None
        and oldest[0] < BF16_MIN_COMPUTE_CAPABILITY
    ):
        raise UserError(
            "train.mixed_precision",
            f"bf16 needs GPUs of compute capability {BF16_MIN_COMPUTE_CAPABILITY:.1f} (Ampere) or "
            f"newer, and this machine's {oldest[1]} has {oldest[0]:.1f}",
            "use --mixed-precision fp16 (loss-scaled) or no (fp32)",
        )
    return requested


def batch_math(global_batch: int, micro_batch: int | None, data_parallel: int) -> tuple[int, int]:
    """(micro batch, gradient accumulation) so that micro × accumulation × dp == global batch."""
    if micro_batch is None:
        if global_batch % data_parallel:
            raise UserError(
                "train.global_batch_size",
                f"{global_batch} is not divisible by the data-parallel size {data_parallel}",
                f"use a multiple of {data_parallel}: {_nearest(global_batch, data_parallel)}",
            )
        per_rank = global_batch // data_parallel
        micro_batch = max(
            m for m in range(1, min(per_rank, DEFAULT_MAX_MICRO_BATCH) + 1) if per_rank % m == 0
        )
    step = micro_batch * data_parallel
    if global_batch % step:
        raise UserError(
            "train.global_batch_size",
            f"global batch {global_batch} is not a multiple of micro batch {micro_batch} × "
            f"data-parallel size {data_parallel} = {step}",
            f"use {_nearest(global_batch, step)}, or change train.micro_batch_size",
        )
    return micro_batch, global_batch // step


def _nearest(value: int, step: int) -> str:
    below = (value // step) * step
    above = below + step
    return f"{below} or {above}" if below > 0 else str(above)


def pipeline_stage_names(model: ModelFacts, stages: int) -> list[str]:
    """Which layers each pipeline stage holds, balanced by parameters as the pipeline engine does."""
    if stages <= 1:
        return []
    from dplaunch.planning.partition import partition_layers

    return partition_layers(model, stages)
