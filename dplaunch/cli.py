"""The `dplaunch` command line. Imports nothing heavy: torch & friends load only in training ranks."""

from __future__ import annotations

import functools
import inspect
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from dplaunch.config.flags import PLAN_PANEL, RUN_FLAGS, flag_option
from dplaunch.errors import EXIT_USER_ERROR, UserError

try:  # newer typer (0.29) ships its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # older typer runs on click itself
    from click import exceptions as click_errors  # type: ignore[no-redef]
# `dplaunch` alone prints the help through this error (click >= 8.2); () matches nothing
NO_ARGS_IS_HELP = getattr(click_errors, "NoArgsIsHelpError", ())

app = typer.Typer(
    name="dplaunch",
    help="One command for data-parallel, ZeRO and hybrid training of Hugging Face models.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class Framework(str, Enum):
    # launching.frameworks.FRAMEWORKS; auto: what the script imports
    auto = "auto"
    pytorch = "pytorch"
    tensorflow = "tensorflow"
    horovod = "horovod"


def flag_annotation(name: str, *, help: str | None = None, panel: str | None = None) -> Any:
    """A run flag of config/flags.py as a typer option (`help`/`panel` for a command's own wording)."""
    flag = RUN_FLAGS[name]
    names = [flag_option(name), *([flag.short] if flag.short else [])]
    if isinstance(flag.kind, tuple):
        value_type: Any = Enum(name, {value: value for value in flag.kind}, type=str)
    else:
        value_type = flag.kind
    low, high = flag.bounds or (None, None)
    option = typer.Option(
        *names, help=help or flag.help, rich_help_panel=panel or flag.panel, min=low, max=high
    )
    return Annotated[value_type if value_type is bool else value_type | None, option]


# the flags every planning command shares; `with_run_flags` adds them to a command
RUN_FLAG_PARAMETERS: dict[str, tuple[Any, Any]] = {
    "config": (
        Annotated[
            Path | None,
            typer.Argument(
                help="Run file (YAML). Default: the embedded configs/default.yaml.",
                show_default=False,
            ),
        ],
        None,
    ),
    **{
        name: (flag_annotation(name), False if flag.kind is bool else None)
        for name, flag in RUN_FLAGS.items()
    },
    "assignments": (
        Annotated[
            list[str] | None,
            typer.Option(
                "--set", help="Override any run-file key: --set train.lr=1e-4 (repeatable)."
            ),
        ],
        None,
    ),
}


CONFIG_OPTION = Annotated[
    Path | None,
    typer.Option("--config", help="Run file (YAML) with launch/parallel/train sections."),
]


def with_run_flags(command: Any = None, *, config_option: bool = False) -> Any:
    """Give a command the shared run flags; it receives them as one RunFlags object named `flags`."""
    if command is None:
        return functools.partial(with_run_flags, config_option=config_option)
    own = [
        p
        for name, p in inspect.signature(command, eval_str=True).parameters.items()
        if name != "flags"
    ]
    shared = [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default
        )
        for name, (annotation, default) in RUN_FLAG_PARAMETERS.items()
    ]
    config = shared.pop(0)
    if config_option:
        shared.insert(0, config.replace(annotation=CONFIG_OPTION))
        config = None
    else:
        config = config.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def is_argument(parameter: inspect.Parameter) -> bool:
        return any(
            isinstance(meta, typer.models.ArgumentInfo)
            for meta in getattr(parameter.annotation, "__metadata__", ())
        )

    positional = [p for p in own if is_argument(p)]
    keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if not is_argument(p)]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        from dplaunch.launching.prepare import RunFlags

        values = {name: kwargs.pop(name) for name in RUN_FLAG_PARAMETERS}
        if values["cpu"] and values["gpus"] is not None and values["gpus"] < 1:
            # the run file's own check suggests --cpu, which was given
            raise UserError(
                "--gpus", f"{values['gpus']} CPU ranks requested", "give --gpus 1 or more"
            )
        values["assignments"] = values["assignments"] or []
        for name, value in values.items():
            if isinstance(value, Enum):
                values[name] = value.value
        return command(flags=RunFlags(**values), **kwargs)

    parameters = [
        *positional[:1],
        *([config] if config else []),
        *positional[1:],
        *keyword,
        *shared,
    ]
    wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    del wrapper.__wrapped__
    return wrapper


