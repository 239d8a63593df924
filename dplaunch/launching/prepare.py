"""From CLI flags to a prepared run: resolved config, plan, rendered files, exact argv. Nothing written."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dplaunch.cluster.environments import detect_job
from dplaunch.cluster.hostfile import launch_for_hostfile, read_hostfile
from dplaunch.cluster.hostlist import expand_hostlist
from dplaunch.cluster.jobs import ClusterJob, launch_for_job
from dplaunch.cluster.slurm import (
    SlurmAllocation,
    detect_allocation,
    launch_for_allocation,
    rank_threads,
)
from dplaunch.config.flags import RunFlags
from dplaunch.config.load import dump_run_config, load_run_config
from dplaunch.config.schema import LaunchConfig, ModelConfig, RunConfig, ScriptRunConfig
from dplaunch.config.trackers import check_trackers_installed
from dplaunch.data.checks import check_data
from dplaunch.errors import UserError
from dplaunch.launching.deepspeed_ops import (
    check_ops_can_be_built,
    loads_deepspeed,
    torch_extensions_dir,
)
from dplaunch.launching.devices import (
    Gpu,
    cpu_device_name,
    host_memory_gb,
    local_gpus,
    oldest_compute_capability,
    smallest_gpu_memory_gb,
    visible_keys,
)
from dplaunch.launching.ports import claim_free_port, claim_gpu, claim_port
from dplaunch.planning.model_facts import (
    ModelFacts,
    check_model_type,
    check_sequence_length,
    check_tokenizer,
    load_config_json,
)
from dplaunch.planning.plan import Machine, ModelChoices, Plan, make_plan
from dplaunch.planning.profiles import Profile
from dplaunch.planning.rules import check_checkpoint_every, check_sequence_length_splits
from dplaunch.rendering.accelerate_config import accelerate_config_name, render_accelerate_config
from dplaunch.rendering.deepspeed_config import render_deepspeed_config
from dplaunch.rendering.launch_command import (
    hostfile_launch_argv,
    launch_argv,
    launch_script_name,
    render_launch_script,
)
from dplaunch.run_directory.environment import ERRORS_DIR_ENV, TIMEOUT_MINUTES_ENV
from dplaunch.run_directory.files import plan_text
from dplaunch.run_directory.layout import (
    DEEPSPEED_FILE,
    DEFAULT_RUNS_DIR,
    ERRORS_DIR,
    LAUNCH_SCRIPT,
    NCCL_TRACE_FILE_PREFIX,
    PLAN_FILE,
    RUN_FILE,
)
from dplaunch.tasks import task_of

# seconds a host name may take to resolve before the check gives up (and lets the launch try)
MASTER_ADDR_RESOLVE_SECONDS = 5.0


@dataclass
class PreparedRun:
    """A run ready to be written and started."""

    config: RunConfig | ScriptRunConfig
    plan: Plan
    run_dir: Path
    files: dict[str, str]
    argv: list[str]
    env: dict[str, str]
    # where a scheduler's job decided the launch section (ClusterJob.note), said first
    cluster_note: str | None = None


def model_facts(model: ModelConfig) -> ModelFacts:
    """Shape facts of the configured model, from model.config or the model's config.json."""
    if model.config is not None:
        check_model_type(str(model.config["model_type"]), "model.config.model_type")
        return ModelFacts.from_config_dict(model.config)
    config_json = load_config_json(model.name_or_path or "")
    _refuse_code_not_trusted(model, config_json)
    # a model with code of its own may name its own type; without model_type transformers guesses
    # the type from the folder's name
    if config_json.get("model_type") and not config_json.get("auto_map"):
        check_model_type(str(config_json["model_type"]), "model.name_or_path")
    return ModelFacts.from_config_dict(config_json)


def local_machine(*, render_only: bool = False) -> tuple[Machine, list[Gpu]]:
    """What the planner may know of this machine, and the GPUs this process may use."""
    count, gpus = local_gpus()
    machine = Machine(
        visible_gpus=count,
        render_only=render_only,
        oldest_gpu=oldest_compute_capability(gpus),
        host_memory_gb=host_memory_gb(),
    )
    return machine, gpus


