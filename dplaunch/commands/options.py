"""How a command's typer function takes options grouped in a dataclass, and returns its exit status.

typer reads a command's options from its function's signature, one parameter each. A command that
shares the run flags (`RunFlags`, config/flags.py) or keeps its own options in a dataclass
(`PlanOptions`, `SlurmOptions`, `VerifyOptions`) takes that dataclass as one parameter;
`@command` shows typer each field of it as one option, builds the dataclass from what the user
gave, and calls the function with it. So each option is written once, as a field, and inside the
function `flags.gpus` is an ordinary typed attribute that editors and type checkers follow.

A field of a command's own dataclass declares its typer option in its annotation
(`Annotated[int | None, typer.Option("--gpus", help=...)]`); a RunFlags field gets its option from
its `flag(...)` row (`run_flag_option`), since config/ may not import typer.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from dplaunch.config.flags import RUN_FLAGS, RunFlags, flag_option

RUN_FILE_ARGUMENT = typer.Argument(
    help="Run file (YAML). Default: the embedded configs/default.yaml.", show_default=False
)
RUN_FILE_OPTION = typer.Option(
    "--config", help="Run file (YAML) with launch/parallel/train sections."
)
SET_OPTION = typer.Option(
    "--set", help="Override any run-file key: --set train.lr=1e-4 (repeatable)."
)


def run_flag_option(name: str, *, help: str | None = None, panel: str | None = None) -> Any:
    """The typer option of a RunFlags field (`help`/`panel`: a command's own wording of it)."""
    flag = RUN_FLAGS[name]
    names = [flag_option(name), *([flag.short] if flag.short else [])]
    low, high = flag.bounds or (None, None)
    return typer.Option(
        *names, help=help or flag.help, rich_help_panel=panel or flag.panel, min=low, max=high
    )


def command(*, config_option: bool = False) -> Callable[[Callable[..., int]], Callable[..., None]]:
    """Give typer one option per field of each dataclass parameter of the decorated function,
    which returns its exit status. ``config_option``: the run file is `--config FILE` rather than
    the first argument (commands whose argument is something else, or who need none)."""

    def decorate(function: Callable[..., int]) -> Callable[..., None]:
        hints = typing.get_type_hints(function, include_extras=True)
        spread: dict[str, type] = {}  # parameter → the dataclass its fields come from
        own: list[inspect.Parameter] = []
        shared: list[inspect.Parameter] = []
        for name, parameter in inspect.signature(function).parameters.items():
            annotation = hints.get(name, parameter.annotation)
            if dataclasses.is_dataclass(annotation):
                spread[name] = annotation  # type: ignore[assignment]
                fields = _field_parameters(annotation, config_option=config_option)
                (shared if annotation is RunFlags else own).extend(fields)
            else:
                own.append(
                    parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=annotation)
                )
        # typer takes the arguments in the order they appear; --help lists the command's own
        # options before the run flags it shares with the other commands
        parameters = [p for p in own + shared if _is_argument(p)]
        parameters += [p for p in own + shared if not _is_argument(p)]

        @functools.wraps(function)
        def run(**given: Any) -> None:
            for name, cls in spread.items():
                names = [field.name for field in dataclasses.fields(cls)]
                values = {field: given.pop(field) for field in names}
                given[name] = cls(**{k: v for k, v in values.items() if v is not None})
            raise typer.Exit(function(**given))

        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        del run.__wrapped__  # typer must read the spread signature, not the function's own
        return run

    return decorate


def _field_parameters(cls: Any, *, config_option: bool) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(cls, include_extras=True)
    parameters = []
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if cls is RunFlags:
            annotation = _run_flag_annotation(field.name, annotation, config_option=config_option)
        default = field.default
        if default is dataclasses.MISSING:
            # a list not given arrives as None, and the field's default_factory fills it
            default, annotation = None, _or_none(annotation)
        parameters.append(
            inspect.Parameter(
                field.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default
            )
        )
    return parameters


def _run_flag_annotation(name: str, annotation: Any, *, config_option: bool) -> Any:
    if name == "config":
        return Annotated[Path | None, RUN_FILE_OPTION if config_option else RUN_FILE_ARGUMENT]
    if name == "assignments":
        return Annotated[annotation, SET_OPTION]
    return Annotated[annotation, run_flag_option(name)]


def _or_none(annotation: Any) -> Any:
    # Annotated[list[str], option] → Annotated[list[str] | None, option]
    if typing.get_origin(annotation) is Annotated:
        return Annotated[(typing.get_args(annotation)[0] | None, *annotation.__metadata__)]
    return annotation | None


def _is_argument(parameter: inspect.Parameter) -> bool:
    return any(
        isinstance(meta, typer.models.ArgumentInfo)
        for meta in getattr(parameter.annotation, "__metadata__", ())
    )
