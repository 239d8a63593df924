"""`parallel: auto`: the run takes the plan `dplaunch plan` recommends, and says why in one line.

Pure Python, like the rest of planning/: the GPU memory comes in from the caller (a run-file key,
or a function that asks nvidia-smi, called only when needed).

What the estimate assumes for the run (the same inputs `dplaunch plan CONFIG` uses):

- the layout the launcher will use: total ranks and ranks per node, as ``make_plan`` decides them;
- the micro batch of each layout: ``train.micro_batch_size``, or (unset) with a profile the
  fastest that fits of every micro batch that splits the global batch ÷ dp, accumulation
  following — without one the largest ≤ 8, as `train` derives it (plan.batch_math) — so every
  row trains the run's global batch a step; a layout whose dp cannot split it is not picked;
- activation checkpointing from ``model.gradient_checkpointing``, or (not in the run file) with
  a profile off, on, or every-K (one block in 2 or 4), whichever is fastest among the
  combinations that fit (candidates.LEVERS:
  the tuner searches the layout and these levers together, with no trial run); auto then writes
  the values it chose into the run's resolved file;
- sequence length ``data.max_length``, ``train.mixed_precision``, the attention kernel from
  ``model.attn_implementation``
  (unset: transformers' own pick, sdpa for the families that support it), the model's task and
  labels, and ``model.lora`` (adapters trained, the base frozen or quantized).

With ``parallel.fsdp`` set, auto picks among that engine's rows of the table (FSDP with or
without offload); without it, never an FSDP row (planning/candidates.py).

With a hardware profile (``launch.profile``, the user's cache of `dplaunch calibrate`, or the
datasheet of a known GPU) every row has a forecast step time (planning/forecast.py) and auto picks
the **fastest** row that fits; its note names the runner-up and why ("ZeRO-2 1.31 s/step beats
ZeRO-3 1.58 s/step: 40 % less all-gather traffic"). Without one it falls back to the rule of
planning/candidates.py (least splitting, then least traffic).

On CPU ranks there is no GPU memory to plan for: auto keeps DDP there and says so, unless
``launch.gpu_memory_gb`` gives a memory per rank, in which case the same rule picks as on GPUs
(this is how a GPU plan is rehearsed on CPU, and how the tests exercise it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dplaunch.config.schema import ParallelConfig, RunConfig, TrainConfig
from dplaunch.errors import UserError
from dplaunch.planning.candidates import (
    LEVERS,
    Candidate,
    Eligible,
    candidate_plans,
    recommendation_line,
    workload_memory,
)
from dplaunch.planning.forecast import Forecast, forecast_step
from dplaunch.planning.loss_chunk import chunk_setting
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.plan import (
    DEFAULT_MAX_MICRO_BATCH,
    Machine,
    Plan,
    _devices,
    _nodes,
    batch_math,
)
from dplaunch.planning.profiles import Profile
from dplaunch.planning.workload import Generation, LoraSpec, Workload
from dplaunch.tasks import task_of


@dataclass(frozen=True)
class AutoChoice:
    """The parallel section auto picked, the one line that says why, and the table it came from;
    ``settings``: the run-file keys of the levers it tuned with the layout (planning/candidates.py
    LEVERS: train.micro_batch_size, model.gradient_checkpointing) → their values."""

    parallel: ParallelConfig
    note: str
    candidates: tuple[Candidate, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)

    def apply(self, config: RunConfig) -> RunConfig:
        """CONFIG with the parallel section and the tuned levers auto chose."""
        sections: dict[str, Any] = {"parallel": self.parallel}
        for key, value in self.settings.items():
            section, name = key.split(".")
            current = sections.get(section, getattr(config, section))
            sections[section] = current.model_copy(update={name: value})
        return config.model_copy(update=sections)


def planning_micro_batch(train: TrainConfig) -> int:
    """The workload's micro batch before a layout is chosen: the configured one, or the largest
    any layout could derive (the table's rows take their own: candidates.layout_workload)."""
    if train.micro_batch_size is not None:
        return train.micro_batch_size
    limit = min(train.global_batch_size, DEFAULT_MAX_MICRO_BATCH)
    return max(m for m in range(1, limit + 1) if train.global_batch_size % m == 0)


def run_workload(config: RunConfig) -> Workload:
    """The workload of a run file."""
    task = task_of(config.model.task)
    generation = run_generation(config)
    return Workload(
        micro_batch=planning_micro_batch(config.train),
        # grpo trains rows of a prompt and its completion
        seq_len=config.data.max_length + (generation.completion_tokens if generation else 0),
        mixed_precision=config.train.mixed_precision,
        activation_checkpointing=config.model.checkpoint_every > 0,
        checkpoint_every=max(config.model.checkpoint_every, 1),
        task=config.model.task,
        num_labels=config.model.num_labels,
        global_batch_size=config.train.global_batch_size,
        fixed_micro_batch=config.train.micro_batch_size,
        attn_implementation=config.model.attn_implementation,
        # examples packed with their own masks, or sample answers, the pipeline cannot take
        pipeline=not (task.own_labels and (config.data.packing or config.train.sample_prompts)),
        sequence_parallel=True,
        lora=LoraSpec.from_config(config.model.lora),
        guard=config.train.on_nonfinite != "off",
        clip=config.train.max_grad_norm > 0,
        packed=task.examples and task.packs(config.data.packing),
        reference=reference_kind(config),
        loss_chunk=chunk_setting(config.train.loss_chunk, config.train.tiled_mlp),
        generation=generation,
        tunable=tunable_levers(config),
    )


def run_generation(config: RunConfig) -> Generation | None:
    """Workload.generation of a run: grpo's sampling (train.grpo), else None."""
    settings = config.train.grpo
    if not task_of(config.model.task).prompts or settings is None:
        return None
    return Generation(
        settings.num_generations, settings.max_completion_length, settings.num_iterations
    )


def tunable_levers(config: RunConfig) -> tuple[str, ...]:
    """The levers the run leaves to the tuner (Workload.tunable): the micro batch when
    train.micro_batch_size is unset, activation checkpointing when model.gradient_checkpointing
    is not in the run file (nor set by a flag)."""
    levers = []
    if config.train.micro_batch_size is None:
        levers.append("micro_batch")
    if "gradient_checkpointing" not in config.model.model_fields_set:
        levers.append("activation_checkpointing")
    return tuple(levers)


def reference_kind(config: RunConfig) -> str | None:
    """Workload.reference of a run: dpo with a loss that needs a reference, not precomputed, or
    grpo with beta > 0 holds a frozen "copy" of the model, or (LoRA) asks the policy with its
    "adapters" disabled."""
    train, task = config.train, task_of(config.model.task)
    needed = task.preference and train.preference.needs_reference and not train.precompute_ref
    # grpo's KL term compares the policy with its starting weights
    needed = needed or (task.prompts and train.grpo is not None and train.grpo.beta > 0)
    if not needed:
        return None
    return "adapters" if config.model.lora is not None else "copy"


def _runs_as_configured(workload: Workload) -> Callable[[Candidate], bool] | None:
    """No pipeline for data the pipeline cannot take (the plan table itself leaves out the
    layouts that cannot split the global batch)."""
    if workload.pipeline:
        return None
    return lambda candidate: candidate.pp == 1


def plan_candidates(
    facts: ModelFacts,
    workload: Workload,
    *,
    gpus: int,
    gpus_per_node: int,
    gpu_memory_gb: float,
    safety_margin: float = 0.1,
    fsdp: str | None = None,
    profile: Profile | None = None,
) -> list[Candidate]:
    """The plan table for this model and workload; layouts that cannot split the batch, or pipeline
    a run whose data the pipeline cannot take, are not picked. With a ``profile`` every row gets
    its forecast and the fastest that fits is picked."""
    return candidate_plans(
        facts,
        workload,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        gpu_memory_gb=gpu_memory_gb,
        safety_margin=safety_margin,
        eligible=Eligible(fsdp, _runs_as_configured(workload)),
        profile=profile,
    )


def _engine(fsdp: str | None) -> dict[str, str]:
    # set only when FSDP: the resolved run.yaml of a DDP/ZeRO plan stays as it was
    return {"fsdp": fsdp} if fsdp else {}


def resolve_auto_parallel(
    config: RunConfig,
    facts: ModelFacts,
    machine: Machine,
    measure_gpu_memory_gb: Callable[[], float | None] = lambda: None,
    profile: Profile | None = None,
) -> AutoChoice:
    """Replace ``parallel: auto`` by the recommended plan for this run and machine: with a
    ``profile``, the fastest forecast that fits."""
    given = config.parallel
    if (given.zero_stage, given.offload, given.tp, given.pp, given.sp) != (0, "none", 1, 1, 1):
        raise UserError(
            "parallel.auto",
            "auto picks zero_stage, offload, tp and pp itself (and sp)",
            "drop --zero/--offload/--tp/--pp/--sp (or those keys), or drop auto",
        )
    launch = config.launch
    target, gpus = _devices(launch, machine, [])
    _, per_node = _nodes(launch, gpus)
    memory = launch.gpu_memory_gb
    if memory is None and target == "cpu":
        return AutoChoice(
            ParallelConfig(**_engine(given.fsdp)),
            f"parallel: auto → {'FSDP ' + given.fsdp if given.fsdp else 'DDP'}: CPU ranks have "
            "no GPU memory to plan for "
            "(set launch.gpu_memory_gb to plan as for GPUs of that size)",
        )
    if memory is None:
        memory = measure_gpu_memory_gb()
    if memory is None:
        raise UserError(
            "launch.gpu_memory_gb",
            "parallel: auto needs the memory of one GPU and nvidia-smi did not report it",
            "set launch.gpu_memory_gb (GiB per GPU), e.g. --set launch.gpu_memory_gb=80",
        )
    workload = run_workload(config)
    candidates = plan_candidates(
        facts,
        workload,
        gpus=gpus,
        gpus_per_node=per_node,
        gpu_memory_gb=memory,
        fsdp=given.fsdp,
        profile=profile,
    )
    chosen = next((c for c in candidates if c.recommended), None)
    if chosen is None:
        if any(c.fits for c in candidates):
            # the best plan that fits cannot split this global batch: batch_math says how to fix it
            best = next(c for c in candidates if c.why)
            batch_math(workload.global_batch_size or 1, workload.fixed_micro_batch, best.dp)
        raise UserError("parallel.auto", recommendation_line(candidates))
    parallel = ParallelConfig(
        zero_stage=chosen.zero_stage,
        offload=chosen.offload,
        tp=chosen.tp,
        pp=chosen.pp,
        **_engine(chosen.fsdp),
        sp=chosen.sp,
    )
    source = "launch.gpu_memory_gb" if launch.gpu_memory_gb is not None else "nvidia-smi"
    note = f"parallel: auto → {chosen.why} ({memory:g} GB per GPU from {source})"
    levers = {lever.name: lever for lever in LEVERS}
    settings = {
        levers[name].key: levers[name].run_value(value) for name, value in chosen.settings.items()
    }
    return AutoChoice(parallel, note, tuple(candidates), settings)


def plan_workload(config: RunConfig, plan: Plan) -> Workload:
    """The workload of the run file under PLAN (its micro batch and global batch)."""
    return replace(
        run_workload(config),
        micro_batch=plan.micro_batch_size,
        global_batch_size=plan.global_batch_size,
    )


def layout_forecast(config: RunConfig, facts: ModelFacts, plan: Plan, profile: Profile) -> Forecast:
    """The forecast of the run's own layout on PROFILE (with the chunk the plan resolved)."""
    workload = replace(plan_workload(config, plan), loss_chunk=plan.loss_chunk)
    return forecast_step(
        facts, plan.dims, workload, profile, guard=workload.guard, clip=workload.clip
    )


def run_forecast(
    config: RunConfig, facts: ModelFacts, plan: Plan, profile: Profile
) -> dict[str, Any]:
    """The forecast of the run's own layout, as plan.json's ``forecast`` holds it (hours and
    GPU-hours to train.max_steps when it is set; the ranks know the steps of an epoch)."""
    return layout_forecast(config, facts, plan, profile).to_dict(steps=config.train.max_steps)


# the workload and its estimate live with the plan table; `dplaunch plan` and the benchmark take them from here
__all__ = [
    "AutoChoice",
    "Workload",
    "plan_candidates",
    "resolve_auto_parallel",
    "layout_forecast",
    "plan_workload",
    "run_forecast",
    "run_workload",
    "workload_memory",
]