def check_master_addr(launch: LaunchConfig) -> None:
    """A rendezvous host name that does not resolve would leave every node waiting: refuse it."""
    address = launch.master_addr
    if address in ("127.0.0.1", "localhost", "::1"):
        return
    failure: list[str] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(address, None)
        except (OSError, UnicodeError) as error:
            failure.append(str(error))

    # getaddrinfo has no timeout of its own: a slow resolver must not stall the launch
    resolver = threading.Thread(target=resolve, daemon=True)
    resolver.start()
    resolver.join(MASTER_ADDR_RESOLVE_SECONDS)
    if failure:
        raise UserError(
            "launch.master_addr",
            f"cannot resolve {address!r} ({failure[0]}): no node could reach the rendezvous",
            "give the head node's host name or IP address as the other nodes see it "
            "(--master-addr, the same on every node)",
        )


def _refuse_code_not_trusted(model: ModelConfig, config_json: dict[str, Any]) -> None:
    # a model folder can map itself to Python files of its own (config.json "auto_map"); transformers
    # runs them only with trust_remote_code, and without it every rank fails. Say so before launch,
    # unless transformers has the architecture built in (then it uses its own code)
    auto_map = config_json.get("auto_map")
    if model.trust_remote_code or not isinstance(auto_map, dict) or not auto_map:
        return
    model_type = str(config_json.get("model_type", ""))
    spec = importlib.util.find_spec("transformers")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        models = Path(spec.submodule_search_locations[0]) / "models"
        if model_type and (models / model_type.replace("-", "_")).is_dir():
            return
    code = ", ".join(sorted({str(v if isinstance(v, str) else v[0]) for v in auto_map.values()}))
    raise UserError(
        "model.trust_remote_code",
        f"{model.name_or_path} runs its own Python code ({code}) for model_type {model_type!r}, "
        "and dplaunch runs no downloaded code unless told to",
        "read that code; if you trust it, set model.trust_remote_code=true",
    )


@dataclass(frozen=True)
class ThisMachine:
    """What settling a plan on this machine needs to know."""

    # the GPUs this process may use (local_machine)
    gpus: list[Gpu]
    # False when someone else places the ranks (SLURM's own CUDA_VISIBLE_DEVICES, DeepSpeed's
    # hostfile runner) or the files are only rendered: no GPU is claimed then
    claims_gpus: bool
    # the files are for another machine: nothing here is claimed or built
    render_only: bool
    # OMP_NUM_THREADS for each rank and where it comes from (openmp_threads; None: the launcher's)
    threads: tuple[str, str] | None


@dataclass(frozen=True)
class CheckedRun:
    """A training run's config once its checks passed, its model's shape, and what they noted."""

    config: RunConfig
    facts: ModelFacts
    notes: tuple[str, ...]


def run_profile(launch: LaunchConfig, machine: Machine, gpus: list[Gpu]) -> Profile | None:
    """The hardware profile the run's forecast divides by: launch.profile, else `dplaunch
    calibrate`'s for this hardware in the user's cache, else a known GPU's datasheet; None when
    none is known (CPU ranks never calibrated, a GPU without a datasheet, files rendered for
    another machine)."""
    from dplaunch.planning.plan import _devices, _nodes
    from dplaunch.planning.profiles import choose_profile

    if machine.render_only and not launch.profile:
        return None  # the GPUs are another machine's
    target, total = _devices(launch, machine, [])
    nodes, per_node = _nodes(launch, total)
    device = cpu_device_name() if target == "cpu" else (gpus[0].name if gpus else None)
    path = Path(launch.profile) if launch.profile else None
    return choose_profile(device, per_node, nodes, path=path, field_name="launch.profile")


