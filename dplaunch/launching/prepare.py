"""From CLI flags to a prepared run: resolved config, plan, rendered files, exact argv. Nothing written."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dplaunch.config.load import dump_run_config, load_run_config
from dplaunch.config.schema import ModelConfig, RunConfig, ScriptRunConfig
from dplaunch.errors import UserError
from dplaunch.launching.ports import free_port, port_is_free
from dplaunch.planning.data_check import check_data
from dplaunch.planning.devices import visible_gpu_count
from dplaunch.planning.model_facts import ModelFacts, load_config_json
from dplaunch.planning.plan import Machine, Plan, make_plan
from dplaunch.rendering.accelerate_config import DEEPSPEED_CONFIG_NAME, render_accelerate_config
from dplaunch.rendering.deepspeed_config import render_deepspeed_config
from dplaunch.rendering.launch_command import launch_argv, render_launch_script

# flag name → dotted key in the run file
FLAG_KEYS = {
    "gpus": "launch.gpus",
    "cpu": "launch.cpu",
    "nodes": "launch.nodes",
    "gpus_per_node": "launch.gpus_per_node",
    "node_rank": "launch.node_rank",
    "master_addr": "launch.master_addr",
    "master_port": "launch.master_port",
    "hostfile": "launch.hostfile",
    "zero": "parallel.zero_stage",
    "offload": "parallel.offload",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "global_batch": "train.global_batch_size",
    "micro_batch": "train.micro_batch_size",
    "max_steps": "train.max_steps",
    "mixed_precision": "train.mixed_precision",
    "output_dir": "output_dir",
}


@dataclass
class RunFlags:
    """The flags `train`, `config`, `launch`, `slurm` and `plan` share (None = not given)."""

    config: Path | None = None
    assignments: list[str] = field(default_factory=list)
    gpus: int | None = None
    cpu: bool | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    hostfile: str | None = None
    zero: int | None = None
    offload: str | None = None
    tp: int | None = None
    pp: int | None = None
    global_batch: int | None = None
    micro_batch: int | None = None
    max_steps: int | None = None
    mixed_precision: str | None = None
    output_dir: str | None = None

    def overrides(self) -> dict[str, Any]:
        """Flags that were given, as dotted run-file keys."""
        given = {name: getattr(self, name) for name in FLAG_KEYS}
        # 0 is a value (--gpus 0 must be refused, not ignored); only None/False mean "not given"
        return {
            FLAG_KEYS[name]: value
            for name, value in given.items()
            if value is not None and value is not False
        }


@dataclass
class PreparedRun:
    """A run ready to be written and started."""

    config: RunConfig | ScriptRunConfig
    plan: Plan
    run_dir: Path
    files: dict[str, str]
    argv: list[str]
    env: dict[str, str]


def model_facts(model: ModelConfig) -> ModelFacts:
    """Shape facts of the configured model, from model.config or the model's config.json."""
    if model.config is not None:
        return ModelFacts.from_config_dict(model.config)
    config_json = load_config_json(model.name_or_path or "")
    _refuse_code_not_trusted(model, config_json)
    return ModelFacts.from_config_dict(config_json)


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


def prepare_training_run(
    flags: RunFlags, *, render_only: bool = False, out_dir: Path | None = None
) -> PreparedRun:
    """Load, validate and plan a training run; render its files. Raises UserError, writes nothing."""
    config: RunConfig = load_run_config(
        flags.config, overrides=flags.overrides(), assignments=flags.assignments
    )
    facts = model_facts(config.model)
    check_data(config.data, config.model.task)
    machine = Machine(visible_gpus=visible_gpu_count(), render_only=render_only)
    auto = None
    if config.parallel.auto:
        from dplaunch.environment_report import smallest_gpu_memory_gb
        from dplaunch.planning.auto import resolve_auto_parallel

        auto = resolve_auto_parallel(config, facts, machine, smallest_gpu_memory_gb)
        config.parallel = auto.parallel
    plan = make_plan(config.launch, config.parallel, config.train, machine, facts)
    if auto is not None:
        plan = replace(plan, notes=(*plan.notes, auto.note))
    plan = _settle_port(
        plan, explicit=config.launch.master_port is not None, render_only=render_only
    )
    run_dir = out_dir or Path(config.output_dir or _default_run_dir(config.name or "run"))
    config.output_dir = str(run_dir)
    target = ["-m", "dplaunch.train", str(run_dir.absolute())]
    return _render(config, plan, run_dir, target, max_grad_norm=config.train.max_grad_norm)