@app.command()
@with_run_flags
def train(
    flags: Any,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print the plan, rendered files and launch command; start nothing."
        ),
    ] = False,
    resume: Annotated[
        str | None,
        typer.Option("--resume", help="'auto' (newest complete checkpoint) or a checkpoint path."),
    ] = None,
) -> None:
    """Train a Hugging Face model with the planned parallel layout."""
    from dplaunch.commands.train import run_train

    raise typer.Exit(run_train(flags, dry_run=dry_run, resume=resume))


@app.command()
@with_run_flags
def config(
    flags: Any,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Directory to write accelerate.yaml, deepspeed.json, run.yaml, launch.sh into "
            "(or -o DIR: the run directory launch.sh then trains in).",
        ),
    ] = None,
) -> None:
    """Render the run's Accelerate/DeepSpeed files for the target the flags describe (GPUs need not be here)."""
    from dplaunch.commands.train import run_config

    raise typer.Exit(run_config(flags, out))


@app.command()
@with_run_flags(config_option=True)
def launch(
    flags: Any,
    script: Annotated[
        Path,
        typer.Argument(help="Your Accelerate, torchrun-style or TensorFlow Python script."),
    ],
    script_args: Annotated[
        list[str] | None, typer.Argument(help="Arguments for the script (after --).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan and launch command; start nothing.")
    ] = False,
    framework: Annotated[
        Framework,
        typer.Option(
            "--framework",
            help="auto: what the script imports (TensorFlow/Keras: workers with TF_CONFIG).",
        ),
    ] = Framework.auto,
) -> None:
    """Launch any Accelerate, PyTorch DDP or TensorFlow script with the same plan: dplaunch launch SCRIPT [flags] -- ARGS."""
    from dplaunch.commands.train import run_launch

    argv = [str(script), *(script_args or [])]
    raise typer.Exit(run_launch(flags, argv, dry_run=dry_run, framework=framework.value))


class Task(str, Enum):
    causal_lm = "causal-lm"
    sequence_classification = "sequence-classification"
    sft = "sft"


_WORKLOAD = "Workload"


class AttentionKernel(str, Enum):
    """model.attn_implementation's values (schema.AttentionImplementation; a test keeps them equal)."""

    eager = "eager"
    sdpa = "sdpa"
    flash_attention_2 = "flash_attention_2"
    flash_attention_3 = "flash_attention_3"
    flex_attention = "flex_attention"


class LoraQuantizeChoice(str, Enum):
    """model.lora.quantize's values (schema.LoraQuantize; a test keeps them equal)."""

    four_bit = "4bit"
    eight_bit = "8bit"