def prepare_training_run(
    flags: RunFlags,
    *,
    render_only: bool = False,
    out_dir: Path | None = None,
    use_allocation: bool = True,
) -> PreparedRun:
    """Check, plan, settle on this machine and render a training run, each once. Raises
    UserError, writes nothing.

    Inside a SLURM job the allocation decides the launch section (``use_allocation=False``
    for `dplaunch slurm`, which plans another job).
    """
    config: RunConfig = load_run_config(
        flags.config, overrides=flags.overrides(), assignments=flags.assignments
    )
    allocation = current_allocation() if use_allocation else None
    job = current_job(allocation) if use_allocation else None
    checked = check_training_run(config, allocation, render_only=render_only, job=job)
    machine, gpus = local_machine(render_only=render_only)
    config, plan = plan_training_run(checked, machine, gpus)
    run_dir = out_dir or Path(config.output_dir or _default_run_dir(config.name or "run"))
    here = ThisMachine(
        gpus,
        claims_gpus=not (render_only or job is not None or config.launch.hostfile),
        render_only=render_only,
        # `dplaunch slurm` plans another machine: the job decides its threads itself
        threads=openmp_threads(plan, allocation, here=not render_only) if use_allocation else None,
    )
    target = ["-m", "dplaunch.train", str(run_dir.absolute())]
    prepared = settle_and_render(config, plan, run_dir, target, here)
    prepared.cluster_note = job.note() if job is not None else None
    return prepared


def check_training_run(
    config: RunConfig,
    allocation: SlurmAllocation | None,
    *,
    render_only: bool,
    job: ClusterJob | None = None,
) -> CheckedRun:
    """Everything about a training run that can be refused before planning: the cluster's launch
    section, the model, its tokenizer, the data (SFT examples too) and the trackers."""
    launch, notes = launch_for_cluster(
        config.launch, allocation=allocation, render_only=render_only, job=job
    )
    config = config.model_copy(update={"launch": launch})
    facts = model_facts(config.model)
    check_checkpoint_every(config.model.checkpoint_every, facts.num_layers)
    length_note = check_sequence_length(
        facts, config.data.max_length, from_run_file=config.model.config is not None
    )
    if length_note is not None:
        notes.append(length_note)
    check_sequence_length_splits(config.parallel.sp, config.data.max_length)
    check_tokenizer(config.model)
    check_trackers_installed(config.train.report_to)
    if config.data.mixture is not None or config.data.eval_datasets is not None:
        # each source checked as a dataset of its own (data/mixture_checks.py)
        from dplaunch.data.mixture_checks import check_evaluation_sets, check_mixture

        check_evaluation_sets(config, notes)
    if config.data.mixture is not None:
        check_mixture(config, notes)
        return CheckedRun(config, facts, tuple(notes))
    from dplaunch.data.example_checks import check_examples
    from dplaunch.data.sft_checks import data_task_of

    data_task = data_task_of(config)
    dataset_classes = check_data(
        config.data,
        data_task,
        config.train.global_batch_size,
        num_labels=config.model.num_labels,
        classes_named="num_labels" in config.model.model_fields_set,
        notes=notes,
    )
    notes.extend(check_examples(config, data_task))
    if config.data.streaming and config.data.count_stream:
        config = _count_stream(config, data_task, notes)
    if dataset_classes is not None:
        # as HF's run_glue: the dataset's ClassLabel names the classes (and counts them)
        data = config.data.model_copy(update={"label_names": list(dataset_classes)})
        model = config.model.model_copy(update={"num_labels": len(dataset_classes)})
        config = config.model_copy(update={"data": data, "model": model})
        notes.append(
            f"data.label_names: {', '.join(dataset_classes)} (the dataset's ClassLabel "
            f"{config.data.label_column!r}); model.num_labels {len(dataset_classes)}"
        )
    return CheckedRun(config, facts, tuple(notes))


def plan_training_run(
    checked: CheckedRun, machine: Machine, gpus: list[Gpu]
) -> tuple[RunConfig, Plan]:
    """The plan of a checked run (`parallel: auto` picks its layout first) and the config that
    says the layout chosen."""
    config, facts = checked.config, checked.facts
    auto_notes: tuple[str, ...] = ()
    profile = run_profile(config.launch, machine, gpus)
    if config.parallel.auto:
        from dplaunch.planning.auto import resolve_auto_parallel

        auto = resolve_auto_parallel(
            config, facts, machine, lambda: smallest_gpu_memory_gb(gpus), profile
        )
        # the layout, and the micro batch and checkpointing it was tuned with (when left open)
        config = auto.apply(config)
        auto_notes = (auto.note,)
    plan = make_plan(
        config.launch,
        config.parallel,
        config.train,
        machine,
        facts,
        ModelChoices.of(config.model),
        extra_notes=(*auto_notes, *checked.notes),
    )
    if config.model.lora is not None:
        from dplaunch.planning.lora_check import check_lora

        check_lora(config.model, facts, plan.dims)
    plan = _plan_loss_chunk(config, facts, plan)
    if profile is not None:
        from dplaunch.planning.auto import run_forecast

        plan = replace(plan, forecast=run_forecast(config, facts, plan, profile))
    return config, plan


