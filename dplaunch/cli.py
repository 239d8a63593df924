"""The `dplaunch` command line: the app, its commands and one line for every user error.

Each command's options and handler live in its own module of dplaunch/commands/; this module
registers them and turns user errors (UserError, a mistyped command line) into one line and exit
code 2. Imports nothing heavy: torch & friends load only in training ranks.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import typer

from dplaunch.commands import (
    calibrate,
    convert,
    data,
    doctor,
    env,
    export,
    k8s,
    plan,
    ray,
    report,
    slurm,
    train,
    verify,
)
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


# each command's options and handler live in its commands/ module; this order is --help's
COMMANDS = {
    "train": train.train_command,
    "config": train.config_command,
    "launch": train.launch_command,
    "data": data.data_command,
    "plan": plan.plan_command,
    "verify": verify.verify_command,
    "doctor": doctor.doctor_command,
    "calibrate": calibrate.calibrate_command,
    "env": env.env_command,
    "report": report.report_command,
    "export": export.export_command,
    "convert": convert.convert_command,
    "slurm": slurm.slurm_command,
    "k8s": k8s.k8s_command,
    "ray": ray.ray_command,
}
for name, function in COMMANDS.items():
    app.command(name)(function)


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
