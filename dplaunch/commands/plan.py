"""`dplaunch plan`: every layout for N GPUs, its memory per GPU and traffic, and the one to use.

Reads only the model's config.json (or a run file's ``model.config``), never the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from dplaunch.commands.options import command, run_flag_option
from dplaunch.config.flags import (
    PLAN_PANEL,
    AttentionImplementation,
    LoraQuantize,
    MixedPrecision,
    TaskName,
)
from dplaunch.errors import UserError
from dplaunch.planning.profiles import GPU_SHEETS

if TYPE_CHECKING:
    from dplaunch.planning.candidates import Candidate
    from dplaunch.planning.estimate import MemoryEstimate
    from dplaunch.planning.job_time import JobSetting
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.profiles import Profile
    from dplaunch.planning.workload import Workload

# what a bare `--model` plans for, when no run file says otherwise
DEFAULT_SEQ_LEN = 2048
DEFAULT_MIXED_PRECISION = "bf16"


_WORKLOAD = "Workload"
_FORECAST = "Forecast"
# the classes of link between nodes the datasheet figures know (planning/profiles.py)
Interconnect = Literal["infiniband", "ethernet"]
IntraNode = Literal["nvlink", "pcie"]


@dataclass
class PlanOptions:
    """The options of `dplaunch plan` (None: not given), each one typer option."""

    config: Annotated[
        Path | None,
        typer.Argument(
            help="Run file (YAML): its model, train, data.max_length and launch sections. "
            "Default: the embedded default run file.",
            show_default=False,
        ),
    ] = None
    model: Annotated[
        str | None,
        typer.Option(
            "--model", help="Instead of a run file: hub id, model folder or config.json path."
        ),
    ] = None
    gpus: Annotated[int | None, run_flag_option("gpus", help="Total GPUs to plan for.")] = None
    nodes: Annotated[int | None, run_flag_option("nodes")] = None
    gpus_per_node: Annotated[int | None, run_flag_option("gpus_per_node")] = None
    gpu_memory: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory",
            help="GiB of one GPU (default: launch.gpu_memory_gb, else --gpu-type's datasheet, "
            "else nvidia-smi).",
            rich_help_panel=PLAN_PANEL,
        ),
    ] = None
    micro_batch: Annotated[
        int | None,
        run_flag_option("micro_batch", help="Samples per forward pass per GPU.", panel=_WORKLOAD),
    ] = None
    global_batch: Annotated[
        int | None,
        run_flag_option("global_batch", help="Samples per optimizer step.", panel=_WORKLOAD),
    ] = None
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            help="Tokens per sample (default data.max_length, or 2048).",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None
    mixed_precision: Annotated[
        MixedPrecision | None,
        run_flag_option(
            "mixed_precision", help="no, fp16 or bf16 (--model default: bf16).", panel=_WORKLOAD
        ),
    ] = None
    activation_checkpointing: Annotated[
        bool,
        typer.Option(
            "--activation-checkpointing",
            help="Plan with activation checkpointing.",
            rich_help_panel=_WORKLOAD,
        ),
    ] = False
    attn_implementation: Annotated[
        AttentionImplementation | None,
        typer.Option(
            "--attn-implementation",
            help="Attention kernel (default: model.attn_implementation, else what transformers "
            "picks: sdpa where supported). Only eager keeps the s×s scores.",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None
    task: Annotated[
        TaskName | None, typer.Option("--task", help="The model's head.", rich_help_panel=_WORKLOAD)
    ] = None
    # LoRA rank (None: the run file's model.lora, else full fine-tuning) and QLoRA's base
    lora: Annotated[
        int | None,
        typer.Option(
            "--lora",
            min=1,
            metavar="R",
            help="Plan LoRA training of rank R (adapters on every linear layer; the base frozen).",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None
    quantize: Annotated[
        LoraQuantize | None,
        typer.Option(
            "--quantize",
            help="QLoRA: the frozen base in 4-bit (nf4) or 8-bit (with --lora).",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None
    cpu: Annotated[
        bool,
        run_flag_option(
            "cpu", help="Plan CPU ranks: the forecast uses this machine's `dplaunch calibrate`."
        ),
    ] = False
    max_steps: Annotated[
        int | None,
        run_flag_option(
            "max_steps", help="Optimizer steps the hours and GPU-hours are for.", panel=_FORECAST
        ),
    ] = None
    profile: Annotated[
        Path | None,
        run_flag_option(
            "profile",
            help="Hardware profile (dplaunch calibrate --out). Default: the user's cache for this "
            "hardware, else the GPU's datasheet.",
            panel=_FORECAST,
        ),
    ] = None
    gpu_type: Annotated[
        str | None,
        typer.Option(
            "--gpu-type",
            help="The GPU to plan for by its datasheet (its memory, and its rates when no "
            f"profile is known): {', '.join(GPU_SHEETS)} (a size in the name, 'A100 40GB', "
            "sets the memory), or a GPU calibrated here (default: nvidia-smi's).",
            rich_help_panel=_FORECAST,
        ),
    ] = None
    interconnect: Annotated[
        Interconnect | None,
        typer.Option(
            "--interconnect",
            help="Between nodes, for the datasheet figures (default infiniband).",
            rich_help_panel=_FORECAST,
        ),
    ] = None
    intra_node: Annotated[
        IntraNode | None,
        typer.Option(
            "--intra-node",
            help="Between the GPUs of a node, for the datasheet figures (default: NVLink on SXM "
            "boards, PCIe for PCIe and NVL cards, whose NVLink bridges join pairs).",
            rich_help_panel=_FORECAST,
        ),
    ] = None
    price_per_gpu_hour: Annotated[
        float | None,
        typer.Option(
            "--price-per-gpu-hour",
            min=0,
            help="Price of one GPU-hour: adds each plan's cost to train.max_steps.",
            rich_help_panel=_FORECAST,
        ),
    ] = None
    safety_margin: Annotated[
        float, typer.Option("--safety-margin", help="Fraction of GPU memory kept free.")
    ] = 0.1
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the rows as a JSON list instead of a table.")
    ] = False
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            help="A checkpoint (or run directory): say what resuming it under the recommended "
            "layout converts, and about how long that takes.",
        ),
    ] = None
    assignments: Annotated[
        list[str],
        typer.Option("--set", help="Override a run-file key: --set data.max_length=4096."),
    ] = field(default_factory=list)


@command()
def plan_command(options: PlanOptions) -> int:
    """Memory per GPU and traffic of every DDP / ZeRO / offload / tp / pp plan; marks the one to use."""
    return run_plan(options)


@dataclass
class PlanSetting:
    """Everything the table is computed from, with where each value came from."""

    facts: ModelFacts
    model_label: str
    workload: Workload
    gpus: int
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    memory_source: str
    # the forecast's rates (None: no profile known, no forecast); the steps hours are for
    profile: Profile | None = None
    max_steps: int | None = None
    # "cpu": CPU ranks (--cpu, launch.cpu)
    target: str = "gpu"
    # what the hours count besides the steps (None: train.max_steps unknown)
    job: JobSetting | None = None


def _from_run_file(options: PlanOptions) -> tuple[ModelFacts, str, Workload, Any]:
    """(facts, label, workload, the run file's RunConfig)."""
    from dplaunch.config.load import load_run_config
    from dplaunch.launching.prepare import model_facts
    from dplaunch.planning.auto import run_workload

    overrides = {
        "launch.gpus": options.gpus,
        "launch.nodes": options.nodes,
        "launch.gpus_per_node": options.gpus_per_node,
        "launch.gpu_memory_gb": options.gpu_memory,
        "train.micro_batch_size": options.micro_batch,
        "train.global_batch_size": options.global_batch,
        "train.mixed_precision": options.mixed_precision,
        "data.max_length": options.seq_len,
        "model.gradient_checkpointing": options.activation_checkpointing or None,
        "model.attn_implementation": options.attn_implementation,
        "model.task": options.task,
        "model.lora.r": options.lora,
        "launch.cpu": options.cpu or None,
        "launch.profile": str(options.profile) if options.profile else None,
        "train.max_steps": options.max_steps,
    }
    config = load_run_config(options.config, overrides=overrides, assignments=options.assignments)
    if options.quantize is not None:
        if config.model.lora is None:
            raise UserError(
                "--quantize",
                "QLoRA quantizes the frozen base of a LoRA run, and this run trains every weight",
                "add --lora R (or model.lora to the run file)",
            )
        config.model.lora.quantize = options.quantize
    facts = model_facts(config.model)
    label = config.model.name_or_path or f"{facts.model_type} from the run file's model.config"
    # sequence-parallel rows when the sequence length is the question (--seq-len)
    workload = replace(run_workload(config), sequence_parallel=options.seq_len is not None)
    return facts, label, workload, config


def _model_config(model: str) -> dict[str, Any]:
    """config.json of a folder, a cached hub model, or (online) fetched alone from the hub."""
    from dplaunch.hub import hub_offline, hub_unreachable, looks_like_path
    from dplaunch.planning.model_facts import load_config_json

    if model.startswith("pkg:"):  # how run files name a model shipped in a Python package
        from dplaunch.config.load import resolve_package_path

        model = resolve_package_path(model)
    if (
        hub_offline(for_datasets=False)
        or Path(model).expanduser().exists()
        or looks_like_path(model)
    ):
        # a local path is reported for what it is (a broken folder is no reason to ask the hub)
        return load_config_json(model, field="--model")
    try:
        return load_config_json(model, field="--model")
    except UserError:
        problem = hub_unreachable()  # one try, not huggingface_hub's retries over 24 s
        if problem is None:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.utils import logging as hub_logging

            hub_logging.set_verbosity_error()  # its retry lines: the one line below says it
            try:
                path = hf_hub_download(model, "config.json")  # this one file, never the weights
                return json.loads(Path(path).read_text())
            except Exception as error:  # noqa: BLE001 — not on the hub, gated, or no network
                problem = type(error).__name__
        raise UserError(
            "--model",
            f"{model!r} is neither a local folder, in the Hugging Face cache, nor reachable "
            f"({problem})",
            "download its config first (hf download ID config.json) or give a path",
        ) from None


def _from_model(options: PlanOptions) -> tuple[ModelFacts, str, Workload]:
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.workload import LoraSpec, Workload

    if options.assignments:
        raise UserError("--set", "overrides a run file's keys", "give a run file, or drop --set")
    if options.quantize is not None and options.lora is None:
        raise UserError(
            "--quantize",
            "QLoRA quantizes the frozen base of a LoRA run",
            "add --lora R (the adapters' rank, e.g. --lora 16)",
        )
    from dplaunch.tasks import CAUSAL_LM, task_of

    raw = _model_config(options.model or "")
    facts = ModelFacts.from_config_dict(raw)
    task = task_of(options.task or CAUSAL_LM.name)
    seq_len = options.seq_len or min(facts.max_positions or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN)
    workload = Workload(
        micro_batch=options.micro_batch or 1,
        seq_len=int(seq_len),
        mixed_precision=options.mixed_precision or DEFAULT_MIXED_PRECISION,
        activation_checkpointing=options.activation_checkpointing,
        task=task.name,
        num_labels=None,
        global_batch_size=options.global_batch,
        # without --micro-batch each layout's own from --global-batch (tuned with a profile)
        fixed_micro_batch=options.micro_batch or (None if options.global_batch else 1),
        attn_implementation=options.attn_implementation,
        sequence_parallel=options.seq_len is not None,
        lora=LoraSpec(r=options.lora, quantize=options.quantize) if options.lora else None,
        # dpo's reference model, unless LoRA's adapters disabled give it
        reference=("adapters" if options.lora else "copy") if task.preference else None,
        tunable=tuple(
            lever
            for lever, given in (
                ("micro_batch", options.micro_batch),
                ("activation_checkpointing", options.activation_checkpointing),
            )
            if not given
        ),
    )
    return facts, str(options.model), workload


def resolve_setting(options: PlanOptions) -> PlanSetting:
    """Model facts, workload and GPUs from the flags, a run file, and the machine (in that order)."""
    from dplaunch.config.schema import LaunchConfig
    from dplaunch.planning.plan import _nodes

    if options.model is not None and options.config is not None:
        raise UserError(
            "--model", "a run file already names the model", "give either CONFIG or --model"
        )
    check_gpu_type(options)
    launch, max_steps, config = None, options.max_steps, None
    if options.model is not None:
        facts, label, workload = _from_model(options)
    else:
        facts, label, workload, config = _from_run_file(options)
        launch, max_steps = config.launch, config.train.max_steps
    cpu = options.cpu or bool(launch and launch.cpu)

    gpus = options.gpus or (launch.gpus if launch else None)
    if gpus is None and not cpu:
        from dplaunch.launching.devices import visible_gpu_count

        gpus = visible_gpu_count() or None
    if gpus is None or gpus < 1:
        raise UserError(
            "--gpus", "how many GPUs to plan for?", "give --gpus N (all nodes together)"
        )
    layout = LaunchConfig(
        gpus=gpus,
        nodes=options.nodes or (launch.nodes if launch else 1),
        gpus_per_node=options.gpus_per_node or (launch.gpus_per_node if launch else None),
    )
    nodes, per_node = _nodes(layout, gpus)
    memory, source = _memory(options, launch, cpu, per_node)
    return PlanSetting(
        facts,
        label,
        workload,
        gpus,
        nodes,
        per_node,
        memory,
        source,
        profile=_profile(options, launch, cpu, per_node, nodes),
        max_steps=max_steps,
        target="cpu" if cpu else "gpu",
        job=_job_setting(config, max_steps, facts, workload, nodes),
    )


def _job_setting(
    config: Any, max_steps: int | None, facts: ModelFacts, workload: Workload, nodes: int
) -> JobSetting | None:
    """The run's job besides its steps (a run file's evaluations and checkpoints; --model: the
    steps alone); None without train.max_steps."""
    from dplaunch.planning.job_time import JobSetting, RunSchedule, run_schedule

    if max_steps is None:
        return None
    if config is None:
        schedule = RunSchedule(max_steps, evaluations=0, eval_samples=0, saves=0, nodes=nodes)
    else:
        schedule = run_schedule(config, nodes)
        assert schedule is not None
    return JobSetting.of(schedule, facts, workload)


def _memory(options: PlanOptions, launch: Any, cpu: bool, per_node: int) -> tuple[float, str]:
    """GiB of one GPU (a CPU rank's share of the host's RAM), and where it came from."""
    memory, source = options.gpu_memory, "--gpu-memory"
    if memory is None and launch is not None and launch.gpu_memory_gb is not None:
        memory, source = launch.gpu_memory_gb, "launch.gpu_memory_gb"
    if memory is None and cpu:
        from dplaunch.launching.devices import host_memory_gb

        host = host_memory_gb()
        if host is not None:
            memory, source = host / per_node, f"the host's RAM / {per_node} CPU ranks"
    if memory is None and options.gpu_type is not None:
        from dplaunch.planning.profiles import gpu_memory_gb

        memory, source = gpu_memory_gb(options.gpu_type), f"--gpu-type {options.gpu_type}"
    if memory is None:
        from dplaunch.launching.devices import smallest_gpu_memory_gb

        memory, source = smallest_gpu_memory_gb(), "nvidia-smi"
    if memory is None:
        raise UserError(
            "--gpu-memory",
            "no GPU here to read the memory from",
            "give the GiB of one GPU, e.g. --gpu-memory 80 (H100 80GB) or 32 (V100 32GB)",
        )
    if memory <= 0:
        raise UserError("--gpu-memory", f"{memory} GB", "give the GiB of one GPU, e.g. 80")
    return memory, source


def _profile(
    options: PlanOptions, launch: Any, cpu: bool, per_node: int, nodes: int
) -> Profile | None:
    """--profile FILE (launch.profile), else this hardware's calibration in the user's cache,
    else the datasheet of --gpu-type or the visible GPU; None: no forecast."""
    from dplaunch.launching.devices import cpu_device_name, visible_gpus
    from dplaunch.planning.profiles import choose_profile

    if cpu:
        device: str | None = cpu_device_name()
    else:
        device = options.gpu_type or next((gpu.name for gpu in visible_gpus()), None)
    path = options.profile or (Path(launch.profile) if launch and launch.profile else None)
    return choose_profile(
        device,
        per_node,
        nodes,
        path=path,
        interconnect=options.interconnect,
        intra=options.intra_node,
    )


def check_gpu_type(options: PlanOptions) -> None:
    """Refuse a --gpu-type that no datasheet and no calibration here knows (it would be ignored)."""
    from dplaunch.planning.profiles import known_device

    if options.gpu_type is not None and not known_device(options.gpu_type):
        raise UserError(
            "--gpu-type",
            f"{options.gpu_type!r} has no datasheet and no profile calibrated here",
            f"one of {', '.join(GPU_SHEETS)}, or run `dplaunch calibrate` on it",
        )


def _short(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.1f} M"


def describe(setting: PlanSetting, safety_margin: float) -> list[str]:
    """The lines above the table: model, workload, GPUs, and what the numbers assume."""
    from dplaunch.planning.estimate import count_parameters
    from dplaunch.planning.lora import count_lora, lora_line
    from dplaunch.planning.model_facts import attention_implementation
    from dplaunch.tasks import task_of

    work = setting.workload
    count = count_parameters(setting.facts, work.task, work.num_labels)
    exact = "exact count from the config" if count.exact else "APPROXIMATE: " + count.note
    usable = setting.gpu_memory_gb * (1 - safety_margin)
    batch = f", global batch {work.global_batch_size}" if work.global_batch_size else ""
    attention = attention_implementation(setting.facts.model_type, work.attn_implementation)
    picked = "" if work.attn_implementation else ", as transformers picks it"
    scores = "keeps" if attention == "eager" else "never builds"
    tuned = setting.profile is not None and bool(work.tunable)
    tuned_micro = work.fixed_micro_batch is None and tuned and "micro_batch" in work.tunable
    micro = str(work.micro_batch)
    if work.fixed_micro_batch is None:
        # each row's is the run's batch maths on its dp (candidates.layout_workload)
        micro = "tuned" if tuned_micro else f"up to {work.micro_batch}"
    if work.rows_per_sample > 1:
        micro += f" pairs ({work.micro_batch * work.rows_per_sample} rows: chosen and rejected in one forward)"
    if tuned_micro:
        micro += " (each layout's fastest that fits of those that split global batch ÷ dp: column micro = micro batch × accumulation; set train.micro_batch_size to keep one)"
    elif work.fixed_micro_batch is None:
        micro += " (each layout's: the largest that splits global batch ÷ dp, as train derives it; set train.micro_batch_size)"
    every = work.checkpoint_every if work.activation_checkpointing else 0
    checkpointing = "off" if not every else "on" if every == 1 else f"on, 1 block in {every}"
    if tuned and "activation_checkpointing" in work.tunable:
        checkpointing = "off, on, or on for 1 block in 2 or 4, each layout's fastest that fits (column ckpt: off, on, 1/K; set model.gradient_checkpointing to keep one)"
    lora = []
    if work.lora is not None:
        adapters = count_lora(setting.facts, work.lora, work.task, work.num_labels)
        lora = [lora_line(adapters, count.total)]
    return [
        f"model: {setting.model_label} ({setting.facts.model_type}, {work.task}): "
        f"{count.total:,} parameters ({_short(count.total)}; {exact})",
        f"per GPU: micro batch {micro} × sequence {work.seq_len}{batch}, "
        f"{work.mixed_precision if work.mixed_precision != 'no' else 'fp32'}, activation "
        f"checkpointing {checkpointing}, {attention} "
        f"attention{picked} ({scores} the s×s attention scores)",
        f"{setting.gpus} GPUs ({setting.nodes} node(s) × {setting.gpus_per_node}), "
        f"{setting.gpu_memory_gb:g} GB each (from {setting.memory_source}); a plan fits in "
        f"{usable:.1f} GB ({safety_margin:.0%} kept free)",
        "states = weights + gradients + optimizer (Adam), busiest GPU; activ = the layers' "
        "activations; other = logits, buffers, CUDA context (the breakdown below); "
        "comm/step = GB each GPU sends per optimizer step; cpu = host memory for offload",
        *lora,
        *([_reference_line(work)] if task_of(work.task).preference else []),
        *forecast_lines(setting),
    ]


def forecast_lines(setting: PlanSetting) -> list[str]:
    """What the forecast columns are, on which profile; or why there are none."""
    profile = setting.profile
    devices = "CPU ranks" if setting.target == "cpu" else "GPUs"
    if profile is None:
        how = (
            "run `dplaunch calibrate --cpu --gpus N` on this machine"
            if setting.target == "cpu"
            else "run `dplaunch calibrate` on the GPUs, or give --gpu-type "
            f"({', '.join(GPU_SHEETS)})"
        )
        return [f"no forecast: no profile of these {devices} ({how}, or --profile FILE)"]
    job = (
        f"the job: {setting.max_steps:,} steps (train.max_steps), start-up, evaluations and "
        "checkpoints (docs: Planning › The job's hours)"
        if setting.max_steps
        else "train.max_steps (unset: give --max-steps)"
    )
    return [
        f"forecast on {profile.label}: s/step = one optimizer step, tokens/s, MFU = the model's "
        f"FLOPs / (step × GPUs × peak), hours and GPU-hours of {job}",
        *(f"  profile note: {note}" for note in profile.notes),
    ]


def _reference_line(work: Workload) -> str:
    if work.holds_reference:
        return "reference model: a frozen copy of the weights, held as the policy's are (counted)"
    if work.reference == "adapters":
        return "reference model: the policy with its LoRA adapters disabled (none held)"
    return "reference model: none (precomputed, or a reference-free loss)"


def plan_table(options: PlanOptions) -> tuple[PlanSetting, list[Candidate]]:
    """The setting and its candidate plans (one recommended unless nothing fits)."""
    from dplaunch.planning.auto import plan_candidates

    setting = resolve_setting(options)
    candidates = plan_candidates(
        setting.facts,
        setting.workload,
        gpus=setting.gpus,
        gpus_per_node=setting.gpus_per_node,
        gpu_memory_gb=setting.gpu_memory_gb,
        safety_margin=options.safety_margin,
        profile=setting.profile,
    )
    return setting, candidates


def run_plan(options: PlanOptions) -> int:
    """Print the table (or its JSON rows); exit 0 even when nothing fits (the table says so)."""
    from dplaunch.planning.candidates import format_table, to_json_rows

    setting, candidates = plan_table(options)
    price = options.price_per_gpu_hour
    resume_line = _resume_line(options.resume, candidates, setting) if options.resume else None
    if options.as_json:
        rows = to_json_rows(candidates, setting.job, price)
        typer.echo(json.dumps(rows, indent=2))
        return 0
    for line in describe(setting, options.safety_margin):
        typer.echo(line)
    typer.echo("")
    typer.echo(format_table(candidates, setting.job, price))
    shown = next((c for c in candidates if c.recommended), None) or next(
        (c for c in candidates if c.why), None
    )
    if shown is not None and shown.memory is not None:
        typer.echo("")
        typer.echo(f"memory of one GPU under {shown.layout} (GiB):")
        for line in shown.memory.breakdown_lines():
            typer.echo(line)
        typer.echo(host_memory_line(shown.memory, setting.gpus_per_node))
    if resume_line is not None:
        typer.echo("")
        typer.echo(resume_line)
    return 0


def _resume_line(checkpoint: Path, candidates: list[Candidate], setting: PlanSetting) -> str:
    """What resuming CHECKPOINT under the recommended layout does: loads as it is, or converts
    once through the universal form, and about how long that takes."""
    from dplaunch.launching.resume import check_layout
    from dplaunch.run_directory.checkpoints import find_checkpoint
    from dplaunch.run_directory.files import read_plan_file

    info = find_checkpoint(checkpoint.expanduser()).info
    chosen = next((c for c in candidates if c.recommended), None)
    if chosen is None:
        return f"resume: {info.path} (step {info.step}): no layout fits, so none to resume under"
    dims = chosen.dims(setting.gpus, setting.gpus_per_node)
    precision = setting.workload.mixed_precision
    convert, notes = check_layout(read_plan_file(info.path), dims, precision, info)
    what = notes[0] if convert else f"loads as it is under {dims.name(precision)}"
    return f"resume: {info.path} (step {info.step}): {what}"


def host_memory_line(memory: MemoryEstimate, ranks_per_node: int) -> str:
    """Host RAM per node the plan needs (every rank loads the model at once), beside this node's."""
    from dplaunch.launching.devices import host_memory_gb

    here = host_memory_gb()
    known = f"; this node has {here:.0f} GiB" if here is not None else ""
    return f"host RAM: {memory.host_line(ranks_per_node)}{known}"