def _plan_loss_chunk(config: RunConfig, facts: ModelFacts, plan: Plan) -> Plan:
    """train.loss_chunk (and train.tiled_mlp's chunked loss) resolved on the plan's layout: the
    chunk the ranks compute the head and loss in (0: the full logits), and the plan's note."""
    from dplaunch.planning.auto import plan_workload
    from dplaunch.planning.candidates import workload_memory
    from dplaunch.planning.loss_chunk import check_loss_chunk

    train = config.train
    check_loss_chunk(train.loss_chunk, config.model.task, plan.dims, train.tiled_mlp)
    workload = plan_workload(config, plan)
    full = workload_memory(facts, plan.dims, replace(workload, loss_chunk=0))
    chunked = workload_memory(facts, plan.dims, workload)
    if not chunked.loss_chunk:
        return plan
    if isinstance(train.loss_chunk, int):
        why = "as train.loss_chunk sets"
    elif train.tiled_mlp:
        why = "train.tiled_mlp chunks the loss as its tiles"
    else:
        why = (
            f"auto: the logits would take {full.logits_gb:.2f} GiB of a GPU, a large share of "
            f"the forward/backward's {full.forward_backward_gb:.2f} GiB"
        )
    note = (
        f"train.loss_chunk: the output head runs {chunked.loss_chunk:,} tokens at a time "
        f"({why}); the plan counts {chunked.logits_gb:.3g} GiB for them instead of the full "
        f"logits' {full.logits_gb:.3g} GiB"
    )
    return replace(plan, loss_chunk=chunked.loss_chunk, notes=(*plan.notes, note))


def _count_stream(config: RunConfig, data_task: str, notes: list[str]) -> RunConfig:
    """data.count_stream: count the stream's records; train.epochs (unset: 1) then sets
    train.max_steps, which run.yaml gives the ranks (a stream's length is its max_steps)."""
    from dplaunch.data.stream_length import stream_length

    data = config.data
    packing = task_of(data_task).packs(data.packing)
    steps, note = stream_length(config, data_task, packing)
    if config.train.max_steps is None:
        epochs = config.train.epochs or 1
        max_steps = max(1, math.ceil(epochs * steps))
        note += f"; {epochs:g} epoch(s) → train.max_steps {max_steps:,}"
        train = config.train.model_copy(update={"max_steps": max_steps})
        config = config.model_copy(update={"train": train})
    notes.append(note)
    return config


def load_script_config(flags: RunFlags) -> ScriptRunConfig:
    """The run file of a launch of a user's own script (launch, parallel and train keys only)."""
    return load_run_config(
        flags.config,
        overrides=flags.overrides(),
        assignments=flags.assignments,
        schema=ScriptRunConfig,
    )


def check_script_exists(script: list[str]) -> None:
    """A missing script, after the run file's own checks."""
    if not Path(script[0]).is_file():
        raise UserError("SCRIPT", f"{script[0]} does not exist", "give the path of a Python script")


def script_run_dir(config: ScriptRunConfig, script: list[str]) -> Path:
    """Where a script's launch writes: --output-dir, else runs/<script name>-<time>."""
    return Path(config.output_dir or _default_run_dir(Path(script[0]).stem))