def prepare_script_launch(flags: RunFlags, script: list[str]) -> PreparedRun:
    """Plan a launch of a user's own Accelerate or torchrun-style script."""
    config: ScriptRunConfig = load_run_config(
        flags.config,
        overrides=flags.overrides(),
        assignments=flags.assignments,
        schema=ScriptRunConfig,
    )
    if not Path(script[0]).is_file():
        raise UserError("SCRIPT", f"{script[0]} does not exist", "give the path of a Python script")
    machine = Machine(visible_gpus=visible_gpu_count())
    plan = make_plan(config.launch, config.parallel, config.train, machine)
    if plan.engine == "pipeline":
        raise UserError(
            "parallel.pp",
            "pipeline parallelism needs dplaunch's own loop",
            "use `dplaunch train` for pp > 1",
        )
    if plan.target == "cpu" and plan.uses_deepspeed:
        plan = replace(
            plan,
            notes=(
                *plan.notes,
                "DeepSpeed on CPU ranks: the script must build its Accelerator with "
                "kwargs_handlers=[InitProcessGroupKwargs(backend='gloo')] (dplaunch train does this)",
            ),
        )
    plan = _settle_port(plan, explicit=config.launch.master_port is not None, render_only=False)
    run_dir = Path(config.output_dir or _default_run_dir(Path(script[0]).stem))
    config.output_dir = str(run_dir)
    return _render(config, plan, run_dir, script, max_grad_norm=config.train.max_grad_norm)


def _render(
    config: Any, plan: Plan, run_dir: Path, target: list[str], *, max_grad_norm: float
) -> PreparedRun:
    files: dict[str, str] = {}
    run_abs = run_dir.absolute()
    if plan.uses_deepspeed:
        files[DEEPSPEED_CONFIG_NAME] = render_deepspeed_config(plan, max_grad_norm=max_grad_norm)
    files["accelerate.yaml"] = render_accelerate_config(plan, str(run_abs / DEEPSPEED_CONFIG_NAME))
    files["run.yaml"] = dump_run_config(config)
    files["plan.json"] = json.dumps(plan.to_dict(), indent=2) + "\n"
    argv = launch_argv(plan, run_abs, target)
    env = rank_environment(plan)
    files["launch.sh"] = render_launch_script(argv, env, Path.cwd())
    return PreparedRun(config=config, plan=plan, run_dir=run_dir, files=files, argv=argv, env=env)


def rank_environment(plan: Plan) -> dict[str, str]:
    """Variables dplaunch sets for the ranks on top of the user's environment (never secrets)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    # launch.timeout_minutes, for scripts that build their own process group (dplaunch launch)
    env["DPLAUNCH_TIMEOUT_MINUTES"] = f"{plan.timeout_minutes:g}"
    if plan.target == "cpu":
        env["DS_ACCELERATOR"] = (
            "cpu"  # DeepSpeed would otherwise probe for CUDA and warn in every rank
        )
        if not plan.uses_deepspeed or plan.engine == "pipeline":
            # an unmodified Accelerate script sees a real gloo world only with this (DESIGN.md); with
            # DeepSpeed it would make Accelerate drop the DeepSpeed plugin, so there gloo is asked for in code
            env["ACCELERATE_USE_CPU"] = "1"
        cores = os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(
            max(1, cores // plan.processes_per_node)
        )
    return env


def _settle_port(plan: Plan, *, explicit: bool, render_only: bool) -> Plan:
    # a busy port fails deep inside every rank: catch it here. One node: pick another; several: say so
    if render_only or port_is_free(plan.master_port):
        return plan
    if plan.num_nodes > 1:
        if plan.node_rank != 0:
            return plan  # the port is busy on the head node, not here
        raise UserError(
            "launch.master_port",
            f"port {plan.master_port} is in use on this node",
            "pick a free one with --master-port and pass the same to every node",
        )
    port = free_port()
    reason = "given" if explicit else "default"
    return replace(
        plan,
        master_port=port,
        notes=(*plan.notes, f"port {plan.master_port} ({reason}) is busy: using free port {port}"),
    )


def _default_run_dir(name: str) -> str:
    return str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