@app.command()
def plan(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="Run file (YAML): its model, train, data.max_length and launch sections. "
            "Default: the embedded default run file.",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", help="Instead of a run file: hub id, model folder or config.json path."
        ),
    ] = None,
    gpus: flag_annotation("gpus", help="Total GPUs to plan for.") = None,
    nodes: flag_annotation("nodes") = None,
    gpus_per_node: flag_annotation("gpus_per_node") = None,
    gpu_memory: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory",
            help="GiB of one GPU (default: launch.gpu_memory_gb, else nvidia-smi).",
            rich_help_panel=PLAN_PANEL,
        ),
    ] = None,
    micro_batch: flag_annotation(
        "micro_batch", help="Samples per forward pass per GPU.", panel=_WORKLOAD
    ) = None,
    global_batch: flag_annotation(
        "global_batch", help="Samples per optimizer step.", panel=_WORKLOAD
    ) = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            help="Tokens per sample (default data.max_length, or 2048).",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    mixed_precision: flag_annotation(
        "mixed_precision", help="no, fp16 or bf16 (--model default: bf16).", panel=_WORKLOAD
    ) = None,
    activation_checkpointing: Annotated[
        bool,
        typer.Option(
            "--activation-checkpointing",
            help="Plan with activation checkpointing.",
            rich_help_panel=_WORKLOAD,
        ),
    ] = False,
    attn_implementation: Annotated[
        AttentionKernel | None,
        typer.Option(
            "--attn-implementation",
            help="Attention kernel (default: model.attn_implementation, else what transformers "
            "picks: sdpa where supported). Only eager keeps the s×s scores.",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    task: Annotated[
        Task | None, typer.Option("--task", help="The model's head.", rich_help_panel=_WORKLOAD)
    ] = None,
    lora: Annotated[
        int | None,
        typer.Option(
            "--lora",
            min=1,
            metavar="R",
            help="Plan LoRA training of rank R (adapters on every linear layer; the base frozen).",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    quantize: Annotated[
        LoraQuantizeChoice | None,
        typer.Option(
            "--quantize",
            help="QLoRA: the frozen base in 4-bit (nf4) or 8-bit (with --lora).",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    safety_margin: Annotated[
        float, typer.Option("--safety-margin", help="Fraction of GPU memory kept free.")
    ] = 0.1,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the rows as a JSON list instead of a table.")
    ] = False,
    assignments: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a run-file key: --set data.max_length=4096."),
    ] = None,
) -> None:
    """Memory per GPU and traffic of every DDP / ZeRO / offload / tp / pp plan; marks the one to use."""
    from dplaunch.commands.plan import PlanOptions, run_plan

    options = PlanOptions(
        config=config,
        model=model,
        gpus=gpus,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu_memory=gpu_memory,
        micro_batch=micro_batch,
        global_batch=global_batch,
        seq_len=seq_len,
        mixed_precision=mixed_precision.value if mixed_precision else None,
        activation_checkpointing=activation_checkpointing,
        attn_implementation=attn_implementation.value if attn_implementation else None,
        task=task.value if task else None,
        lora=lora,
        quantize=quantize.value if quantize else None,
        safety_margin=safety_margin,
        as_json=as_json,
        assignments=assignments or [],
    )
    raise typer.Exit(run_plan(options))


@app.command()
@with_run_flags
def verify(
    flags: Any,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps of each run.")] = 4,
    tolerance: Annotated[
        float | None,
        typer.Option(
            "--tolerance",
            help="Largest relative loss gap (default 1e-3 fp32, 2e-2 bf16, 1e-2 fp16).",
        ),
    ] = None,
    shrink: Annotated[
        bool,
        typer.Option(
            "--shrink",
            help="Same architecture and mesh with a few narrow layers (rehearse a GPU plan on CPU).",
        ),
    ] = False,
    reference: Annotated[
        Path | None,
        typer.Option(
            "--reference",
            help="An existing pure-DDP run (same model, data and train keys) to compare with.",
        ),
    ] = None,
    inject_fault: Annotated[str | None, typer.Option("--inject-fault", hidden=True)] = None,
) -> None:
    """Run K steps of the plan and K steps of pure DDP (same batch, seed, data); PASS or FAIL on the losses."""
    from dplaunch.commands.verify import VerifyOptions, run_verify

    options = VerifyOptions(
        steps=steps,
        tolerance=tolerance,
        shrink=shrink,
        inject_fault=inject_fault,
        reference=reference,
    )
    raise typer.Exit(run_verify(flags, options))


@app.command()
@with_run_flags(config_option=True)
def doctor(flags: Any) -> None:
    """Check every node of the plan (name resolution, rendezvous port, interface, all-reduce bandwidth, GPUs, disk): PASS/FAIL within 60 s."""
    from dplaunch.commands.doctor import run_doctor

    raise typer.Exit(run_doctor(flags))


@app.command()
def env(
    all_ops: Annotated[
        bool, typer.Option("--all-ops", help="Every DeepSpeed op, not only those plans use.")
    ] = False,
    no_ops: Annotated[
        bool, typer.Option("--no-ops", help="Skip the DeepSpeed op probe (no torch import).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Versions, GPUs, SLURM allocation, rendezvous port and DeepSpeed ops: paste it into a bug report."""
    from dplaunch.commands.env import run_env

    raise typer.Exit(run_env(probe_ops=not no_ops, all_ops=all_ops, as_json=as_json))


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (with metrics.jsonl).")],
    compare: Annotated[
        list[Path] | None,
        typer.Option("--compare", help="Another run to overlay (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output folder (default RUN_DIR/report).")
    ] = None,
) -> None:
    """PNG plots (loss, eval, lr, tokens/s, memory) and summary.txt from runs' metrics.jsonl."""
    from dplaunch.commands.report import run_report

    raise typer.Exit(run_report(run_dir, compare or [], out))


@app.command()
def export(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A checkpoints/step-N directory, or a run directory (its newest checkpoint)."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory for the HF model + tokenizer.")],
    adapter: Annotated[
        bool,
        typer.Option(
            "--adapter",
            help="A LoRA run's adapter as a PEFT folder instead of the model merged with it.",
        ),
    ] = False,
) -> None:
    """One consolidated HF model + tokenizer (safetensors) from a checkpoint, for from_pretrained.

    Tensor-parallel checkpoints are joined by a short job of CPU ranks (one per tp rank). A LoRA
    run's checkpoint gives its adapter merged into the base, or with --adapter the PEFT folder.
    """
    from dplaunch.commands.export import run_export

    raise typer.Exit(run_export(checkpoint, out, adapter))


_JOB = "SLURM job"


@app.command()
@with_run_flags
def slurm(
    flags: Any,
    cpus_per_gpu: Annotated[
        int | None,
        typer.Option(
            "--cpus-per-gpu",
            help="CPU cores per GPU (default: the node's cores / GPUs from sinfo, else 10).",
            rich_help_panel=_JOB,
        ),
    ] = None,
    time: Annotated[
        str,
        typer.Option("--time", help="Time limit, HH:MM:SS or D-HH:MM:SS.", rich_help_panel=_JOB),
    ] = "01:00:00",
    signal_seconds: Annotated[
        int | None,
        typer.Option(
            "--signal-seconds",
            help="Seconds before the time limit at which the ranks checkpoint and stop "
            "(SIGUSR1; default 120).",
            rich_help_panel=_JOB,
        ),
    ] = None,
    partition: Annotated[
        str | None, typer.Option("--partition", help="SLURM partition.", rich_help_panel=_JOB)
    ] = None,
    account: Annotated[
        str | None,
        typer.Option("--account", help="SLURM account, e.g. abc@h100.", rich_help_panel=_JOB),
    ] = None,
    qos: Annotated[str | None, typer.Option("--qos", help="QoS.", rich_help_panel=_JOB)] = None,
    constraint: Annotated[
        str | None,
        typer.Option("--constraint", help="Node feature, e.g. h100.", rich_help_panel=_JOB),
    ] = None,
    job_name: Annotated[
        str | None,
        typer.Option(
            "--job-name", help="Job name (default: the run's name).", rich_help_panel=_JOB
        ),
    ] = None,
    module: Annotated[
        list[str] | None,
        typer.Option(
            "--module", help="`module load` this first (repeatable).", rich_help_panel=_JOB
        ),
    ] = None,
    setup: Annotated[
        list[str] | None,
        typer.Option(
            "--setup",
            help="A shell line run before srun, e.g. 'source venv/bin/activate' (repeatable).",
            rich_help_panel=_JOB,
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(
            "--out", help="Where to write the script (default RUN/job.sbatch; '-' = stdout)."
        ),
    ] = None,
    submit: Annotated[
        bool, typer.Option("--submit", help="Submit it with sbatch and print the job id.")
    ] = False,
    python: Annotated[
        str | None,
        typer.Option(
            "--python",
            help="Python that runs dplaunch in the job (default: this one; 'python' = the "
            "one on PATH after --module/--setup).",
            rich_help_panel=_JOB,
        ),
    ] = None,
    relative_paths: Annotated[
        bool,
        typer.Option(
            "--relative-paths",
            help="Name the run file, run directory and logs relative to this directory, and "
            "python as 'python' unless --python: a script to share or commit, which works when "
            "sbatch is run from the same directory.",
            rich_help_panel=_JOB,
        ),
    ] = False,
) -> None:
    """Write an sbatch script that trains with this plan on SLURM nodes (one launcher per node)."""
    from dplaunch.commands.slurm import SlurmOptions, run_slurm

    options = SlurmOptions(
        cpus_per_gpu=cpus_per_gpu,
        time=time,
        signal_seconds=signal_seconds,
        partition=partition,
        account=account,
        qos=qos,
        constraint=constraint,
        job_name=job_name,
        modules=module or [],
        setup=setup or [],
        out=out,
        submit=submit,
        python=python,
        relative_paths=relative_paths,
    )
    raise typer.Exit(run_slurm(flags, options))


def usage_error(error: click_errors.UsageError) -> UserError:
    """A mistyped command line (unknown option, bad or missing value, extra argument) as a UserError."""
    command = _command_path(error.ctx) if error.ctx is not None else _command_from_argv()
    see_help = f"see {command} --help"
    if isinstance(error, click_errors.NoSuchOption):
        possible = sorted(error.possibilities or [])
        if not possible:
            return UserError(error.option_name, "no such option", see_help)
        guess = possible[0] if len(possible) == 1 else f"one of {', '.join(possible)}"
        return UserError(error.option_name, "no such option", f"did you mean {guess}? ({see_help})")
    if isinstance(error, click_errors.MissingParameter):
        kind = error.param.param_type_name if error.param is not None else "value"
        return UserError(_parameter_name(error), f"this {kind} is required", see_help)
    if isinstance(error, click_errors.BadParameter):
        return UserError(_parameter_name(error), _bad_value(error), see_help)
    if isinstance(error, click_errors.BadOptionUsage):
        problem = "needs a value" if "requires" in error.message else _clause(error.message)
        return UserError(error.option_name, problem, see_help)
    extra = re.match(r"Got unexpected extra arguments?(?:\(s\))? \((.*)\)$", error.message)
    if extra:
        arguments = [
            p.name.upper()
            for p in (error.ctx.command.params if error.ctx is not None else [])
            if p.param_type_name == "argument" and p.name
        ]
        takes = f"{command} takes only {' '.join(arguments)}" if arguments else f"{command} takes"
        return UserError(
            extra.group(1), "unexpected extra argument", f"{takes} and options ({see_help})"
        )
    problem, _, suggestion = error.message.partition(". ")
    field = "COMMAND" if problem.startswith("No such command") else command
    return UserError(field, _clause(problem).lower(), _clause(suggestion).lower() or see_help)


def _command_path(ctx: Any) -> str:
    # `dplaunch train`, also when run as `python -m dplaunch`
    names = []
    while ctx.parent is not None:
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    return " ".join(["dplaunch", *names])


def _command_from_argv() -> str:
    # the parser's own errors (an option without its value) come without a context
    commands = {c.name or c.callback.__name__ for c in app.registered_commands if c.callback}
    first = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    return f"dplaunch {first}" if first in commands else "dplaunch"


def _parameter_name(error: click_errors.BadParameter) -> str:
    # arguments by their name in the usage line (SCRIPT), options by their long flag
    param = error.param
    if param is None:
        hint = error.param_hint
        return hint if isinstance(hint, str) else " / ".join(hint or ["value"])
    if param.param_type_name == "argument":
        return (param.name or "argument").upper()
    return next((opt for opt in param.opts if opt.startswith("--")), param.opts[0])


def _bad_value(error: click_errors.BadParameter) -> str:
    # typer checks values with pydantic: its error holds the value the user typed
    errors = getattr(error.__cause__, "errors", None)
    details = errors() if callable(errors) else []
    message, value = error.message, None
    if details:
        message, value = details[0]["msg"], details[0].get("input")
    message = _clause(message.removeprefix("Value error, "))
    if value is None or repr(value) in message:
        return message
    return f"{value!r} is invalid: {message}"


def _clause(text: str) -> str:
    return text.strip().rstrip(".")


def main() -> None:
    """Console entry point: user errors become one line and exit code 2."""
    try:
        status = app(standalone_mode=False)
    except UserError as error:
        _fail(error)
    except NO_ARGS_IS_HELP as error:
        # typer has printed the help already; plain click keeps it in the message
        if error.format_message().strip():
            print(error.format_message(), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except click_errors.UsageError as error:
        _fail(usage_error(error))
    except click_errors.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    # without standalone mode, typer returns the exit status (of typer.Exit, --help's 0)
    sys.exit(status if isinstance(status, int) else 0)


def _fail(error: UserError) -> None:
    print(f"dplaunch: error: {error.line()}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)