def prepare_script_launch(flags: RunFlags, script: list[str]) -> PreparedRun:
    """Check, plan, settle on this machine and render a launch of a user's own Accelerate or
    torchrun-style script."""
    config = load_script_config(flags)
    allocation = current_allocation()
    job = current_job(allocation)
    launch, cluster_notes = launch_for_cluster(
        config.launch, allocation=allocation, render_only=False, job=job
    )
    config = config.model_copy(update={"launch": launch})
    check_script_exists(script)
    machine, gpus = local_machine()
    plan = make_plan(
        config.launch, config.parallel, config.train, machine, extra_notes=cluster_notes
    )
    plan.dims.check_script_launch()
    notes = []
    if plan.target == "cpu" and plan.uses_deepspeed:
        notes.append(
            "DeepSpeed on CPU ranks: the script must build its Accelerator with "
            "kwargs_handlers=[InitProcessGroupKwargs(backend='gloo')] (dplaunch train does this)"
        )
    here = ThisMachine(
        gpus,
        claims_gpus=not (job is not None or config.launch.hostfile),
        render_only=False,
        threads=openmp_threads(plan, allocation),
    )
    # each rank runs the script as `python SCRIPT ARGS…` would, and exits without gloo's teardown race
    target = ["-m", "dplaunch.train.script", *script]
    run_dir = script_run_dir(config, script)
    prepared = settle_and_render(config, plan, run_dir, target, here, notes=tuple(notes))
    prepared.cluster_note = job.note() if job is not None else None
    return prepared


def settle_and_render(
    config: RunConfig | ScriptRunConfig,
    plan: Plan,
    run_dir: Path,
    target: list[str],
    here: ThisMachine,
    notes: tuple[str, ...] = (),
) -> PreparedRun:
    """The tail every prepared run shares: its ops checked, the plan settled on this machine
    (settle_on_this_machine), the config naming its run directory, and the files rendered.

    ``notes``: the caller's, shown after the plan's own and before what settling notes."""
    if not here.render_only:  # files rendered for elsewhere are built there
        check_ops_can_be_built(plan)
    explicit_port = config.launch.master_port is not None
    plan, env = settle_on_this_machine(plan, here, explicit_port=explicit_port, notes=notes)
    config = config.model_copy(update={"output_dir": str(run_dir)})
    return render_files(config, plan, run_dir, target, extra_env=env, threads=here.threads)


def settle_on_this_machine(
    plan: Plan, here: ThisMachine, *, explicit_port: bool, notes: tuple[str, ...] = ()
) -> tuple[Plan, dict[str, str]]:
    """The plan as it runs here: its rendezvous port free and claimed, this node's GPUs claimed,
    gloo's interface chosen; the ranks' environment for these, and a note on each (after
    NOTES, the caller's)."""
    settled = list(notes)
    port = _free_master_port(
        plan, explicit=explicit_port, render_only=here.render_only, notes=settled
    )
    gpu_env = _claim_gpus(plan, here.gpus, settled) if here.claims_gpus else {}
    gloo_env = gloo_interface(plan, settled)
    threads = here.threads
    # (FSDP's offload steps torch's AdamW on the host: no CPU Adam build, no thread note)
    if threads is not None and plan.offload != "none" and plan.engine != "fsdp":
        on_the_node = threads[0] == node_threads(plan.processes_per_node)
        count = "OpenMP threads" if on_the_node else f"{threads[0]} OpenMP thread(s)"
        settled.append(
            f"offload: DeepSpeed's CPU Adam steps on {count} per rank "
            f"(OMP_NUM_THREADS: {threads[1]})"
        )
    plan = replace(plan, master_port=port, notes=(*plan.notes, *settled))
    return plan, {**gpu_env, **gloo_env}


def render_files(
    config: Any,
    plan: Plan,
    run_dir: Path,
    target: list[str],
    *,
    extra_env: dict[str, str] | None = None,
    threads: tuple[str, str] | None = None,
) -> PreparedRun:
    """The files, argv and environment that start ``target`` on every rank of ``plan`` (writes nothing).

    ``threads``: openmp_threads' answer (None: the launcher's default, one thread per rank)."""
    # the files run on another node: launch.sh computes the threads there
    on_the_node = threads is not None and threads[0] == node_threads(plan.processes_per_node)
    computed = {"OMP_NUM_THREADS": threads[0]} if threads is not None and on_the_node else {}
    files: dict[str, str] = {}
    run_abs = run_dir.absolute()
    if plan.uses_deepspeed:
        files[DEEPSPEED_FILE] = render_deepspeed_config(
            plan, max_grad_norm=config.train.max_grad_norm
        )
    # node R > 0 of a multi-node run writes accelerate-nodeR.yaml and launch-nodeR.sh
    accelerate_name = accelerate_config_name(plan)
    files[accelerate_name] = render_accelerate_config(plan, str(run_abs / DEEPSPEED_FILE))
    env = {
        **rank_environment(plan, run_abs / ERRORS_DIR, None if on_the_node else threads),
        **(extra_env or {}),
    }
    if config.launch.hostfile:
        argv = hostfile_launch_argv(plan, Path(config.launch.hostfile), target, env)
    else:
        argv = launch_argv(plan, run_abs, target, accelerate_config=accelerate_name)
    return run_files(config, plan, run_dir, argv, env, engine=files, computed=computed)


def run_files(
    config: Any,
    plan: Plan,
    run_dir: Path,
    argv: list[str],
    env: dict[str, str],
    *,
    engine: dict[str, str] | None = None,
    workers: dict[str, str] | None = None,
    computed: dict[str, str] | None = None,
) -> PreparedRun:
    """A prepared run: the run file, the plan and the launch script every run directory holds,
    after the ENGINE's files (deepspeed.json, accelerate.yaml) and before the WORKERS' spec of a
    TensorFlow launch (the order --dry-run prints them in). ``computed``: variables launch.sh
    computes where it runs (render_launch_script)."""
    files = {
        **(engine or {}),
        RUN_FILE: dump_run_config(config),
        PLAN_FILE: plan_text(plan.to_dict()),
        **(workers or {}),
        # the head node's script checks its rendezvous port (the other nodes connect to it)
        launch_script_name(plan): render_launch_script(
            argv, env, Path.cwd(), computed, port=plan.master_port if plan.node_rank == 0 else None
        ),
    }
    return PreparedRun(config=config, plan=plan, run_dir=run_dir, files=files, argv=argv, env=env)


def rank_environment(
    plan: Plan, errors_dir: Path, threads: tuple[str, str] | None = None
) -> dict[str, str]:
    """Variables dplaunch sets for the ranks (PyTorch ranks and TensorFlow workers alike) on top
    of the user's environment (never secrets): ERRORS_DIR is where they dump their stacks.

    ``threads`` is openmp_threads' answer: OMP_NUM_THREADS for each rank, and where it comes from."""
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.update(hang_dump_environment(plan, errors_dir))
    # launch.timeout_minutes, for scripts that build their own process group (dplaunch launch)
    env[TIMEOUT_MINUTES_ENV] = f"{plan.timeout_minutes:g}"
    # where DeepSpeed's ops are built: ZeRO's engine and Ulysses' sp collectives build the same
    if loads_deepspeed(plan) and not os.environ.get("TORCH_EXTENSIONS_DIR"):
        env["TORCH_EXTENSIONS_DIR"] = str(torch_extensions_dir())
    if plan.target == "cpu":
        env["DS_ACCELERATOR"] = (
            "cpu"  # DeepSpeed would otherwise probe for CUDA and warn in every rank
        )
        # CPU ranks on a GPU machine (--cpu) see no GPU: nothing of theirs lands on one (a
        # quantized base under ZeRO-3 loads where transformers finds a device)
        env["CUDA_VISIBLE_DEVICES"] = ""
        if not plan.uses_deepspeed or plan.engine == "pipeline":
            # an unmodified Accelerate script sees a real gloo world only with this (without it,
            # every rank runs as world size 1); with DeepSpeed it would make Accelerate drop the
            # DeepSpeed plugin, so there gloo is asked for in code
            env["ACCELERATE_USE_CPU"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads[0]
    return env


# the NCCL flight recorder: the last collectives of every rank, dumped when one times out
NCCL_TRACE_BUFFER_SIZE = 2000


def hang_dump_environment(
    plan: Plan, errors_dir: Path, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Where the ranks write their Python stacks after a collective timeout (RUN/errors/), and on
    GPUs NCCL's flight recorder dumped there too; values the user set are kept."""
    environ = os.environ if environ is None else environ
    env = {ERRORS_DIR_ENV: str(errors_dir)}
    if plan.target == "gpu":
        recorder = {
            "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_BUFFER_SIZE),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(errors_dir / NCCL_TRACE_FILE_PREFIX),
        }
        env.update({name: value for name, value in recorder.items() if name not in environ})
    return env


def node_threads(ranks: int) -> str:
    """OMP_NUM_THREADS as launch.sh computes it on the node that runs it: that node's cores
    (nproc: its affinity mask, as usable_cores) ÷ its ranks, at least 1."""
    return f"$(( $(nproc) / {ranks} > 1 ? $(nproc) / {ranks} : 1 ))"


def openmp_threads(
    plan: Plan,
    allocation: SlurmAllocation | None,
    environ: Mapping[str, str] | None = None,
    *,
    here: bool = True,
) -> tuple[str, str] | None:
    """OMP_NUM_THREADS for each rank and where it comes from; None leaves it to the launcher.

    `accelerate launch` and torchrun set 1 unless the variable is set: right for GPU ranks that
    only feed kernels, wrong for CPU ranks and for ZeRO-Offload, whose CPU Adam is OpenMP.
    ``here``: the ranks run on this machine; else (files rendered for another node) the count
    is node_threads', computed by launch.sh where it runs."""
    environ = os.environ if environ is None else environ
    needs_cores = plan.target == "cpu" or plan.offload != "none"
    given = environ.get("OMP_NUM_THREADS")
    if given:
        # ranks inherit it anyway; written into launch.sh where it matters
        return (given, "set in this shell") if needs_cores else None
    ranks = plan.processes_per_node
    if allocation is not None:
        threads = rank_threads(allocation, ranks)
        if threads is not None:
            return str(threads), f"SLURM's {allocation.cpus_per_task} CPUs per task ÷ {ranks} ranks"
    if not needs_cores:
        return None
    if not here:
        return node_threads(
            ranks
        ), f"the cores of the node that runs {LAUNCH_SCRIPT} ÷ {ranks} ranks"
    cores = usable_cores()
    return str(max(1, cores // ranks)), f"{cores} cores here ÷ {ranks} ranks per node"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: taskset, cgroups), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _free_master_port(plan: Plan, *, explicit: bool, render_only: bool, notes: list[str]) -> int:
    # a busy port fails deep inside every rank: catch it here. One node: pick another; several: say so
    if render_only or (plan.num_nodes > 1 and plan.node_rank != 0):
        return plan.master_port  # on other nodes the port is the head node's
    taken = claim_port(plan.master_port)
    if taken is None:
        return plan.master_port
    why = "is busy" if taken == "busy" else "is taken by another dplaunch run on this machine"
    if plan.num_nodes > 1:
        raise UserError(
            "launch.master_port",
            f"port {plan.master_port} {why}",
            "pick a free one with --master-port and pass the same to every node",
        )
    port = claim_free_port()
    reason = "given" if explicit else "default"
    notes.append(f"port {plan.master_port} ({reason}) {why}: using free port {port}")
    return port


def _claim_gpus(plan: Plan, gpus: list[Gpu], notes: list[str]) -> dict[str, str]:
    """Claim this node's GPUs, so that two runs on one machine take different ones (as ports).

    Notes which, and returns CUDA_VISIBLE_DEVICES for the ranks."""
    if plan.target != "gpu":
        return {}
    candidates = visible_keys(gpus)
    wanted = plan.processes_per_node
    chosen: list[str] = []
    held: list[str] = []
    for name, key in candidates:
        if len(chosen) == wanted:
            break
        (chosen if claim_gpu(key) else held).append(name)
    if len(chosen) < wanted:
        raise UserError(
            "launch.gpus",
            f"{wanted} GPU(s) wanted here, but GPU(s) {','.join(held)} of this machine's "
            f"{len(candidates)} are held by another dplaunch run",
            "wait for that run to end, or ask for fewer GPUs",
        )
    note = f"GPUs {','.join(chosen)} claimed for this run (CUDA_VISIBLE_DEVICES)"
    if held:
        note += f"; {','.join(held)} are held by another dplaunch run"
    notes.append(note)
    # the indices are nvidia-smi's, which counts in PCI bus order; CUDA counts fastest first
    # unless told otherwise, so on a machine of mixed GPUs the ranks would use others
    return {"CUDA_VISIBLE_DEVICES": ",".join(chosen), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def gloo_interface(
    plan: Plan, notes: list[str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for the ranks of a multi-node run; a note on it goes to NOTES.

    Besides NCCL the ranks talk over gloo (the side group that agrees on stops and saves), and gloo
    binds the address of the host name unless GLOO_SOCKET_IFNAME names an interface: on clusters
    that can be a network the other nodes do not reach. DeepSpeed's hostfile runner forwards
    NCCL_* to the other hosts but not GLOO_*, so the variable travels with the ranks' own."""
    environ = os.environ if environ is None else environ
    if plan.num_nodes == 1:
        return {}
    given = environ.get("GLOO_SOCKET_IFNAME")
    if given:
        return {"GLOO_SOCKET_IFNAME": given}
    nccl = environ.get("NCCL_SOCKET_IFNAME", "")
    if not nccl:
        return {}
    # NCCL reads prefixes ("eth" = eth0, eth1…), "^" exclusions and "=" exact names; gloo only exact
    # names, so the value is reused only when it names interfaces this node has
    names = nccl.removeprefix("=").split(",")
    if not nccl.startswith("^") and set(names) <= {name for _, name in socket.if_nameindex()}:
        notes.append(
            f"GLOO_SOCKET_IFNAME={','.join(names)} (NCCL_SOCKET_IFNAME's) for the ranks' gloo group"
        )
        return {"GLOO_SOCKET_IFNAME": ",".join(names)}
    notes.append(
        f"NCCL_SOCKET_IFNAME={nccl} is set but GLOO_SOCKET_IFNAME is not: the ranks' gloo group "
        "uses the host name's address; set GLOO_SOCKET_IFNAME to the interface's exact name"
    )
    return {}


def _default_run_dir(name: str) -> str:
    return str(Path(DEFAULT_RUNS_DIR) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


# --- clusters: a SLURM allocation or a DeepSpeed hostfile decides the launch section ---------


def current_allocation() -> SlurmAllocation | None:
    """The SLURM job this process runs in (None outside one); node lists expanded by scontrol."""
    try:
        return detect_allocation(os.environ, expand=expand_hostlist)
    except ValueError as error:
        raise UserError(
            "SLURM",
            str(error),
            "run dplaunch in a regular SLURM job, or unset SLURM_JOB_ID to ignore the job",
        ) from None


def current_job(allocation: SlurmAllocation | None) -> ClusterJob | None:
    """The scheduler's job this process runs in: SLURM's allocation, else a Kubernetes pod's, a
    SkyPilot or a dstack node's (cluster/environments.py); None on a machine of its own."""
    if allocation is not None:
        return allocation.job()
    return detect_job(os.environ)


def launch_for_cluster(
    launch: LaunchConfig,
    *,
    allocation: SlurmAllocation | None,
    render_only: bool,
    job: ClusterJob | None = None,
) -> tuple[LaunchConfig, list[str]]:
    """The launch section once SLURM (inside a job), another scheduler's job (``job``) or a
    hostfile has had its say; plan notes."""
    if allocation is not None:
        return launch_for_allocation(launch, allocation)
    if job is not None:
        return launch_for_job(launch, job)
    if not launch.hostfile:
        if not render_only:  # files rendered for a cluster name its hosts, not this machine's
            check_master_addr(launch)
        return launch, []
    hosts = read_hostfile(launch.hostfile)
    resolved, notes = launch_for_hostfile(launch, hosts, own_host_names())
    if len(hosts) > 1 and not render_only and shutil.which("pdsh") is None:
        raise UserError(
            "launch.hostfile",
            f"{len(hosts)} hosts need DeepSpeed's multi-node launcher, which starts them with "
            "pdsh over ssh, and pdsh is not installed here",
            "install pdsh (apt install pdsh) and set up passwordless ssh to every host, or run "
            "`dplaunch train --nodes N --node-rank R --master-addr HEAD` on each node instead",
        )
    absolute = str(Path(launch.hostfile).absolute())
    return resolved.model_copy(update={"hostfile": absolute}), notes


def own_host_names() -> tuple[str, ...]:
    """The names this machine answers to (for telling a local hostfile entry from a remote one)."""
    name = socket.gethostname()
    names = {name, name.split(".")[0]}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return tuple(sorted(names))
